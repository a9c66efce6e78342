"""The stall rules as pure functions: thresholds, durations, which condition a stall lands on."""

from __future__ import annotations

import pytest
from cuvil_operator.stalls import find_stall, parse_duration

T0, T2, T10 = "2026-01-01T00:00:00Z", "2026-01-01T00:00:02Z", "2026-01-01T00:00:10Z"
SPEC = {"targets": ["cuda-sm_90"], "output": {"repository": "reg:5000/m"}}


def test_durations() -> None:
    assert parse_duration("90s") == 90 and parse_duration("30m") == 1800
    assert parse_duration("2h") == 7200 and parse_duration(45) == 45
    with pytest.raises(ValueError):
        parse_duration("soon")


def test_no_worker_only_after_the_threshold_and_timeout_fails() -> None:
    status = {"queuedAt": T0}
    pending = {"phase": "Pending"}
    idle = {"cuvil.cuda.sm_90": ["cuda-sm_90"]}
    assert find_stall(SPEC, status, pending, {}, idle, T2, 5) is None
    stall = find_stall(SPEC, status, pending, {}, idle, T10, 5)
    assert stall is not None and (stall.reason, stall.condition) == ("NoWorker", "Compiling")
    assert not stall.fail and "cuvil.cuda.sm_90 (for cuda-sm_90)" in stall.message
    assert find_stall(SPEC, status, pending, {}, {}, T10, 5) is None  # a worker consumes it
    timed = find_stall({**SPEC, "timeout": "8s"}, status, pending, {}, idle, T10, 5)
    assert timed is not None and timed.reason == "Timeout" and timed.fail


def test_a_registry_fault_lands_on_pushed_naming_the_registry() -> None:
    progress = {"targets": {"cuda-sm_90": {"fault": "RegistryFault: refused"}}}
    status = {"faultSince": T0}
    assert find_stall(SPEC, status, {"phase": "Pushing"}, progress, {}, T2, 5) is None
    stall = find_stall(SPEC, status, {"phase": "Pushing"}, progress, {}, T10, 5)
    assert stall is not None and (stall.reason, stall.condition) == ("RegistryFault", "Pushed")
    assert "registry reg:5000" in stall.message and "RegistryFault: refused" in stall.message
