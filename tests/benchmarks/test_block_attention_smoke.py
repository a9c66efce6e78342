"""The block-attention benchmark end to end: every attention case timed both ways and agreeing
with ATen's, every GEMM case timed on each path."""

from __future__ import annotations

from benchmarks.block_attention import ATTENTION, GEMMS
from tests.benchmarks.scripts import run_report


def test_every_case_is_timed_and_attention_agrees_with_sdpa() -> None:
    report = run_report("benchmarks.block_attention", "--threads", "1", "--rounds", "2")
    run = report["threads"]["1"]
    assert [
        (c["batch"], c["heads"], c["kv_heads"], c["tokens"], c["head_dim"], c["causal"])
        for c in run["attention"]
    ] == [tuple(shape) for shape in ATTENTION]
    for case in run["attention"]:
        assert set(case["median_ms"]) == {"cuvil", "sdpa"}
        assert min(case["median_ms"].values()) > 0
        assert case["max_abs_diff"] < 1e-4
    assert [(c["rows"], c["in"], c["out"]) for c in run["gemm"]] == list(GEMMS)
    for case in run["gemm"]:
        assert len(case["median_ms"]) == 3 and min(case["median_ms"].values()) > 0
