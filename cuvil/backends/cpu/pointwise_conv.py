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
from typing import Any

import torch

from cuvil.backends.cpu.activations import INPLACE_ACTIVATIONS
from cuvil.backends.cpu.native_calls import INPLACE_OPS, Result, op
from cuvil.backends.cpu.tactics import batch_tactics
from cuvil.runtime.kernels import PreparedKernel

aten = torch.ops.aten
CHANNELS_LAST = torch.channels_last


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


class GemmConv:
    """The GEMM path: ``(x)`` or ``(x, residual)`` -> activation(conv(x) [+ residual]),
    channels-last in and out; a ``donated`` residual (runtime/donation.py) is accumulated into
    in place rather than copied first."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, donated: bool
    ) -> None:
        self.out_channels, self.in_channels = int(weight.shape[0]), int(weight.shape[1])
        self.transposed = weight.reshape(self.out_channels, self.in_channels).t()  # a view
        self.bias = bias
        self.activation = activation
        self.activate = INPLACE_ACTIVATIONS[activation]
        self.donated = donated

    def _rows(self, x: torch.Tensor, channels: int) -> torch.Tensor:
        return x.contiguous(memory_format=CHANNELS_LAST).permute(0, 2, 3, 1).reshape(-1, channels)

    def _back(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        return y.view(batch, height, width, self.out_channels).permute(0, 3, 1, 2)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        bias = self.bias
        if residual is not None:
            start = self._rows(residual, self.out_channels)
            if self.donated:
                y = start.add_(bias) if bias is not None else start
            else:
                y = torch.add(start, bias) if bias is not None else start.clone()
            y = y.addmm_(self._rows(x, self.in_channels), self.transposed)
        else:
            rows = self._rows(x, self.in_channels)
            y = (
                torch.addmm(bias, rows, self.transposed)
                if bias is not None
                else rows.mm(self.transposed)
            )
        return self._back(self.activate(y), x)

    def native_calls(self, args: tuple[Any, ...]) -> list[Any]:
        """The same ATen calls, for the native plan loop (native_calls.py)."""
        x, residual = args[0], (args[1] if len(args) > 1 else None)
        calls: list[Any] = []

        def rows(value: Any, channels: int) -> Result:
            calls.append(op(aten.contiguous.default, value, memory_format=CHANNELS_LAST))
            calls.append(op(aten.permute.default, Result(len(calls) - 1), [0, 2, 3, 1]))
            calls.append(op(aten.reshape.default, Result(len(calls) - 1), [-1, channels]))
            return Result(len(calls) - 1)

        bias = self.bias
        if residual is not None:
            start = rows(residual, self.out_channels)
            if self.donated:
                if bias is not None:
                    calls.append(op(aten.add_.Tensor, start, bias))
            elif bias is not None:
                calls.append(op(aten.add.Tensor, start, bias))
            else:
                calls.append(op(aten.clone.default, start))
            y = Result(len(calls) - 1)
            source = rows(x, self.in_channels)
            calls.append(op(aten.addmm_.default, y, source, self.transposed))
        else:
            source = rows(x, self.in_channels)
            if bias is not None:
                calls.append(op(aten.addmm.default, bias, source, self.transposed))
            else:
                calls.append(op(aten.mm.default, source, self.transposed))
        if self.activation != "none":
            calls.append(INPLACE_OPS[self.activation](Result(len(calls) - 1)))
        batch, _, height, width = (int(size) for size in x.shape)
        shape = [batch, height, width, self.out_channels]
        calls.append(op(aten.view.default, Result(len(calls) - 1), shape))
        calls.append(op(aten.permute.default, Result(len(calls) - 1), [0, 3, 1, 2]))
        return calls


def gemm_conv(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    residual: bool,
    donated: bool = False,
) -> GemmConv:
    """The GEMM path (``GemmConv``); ``residual``: whether calls pass one."""
    return GemmConv(weight, bias, activation, donated)


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
