"""1x1 convolutions as GEMMs: a second path for ``cuvil.conv2d``, chosen per batch bucket.

A channels-last 1x1 convolution with stride 1, no padding and one group is a matrix product:
the input viewed as ``[N*H*W, C_in]`` (no copy) times the weight as ``[C_in, C_out]`` gives the
output as ``[N*H*W, C_out]``, which is the channels-last output viewed back (no copy either).

Why a second path: the kernels differ. MKL's GEMM and oneDNN's convolution block the same
product differently, and which is faster depends on the shape (a few channels on many pixels
can favour the GEMM, where oneDNN wins most others) and on the CPU. Neither wins everywhere, so
both run under ``Tactics`` (timed in place, the faster kept per batch bucket).

Epilogue on the GEMM path: the bias rides in ``addmm``; a residual is added first (residual +
bias, into a fresh buffer) and the GEMM accumulates into it; the activation runs in place last.
The GEMM path reads the weight as loaded, through a transposed view (MKL takes a transposed
operand as a flag, not a copy), so it holds no second copy of the weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cuvil.backends.cpu.activations import INPLACE_ACTIVATIONS
from cuvil.backends.cpu.tactics import batch_tactics
from cuvil.runtime.kernels import PreparedKernel


def is_pointwise(
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> bool:
    """A 1x1 convolution that is exactly a GEMM over the channel dim."""
    return (
        weight.dim() == 4
        and tuple(weight.shape[2:]) == (1, 1)
        and all(s == 1 for s in stride)
        and all(p == 0 for p in padding)
        and groups == 1
        and weight.dtype == torch.float32
    )


def gemm_conv(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    residual: bool,
    donated: bool = False,
) -> Callable[..., torch.Tensor]:
    """The GEMM path: ``(x)`` or ``(x, residual)`` -> activation(conv(x) [+ residual]),
    channels-last in and out; a ``donated`` residual (runtime/donation.py) is accumulated into
    in place rather than copied first."""
    out_channels, in_channels = int(weight.shape[0]), int(weight.shape[1])
    transposed = weight.reshape(out_channels, in_channels).t()  # a view: no copy
    activate = INPLACE_ACTIVATIONS[activation]
    channels_last = torch.channels_last

    def rows_of(x: torch.Tensor, channels: int) -> torch.Tensor:
        return x.contiguous(memory_format=channels_last).permute(0, 2, 3, 1).reshape(-1, channels)

    def back(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        return y.view(batch, height, width, out_channels).permute(0, 3, 1, 2)

    if residual:

        def gemm_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            start = rows_of(residual, out_channels)
            if donated:
                y = start.add_(bias) if bias is not None else start
            else:
                y = torch.add(start, bias) if bias is not None else start.clone()
            return back(activate(y.addmm_(rows_of(x, in_channels), transposed)), x)

        return gemm_add

    def gemm(x: torch.Tensor) -> torch.Tensor:
        rows = rows_of(x, in_channels)
        y = torch.addmm(bias, rows, transposed) if bias is not None else rows.mm(transposed)
        return back(activate(y), x)

    return gemm


def with_gemm_tactic(
    onednn: Callable[..., torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    residual: bool,
    donated: bool = False,
) -> PreparedKernel:
    """``onednn`` and the GEMM path under one tactic choice, keyed by the batch bucket."""
    gemm = gemm_conv(weight, bias, activation, residual, donated)
    return batch_tactics([("onednn", onednn), ("gemm", gemm)])
