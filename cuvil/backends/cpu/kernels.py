"""CPU kernels for Cuvil's fused ops: oneDNN primitives reached through ATen, weights prepacked.

Each entry of CPU_KERNELS is a factory called once when a plan is built, with what the plan
knows of the node (``FusedCall``: constant arguments — weights as tensors, literals as values —
and the names and static sizes of the arguments that arrive at run time); it returns the
function the plan calls with those run-time values, and the per-shape choice it still makes.
Prepacking (``mkldnn._reorder_*_weight``) therefore happens once per load, never per call.
Activations map onto oneDNN post-ops; a residual add becomes a binary post-op. Linear and
SwiGLU live in linear_kernels.py (two GEMM paths, chosen per shape); max pooling, an ATen op
the backend runs with its own C kernel, in pooling.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from cuvil import fused_ops as fused
from cuvil.backends import kv_cache
from cuvil.backends.cpu import plan_loop, rowwise
from cuvil.backends.cpu.conv_weights import ConvWeight
from cuvil.backends.cpu.direct_conv import DirectConv
from cuvil.backends.cpu.dnnl import load as load_dnnl
from cuvil.backends.cpu.kept_primitives import KeptWithFallback
from cuvil.backends.cpu.linear_kernels import (
    ONEDNN_ACTIVATIONS,
    compute_precision,
    linear_kernel,
    swiglu_kernel,
    takes_low_input,
    widened,
)
from cuvil.backends.cpu.native_calls import Result, chosen_path, kept_conv_call, kept_of, op
from cuvil.backends.cpu.pointwise_conv import is_pointwise, with_gemm_tactic
from cuvil.backends.cpu.pooling import max_pool2d_kernel
from cuvil.backends.cpu.tactics import Tactics, bucket
from cuvil.backends.cpu.winograd import has_enough_tiles, is_winograd_shape, with_winograd_tactic
from cuvil.runtime.kernels import FusedCall, KernelFactory, PreparedKernel

mkldnn = torch.ops.mkldnn
CHANNELS_LAST = torch.channels_last


def conv2d_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.conv2d(input, weight, bias, stride, padding, dilation, groups, activation,
    residual)``: activation(conv(input) + residual), channels-last, weight prepacked."""
    call.check_runtime(("input", "residual"))
    weight: torch.Tensor = call.arg("weight")
    bias = call.arg("bias")
    low_out = call.output_dtype == "bf16"
    if weight.dtype == torch.bfloat16:
        if compute_precision(weight.dtype) == "bf16":
            low_bias = bias.to(torch.bfloat16) if bias is not None else None

            def aten_path(weights: ConvWeight | None = None) -> Callable[..., torch.Tensor]:
                inner = _onednn_conv(call, weight, low_bias, weights)
                return _bf16_borders(inner, low_out)

            kept = _kept_bf16_conv(call, weight, bias, low_out)
            if kept is not None:  # ATen's call (and its packed weight) only on first need
                return PreparedKernel(
                    KeptWithFallback(kept, aten_path).run, native=_kept_form(kept)
                )
            weights = _conv_weight(call, weight)
            native = _bf16_conv_form(call, weights, low_bias, low_out)
            return PreparedKernel(aten_path(weights), native=native)
        weight, bias = weight.float(), bias.float() if bias is not None else None  # widened
    prepared = _fp32_conv2d(call, weight, bias)
    if low_out or "bf16" in call.dtypes.values():
        return widened(prepared, low_out)
    return prepared


def _kept_bf16_conv(
    call: FusedCall, weight: torch.Tensor, bias: torch.Tensor | None, low_out: bool
) -> DirectConv | None:
    """Kept bf16 primitives for a convolution whose input the graph gives in bf16
    (passes/low_activations.py), where libdnnl is loaded; else None (ATen's oneDNN call)."""
    dnnl = load_dnnl()
    if dnnl is None or not takes_low_input(call):
        return None
    activation = str(call.arg("activation"))
    residual = call.is_runtime("residual")
    dtypes = (torch.bfloat16, torch.bfloat16 if low_out else torch.float32)
    return DirectConv(
        dnnl, weight, bias, _geometry(call), activation, residual, call.residual_donated, dtypes
    )


