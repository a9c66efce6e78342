"""A target the compiling machine is not says so in its report."""

from __future__ import annotations

from cuvil_worker.tasks import benchmark_caveat


def test_an_off_target_benchmark_is_flagged() -> None:
    here = ["cpu-x86_64-avx512", "cpu-x86_64", "cpu"]
    assert benchmark_caveat("cpu-x86_64", here) is None
    note = benchmark_caveat("cpu-x86_64-amx", here)
    assert note is not None and "not a cpu-x86_64-amx machine" in note
    assert "cpu-x86_64-avx512" in note and "not the target's" in note
