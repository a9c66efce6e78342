"""Cuvil's Triton templates run through the interpreter on random CPU tensors, against torch:
fp32 within 1e-5 of the output scale, bf16 storage within the bf16 budget; the launch guards;
and the interpreter's gaps (libdevice, bf16 ``tl.dot``) closed for a launch and only then."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime import interpreter as triton_interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from cuvil.backends.cuda.aten_ops import ACTIVATIONS
from cuvil.backends.cuda.interpreter import GuardError, Interpreted, interpreter_patches
from cuvil.backends.cuda.launches import LAUNCHES
from cuvil.fused_ops import ATTENTION, CONV2D, LAYER_NORM, LINEAR, RMS_NORM, ROPE, SWIGLU
from cuvil.precisions import PRECISIONS
from tests.cuvil.backends.cuda.nodes import (
    guarded_launcher,
    manifest_for,
    one_node,
    only_spec,
    relative_to_scale,
)
from tests.cuvil.backends.cuda.nodes import run_kernel as run

FP32_TOLERANCE = 1e-5
POINTERS = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}
BF16_BUDGET = PRECISIONS["bf16"].budget


@pytest.mark.parametrize("width", [64, 100, 384])
def test_rms_norm_matches_torch(width: int) -> None:
    x, weight = torch.randn(2, 3, width), torch.randn(width)
    out, spec = run(RMS_NORM, {"input": x}, {"weight": weight, "eps": 1e-6}, tuple(x.shape))
    expected = F.rms_norm(x, [width], weight, 1e-6)
    assert relative_to_scale(out, expected) <= FP32_TOLERANCE
    block = 1 << (width - 1).bit_length()
    assert spec.constexprs == {"N": width, "BLOCK_N": block, "BLOCK_M": 2048 // block}
    # rows are 16-divisible only where the width is: the stride hints follow it
    assert ("stride_x" in spec.div16) == (width % 16 == 0)


@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
def test_layer_norm_matches_torch(affine: tuple[bool, bool]) -> None:
    width = 96
    x = torch.randn(37, 2, width) * 3 + 1  # 74 rows: four full programs of 16 and a part
    weight = torch.randn(width) if affine[0] else None
    bias = torch.randn(width) if affine[1] else None
    constants = {"weight": weight, "bias": bias, "eps": 1e-5}
    out, spec = run(LAYER_NORM, {"input": x}, constants, tuple(x.shape))
    expected = F.layer_norm(x, [width], weight, bias, 1e-5)
    assert relative_to_scale(out, expected) <= FP32_TOLERANCE
    assert spec.constexprs["HAS_WEIGHT"] is affine[0] and spec.constexprs["HAS_BIAS"] is affine[1]


def test_bf16_rows_stay_within_the_bf16_budget() -> None:
    width = 128
    x, weight, bias = (torch.randn(4, width).bfloat16() for _ in range(3))
    weight, bias = weight[0], bias[0]
    out, spec = run(RMS_NORM, {"input": x}, {"weight": weight, "eps": 1e-6}, tuple(x.shape))
    assert out.dtype == torch.bfloat16 and dict(spec.params)["x_ptr"] == "*bf16"
    expected = F.rms_norm(x.float(), [width], weight.float(), 1e-6)
    assert relative_to_scale(out, expected) <= BF16_BUDGET
    constants = {"weight": weight, "bias": bias, "eps": 1e-5}
    out, _ = run(LAYER_NORM, {"input": x}, constants, tuple(x.shape))
    expected = F.layer_norm(x.float(), [width], weight.float(), bias.float(), 1e-5)
    assert relative_to_scale(out, expected) <= BF16_BUDGET


# every epilogue shape but the plain linear (test_a_plain_linear_runs_in_aten)
EPILOGUES = [
    (activation, residual)
    for activation in sorted(ACTIVATIONS)
    for residual in (False, True)
    if activation != "none" or residual
]


@pytest.mark.parametrize(("activation", "residual"), EPILOGUES)
def test_the_linear_epilogue_matches_torch(activation: str, residual: bool) -> None:
    x, weight, bias = torch.randn(6, 24), torch.randn(40, 24), torch.randn(40)
    inputs = {"input": x} | ({"residual": torch.randn(6, 40)} if residual else {})
    constants = {"weight": weight, "bias": bias, "activation": activation}
    out, spec = run(LINEAR, inputs, constants, (6, 40))
    y = F.linear(x, weight, bias)
    expected = ACTIVATIONS[activation](y + inputs["residual"] if residual else y)
    assert relative_to_scale(out, expected) <= FP32_TOLERANCE
    assert spec.constexprs["ACT_AFTER_RES"] is (residual and activation != "none")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# (x, cos/sin) shapes: Llama's (cos per position, broadcast over heads), per head, 3-D, and a
# head dim whose half is no power of two
ROPE_SHAPES = [
    ((2, 4, 5, 32), (2, 1, 5, 32)),
    ((1, 3, 6, 16), (1, 3, 6, 16)),
    ((3, 7, 64), (7, 64)),
    ((1, 2, 4, 24), (1, 1, 4, 24)),
]


@pytest.mark.parametrize(("x_shape", "angle_shape"), ROPE_SHAPES)
def test_rope_matches_torch(x_shape: tuple[int, ...], angle_shape: tuple[int, ...]) -> None:
    x = torch.randn(x_shape)
    if x.dim() == 4:  # a strided view [batch, heads, seq, dim] of [batch, seq, heads, dim]
        x = torch.randn(x_shape[0], x_shape[2], x_shape[1], x_shape[3]).transpose(1, 2)
    angles = torch.randn(angle_shape)
    cos, sin = angles.cos(), angles.sin()
    inputs = {"input": x, "cos": cos, "sin": sin}
    out, spec = run(ROPE, inputs, {}, x_shape)
    assert relative_to_scale(out, _rope(inputs["input"], cos, sin)) <= FP32_TOLERANCE
    assert spec.constexprs["D"] == x_shape[-1] and spec.constexprs["HALF"] == x_shape[-1] // 2


def test_a_rope_that_broadcasts_its_input_runs_in_aten() -> None:
    from cuvil.backends.cuda.codegen import plan_kernels

    runtime = {"input": torch.randn(1, 1, 4, 8), "cos": torch.randn(2, 1, 4, 8)}
    runtime["sin"] = runtime["cos"]
    graph, weights, _ = one_node(ROPE, runtime, {}, (2, 1, 4, 8))
    plan = plan_kernels(graph, weights, {})
    assert not plan.kernels and "broadcasts x" in plan.nodes["fused"]["aten"]


# (batch, heads, kv heads, queries, keys, head dim), mask shape or None, causal
ATTENTION_CASES = [
    ((1, 8, 2, 16, 16, 32), (1, 1, 16, 16), False),  # Llama: GQA, the padding mask's bias
    ((2, 4, 4, 40, 40, 64), None, True),  # causal, over several key blocks
    ((1, 2, 2, 5, 37, 24), (2, 5, 37), False),  # more keys than queries, a per-head mask
    ((1, 2, 1, 9, 9, 128), None, False),  # one key head for all, the widest head dim
]


@pytest.mark.parametrize(("shape", "mask_shape", "causal"), ATTENTION_CASES)
def test_attention_matches_torch(
    shape: tuple[int, ...], mask_shape: tuple[int, ...] | None, causal: bool
) -> None:
    batch, heads, kv_heads, queries, keys, width = shape
    q = torch.randn(batch, queries, heads, width).transpose(1, 2)  # strided, as models leave it
    k, v = torch.randn(batch, kv_heads, keys, width), torch.randn(batch, kv_heads, keys, width)
    inputs = {"query": q, "key": k, "value": v}
    mask = torch.randn(mask_shape) if mask_shape else None
    if mask is not None:
        inputs["mask"] = mask
    gqa = heads != kv_heads
    constants = {"scale": None, "causal": causal, "gqa": gqa}
    out, spec = run(ATTENTION, inputs, constants, tuple(q.shape))
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
    )
    assert relative_to_scale(out, expected) <= FP32_TOLERANCE
    assert spec.constexprs["IS_CAUSAL"] is causal and spec.constexprs["HAS_MASK"] is bool(
        mask_shape
    )


def test_bf16_attention_stays_within_the_bf16_budget() -> None:
    q, k, v = (torch.randn(1, 2, 20, 32).bfloat16() for _ in range(3))
    constants = {"scale": 0.2, "causal": False, "gqa": False}
    out, _ = run(ATTENTION, {"query": q, "key": k, "value": v}, constants, tuple(q.shape))
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.2)
    assert out.dtype == torch.bfloat16
    assert relative_to_scale(out, expected) <= BF16_BUDGET


def test_attention_the_template_does_not_take_runs_in_aten() -> None:
    from cuvil.backends.cuda.codegen import plan_kernels

    q, wide = torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 256)
    boolean = {"query": q, "key": q, "value": q, "mask": torch.ones(1, 1, 4, 4, dtype=torch.bool)}
    constants = {"scale": None, "causal": False, "gqa": False}
    cases = ((boolean, "boolean mask"), ({"query": wide, "key": wide, "value": wide}, "128"))
    for runtime, reason in cases:
        graph, weights, _ = one_node(ATTENTION, runtime, constants, tuple(runtime["query"].shape))
        plan = plan_kernels(graph, weights, {})
        assert not plan.kernels and reason in plan.nodes["fused"]["aten"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_torch(dtype: torch.dtype) -> None:
    x, weight = torch.randn(3, 5, 24), torch.randn(2 * 40, 24).to(dtype)
    constants = {"gate_up_weight": weight, "hidden": 40}
    out, spec = run(SWIGLU, {"input": x}, constants, (3, 5, 40))
    gate, up = F.linear(x.to(dtype).float(), weight.float()).split(40, dim=-1)
    budget = FP32_TOLERANCE if dtype == torch.float32 else BF16_BUDGET
    assert relative_to_scale(out, F.silu(gate) * up) <= budget
    assert out.dtype == torch.float32 and dict(spec.params)["y_ptr"] == POINTERS[dtype]


@pytest.mark.parametrize(
    ("activation", "residual"), [("relu", True), ("none", True), ("silu", False)]
)
def test_the_convolution_epilogue_matches_torch(activation: str, residual: bool) -> None:
    x, weight, bias = torch.randn(2, 6, 9, 7), torch.randn(8, 3, 3, 3), torch.randn(8)
    inputs = {"input": x} | ({"residual": torch.randn(2, 8, 5, 4)} if residual else {})
    geometry = {"stride": (2, 2), "padding": (1, 1), "dilation": (1, 1), "groups": 2}
    constants = {"weight": weight, "bias": bias, "activation": activation, **geometry}
    out, spec = run(CONV2D, inputs, constants, (2, 8, 5, 4))
    y = F.conv2d(x, weight, bias, (2, 2), (1, 1), (1, 1), 2)
    expected = ACTIVATIONS[activation](y + inputs["residual"] if residual else y)
    assert relative_to_scale(out, expected) <= FP32_TOLERANCE
    assert spec.constexprs["N"] == 8 and spec.constexprs["INNER"] == 20  # bias per channel


def test_a_plain_linear_runs_in_aten() -> None:
    from cuvil.backends.cuda.codegen import plan_kernels

    constants = {"weight": torch.randn(4, 8), "bias": None, "activation": "none"}
    graph, weights, _ = one_node(LINEAR, {"input": torch.randn(2, 8)}, constants, (2, 4))
    plan = plan_kernels(graph, weights, {})
    assert not plan.kernels and "cuBLAS" in plan.nodes["fused"]["aten"]


def test_a_strided_input_is_copied_to_contiguous_rows_first() -> None:
    x = torch.randn(64, 6).t()  # rows of 64 that are not contiguous
    weight = torch.randn(64)
    out, _ = run(RMS_NORM, {"input": x}, {"weight": weight, "eps": 1e-6}, tuple(x.shape))
    assert relative_to_scale(out, F.rms_norm(x, [64], weight, 1e-6)) <= FP32_TOLERANCE


def test_a_call_that_breaks_a_guard_runs_the_generic_variant() -> None:
    """A contiguous input at an odd offset (a slice 4 bytes into its storage) keeps the
    specialised kernel's rows but not its alignment: the generic variant takes it, uncopied."""
    weight = torch.randn(64)
    graph, weights, call = one_node(
        RMS_NORM, {"input": torch.randn(4, 64)}, {"weight": weight, "eps": 1e-6}, (4, 64)
    )
    spec = only_spec(graph, weights)
    launcher = guarded_launcher(spec)
    prepared = LAUNCHES[spec.template](call, manifest_for(spec), launcher)
    aligned = torch.randn(4, 64)
    misaligned = torch.randn(257)[1:].view(4, 64)
    for x in (aligned, misaligned):
        assert relative_to_scale(prepared.run(x), F.rms_norm(x, [64], weight, 1e-6)) <= 1e-6
    assert launcher.calls == {"specialised": 1, "generic": 1}


