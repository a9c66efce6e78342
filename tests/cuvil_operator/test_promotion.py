"""status.promoted moves only on gates passed; deferred speed gates and failures keep it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cuvil_operator.conditions import get_condition
from cuvil_operator.promotion import reconcile_measurement, with_promotion
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
    assert condition["message"] == (
        "generation 3 failed (gate minSpeedup failed: measured 1.8, required >= 50);"
        " generation 2 (sha256:two) stays served"
    )


def test_phases_before_the_end_change_nothing() -> None:
    patch = build_progress_status({"phase": "Pending"}, 1, {"phase": "Compiling"}, T1)
    assert with_promotion({}, dict(patch), 1, T1) == patch


def _awaiting(status: dict[str, Any], *targets: str) -> dict[str, Any]:
    """A candidate for generation 2 whose CUDA targets' speed gates wait for a measurement."""
    report = {t: MEASURED if t.startswith("cpu") else DEFERRED for t in targets}
    return _finish(status, 2, _result("sha256:two", report))


def _measure(status: dict[str, Any], **measurement: Any) -> tuple[Any, list[tuple[str, str]]]:
    events: list[tuple[str, str]] = []
    notify = lambda type_, reason, message: events.append((reason, message))  # noqa: E731
    text = json.dumps({"generation": 2, **measurement})
    return reconcile_measurement(status, text, notify, T2), events


ONE = {"generation": 1, "ref": f"{REPO}@sha256:one", "digest": "sha256:one"}


def test_a_measurement_that_meets_the_deferred_gates_promotes_the_candidate() -> None:
    status = {"phase": "Validating", "promoted": ONE}
    status |= _awaiting(status, "cpu-x86_64", "cuda-sm_90")
    assert status["candidate"]["awaiting"] == {"cuda-sm_90": {"minSpeedup": 1.2}}
    patch, events = _measure(status, target="cuda-sm_90", speedup=1.9, node="gpu-a")
    assert patch["candidate"] is None
    assert patch["promoted"]["generation"] == 2 and patch["promoted"]["digest"] == "sha256:two"
    assert "awaiting" not in patch["promoted"]
    condition = get_condition(patch["conditions"], "Promoted")
    assert condition is not None and condition["status"] == "True"
    assert condition["reason"] == "MeasuredOnNode" and "on node gpu-a" in condition["message"]
    assert [reason for reason, _ in events] == ["Promoted"]


def test_a_measurement_that_misses_a_gate_rejects_the_candidate() -> None:
    status = {"phase": "Validating", "promoted": ONE}
    status |= _awaiting(status, "cuda-sm_90")
    patch, events = _measure(status, target="cuda-sm_90", speedup=0.7)
    assert "promoted" not in patch and patch["candidate"] is None
    condition = get_condition(patch["conditions"], "Promoted")
    assert condition is not None and condition["reason"] == "MeasurementFailed"
    assert "minSpeedup measured 0.7, required >= 1.2" in condition["message"]
    assert "generation 1 (sha256:one) stays served" in condition["message"]
    assert events[0][0] == "MeasurementFailed"


def test_every_awaited_target_must_be_measured() -> None:
    status = _awaiting({"phase": "Validating"}, "cuda-sm_80", "cuda-sm_90")
    patch, _ = _measure(status, target="cuda-sm_80", speedup=1.5)
    assert "promoted" not in patch
    assert patch["candidate"]["measured"]["cuda-sm_80"]["speedup"] == 1.5
    condition = get_condition(patch["conditions"], "Promoted")
    assert condition is not None and "awaiting cuda-sm_90" in condition["message"]
    patch, _ = _measure({**status, **patch}, target="cuda-sm_90", speedup=1.3)
    assert patch["promoted"]["generation"] == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "is not JSON"),
        ('{"generation": 1, "target": "cuda-sm_90", "speedup": 2}', "measures generation 1"),
        ('{"generation": 2, "target": "cpu-x86_64", "speedup": 2}', "awaits no measurement"),
        ('{"generation": 2, "target": "cuda-sm_90"}', "needs a number speedup"),
    ],
)
def test_a_measurement_that_does_not_fit_changes_nothing_and_says_why(
    text: str, message: str
) -> None:
    status = _awaiting({"phase": "Validating"}, "cpu-x86_64", "cuda-sm_90")
    events: list[tuple[str, str]] = []
    notify = lambda type_, reason, text_: events.append((reason, text_))  # noqa: E731
    assert reconcile_measurement(status, text, notify, T2) is None
    assert events[0][0] == "MeasurementIgnored" and message in events[0][1]
