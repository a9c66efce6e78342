"""The decode-attention benchmark end to end: every case timed both ways over fp32 and bf16
caches read cold, and Cuvil's kernel answering as ATen's attention does on each."""

from __future__ import annotations

from benchmarks.decode_attention import CASES
from tests.benchmarks.scripts import run_report


def test_every_case_is_timed_and_agrees_with_sdpa() -> None:
    report = run_report(
        "benchmarks.decode_attention", "--threads", "1", "--runs", "3",
        "--cache-dtypes", "fp32,bf16", "--cold",
    )  # fmt: skip
    cases = report["cases"]
    assert [
        (c["cache_dtype"], c["rows"], c["heads"], c["kv_heads"], c["head_dim"], c["position"])
        for c in cases
    ] == [(dtype, *shape) for dtype in ("fp32", "bf16") for shape in CASES]
    assert all(c["cold"] for c in cases)
    for case in cases:
        assert case["cuvil_ms"] > 0 and case["sdpa_ms"] > 0
        assert case["max_abs_diff"] < 1e-4