def test_a_launch_that_breaks_a_guard_is_refused() -> None:
    x, weight = torch.randn(4, 64), torch.randn(64)
    graph, weights, _ = one_node(RMS_NORM, {"input": x}, {"weight": weight, "eps": 1e-6}, (4, 64))
    kernel = Interpreted(manifest_for(only_spec(graph, weights)))
    out = torch.empty(4, 64)
    args = {"x_ptr": x, "w_ptr": weight, "out_ptr": out, "stride_x": 64, "stride_out": 64}
    args |= {"n_rows": 4, "eps": 1e-6}
    reach = {"x_ptr": 256, "out_ptr": 256, "w_ptr": 64}
    kernel.launch((1, 1, 1), args, reach)
    torch.testing.assert_close(out, F.rms_norm(x, [64], weight, 1e-6))
    misaligned = torch.randn(257)[1:]  # 4 bytes past an aligned allocation
    with pytest.raises(GuardError, match=r"x_ptr .* not divisible by 16"):
        kernel.launch((1, 1, 1), args | {"x_ptr": misaligned}, reach)
    with pytest.raises(GuardError, match="stride_x = 65"):
        kernel.launch((1, 1, 1), args | {"stride_x": 65}, reach)
    with pytest.raises(GuardError, match="at least 256 elements"):
        kernel.launch((1, 1, 1), args | {"out_ptr": torch.empty(3, 64)}, reach)
    with pytest.raises(GuardError, match="the kernel takes"):
        kernel.launch((1, 1, 1), {**args, "extra": 1}, reach)


