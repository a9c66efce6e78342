"""CPU kernels for Cuvil's fused ops: oneDNN primitives reached through ATen, weights prepacked.

Each entry of CPU_KERNELS is a factory called once when a plan is built, with the node's
constant arguments (weights as tensors, attributes as literals) and the names of the arguments
that arrive at run time; it returns the function the plan calls with those run-time values.
Prepacking (``mkldnn._reorder_*_weight``) therefore happens once per load, never per call.
Activations map onto oneDNN post-ops; a residual add becomes a binary post-op. Linear and
SwiGLU live in linear_kernels.py (two GEMM paths, chosen per shape).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from cuvil.backends.cpu import rowwise
from cuvil.backends.cpu.conv_weights import ConvWeight
from cuvil.backends.cpu.direct_conv import DirectConv
from cuvil.backends.cpu.dnnl import load as load_dnnl
from cuvil.backends.cpu.kept_primitives import with_fallback
from cuvil.backends.cpu.linear_kernels import (
    ONEDNN_ACTIVATIONS,
    check_runtime_args,
    compute_precision,
    linear_kernel,
    swiglu_kernel,
)
from cuvil.backends.cpu.pointwise_conv import is_pointwise, with_gemm_tactic
from cuvil.backends.cpu.winograd import has_enough_tiles, is_winograd_shape, with_winograd_tactic

KernelFactory = Callable[[Mapping[str, Any], Sequence[str]], Callable[..., Any]]

mkldnn = torch.ops.mkldnn


def _reduced_precision(
    args: Mapping[str, Any], dynamic: Sequence[str], onednn: KernelFactory
) -> Callable[..., Any]:
    """bf16 weights on a CPU with bf16 instructions: oneDNN computes in bf16 with fp32 at the
    op's borders (inputs cast in, result out)."""
    bias = args.get("bias")
    inner = onednn(
        dict(args) | {"bias": bias.to(torch.bfloat16) if bias is not None else None}, dynamic
    )

    def run(*values: torch.Tensor) -> torch.Tensor:
        return inner(*(v.to(torch.bfloat16) for v in values)).float()

    return run


def conv2d_kernel(args: Mapping[str, Any], dynamic: Sequence[str]) -> Callable[..., Any]:
    """``cuvil.conv2d(input, weight, bias, stride, padding, dilation, groups, activation,
    residual)``: activation(conv(input) + residual), channels-last, weight prepacked."""
    check_runtime_args(dynamic, ("input", "residual"))
    weight: torch.Tensor = args["weight"]
    bias = args.get("bias")
    if weight.dtype == torch.bfloat16 and not args.get("_inner"):
        if compute_precision(weight.dtype) == "bf16":
            return _reduced_precision(dict(args) | {"_inner": True}, dynamic, conv2d_kernel)
        weight, bias = weight.float(), bias.float() if bias is not None else None  # widened
    activation = str(args["activation"])
    donated = bool(args.get("_residual_donated"))  # see runtime/donation.py
    onednn: Callable[..., torch.Tensor]
    dnnl = load_dnnl()
    geometry = _geometry(args)
    if dnnl is not None and weight.dtype == torch.float32:
        kept = DirectConv(dnnl, weight, bias, geometry, activation, "residual" in dynamic, donated)
        onednn = with_fallback(kept, lambda: _onednn_conv(args, dynamic, weight, bias))
    else:
        onednn = _onednn_conv(args, dynamic, weight, bias)
    if is_pointwise(weight, *geometry):
        return with_gemm_tactic(onednn, weight, bias, activation, "residual" in dynamic, donated)
    stride, padding, dilation, groups = geometry
    sizes = args.get("_input_sizes") or ()
    if is_winograd_shape(weight, stride, dilation, groups) and has_enough_tiles(sizes, padding):
        return with_winograd_tactic(onednn, weight, bias, padding, activation, donated)
    return onednn


def _geometry(args: Mapping[str, Any]) -> tuple[list[int], list[int], list[int], int]:
    """stride, padding, dilation, groups of a ``cuvil.conv2d`` node."""
    return list(args["stride"]), list(args["padding"]), list(args["dilation"]), int(args["groups"])


def _onednn_conv(
    args: Mapping[str, Any],
    dynamic: Sequence[str],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> Callable[..., Any]:
    """oneDNN's convolution, the activation and any residual add as post-ops."""
    stride, padding, dilation, groups = _geometry(args)
    attr, scalars, algorithm = ONEDNN_ACTIVATIONS[str(args["activation"])]
    weights = ConvWeight(weight, padding, stride, dilation, groups, args.get("_input_sizes"))
    channels_last = torch.channels_last
    if "residual" not in dynamic:

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


def rms_norm_kernel(args: Mapping[str, Any], dynamic: Sequence[str]) -> Callable[..., Any]:
    """``cuvil.rms_norm(input, weight, eps)``: one native pass (backends/cpu/rowwise.py)."""
    check_runtime_args(dynamic, ("input",))
    return rowwise.rms_norm(args["weight"], float(args["eps"]))


def rope_kernel(args: Mapping[str, Any], dynamic: Sequence[str]) -> Callable[..., Any]:
    """``cuvil.rope(input, cos, sin)``: x * cos + rotate_half(x) * sin, one native pass."""
    return rowwise.rope()


def attention_kernel(args: Mapping[str, Any], dynamic: Sequence[str]) -> Callable[..., Any]:
    """``cuvil.attention(query, key, value, mask, scale, causal, gqa)``: ATen's CPU flash
    attention (blocked, fused softmax) when the call allows it, the math path otherwise."""
    scale = args.get("scale")
    causal = bool(args.get("causal", False))
    gqa = bool(args.get("gqa", False))
    sdpa = F.scaled_dot_product_attention
    if "mask" in dynamic:

        def masked(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
        ) -> torch.Tensor:
            return sdpa(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)

        return masked

    constant_mask = args.get("mask")  # a mask baked into the model, or None

    def unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa(q, k, v, attn_mask=constant_mask, is_causal=causal, scale=scale, enable_gqa=gqa)

    return unmasked


def layer_norm_kernel(args: Mapping[str, Any], dynamic: Sequence[str]) -> Callable[..., Any]:
    """``cuvil.layer_norm(input, weight, bias, eps)`` over the last dim."""
    check_runtime_args(dynamic, ("input",))
    weight, bias, eps = args.get("weight"), args.get("bias"), float(args["eps"])
    shape = [int(weight.shape[-1])] if weight is not None else None

    def layer_norm(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, shape or [x.shape[-1]], weight, bias, eps)

    return layer_norm


CPU_KERNELS: dict[str, KernelFactory] = {
    "cuvil.conv2d": conv2d_kernel,
    "cuvil.linear": linear_kernel,
    "cuvil.swiglu": swiglu_kernel,
    "cuvil.rms_norm": rms_norm_kernel,
    "cuvil.rope": rope_kernel,
    "cuvil.attention": attention_kernel,
    "cuvil.layer_norm": layer_norm_kernel,
}
