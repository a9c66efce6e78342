"""CPU kernels for Cuvil's fused ops: oneDNN primitives reached through ATen, weights prepacked.

Each entry of CPU_KERNELS is a factory called once when a plan is built, with the node's
constant arguments (weights as tensors, attributes as literals) and the names of the arguments
that arrive at run time; it returns the function the plan calls with those run-time values.
Prepacking (``mkldnn._reorder_*_weight``) therefore happens once per load, never per call.
Activations map onto oneDNN post-ops; a residual add becomes a binary post-op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

KernelFactory = Callable[[Mapping[str, Any], Sequence[str]], Callable[..., Any]]

# activation name in the IR -> (oneDNN post-op, scalars, algorithm)
ONEDNN_ACTIVATIONS: dict[str, tuple[str, list[float], str]] = {
    "none": ("none", [], ""),
    "relu": ("relu", [], ""),
    "gelu": ("gelu", [], "none"),
    "gelu_tanh": ("gelu", [], "tanh"),
    "silu": ("swish", [], ""),
    "hardswish": ("hardswish", [], ""),
    "relu6": ("hardtanh", [0.0, 6.0], ""),
    "tanh": ("tanh", [], ""),
    "sigmoid": ("sigmoid", [], ""),
}

mkldnn = torch.ops.mkldnn

# The same activations as plain functions, for the ATen fallback path.
ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda x: x,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "hardswish": F.hardswish,
    "relu6": F.relu6,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def has_onednn_bf16() -> bool:
    """oneDNN runs bf16 natively only with AVX512-BF16/AMX (or AVX-NE-CONVERT); checked at load."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _reduced_precision(
    args: Mapping[str, Any], dynamic: Sequence[str], onednn: KernelFactory, aten: Callable[..., Any]
) -> Callable[..., Any]:
    """bf16 weights: compute in bf16, keep fp32 at the op's borders (inputs cast in, result out).
    oneDNN where the CPU has bf16 instructions; ATen's bf16 kernels otherwise."""
    if not has_onednn_bf16():
        return aten
    bias = args.get("bias")
    inner = onednn(
        dict(args) | {"bias": bias.to(torch.bfloat16) if bias is not None else None}, dynamic
    )

    def run(*values: torch.Tensor) -> torch.Tensor:
        return inner(*(v.to(torch.bfloat16) for v in values)).float()

    return run


def _runtime_order(dynamic: Sequence[str], expected: Sequence[str]) -> None:
    unexpected = [name for name in dynamic if name not in expected]
    if unexpected:
        raise ValueError(f"arguments {unexpected} must be constants for this kernel")


def pack_conv_weight(
    weight: torch.Tensor,
    padding: list[int],
    stride: list[int],
    dilation: list[int],
    groups: int,
    input_sizes: Sequence[int | None] | None,
) -> torch.Tensor:
    """oneDNN's blocked weight layout for this input geometry. Packing needs the channels and
    spatial sizes (without them oneDNN may pick a layout it then reorders on every call, 15x
    slower on strided 1x1 convolutions); with dynamic spatial dims the weight stays plain
    channels-last, which oneDNN reads directly."""
    sizes = list(input_sizes or [])
    if len(sizes) != 4 or any(size is None for size in sizes[1:]):
        return weight.contiguous(memory_format=torch.channels_last)
    hint = [1, *(int(size) for size in sizes[1:])]  # type: ignore[arg-type]
    return mkldnn._reorder_convolution_weight(weight, padding, stride, dilation, groups, hint)


