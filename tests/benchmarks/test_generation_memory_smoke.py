"""The generation memory benchmark end to end: both settings load, warm up and decode the same
logits, and sharing the packed weight copies between the prefill and decode graphs' kernels
keeps fewer bytes resident than a copy per kernel."""

from __future__ import annotations

from tests.benchmarks.scripts import run_report


def test_shared_packed_copies_take_less_memory_for_the_same_logits() -> None:
    report = run_report("benchmarks.generation_memory", "--slots", "4", "--steps", "2")
    assert set(report["runs"]) == {"shared", "per_kernel"}
    for run in report["runs"].values():
        sizes = run["resident_mib"]
        assert sizes["start"] < sizes["loaded"] <= sizes["warmed_up"]
    growth = report["warm_up_growth_mib"]
    assert growth["shared"] < growth["per_kernel"]
    assert report["logits_max_abs_diff"] < 1e-3
