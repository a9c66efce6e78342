"""Conditions and status builders, with plain dicts."""

from __future__ import annotations

from typing import Any

from cuvil_operator.conditions import get_condition, set_condition
from cuvil_operator.spec_checks import SpecProblem
from cuvil_operator.status import (
    build_invalid_status,
    build_progress_status,
    build_report,
    build_submitted_status,
    is_following,
    status_changed,
)

T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:00:05Z", "2026-01-01T00:00:09Z"


def _conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_transition_time_moves_only_when_status_changes() -> None:
    conditions = set_condition([], "Ready", "False", "Pending", "queued", 1, T0)
    conditions = set_condition(conditions, "Ready", "False", "Compiling", "passes", 1, T1)
    ready = get_condition(conditions, "Ready")
    assert ready is not None and ready["lastTransitionTime"] == T0
    assert ready["reason"] == "Compiling"
    conditions = set_condition(conditions, "Ready", "True", "Succeeded", "pushed", 2, T2)
    ready = get_condition(conditions, "Ready")
    assert ready is not None and ready["lastTransitionTime"] == T2
    assert ready["observedGeneration"] == 2


def test_conditions_keep_a_stable_order() -> None:
    conditions = set_condition([], "Ready", "False", "Pending", "", 1, T0)
    conditions = set_condition(conditions, "Custom", "True", "X", "", 1, T0)
    conditions = set_condition(conditions, "Accepted", "True", "Submitted", "", 1, T0)
    assert [c["type"] for c in conditions] == ["Accepted", "Ready", "Custom"]


def test_submitted_then_progress_to_succeeded() -> None:
    status = build_submitted_status({}, 1, "cuvil-u-1", T0)
    assert status["phase"] == "Pending" and is_following(status)
    assert _conditions(status)["Accepted"] == ("True", "Submitted")
    compiling = {
        "phase": "Compiling",
        "targets": {"cpu-x86_64": {"state": "COMPILING", "stage": "passes"}},
    }
    patch = build_progress_status(status, 1, compiling, T1)
    assert patch["phase"] == "Compiling" and patch["stages"] == {"cpu-x86_64": "passes"}
    assert _conditions(patch)["Compiling"] == ("True", "Compiling")
    status = {**status, **patch}
    assert not status_changed(status, build_progress_status(status, 1, compiling, T2))
    result = {
        "index": {"ref": "r/m@sha256:i", "digest": "sha256:i"},
        "artifacts": [
            {
                "target": "cpu-x86_64",
                "ref": "r/m@sha256:a",
                "digest": "sha256:a",
                "size": 10,
                "extra": "dropped",
            }
        ],
        "report": {"cpu-x86_64": {"latency_ms": {"speedup": 1.8}, "max_abs_error": 2e-5}},
    }
    done = build_progress_status(status, 1, {"phase": "Succeeded", "result": result}, T2)
    assert done["phase"] == "Succeeded" and done["digest"] == "sha256:i"
    assert done["artifacts"] == [
        {"target": "cpu-x86_64", "ref": "r/m@sha256:a", "digest": "sha256:a", "size": 10}
    ]
    assert done["report"]["speedup"] == 1.8 and done["report"]["maxAbsError"] == 2e-5
    assert _conditions(done) == {
        "Accepted": ("True", "Submitted"),
        "Compiling": ("False", "Compiled"),
        "Validated": ("True", "Validated"),
        "Pushed": ("True", "Pushed"),
        "Ready": ("True", "Succeeded"),
    }
    assert not is_following({**status, **done})


