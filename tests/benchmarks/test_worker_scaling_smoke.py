"""The worker scaling benchmark end to end, at its smallest: real Redis, registry and two
workers; one round of one compile each way, and a ratio computed from the rounds it ran."""

from __future__ import annotations

from tests.benchmarks.scripts import run_report


def test_one_round() -> None:
    report = run_report("benchmarks.worker_scaling", "--compiles", "1", "--rounds", "1")
    (round_,) = report["rounds"]
    assert round_["one_worker"]["seconds"] > 0 and round_["two_workers"]["seconds"] > 0
    assert report["best_ratio"] == round_["ratio"] > 0
