"""The int8-weight GEMM benchmark end to end: the int8 kernel is timed against oneDNN's bf16
GEMM at every row count asked for, and computes the dequantized weight's product."""

from __future__ import annotations

import pytest

from cuvil.backends.cpu import int8_weights
from tests.benchmarks.scripts import run_report

pytestmark = pytest.mark.skipif(
    not int8_weights.offered(), reason="the int8-weight GEMM needs AMX-INT8"
)


def test_the_int8_kernel_is_timed_against_bf16_and_computes_its_product() -> None:
    report = run_report(
        "benchmarks.int8_weight_gemm", "--shapes", "output", "--rows", "1,5", "--repeats", "1"
    )
    assert list(report["results"]) == ["output"]
    assert [entry["rows"] for entry in report["results"]["output"]] == [1, 5]
    for entry in report["results"]["output"]:
        assert entry["int8_ms"] > 0 and entry["bf16_ms"] > 0
        assert entry["max_relative_error"] < 1e-4
    assert set(report["all_shapes"]) == {"1", "5"}
