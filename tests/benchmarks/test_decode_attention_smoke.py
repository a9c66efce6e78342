"""The decode-attention benchmark end to end: every case timed both ways, and Cuvil's kernel
answering as ATen's attention does on each."""

from __future__ import annotations

from benchmarks.decode_attention import CASES
from tests.benchmarks.scripts import run_report


def test_every_case_is_timed_and_agrees_with_sdpa() -> None:
    report = run_report("benchmarks.decode_attention", "--threads", "1", "--runs", "3")
    cases = report["cases"]
    assert [
        (c["rows"], c["heads"], c["kv_heads"], c["head_dim"], c["position"]) for c in cases
    ] == [tuple(shape) for shape in CASES]
    for case in cases:
        assert case["cuvil_ms"] > 0 and case["sdpa_ms"] > 0
        assert case["max_abs_diff"] < 1e-4