def test_failure_without_a_worker_reason_marks_the_phase_it_hit() -> None:
    status = {**build_submitted_status({}, 3, "t", T0), "phase": "Validating"}
    patch = build_progress_status(status, 3, {"phase": "Failed", "error": "max abs 0.3"}, T1)
    assert patch["phase"] == "Failed" and patch["message"] == "max abs 0.3"
    assert _conditions(patch)["Validated"] == ("False", "Failed")
    assert _conditions(patch)["Compiling"] == ("False", "Compiled")
    assert _conditions(patch)["Ready"] == ("False", "Failed")
    pushing = {**status, "phase": "Pushing"}
    patch = build_progress_status(pushing, 3, {"phase": "Failed", "error": "401"}, T1)
    assert _conditions(patch)["Pushed"] == ("False", "Failed")
    assert _conditions(patch)["Validated"] == ("True", "Validated")


def test_gate_failure_lands_on_validated_with_every_gate_and_the_report() -> None:
    """The worker names the condition; the phase last seen (Compiling) does not decide it."""
    status = {**build_submitted_status({}, 1, "t", T0), "phase": "Compiling"}
    error = (
        "cpu-x86_64: GateFailed: gate minSpeedup failed: measured 1.2, required >= 100; "
        "gate maxLatencyP99Ms failed: measured 0.5, required <= 0.001"
    )
    details = {
        "gates": {
            "minSpeedup": {"measured": 1.2, "limit": 100.0, "passed": False},
            "maxLatencyP99Ms": {"measured": 0.5, "limit": 0.001, "passed": False},
        },
        "benchmark": {"speedup": 1.2, "compiled_p99_ms": 0.5},
        "validation": {"max_abs_error": 2e-6},
    }
    progress = {
        "phase": "Failed",
        "error": error,
        "reason": "GateFailed",
        "condition": "Validated",
        "targets": {"cpu-x86_64": {"state": "FAILURE", "reason": "GateFailed",
                                   "condition": "Validated", "details": details}},
    }  # fmt: skip
    patch = build_progress_status(status, 1, progress, T1)
    conditions = {c["type"]: c for c in patch["conditions"]}
    validated = conditions["Validated"]
    assert (validated["status"], validated["reason"]) == ("False", "GateFailed")
    assert "minSpeedup" in validated["message"] and "maxLatencyP99Ms" in validated["message"]
    assert "measured 1.2, required >= 100" in validated["message"]
    assert (conditions["Compiling"]["status"], conditions["Compiling"]["reason"]) == (
        "False",
        "Compiled",
    )
    assert conditions["Ready"]["reason"] == "GateFailed"
    report = patch["report"]
    assert report["speedup"] == 1.2 and report["error"] == error
    target = report["targets"]["cpu-x86_64"]
    assert target["gates"]["minSpeedup"] == {"measured": 1.2, "limit": 100.0, "passed": False}
    assert target["validation"] == {"maxAbsError": 2e-6}  # camelCase, like the status


def test_invalid_status_names_the_field_and_clears_the_task() -> None:
    previous = build_submitted_status({}, 1, "cuvil-u-1", T0)
    problems = [SpecProblem("spec.inputs[0].shape[1]", "dim 'seq' is not declared")]
    status = build_invalid_status(previous, 2, problems, T1)
    assert status["phase"] == "Failed" and status["taskId"] is None
    assert status["message"] == "spec.inputs[0].shape[1]: dim 'seq' is not declared"
    accepted = next(c for c in status["conditions"] if c["type"] == "Accepted")
    assert accepted["status"] == "False" and accepted["reason"] == "InvalidSpec"
    assert accepted["observedGeneration"] == 2 and "spec.inputs[0].shape[1]" in accepted["message"]


def test_single_artifact_digest_without_index_and_report_summary() -> None:
    result = {"artifacts": [{"target": "cpu-x86_64", "ref": "r", "digest": "sha256:a"}]}
    patch = build_progress_status({}, 1, {"phase": "Succeeded", "result": result}, T0)
    assert patch["digest"] == "sha256:a" and "index" not in patch
    report = build_report({"a": {"speedup": 2.5}, "b": {"speedup": 1.5}, "c": "junk"})
    assert report["speedup"] == 1.5 and set(report["targets"]) == {"a", "b"}
