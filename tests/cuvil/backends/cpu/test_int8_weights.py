"""int8 weights (backends/cpu/int8_weights.py): the AMX kernel multiplies rows (as two int8
digits each) by the int8 weight times its row scales, as F.linear on the dequantized weight does
to within 1e-4 of the result's scale, at every row count, width and depth its tiles meet,
natively too; linears and SwiGLUs with int8 weights run calls of up to FEW_ROWS rows on it and
longer ones (and every call on CPUs without AMX) on the bf16 values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu import int8_weights
from cuvil.backends.cpu.int8_weights import FEW_ROWS, Int8WeightLinear, pack
from cuvil.backends.cpu.linear_kernels import linear_kernel, swiglu_kernel
from cuvil.passes.precision import quantize_rows, with_int8_linears
from tests.cuvil.backends.cpu.calls import prepare, run_native
from tests.cuvil.backends.cpu.test_linear_kernels import REFERENCE

needs_amx = pytest.mark.skipif(
    not int8_weights.offered(), reason="needs the plan loop's library and AMX-INT8"
)


def _quantized(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    weight, scale = quantize_rows(torch.randn(out_features, in_features))
    return weight, scale, weight.float() * scale[:, None]


def _close(actual: torch.Tensor, expected: torch.Tensor, bf16_result: bool = False) -> None:
    """Equal up to the rows' two-digit rounding (and the result's rounding to bf16)."""
    assert actual.shape == expected.shape
    assert actual.dtype == (torch.bfloat16 if bf16_result else torch.float32)
    if expected.numel() == 0:
        return
    scale = max(float(expected.abs().max()), 1.0)
    bound = (2**-8 if bf16_result else 1e-4) * scale
    assert float((actual.float() - expected).abs().max()) <= bound


def test_rows_are_quantized_symmetrically_per_output_row() -> None:
    weight = torch.tensor([[0.6, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.0, -2.0]])
    quantized, scale = quantize_rows(weight)
    assert quantized.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.tolist() == pytest.approx([1 / 127, 1.0, 3 / 127])
    assert quantized[0].tolist() == [76, -127, 32]
    assert quantized[1].tolist() == [0, 0, 0]  # an all-zero row keeps scale 1
    assert quantized[2].tolist() == [127, 42, -85]
    torch.manual_seed(0)
    wide = torch.randn(64, 200)
    q, s = quantize_rows(wide)
    assert float(((q.float() * s[:, None]) - wide).abs().max()) <= float(s.max()) / 2 + 1e-7
    model = torch.nn.Sequential(torch.nn.Linear(200, 64), torch.nn.LayerNorm(64))
    with torch.no_grad():
        model[0].weight.copy_(wide)
    rounded = with_int8_linears(model)
    assert torch.equal(rounded[0].weight, q.float() * s[:, None])
    assert torch.equal(model[0].weight, wide)  # a copy: the model keeps its weights
    assert torch.equal(rounded[1].weight, model[1].weight)  # only linears are rounded


def test_the_packing_groups_two_blocks_of_in_feature_quads() -> None:
    weight = (torch.arange(40 * 70) % 251 - 125).to(torch.int8).view(40, 70)
    packed = pack(weight)
    blocks, depth = 3, 128  # 40 outputs: 3 blocks of 16; 70 in features padded to 128
    assert packed.numel() == blocks * 16 * depth
    group = packed[: 2 * 16 * depth].view(depth // 64, 2, 16, 16, 4)  # [step, block, quad, col, 4]
    # block 1, in features 64 + 4q + i, column c: weight row 16 + c
    assert group[1, 1, 1, 5].tolist() == [*weight[21, 68:70].tolist(), 0, 0]
    assert group[0, 0, 3, 2].tolist() == weight[2, 12:16].tolist()
    last = packed[2 * 16 * depth :].view(depth // 64, 1, 16, 16, 4)  # the third block alone
    assert last[0, 0, 1, 3].tolist() == weight[35, 4:8].tolist()
    assert last[:, :, :, 8:].abs().sum() == 0  # outputs 40..47 do not exist: zeros
    assert last[1, 0, 2:].abs().sum() == 0  # in features 72..127: zeros


@needs_amx
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 17, 40, 64])
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(32, 16), (40, 70), (96, 200), (768, 64)]
)
def test_the_kernel_matches_linear_on_the_dequantized_weight(
    rows: int, in_features: int, out_features: int
) -> None:
    weight, scale, values = _quantized(out_features, in_features, rows)
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features).bfloat16()
    residual = torch.randn(rows, out_features)
    expected = F.linear(x.float(), values, bias)
    for low_out in (False, True):
        path = Int8WeightLinear(weight, scale, bias, "none", low_out)
        _close(path(x), expected, low_out)
        wide = torch.randn(rows, in_features)  # fp32 rows: not rounded to bf16
        _close(path(wide), F.linear(wide, values, bias), low_out)
        _close(path(x, residual), expected + residual, low_out)
        low_residual = residual.bfloat16()
        _close(path(x, low_residual), expected + low_residual.float(), low_out)
    _close(Int8WeightLinear(weight, scale, None, "none", False)(x), F.linear(x.float(), values))


@needs_amx
@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_native_calls_compute_the_same_for_rows_and_batches(activation: str) -> None:
    weight, scale, values = _quantized(48, 64, 1)
    bias = torch.randn(48)
    path = Int8WeightLinear(weight, scale, bias, activation, False)
    for x in (torch.randn(6, 64), torch.randn(2, 3, 64)):
        expected = REFERENCE[activation](F.linear(x, values, bias))
        _close(path(x), expected)
        _close(run_native(path.native_calls((x,))), expected)
    plain = Int8WeightLinear(weight, scale, bias, "none", False)
    x, residual = torch.randn(2, 3, 64), torch.randn(2, 3, 48)
    expected = F.linear(x, values, bias) + residual
    _close(run_native(plain.native_calls((x, residual))), expected)


def test_int8_linears_run_few_rows_on_the_int8_weight_and_more_on_its_bf16_values() -> None:
    weight, scale, values = _quantized(40, 64, 2)
    bias = torch.randn(40)
    constants = {"weight": weight, "weight_scale": scale, "bias": bias, "activation": "relu"}
    kernel = prepare(linear_kernel, constants)
    for rows in (1, FEW_ROWS, FEW_ROWS + 1, 90):
        x = torch.randn(rows, 64)
        expected = F.relu(F.linear(x.bfloat16().float(), values.bfloat16().float(), bias))
        y = kernel.run(x)
        # the bf16 paths may also round the product (oneDNN's bf16 GEMM) or not (fp32 ones)
        assert float((y.float() - expected).abs().max()) <= 2**-7 * float(expected.abs().max())
        calls = kernel.native((x,))
        int8_call = any("int8_weight_linear" in str(getattr(c, "op", "")) for c in calls or ())
        assert int8_call is (int8_weights.offered() and rows <= FEW_ROWS)


def test_an_int8_swiglu_gates_the_dequantized_product() -> None:
    weight, scale, values = _quantized(2 * 24, 32, 3)
    kernel = prepare(swiglu_kernel, {"gate_up_weight": weight, "weight_scale": scale, "hidden": 24})
    for rows in (3, FEW_ROWS + 6):
        x = torch.randn(rows, 32)
        gate, up = F.linear(x.bfloat16().float(), values).split(24, dim=-1)
        expected = F.silu(gate) * up
        y = kernel.run(x)
        assert y.dtype == torch.float32
        assert float((y - expected).abs().max()) <= 2**-7 * float(expected.abs().max())
