"""The bf16-weight GEMM (backends/cpu/bf16_weights.py): fp32 rows times a bf16 weight, in fp32,
the same as F.linear on the widened weight at every row count and width the tiles meet; its
native calls compute the same; bf16 linears on CPUs without bf16 GEMMs offer it to the tactics,
fp32 ones do not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu import bf16_weights, linear_kernels
from cuvil.backends.cpu.bf16_weights import Bf16WeightLinear, pack
from cuvil.backends.cpu.linear_kernels import fp32_weight, linear_kernel
from cuvil.backends.cpu.tactics import Tactics
from cuvil.backends.cpu.weight_copies import copies_held
from tests.cuvil.backends.cpu.calls import prepare, run_native
from tests.cuvil.backends.cpu.test_linear_kernels import REFERENCE

pytestmark = pytest.mark.skipif(
    not bf16_weights.offered(), reason="needs the plan loop's library and AVX2 or AVX-512"
)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    if expected.numel() == 0:
        return
    scale = max(float(expected.abs().max()), 1.0)
    assert float((actual - expected).abs().max()) <= 2e-6 * scale * expected.shape[-1] ** 0.5


# the ISA levels this CPU runs: AVX2's code (tiles of up to 2 rows) runs on AVX-512 CPUs too
LEVELS = [level for level in (3, 4) if level <= bf16_weights.isa_level()]


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33])
@pytest.mark.parametrize(("in_features", "out_features"), [(40, 33), (100, 64), (24, 70)])
def test_bf16_weight_gemm_matches_linear_on_the_widened_weight(
    rows: int, in_features: int, out_features: int, isa: int
) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features)
    x, residual = torch.randn(rows, in_features), torch.randn(rows, out_features)
    expected = F.linear(x, weight.float(), bias)
    _close(Bf16WeightLinear(weight, bias, "none", isa)(x), expected)
    _close(Bf16WeightLinear(weight, bias, "none", isa)(x, residual), expected + residual)
    _close(Bf16WeightLinear(weight, None, "none", isa)(x), F.linear(x, weight.float()))


@pytest.mark.parametrize("isa", LEVELS)
def test_rows_that_are_a_view_are_read_as_their_values(isa: int) -> None:
    """Each tile reads its rows from a panel of its own: a transposed or strided view of the
    rows gives what its contiguous copy gives."""
    torch.manual_seed(0)
    weight = torch.randn(70, 40).bfloat16()
    x = torch.randn(40, 13).t()  # [13, 40], not contiguous
    _close(Bf16WeightLinear(weight, None, "none", isa)(x), F.linear(x, weight.float()))
    rows = torch.randn(26, 40)[::2]  # every other row
    _close(Bf16WeightLinear(weight, None, "none", isa)(rows), F.linear(rows, weight.float()))


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_the_activation_runs_after_the_gemm_natively_too(activation: str) -> None:
    torch.manual_seed(1)
    weight, bias = torch.randn(48, 32).bfloat16(), torch.randn(48)
    path = Bf16WeightLinear(weight, bias, activation)
    x = torch.randn(6, 32)
    expected = REFERENCE[activation](F.linear(x, weight.float(), bias))
    _close(path(x), expected)
    _close(run_native(path.native_calls(x, None, 6, 0)), expected)
    residual = torch.randn(6, 48)
    plain = Bf16WeightLinear(weight, bias, "none")
    calls = plain.native_calls(x, residual, 6, 0)
    _close(run_native(calls), F.linear(x, weight.float(), bias) + residual)


def test_the_packing_pairs_each_blocks_columns() -> None:
    weight = torch.arange(40 * 3, dtype=torch.float32).view(40, 3).bfloat16()  # exact in bf16
    packed = pack(weight).view(torch.bfloat16)
    assert packed.shape == (2, 3, 32)  # 40 columns: two blocks, the second padded
    line = packed[0, 1]  # input feature 1 of block 0: columns paired j, 16 + j
    assert line[0::2].tolist() == weight[:16, 1].tolist()
    assert line[1::2].tolist() == weight[16:32, 1].tolist()
    assert packed[1, :, 1::2].abs().sum() == 0  # columns 48..63 do not exist: zeros


def test_bf16_linears_offer_the_path_where_bf16_gemms_widen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(linear_kernels, "has_onednn_bf16", lambda: False)
    torch.manual_seed(2)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    for dtype, offered in ((torch.bfloat16, True), (torch.float32, False)):
        kernel = prepare(
            linear_kernel, {"weight": weight.to(dtype), "bias": bias, "activation": "none"}
        )
        assert isinstance(kernel.choices, Tactics)
        names = [name for name, _ in kernel.choices.candidates]
        assert ("bf16_weights" in names) is offered
        if offered:
            kernel.choices.preset({8: "bf16_weights"})
            x = torch.randn(7, 24)
            _close(kernel.run(x), F.linear(x, weight.bfloat16().float(), bias))
            calls = kernel.native((x,))
            assert calls is not None
            _close(run_native(list(calls)), F.linear(x, weight.bfloat16().float(), bias))


def test_kernels_on_one_bf16_weight_share_its_widened_and_packed_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(linear_kernels, "has_onednn_bf16", lambda: False)
    torch.manual_seed(3)
    weight = torch.randn(40, 24).bfloat16()
    kernels = [
        prepare(linear_kernel, {"weight": weight, "bias": None, "activation": activation})
        for activation in ("none", "relu")
    ]
    paths = [dict(kernel.choices.candidates) for kernel in kernels]  # type: ignore[union-attr]
    assert paths[0]["bf16_weights"].packed is paths[1]["bf16_weights"].packed
    assert fp32_weight(weight) is fp32_weight(weight)
    assert copies_held(weight) == 2  # the fp32 widening and the bf16 blocks, once each
    x = torch.randn(5, 24)
    for kernel, activation in zip(kernels, ("none", "relu"), strict=True):
        _close(kernel.run(x), REFERENCE[activation](F.linear(x, weight.float())))
