"""A GEMM path for bf16 weights on CPUs whose oneDNN has no bf16 instructions: the weight kept
in bf16 and widened to fp32 as it is read, the arithmetic in fp32 (``native/bf16_weights.cc``).

There the other paths multiply by an fp32 copy of the weight made at load, which is as fast
as GEMMs get when the arithmetic bounds them (many rows: prompts, encoders). A decode step of a
few rows is bounded instead by reading every weight from memory once, and a bf16 weight is half
the bytes. So bf16 linears on such CPUs offer this path beside the fp32 ones, and the tactics
time it against them per row bucket. Its result is the product with the bf16 weight, the same
values the fp32 paths compute from the widened copy, up to summation order.

Offered where the plan loop's library is built and the CPU has AVX2 or AVX-512
(``offered()``); ``CUVIL_BF16_WEIGHTS=off`` withdraws it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from cuvil.backends.cpu.activations import INPLACE_ACTIVATIONS
from cuvil.backends.cpu.native_calls import INPLACE_OPS, Result, op
from cuvil.backends.cpu.weight_copies import shared_copy

COLUMNS = 32  # output columns of a packed block


@functools.cache
def isa_level() -> int:
    """The kernel's code for this CPU: 4 (AVX-512), 3 (AVX2), or 0 where the path is not
    offered (no native library, an older CPU, or switched off)."""
    if os.environ.get("CUVIL_BF16_WEIGHTS", "on") == "off":
        return 0
    from cuvil.backends.cpu import plan_loop

    return int(torch.ops.cuvil_native.bf16_weights_level()) if plan_loop.load() else 0


def offered() -> bool:
    """Whether the path runs here."""
    return isa_level() > 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (bf16) as [blocks of 32 outputs, in, 32], zero columns padding the
    last block, each line's columns paired (j beside 16 + j: the kernel widens a line into
    columns 0-15 and 16-31 with one shift and one mask), viewed as int16."""
    out_features, in_features = (int(size) for size in weight.shape)
    blocks = -(-out_features // COLUMNS)
    padded = weight.new_zeros(blocks * COLUMNS, in_features)
    padded[:out_features] = weight
    lines = padded.view(blocks, COLUMNS, in_features).transpose(1, 2)  # [blocks, in, 32]
    half = COLUMNS // 2
    paired = torch.stack((lines[..., :half], lines[..., half:]), dim=-1)
    return paired.reshape(blocks, in_features, COLUMNS).contiguous().view(torch.int16)


class Bf16WeightLinear:
    """``(x)`` or ``(x, residual)`` -> activation(x W^T + b) [+ residual], x fp32 [rows, K], W
    held in bf16: bias and residual added in the kernel, the activation in place after it."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, isa: int = 0
    ) -> None:
        """``isa``: the code to run (4 or 3, at most the CPU's; 0: this CPU's own)."""
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"the bf16-weight path takes bf16 weights, not {weight.dtype}")
        self.isa = isa or isa_level()
        if self.isa not in (3, 4):
            raise ValueError("the bf16-weight path is not offered here (bf16_weights.offered())")
        self.features = int(weight.shape[0])
        self.packed = shared_copy(weight, "bf16 blocks", lambda: pack(weight))
        self.bias = bias.float().contiguous() if bias is not None else None
        self.activation = activation
        self.activate = INPLACE_ACTIVATIONS[activation]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        gemm = torch.ops.cuvil_native.bf16_weight_linear
        y = gemm(x, self.packed, self.features, self.bias, residual, self.isa)
        return y if residual is not None else self.activate(y)

    def native_calls(self, x: Any, residual: Any, rows: int, first: int) -> list[Any]:
        """The same calls for the native plan loop (native_calls.py), on ``x`` and the residual
        rows, numbered from ``first`` in the form they join."""
        gemm = torch.ops.cuvil_native.bf16_weight_linear.default
        calls = [op(gemm, x, self.packed, self.features, self.bias, residual, self.isa)]
        if residual is None and self.activation != "none":
            calls.append(INPLACE_OPS[self.activation](Result(first)))
        return calls


def bf16_weight_candidates(
    weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> list[tuple[str, Bf16WeightLinear]]:
    """The path as a tactic candidate for a bf16 weight, where it is offered; else none."""
    if weight.dtype != torch.bfloat16 or not offered():
        return []
    return [("bf16_weights", Bf16WeightLinear(weight, bias, activation))]