def _kept_form(kept: DirectConv) -> Callable[[tuple[Any, ...]], Sequence[Any] | None]:
    def native(args: tuple[Any, ...]) -> Sequence[Any] | None:
        return kept_conv_call(kept, args[0], args[1] if len(args) > 1 else None)

    return native


def _bf16_borders(inner: Callable[..., torch.Tensor], low_out: bool) -> Callable[..., torch.Tensor]:
    """bf16 weights on a CPU with bf16 instructions: oneDNN computes in bf16; inputs that
    arrive in fp32 are cast in, and the result cast out unless the graph keeps it bf16."""

    def run(*values: torch.Tensor) -> torch.Tensor:
        y = inner(*(v.to(torch.bfloat16) for v in values))
        return y if low_out else y.float()

    return run


def _fp32_conv2d(
    call: FusedCall, weight: torch.Tensor, bias: torch.Tensor | None
) -> PreparedKernel:
    """oneDNN's convolution (kept primitives where libdnnl loads), and where the geometry
    allows, a GEMM or Winograd path beside it, chosen per batch bucket."""
    activation = str(call.arg("activation"))
    residual = call.is_runtime("residual")
    donated = call.residual_donated  # see runtime/donation.py
    onednn: Callable[..., torch.Tensor]
    dnnl = load_dnnl()
    geometry = _geometry(call)
    if dnnl is not None and weight.dtype == torch.float32:
        kept = DirectConv(dnnl, weight, bias, geometry, activation, residual, donated)
        onednn = KeptWithFallback(kept, lambda: _onednn_conv(call, weight, bias)).run
    else:
        onednn = _onednn_conv(call, weight, bias)
    if is_pointwise(weight, *geometry):
        prepared = with_gemm_tactic(onednn, weight, bias, activation, residual, donated)
    else:
        stride, padding, dilation, groups = geometry
        sizes = call.sizes.get("input") or ()
        if is_winograd_shape(weight, stride, dilation, groups) and has_enough_tiles(sizes, padding):
            prepared = with_winograd_tactic(onednn, weight, bias, padding, activation, donated)
        else:
            prepared = PreparedKernel(onednn)
    return replace(prepared, native=_conv_form(prepared, onednn))


def _conv_form(
    prepared: PreparedKernel, onednn: Callable[..., torch.Tensor]
) -> Callable[[tuple[Any, ...]], Sequence[Any] | None]:
    """The native form: the path this batch bucket runs, the kept convolution or one with its
    own native calls (the GEMM and Winograd paths)."""

    def native(args: tuple[Any, ...]) -> Sequence[Any] | None:
        x, residual = args[0], (args[1] if len(args) > 1 else None)
        path: Callable[..., Any] | None = onednn
        if isinstance(prepared.choices, Tactics):
            chosen = chosen_path(prepared.choices, bucket(int(x.shape[0])))
            path = chosen[1] if chosen is not None else None
        if path is None:
            return None
        own = getattr(path, "native_calls", None)
        if own is not None:
            return own(args)
        kept = kept_of(path)
        return kept_conv_call(kept, x, residual) if kept is not None else None

    return native


def _geometry(call: FusedCall) -> tuple[list[int], list[int], list[int], int]:
    """stride, padding, dilation, groups of a ``cuvil.conv2d`` node."""
    stride, padding, dilation = (list(call.arg(key)) for key in ("stride", "padding", "dilation"))
    return stride, padding, dilation, int(call.arg("groups"))


def _conv_weight(call: FusedCall, weight: torch.Tensor) -> ConvWeight:
    stride, padding, dilation, groups = _geometry(call)
    return ConvWeight(weight, padding, stride, dilation, groups, call.sizes.get("input"))