def conv2d_kernel(args: Mapping[str, Any], dynamic: Sequence[str]) -> Callable[..., Any]:
    """``cuvil.conv2d(input, weight, bias, stride, padding, dilation, groups, activation,
    residual)``: activation(conv(input) + residual), channels-last, weight prepacked."""
    _runtime_order(dynamic, ("input", "residual"))
    weight: torch.Tensor = args["weight"]
    bias = args.get("bias")
    stride, padding = list(args["stride"]), list(args["padding"])
    dilation, groups = list(args["dilation"]), int(args["groups"])
    if weight.dtype == torch.bfloat16 and not args.get("_inner"):
        activate = ACTIVATION_FUNCTIONS[str(args["activation"])]
        low_bias = bias.to(torch.bfloat16) if bias is not None else None

        def aten_conv(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            y = F.conv2d(
                x.to(torch.bfloat16), weight, low_bias, stride, padding, dilation, groups
            ).float()
            return activate(y + residual if residual is not None else y)

        return _reduced_precision(dict(args) | {"_inner": True}, dynamic, conv2d_kernel, aten_conv)
    attr, scalars, algorithm = ONEDNN_ACTIVATIONS[str(args["activation"])]
    packed = pack_conv_weight(weight, padding, stride, dilation, groups, args.get("_input_sizes"))
    channels_last = torch.channels_last
    if "residual" not in dynamic:

        def conv(x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous(memory_format=channels_last)
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
            packed,
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


def linear_kernel(args: Mapping[str, Any], dynamic: Sequence[str]) -> Callable[..., Any]:
    """``cuvil.linear(input, weight, bias, activation, residual)``: activation(x W^T + b), or
    x W^T + b + residual; weight prepacked for oneDNN."""
    _runtime_order(dynamic, ("input", "residual"))
    weight: torch.Tensor = args["weight"]
    bias = args.get("bias")
    if weight.dtype == torch.bfloat16 and not args.get("_inner"):
        activate = ACTIVATION_FUNCTIONS[str(args["activation"])]
        low_bias = bias.to(torch.bfloat16) if bias is not None else None

        def aten_linear(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            y = F.linear(x.to(torch.bfloat16), weight, low_bias).float()
            return activate(y) if residual is None else y + residual

        return _reduced_precision(
            dict(args) | {"_inner": True}, dynamic, linear_kernel, aten_linear
        )
    attr, scalars, algorithm = ONEDNN_ACTIVATIONS[str(args["activation"])]
    packed = mkldnn._reorder_linear_weight(weight, None)
    if "residual" in dynamic:
        if attr != "none":
            raise ValueError("cuvil.linear fuses an activation or a residual add, not both")

        def linear_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return mkldnn._linear_pointwise.binary(
                x.contiguous(), residual.contiguous(), packed, bias, "add"
            )

        return linear_add

    def linear(x: torch.Tensor) -> torch.Tensor:
        return mkldnn._linear_pointwise(x.contiguous(), packed, bias, attr, scalars, algorithm)

    return linear


def swiglu_kernel(args: Mapping[str, Any], dynamic: Sequence[str]) -> Callable[..., Any]:
    """``cuvil.swiglu(input, gate_up_weight, hidden)``: silu(x Wg^T) * (x Wu^T) with the two
    projections packed into one GEMM."""
    _runtime_order(dynamic, ("input",))
    hidden = int(args["hidden"])
    if args["gate_up_weight"].dtype == torch.bfloat16:
        weight = args["gate_up_weight"]

        def aten_swiglu(x: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(x.to(torch.bfloat16), weight).float().split(hidden, dim=-1)
            return F.silu(gate) * up

        if not has_onednn_bf16():
            return aten_swiglu
    packed = mkldnn._reorder_linear_weight(args["gate_up_weight"], None)
    low = args["gate_up_weight"].dtype == torch.bfloat16

    def swiglu(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16) if low else x.contiguous()
        both = mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()
        gate, up = both.split(hidden, dim=-1)
        return F.silu(gate) * up

    return swiglu


def rms_norm_kernel(args: Mapping[str, Any], dynamic: Sequence[str]) -> Callable[..., Any]:
    """``cuvil.rms_norm(input, weight, eps)``."""
    _runtime_order(dynamic, ("input",))
    weight, eps = args["weight"], float(args["eps"])
    shape = [int(weight.shape[-1])]

    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, shape, weight, eps)

    return rms_norm


def rope_kernel(args: Mapping[str, Any], dynamic: Sequence[str]) -> Callable[..., Any]:
    """``cuvil.rope(input, cos, sin)``: x * cos + rotate_half(x) * sin."""

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, rotated, sin)

    return rope


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
    _runtime_order(dynamic, ("input",))
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
