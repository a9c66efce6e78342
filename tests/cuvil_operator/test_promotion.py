"""status.promoted moves only on gates passed; deferred speed gates and failures keep it."""

from __future__ import annotations

from typing import Any

from cuvil_operator.conditions import get_condition
from cuvil_operator.promotion import with_promotion
from cuvil_operator.status import build_progress_status

T1, T2 = "2026-12-02T01:00:00Z", "2026-12-02T01:05:00Z"
REPO = "registry.example.com/models/minilm"


def _result(digest: str, targets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "phase": "Succeeded",
        "result": {
            "index": {"ref": f"{REPO}@{digest}", "digest": digest},
            "artifacts": [
                {"target": t, "ref": f"{REPO}@{digest}-{t}", "digest": f"{digest}-{t}"}
                for t in targets
            ],
            "report": targets,
        },
    }


def _finish(status: dict[str, Any], generation: int, progress: dict[str, Any]) -> dict[str, Any]:
    patch = build_progress_status(status, generation, progress, T2)
    return with_promotion(status, patch, generation, T2)


MEASURED = {"speedup": 1.8, "gates": {"minSpeedup": {"measured": 1.8, "limit": 1.2}}}
DEFERRED = {
    "gates": {"minSpeedup": {"measured": None, "limit": 1.2, "deferred": "speed is not measured"}}
}


def test_a_generation_whose_gates_passed_is_promoted() -> None:
    patch = _finish({"phase": "Validating"}, 1, _result("sha256:one", {"cpu-x86_64": MEASURED}))
    assert patch["promoted"]["generation"] == 1
    assert patch["promoted"]["ref"] == f"{REPO}@sha256:one"
    assert patch["promoted"]["targets"] == {"cpu-x86_64": f"{REPO}@sha256:one-cpu-x86_64"}
    condition = get_condition(patch["conditions"], "Promoted")
    assert condition is not None and condition["status"] == "True"
    assert condition["reason"] == "GatesPassed" and "sha256:one" in condition["message"]


def test_an_unmeasured_speed_gate_keeps_the_previous_generation_served() -> None:
    served = {"generation": 1, "ref": f"{REPO}@sha256:one", "digest": "sha256:one"}
    status = {"phase": "Validating", "promoted": served}
    progress = _result("sha256:two", {"cpu-x86_64": MEASURED, "cuda-sm_90": DEFERRED})
    patch = _finish(status, 2, progress)
    assert "promoted" not in patch  # untouched: generation 1 stays
    assert patch["candidate"]["generation"] == 2 and patch["candidate"]["digest"] == "sha256:two"
    condition = get_condition(patch["conditions"], "Promoted")
    assert condition is not None and condition["status"] == "False"
    assert condition["reason"] == "AwaitingMeasurement"
    assert "cuda-sm_90: minSpeedup (speed is not measured)" in condition["message"]
    assert "generation 1 (sha256:one) stays served" in condition["message"]
    assert "cpu-x86_64" not in condition["message"]


def test_a_failed_generation_leaves_the_promoted_one_and_says_so() -> None:
    served = {"generation": 2, "ref": f"{REPO}@sha256:two", "digest": "sha256:two"}
    status = {"phase": "Validating", "promoted": served}
    failed = {"phase": "Failed", "error": "gate minSpeedup failed: measured 1.8, required >= 50"}
    patch = _finish(status, 3, failed)
    assert "promoted" not in patch and patch["candidate"] is None
    condition = get_condition(patch["conditions"], "Promoted")
    assert condition is not None and condition["reason"] == "GenerationFailed"
    assert condition["message"] == "generation 3 failed; generation 2 (sha256:two) stays served"


def test_phases_before_the_end_change_nothing() -> None:
    patch = build_progress_status({"phase": "Pending"}, 1, {"phase": "Compiling"}, T1)
    assert with_promotion({}, dict(patch), 1, T1) == patch