def _bf16_conv_form(
    call: FusedCall, weights: ConvWeight, low_bias: torch.Tensor | None, low_out: bool
) -> Callable[[tuple[Any, ...]], Sequence[Any] | None]:
    """The bf16 convolution's native form: inputs in bf16 (cast where they arrive in fp32),
    channels-last, oneDNN's convolution with its post-ops as ATen calls it, the result cast
    back to fp32 unless the graph keeps it bf16."""
    stride, padding, dilation, groups = _geometry(call)
    attr, scalars, algorithm = ONEDNN_ACTIVATIONS[str(call.arg("activation"))]
    aten = torch.ops.aten
    geometry = (padding, stride, dilation, groups)

    def native(args: tuple[Any, ...]) -> Sequence[Any] | None:
        packed = weights.for_batch(int(args[0].shape[0]))
        calls: list[Any] = []
        for value in args[:2]:
            calls.append(op(aten.to.dtype, value, torch.bfloat16))
            calls.append(
                op(aten.contiguous.default, Result(len(calls) - 1), memory_format=CHANNELS_LAST)
            )
        if len(args) > 1:
            unary = None if attr == "none" else attr
            calls.append(
                op(
                    mkldnn._convolution_pointwise.binary,
                    Result(1),
                    Result(3),
                    packed,
                    low_bias,
                    *geometry,
                    "add",
                    None,
                    unary,
                    scalars,
                    algorithm or None,
                )
            )
        else:
            calls.append(
                op(
                    mkldnn._convolution_pointwise.default,
                    Result(1),
                    packed,
                    low_bias,
                    *geometry,
                    attr,
                    scalars,
                    algorithm,
                )
            )
        if not low_out:
            calls.append(op(aten.to.dtype, Result(len(calls) - 1), torch.float32))
        return calls

    return native


def _onednn_conv(
    call: FusedCall,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weights: ConvWeight | None = None,
) -> Callable[..., torch.Tensor]:
    """oneDNN's convolution through ATen, the activation and any residual add as post-ops."""
    stride, padding, dilation, groups = _geometry(call)
    attr, scalars, algorithm = ONEDNN_ACTIVATIONS[str(call.arg("activation"))]
    weights = weights or _conv_weight(call, weight)
    channels_last = torch.channels_last
    if not call.is_runtime("residual"):

        def conv(x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous(memory_format=channels_last)
            packed = weights.for_batch(x.shape[0])
            return mkldnn._convolution_pointwise(
                x, packed, bias, padding, stride, dilation, groups, attr, scalars, algorithm
            )

        return conv

    unary = None if attr == "none" else attr  # oneDNN wants no unary post-op, not "none"

    def conv_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=channels_last)
        residual = residual.contiguous(memory_format=channels_last)
        return mkldnn._convolution_pointwise.binary(
            x,
            residual,
            weights.for_batch(x.shape[0]),
            bias,
            padding,
            stride,
            dilation,
            groups,
            "add",
            None,
            unary,
            scalars,
            algorithm or None,
        )

    return conv_add


def rms_norm_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.rms_norm(input, weight, eps)``: one native pass (rowwise.py)."""
    call.check_runtime(("input",))
    weight, eps = call.arg("weight"), float(call.arg("eps"))
    run = rowwise.rms_norm(weight, eps)
    kernel = rowwise.address("cuvil_rms_norm")
    if kernel is None or weight.dtype != torch.float32:
        return PreparedKernel(run)
    weight = weight.contiguous()

    def native(args: tuple[Any, ...]) -> list[Any]:
        return [op(torch.ops.cuvil_native.rms_norm.default, kernel, args[0], weight, eps)]

    return PreparedKernel(run, native=native)


def rope_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.rope(input, cos, sin)``: x * cos + rotate_half(x) * sin, one native pass."""
    kernel = rowwise.address("cuvil_rope")
    if kernel is None:
        return PreparedKernel(rowwise.rope())

    def native(args: tuple[Any, ...]) -> list[Any]:
        return [op(torch.ops.cuvil_native.rope.default, kernel, *args[:3])]

    return PreparedKernel(rowwise.rope(), native=native)


