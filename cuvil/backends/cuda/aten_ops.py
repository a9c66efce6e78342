"""The CUDA backend's fused nodes that run through ATen on the plan's device: those a template
does not take (a dynamic row width, a linear or convolution without an epilogue, where cuBLAS or
cuDNN adds the bias, a RoPE that broadcasts its input, attention with a boolean mask). Each
factory computes in the weight's dtype and returns the input's, as the precision pass means
(bf16 weights, fp32 values between ops).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from cuvil import fused_ops as fused
from cuvil.runtime.kernels import FusedCall, KernelFactory, PreparedKernel

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda y: y,
    "relu": torch.relu,
    "relu6": lambda y: F.hardtanh(y, 0.0, 6.0),
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "hardswish": F.hardswish,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def _low(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def _epilogue(
    activation: str, has_residual: bool
) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """activation(y + residual), activation(y) or y + residual: the epilogue rules' shapes."""
    act = ACTIVATIONS[activation]

    def apply(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return act(y + residual) if has_residual and residual is not None else act(y)

    return apply


def linear(call: FusedCall) -> PreparedKernel:
    """``cuvil.linear``: ``F.linear`` in the weight's dtype (cuBLAS on a GPU), then its epilogue."""
    call.check_runtime(("input", "residual"))
    weight: torch.Tensor = call.arg("weight")
    bias = _low(call.arg("bias"), weight.dtype)
    epilogue = _epilogue(str(call.arg("activation")), call.is_runtime("residual"))

    def run(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
        return epilogue(y, residual)

    return PreparedKernel(run)


def conv2d(call: FusedCall) -> PreparedKernel:
    """``cuvil.conv2d``: ``F.conv2d`` in the weight's dtype (cuDNN on a GPU), then its epilogue."""
    call.check_runtime(("input", "residual"))
    weight: torch.Tensor = call.arg("weight")
    bias = _low(call.arg("bias"), weight.dtype)
    stride, padding, dilation = (list(call.arg(key)) for key in ("stride", "padding", "dilation"))
    groups = int(call.arg("groups"))
    epilogue = _epilogue(str(call.arg("activation")), call.is_runtime("residual"))

    def run(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = F.conv2d(x.to(weight.dtype), weight, bias, stride, padding, dilation, groups)
        return epilogue(y.to(x.dtype), residual)

    return PreparedKernel(run)


def swiglu(call: FusedCall) -> PreparedKernel:
    """``cuvil.swiglu``: one GEMM over the packed gate and up weights, then silu(gate) * up."""
    call.check_runtime(("input",))
    weight: torch.Tensor = call.arg("gate_up_weight")
    hidden = int(call.arg("hidden"))

    def run(x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x.to(weight.dtype), weight).split(hidden, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)

    return PreparedKernel(run)


def rms_norm(call: FusedCall) -> PreparedKernel:
    call.check_runtime(("input",))
    weight: torch.Tensor = call.arg("weight")
    eps, shape = float(call.arg("eps")), [int(weight.shape[-1])]
    return PreparedKernel(lambda x: F.rms_norm(x, shape, weight, eps))


def layer_norm(call: FusedCall) -> PreparedKernel:
    call.check_runtime(("input",))
    weight, bias, eps = call.arg("weight"), call.arg("bias"), float(call.arg("eps"))
    return PreparedKernel(lambda x: F.layer_norm(x, [x.shape[-1]], weight, bias, eps))


def rope(call: FusedCall) -> PreparedKernel:
    """``cuvil.rope``: x * cos + rotate_half(x) * sin."""

    def run(x: torch.Tensor, *angles: torch.Tensor) -> torch.Tensor:
        cos, sin = _angles(call, angles)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, rotated, sin)

    return PreparedKernel(run)


def _angles(call: FusedCall, given: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, from the run-time values where they are computed, constants otherwise."""
    values = iter(given)
    cos = next(values) if call.is_runtime("cos") else call.arg("cos")
    sin = next(values) if call.is_runtime("sin") else call.arg("sin")
    return cos, sin


def attention(call: FusedCall) -> PreparedKernel:
    """``cuvil.attention``: torch's scaled dot-product attention (flash or memory-efficient
    kernels on a GPU, as the call allows)."""
    scale, causal, gqa = call.arg("scale"), bool(call.arg("causal", False)), bool(call.arg("gqa"))
    runtime_mask = call.is_runtime("mask")
    constant_mask = None if runtime_mask else call.arg("mask")
    sdpa = F.scaled_dot_product_attention

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
        attn_mask = mask[0] if runtime_mask else constant_mask
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale, enable_gqa=gqa)

    return PreparedKernel(run)


ATEN_KERNELS: dict[str, KernelFactory] = {
    fused.LINEAR: linear,
    fused.CONV2D: conv2d,
    fused.SWIGLU: swiglu,
    fused.RMS_NORM: rms_norm,
    fused.LAYER_NORM: layer_norm,
    fused.ROPE: rope,
    fused.ATTENTION: attention,
}