def test_a_kernel_from_another_template_source_is_refused() -> None:
    x, weight = torch.randn(2, 16), torch.randn(16)
    graph, weights, _ = one_node(RMS_NORM, {"input": x}, {"weight": weight, "eps": 1e-6}, (2, 16))
    manifest = manifest_for(only_spec(graph, weights)) | {"source_sha256": "0" * 64}
    with pytest.raises(GuardError, match="another version of template"):
        Interpreted(manifest)


def test_the_interpreter_patches_hold_for_a_launch_only() -> None:
    stub_tanh, create_dot, library_sum = libdevice.tanh, None, tl.standard.sum
    create_dot = triton_interpreter.InterpreterBuilder.create_dot
    assert isinstance(library_sum, JITFunction)
    with interpreter_patches():
        assert libdevice.tanh is not stub_tanh
        assert isinstance(tl.standard.sum, InterpretedFunction)
        assert triton_interpreter.InterpreterBuilder.create_dot is not create_dot
    assert libdevice.tanh is stub_tanh and tl.standard.sum is library_sum
    assert triton_interpreter.InterpreterBuilder.create_dot is create_dot


def _dot_kernel(a_ptr, b_ptr, c_ptr, SIZE: tl.constexpr):  # type: ignore[no-untyped-def]
    rows = tl.arange(0, SIZE)[:, None] * SIZE + tl.arange(0, SIZE)[None, :]
    c = tl.dot(tl.load(a_ptr + rows), tl.load(b_ptr + rows))
    tl.store(c_ptr + rows, c)


def test_bf16_dot_is_right_under_the_patches_and_wrong_without() -> None:
    a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    expected = a.float() @ b.float()
    kernel = InterpretedFunction(_dot_kernel)
    out = torch.empty(16, 16)
    with interpreter_patches():
        kernel[(1,)](a, b, out, SIZE=16)
    assert relative_to_scale(out, expected) <= 1e-5
    kernel[(1,)](a, b, out, SIZE=16)  # the interpreter's own bf16 dot multiplies raw storage
    assert relative_to_scale(out, expected) > 1.0