def attention_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.attention(query, key, value, mask, scale, causal, gqa)``: Cuvil's block attention
    (native/block_attention.cc) where the native library is loaded, which runs the calls it
    takes on AVX-512 and AVX2 and hands the rest to ATen's; ATen's CPU attention (flash:
    blocked, fused softmax; the math path where that does not apply) otherwise."""
    scale = call.arg("scale")
    causal = bool(call.arg("causal", False))
    gqa = bool(call.arg("gqa", False))
    if plan_loop.load():
        attend = torch.ops.cuvil_native.block_attention.default

        def attention(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
        ) -> torch.Tensor:
            return attend(q, k, v, mask, causal, scale, gqa)

        def native_attention(args: tuple[Any, ...], mask: Any) -> list[Any]:
            return [op(attend, *args[:3], mask, causal, scale, gqa)]

    else:
        sdpa = torch.ops.aten.scaled_dot_product_attention.default

        def attention(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
        ) -> torch.Tensor:
            return sdpa(q, k, v, mask, 0.0, causal, scale=scale, enable_gqa=gqa)

        def native_attention(args: tuple[Any, ...], mask: Any) -> list[Any]:
            return [op(sdpa, *args[:3], mask, 0.0, causal, scale=scale, enable_gqa=gqa)]

    if call.is_runtime("mask"):
        return PreparedKernel(attention, native=lambda args: native_attention(args, args[3]))

    constant_mask = call.arg("mask")  # a mask baked into the model, or None
    low = call.output_dtype == "bf16"
    if low and constant_mask is not None and constant_mask.is_floating_point():
        constant_mask = constant_mask.to(torch.bfloat16)  # an additive mask: the query's dtype

    def unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, constant_mask)

    return PreparedKernel(unmasked, native=lambda args: native_attention(args, constant_mask))


def layer_norm_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.layer_norm(input, weight, bias, eps)`` over the last dim."""
    call.check_runtime(("input",))
    weight, bias, eps = call.arg("weight"), call.arg("bias"), float(call.arg("eps"))
    shape = [int(weight.shape[-1])] if weight is not None else None

    def layer_norm(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, shape or [x.shape[-1]], weight, bias, eps)

    def native(args: tuple[Any, ...]) -> list[Any]:
        x = args[0]
        return [op(torch.ops.aten.layer_norm.default, x, shape or [x.shape[-1]], weight, bias, eps)]

    return PreparedKernel(layer_norm, native=native)


def kv_cache_write_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.kv_cache_write`` (backends/kv_cache.py), natively the same write in C++."""
    prepared = kv_cache.kv_cache_write_kernel(call)

    def native(args: tuple[Any, ...]) -> list[Any]:
        return [op(torch.ops.cuvil_native.kv_cache_write.default, *args[:4])]

    return replace(prepared, native=native)


def cached_attention_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.cached_attention`` (backends/kv_cache.py), natively the same attention in C++
    (each row's slot and length read there, not in Python)."""
    prepared = kv_cache.cached_attention_kernel(call)
    scale = call.arg("scale")
    scale = float(scale) if scale is not None else None

    def native(args: tuple[Any, ...]) -> list[Any]:
        return [op(torch.ops.cuvil_native.cached_attention.default, *args[:5], scale)]

    return replace(prepared, native=native)


CPU_KERNELS: dict[str, KernelFactory] = {
    fused.CONV2D: conv2d_kernel,
    "aten.max_pool2d.default": max_pool2d_kernel,
    fused.LINEAR: linear_kernel,
    fused.SWIGLU: swiglu_kernel,
    fused.RMS_NORM: rms_norm_kernel,
    fused.ROPE: rope_kernel,
    fused.ATTENTION: attention_kernel,
    fused.LAYER_NORM: layer_norm_kernel,
    fused.KV_CACHE_WRITE: kv_cache_write_kernel,
    fused.CACHED_ATTENTION: cached_attention_kernel,
}
