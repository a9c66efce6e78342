"""A third GEMM path for linears called with a few rows: the weight split across threads.

At one row a linear is a matrix-vector product, and MKL runs it on one thread however many
there are, so its time does not fall with more threads. Splitting the output features into one
part per thread and running the parts as a batched GEMM (``baddbmm``, batch = parts) puts every
thread to work, each on the same slice of the weight every call, so on a CPU with per-core L2
each part can stay in its core's cache between calls. Whether that wins for a given shape and
host is for ``Tactics`` to time; the figures are in benchmarks/README.md.

The parts are views of the weight when the feature count divides evenly, else of a copy padded
with zero rows (the padding is sliced off the result). The path joins the others under
``Tactics`` only for row buckets up to ``SPLIT_MAX_ROWS``: beyond that MKL threads the GEMM well
and the split's transposing copy of the result only costs.
"""

from __future__ import annotations

from typing import Any

import torch

from cuvil.backends.cpu.activations import INPLACE_ACTIVATIONS
from cuvil.backends.cpu.native_calls import INPLACE_OPS, Result, op

aten = torch.ops.aten

SPLIT_MAX_ROWS = 4


def split_parts() -> int:
    """One part per intra-op thread; 1 (no split path) on a single thread."""
    return max(1, torch.get_num_threads())


class SplitLinear:
    """``(x)`` or ``(x, residual)`` -> activation(x W^T + b) [+ residual], x of shape [rows, K]."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, parts: int
    ) -> None:
        self.features, self.width = int(weight.shape[0]), int(weight.shape[1])
        per_part = -(-self.features // parts)
        self.parts, self.padded = parts, per_part * parts
        if self.padded != self.features:
            weight = torch.cat((weight, weight.new_zeros(self.padded - self.features, self.width)))
        # [parts, K, per_part], a view of the (padded) weight
        self.blocks = weight.reshape(parts, per_part, self.width).transpose(1, 2)
        self.offsets = None
        if bias is not None:
            extra = self.padded - self.features
            full = torch.cat((bias, bias.new_zeros(extra))) if extra else bias
            self.offsets = full.reshape(parts, 1, per_part)
        self.activation = activation
        self.activate = INPLACE_ACTIVATIONS[activation]

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        rows, padded = x.shape[0], self.padded
        spread = x.unsqueeze(0).expand(self.parts, rows, self.width)
        if self.offsets is not None:
            y = torch.baddbmm(self.offsets, spread, self.blocks)
        else:
            y = spread.bmm(self.blocks)
        y = y.view(1, padded) if rows == 1 else y.transpose(0, 1).reshape(rows, padded)
        return y if padded == self.features else y[:, : self.features]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            return self.gemm(x).add_(residual)
        return self.activate(self.gemm(x))

    def native_calls(self, x: Any, residual: Any, rows: int, first: int) -> list[Any]:
        """The same ATen calls for the native plan loop (native_calls.py), on ``x`` and the
        residual (``Result``s), numbered from ``first`` in the form they join."""
        calls: list[Any] = []

        def add(call: Any) -> Result:
            calls.append(call)
            return Result(first + len(calls) - 1)

        spread = add(op(aten.unsqueeze.default, x, 0))
        spread = add(op(aten.expand.default, spread, [self.parts, rows, self.width]))
        if self.offsets is not None:
            y = add(op(aten.baddbmm.default, self.offsets, spread, self.blocks))
        else:
            y = add(op(aten.bmm.default, spread, self.blocks))
        if rows == 1:
            y = add(op(aten.view.default, y, [1, self.padded]))
        else:
            y = add(op(aten.transpose.int, y, 0, 1))
            y = add(op(aten.reshape.default, y, [rows, self.padded]))
        if self.padded != self.features:
            y = add(op(aten.slice.Tensor, y, 1, 0, self.features))
        if residual is not None:
            add(op(aten.add_.Tensor, y, residual))
        elif self.activation != "none":
            add(INPLACE_OPS[self.activation](y))
        return calls


def split_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, activation: str, residual: bool, parts: int
) -> SplitLinear:
    """The split path (``SplitLinear``); ``residual``: whether calls pass one."""
    return SplitLinear(weight, bias, activation, parts)
