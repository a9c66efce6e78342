"""The bf16-weight GEMM benchmark end to end: every ISA code this CPU runs is timed against
MKL at every row count, and computes MKL's product."""

from __future__ import annotations

import pytest

from benchmarks.bf16_weight_gemm import CODES
from cuvil.backends.cpu import bf16_weights
from tests.benchmarks.scripts import run_report

pytestmark = pytest.mark.skipif(
    not bf16_weights.offered(), reason="the bf16-weight GEMM needs AVX2 or AVX-512"
)


def test_each_code_is_timed_against_mkl_and_computes_its_product() -> None:
    report = run_report(
        "benchmarks.bf16_weight_gemm",
        *("--in-features", "64", "--out-features", "100", "--weights", "2"),
        *("--rows", "1,5", "--rounds", "1", "--repeats", "1"),
    )
    level = bf16_weights.isa_level()
    expected = {name for isa, name in CODES.items() if isa <= level}
    assert set(report["codes"]) == expected
    assert set(report["ms_per_weight"]) == {"1", "5"}
    for timings in report["ms_per_weight"].values():
        assert set(timings) == expected | {"mkl_fp32"} and min(timings.values()) > 0
    assert set(report["mkl_over"]) == expected
    for error in report["max_abs_error"].values():
        assert error < 1e-4
