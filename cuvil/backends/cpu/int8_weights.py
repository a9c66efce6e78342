"""The GEMM of int8 weights (``precision="int8"``): each linear's weight int8 with one fp32 scale
per output column (``cuvil.linear``'s and ``cuvil.swiglu``'s ``weight_scale``).

On CPUs with AMX-INT8 the weight stays int8 in memory and ``native/int8_weights.cc`` multiplies
it as it is stored, the rows written as two int8 digits each (finer than bf16 rows): a decode
step reads half the bytes of a bf16 weight. It runs calls of up to FEW_ROWS rows, where it
measured faster than oneDNN's bf16 GEMM; longer calls (prompts) run the bf16 paths over the
weight's bf16 values, made on first need. Elsewhere (``offered()`` is false) every call runs
those. ``CUVIL_INT8_WEIGHTS=off`` withdraws the native path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cuvil.backends.cpu.activations import INPLACE_ACTIVATIONS
from cuvil.backends.cpu.native_calls import INPLACE_OPS, Result, op
from cuvil.backends.cpu.weight_copies import shared_copy
from cuvil.runtime.kernels import PreparedKernel

aten = torch.ops.aten

COLUMNS = 16  # output columns of a packed block
DEPTH = 64  # the in features are padded to a multiple of this
GROUP = 2  # blocks the kernel multiplies together
FEW_ROWS = 128  # the most rows a call runs on the int8 weight itself (past it oneDNN bf16 wins)


@functools.cache
def offered() -> bool:
    """Whether the native int8 GEMM runs here (AMX-INT8 and the native library)."""
    if os.environ.get("CUVIL_INT8_WEIGHTS", "on") == "off":
        return False
    from cuvil.backends.cpu import plan_loop

    return plan_loop.load() and int(torch.ops.cuvil_native.int8_weights_level()) == 5


def describe_int8() -> str:
    """Where an int8 weight is read as int8, in words."""
    if offered():
        return f"AMX int8 tiles for calls of up to {FEW_ROWS} rows; bf16 values for longer ones"
    return "bf16 values made at load (no AMX-INT8 here, or CUVIL_INT8_WEIGHTS=off)"


def dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 weight's values as bf16 (each row times its scale), shared by every kernel on
    it."""
    return shared_copy(weight, "bf16", lambda: (weight.float() * scale[:, None]).bfloat16())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (int8) in the kernel's order: blocks of 16 outputs, grouped by
    two (the last group may be shorter); within a group, for each 64 in features, each block's
    tile of [16 quads of in features][16 outputs][4] (AMX's int8 layout for the second
    operand), so a group's weight is read as one stream. Zeros pad the last block and the in
    features to a multiple of 64."""
    out_features, in_features = (int(size) for size in weight.shape)
    blocks = -(-out_features // COLUMNS)
    depth = -(-in_features // DEPTH) * DEPTH
    padded = weight.new_zeros(blocks * COLUMNS, depth)
    padded[:out_features, :in_features] = weight
    # [block, k step, quad, column, 4]
    tiles = padded.view(blocks, COLUMNS, depth // DEPTH, DEPTH // 4, 4).permute(0, 2, 3, 1, 4)
    tiles = tiles.reshape(blocks, depth // DEPTH, DEPTH * COLUMNS)
    parts = [
        tiles[first : first + GROUP].transpose(0, 1).reshape(-1)
        for first in range(0, blocks, GROUP)
    ]
    return torch.cat(parts)


class Int8WeightLinear:
    """``(x)`` or ``(x, residual)`` -> activation(x (W * scale)^T + b) [+ residual], x fp32 or
    bf16 [rows, in], the result bf16 where ``low_out`` else fp32; the activation in place after
    the kernel."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str,
        low_out: bool,
    ) -> None:
        if weight.dtype != torch.int8 or scale.shape != (weight.shape[0],):
            raise ValueError("the int8 path takes an int8 weight [out, in] and a scale [out]")
        if not offered():
            raise ValueError("the int8 path is not offered here (int8_weights.offered())")
        self.features = int(weight.shape[0])
        self.in_features = int(weight.shape[1])
        self.packed = shared_copy(weight, "int8 blocks", lambda: pack(weight))
        self.scale = scale.float().contiguous()
        self.bias = bias.float().contiguous() if bias is not None else None
        self.activation = activation
        self.activate = INPLACE_ACTIVATIONS[activation]
        self.low_out = low_out

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        gemm = torch.ops.cuvil_native.int8_weight_linear
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if residual is not None:
            residual = residual.reshape(rows.shape[0], self.features)
        y = gemm(rows, self.packed, self.scale, self.features, self.bias, residual, self.low_out)
        y = y if residual is not None else self.activate(y)
        return y.view(*lead, self.features)

    def native_calls(self, args: tuple[Any, ...]) -> list[Any]:
        """The same calls for the native plan loop (native_calls.py): leading dims flattened
        to rows (no reshape for rows already), the kernel, its activation, the dims back."""
        x, residual = args[0], (args[1] if len(args) > 1 else None)
        lead = [int(size) for size in x.shape[:-1]]
        calls: list[Any] = []
        if len(lead) != 1:
            calls.append(op(aten.reshape.default, x, [-1, self.in_features]))
            x = Result(0)
            if residual is not None:
                calls.append(op(aten.reshape.default, residual, [-1, self.features]))
                residual = Result(1)
        gemm = torch.ops.cuvil_native.int8_weight_linear.default
        scale, bias = self.scale, self.bias
        calls.append(op(gemm, x, self.packed, scale, self.features, bias, residual, self.low_out))
        if residual is None and self.activation != "none":
            calls.append(INPLACE_OPS[self.activation](Result(len(calls) - 1)))
        if len(lead) != 1:
            calls.append(op(aten.reshape.default, Result(len(calls) - 1), [*lead, self.features]))
        return calls


def int8_kernel(
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    low_out: bool,
) -> Int8WeightLinear | None:
    """The native path for the calls of a few rows, where it is offered; else None."""
    return Int8WeightLinear(weight, scale, bias, activation, low_out) if offered() else None


def by_rows(few: Int8WeightLinear, many: Callable[[], PreparedKernel]) -> PreparedKernel:
    """Calls of up to FEW_ROWS rows (decode steps) on ``few``; longer ones (prompts, where the
    arithmetic bounds the GEMM and oneDNN's blocking wins) on the kernel ``many()`` builds on
    first need, over the weight's bf16 values."""
    built: list[PreparedKernel] = []

    def more() -> PreparedKernel:
        if not built:
            built.append(many())
        return built[0]

    def run(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if x.numel() <= FEW_ROWS * few.in_features:
            return few(x, *rest)
        return more().run(x, *rest)

    def native(args: tuple[Any, ...]) -> Sequence[Any] | None:
        x = args[0]
        if x.numel() <= FEW_ROWS * few.in_features:
            return few.native_calls(args)
        form = more().native
        return form(args) if form is not None else None

    return PreparedKernel(run, native=native)
