"""The bf16 compute benchmark end to end: both settings compile and time every case, each
computing in what this CPU gives it (oneDNN's bf16 where ATen offers it, when asked; fp32 where
oneDNN would only emulate bf16)."""

from __future__ import annotations

import torch

from benchmarks.bf16_compute import SETTINGS
from cuvil.backends.cpu.linear_kernels import has_onednn_bf16
from tests.benchmarks.scripts import run_report


def test_both_settings_time_every_case_in_the_precision_they_claim() -> None:
    report = run_report("benchmarks.bf16_compute", "--rounds", "1", "--repeats", "2")
    assert set(report["settings"]) == set(SETTINGS)
    offered = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert report["settings"]["onednn_bf16"]["gemm_compute"] == ("bf16" if offered else "fp32")
    native = has_onednn_bf16()
    assert report["settings"]["fp32_compute"]["gemm_compute"] == ("bf16" if native else "fp32")
    cases = set(report["onednn_over_fp32"])
    assert cases == {
        "decode_1_rows",
        "decode_4_rows",
        "decode_16_rows",
        "prompt_32_tokens",
        "prompt_128_tokens",
    }
    for timings in report["median_ms"].values():
        assert set(timings) == cases and min(timings.values()) > 0
    for setting in report["settings"].values():  # fp32 GEMMs choose a path per row bucket
        if setting["gemm_compute"] == "fp32":
            assert set(setting["decode_paths"]) == {"1", "2", "4", "8", "16"}
