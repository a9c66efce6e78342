"""The token-pick benchmark end to end: every case timed at both vocabularies."""

from __future__ import annotations

from benchmarks.token_picks import CASES
from tests.benchmarks.scripts import run_report


def test_every_case_is_timed_at_both_vocabularies() -> None:
    report = run_report("benchmarks.token_picks", "--runs", "3", "--held", "60")
    assert report["rows"] == 16 and report["held_tokens"] == 60
    assert set(report["step_us"]) == {"2048", "32000"}
    for cases in report["step_us"].values():
        assert set(cases) == set(CASES)
        assert all(microseconds > 0 for microseconds in cases.values())
