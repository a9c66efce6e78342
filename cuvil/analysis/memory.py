"""Tensor lifetimes and a memory plan: offsets in one arena, peak against the naive sum.

Every intermediate value lives from the step that makes it to the last step that reads it
(graph outputs to the end). Views (reshape, transpose, slice, …) allocate nothing: they extend
their source's life; nor do ops that write a graph input in place (the KV-cache write),
whose result is that input. A kernel known to allocate a temporary of its own (``SCRATCH_DTYPES``)
has it planned too, alive during its step. The ``greedy`` planner places buffers largest first
at the lowest offset that does not overlap a buffer alive at the same time; ``naive`` gives
every buffer its own bytes. ``naive_bytes`` is what keeping every intermediate would cost;
``arena_bytes`` what the plan needs. The executor frees each value after its last use, so its
peak follows this plan's liveness (``cuvil inspect --memory`` measures it).

``MemoryPolicy`` is what a user declares on ``cuvil.jit``: the planner, whether kernels may
write over an input nothing reads later (runtime/donation.py), and a budget the plan must fit
at the largest shapes the signature admits, checked at compile time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cuvil.dtypes import torch_dtype
from cuvil.fused_ops import in_place_ops
from cuvil.ir import Graph, Symbol, Value
from cuvil.shape_expr import compile_expr

VIEW_OPS = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.transpose.int",
    "aten.permute.default",
    "aten.expand.default",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.alias.default",
    "aten.t.default",
    "aten.split.Tensor",
    "aten.chunk.default",
    "aten.unbind.int",
    "aten.split_with_sizes.default",
}


# Ops whose kernel allocates a temporary it frees before returning: the temporary's dtype (its
# shape is the output's). ATen's CPU max_pool2d computes the indices of every maximum and drops
# them, an int64 tensor twice the size of a float output.
SCRATCH_DTYPES = {"aten.max_pool2d.default": "i64"}


def scratch_value(node_name: str, outputs: int) -> Value:
    """The value standing for a node's kernel temporary (an index past its outputs)."""
    return Value(node_name, outputs)


@dataclass(frozen=True)
class MemoryPlan:
    symbols: dict[str, int]
    offsets: dict[Value, int]
    sizes: dict[Value, int]
    arena_bytes: int
    naive_bytes: int

    def summary(self) -> dict[str, object]:
        ratio = self.arena_bytes / self.naive_bytes if self.naive_bytes else 1.0
        return {
            "at": self.symbols,
            "buffers": len(self.sizes),
            "arena_bytes": self.arena_bytes,
            "naive_bytes": self.naive_bytes,
            "arena_vs_naive": round(ratio, 4),
        }


def lifetimes(graph: Graph) -> dict[Value, tuple[int, int]]:
    """(first step, last step) per allocating value; views hand their uses to their source."""
    root: dict[Value, Value] = {}
    life: dict[Value, list[int]] = {}
    aliasing = VIEW_OPS | set(in_place_ops())
    for step, node in enumerate(graph.nodes):
        if node.op in ("input", "const"):
            continue
        for value in node.inputs:
            source = root.get(value, value)
            if source in life:
                life[source][1] = step
        sources = [root.get(v, v) for v in node.inputs]
        for index in range(len(node.types)):
            value = Value(node.name, index)
            if node.op in aliasing and sources:
                root[value] = sources[0]
            else:
                life[value] = [step, step]
        if node.op in SCRATCH_DTYPES:  # alive during its own step only
            life[scratch_value(node.name, len(node.types))] = [step, step]
    end = len(graph.nodes)
    for _, value in graph.outputs:
        source = root.get(value, value)
        if source in life:
            life[source][1] = end
    return {value: (first, last) for value, (first, last) in life.items()}


PLANNERS = ("greedy", "naive")


@dataclass(frozen=True)
class MemoryPolicy:
    """How a compiled model's intermediates are laid out (``cuvil.jit(..., memory=...)``)."""

    planner: str = "greedy"  # "greedy": reuse dead buffers' bytes; "naive": none reused
    in_place: bool = True  # kernels may write over an input nothing reads afterwards
    budget_bytes: int | None = None  # the planned arena at the largest admitted shapes

    def __post_init__(self) -> None:
        if self.planner not in PLANNERS:
            raise ValueError(f"planner {self.planner!r}: use one of {', '.join(PLANNERS)}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, not {self.budget_bytes}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> MemoryPolicy:
        return cls(**dict(data)) if data else cls()


class MemoryBudgetError(ValueError):
    """The memory plan needs more than the policy's budget."""


def place(
    spans: Mapping[Value, tuple[int, int]], sizes: Mapping[Value, int], planner: str = "greedy"
) -> dict[Value, int]:
    """Offsets for buffers alive over ``spans`` (first, last step, inclusive) with ``sizes``:
    no two buffers alive at one step share a byte."""
    offsets: dict[Value, int] = {}
    if planner == "naive":
        end = 0
        for value in spans:
            offsets[value], end = end, end + sizes[value]
        return offsets
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, first, last)
    for value in sorted(spans, key=lambda v: (-sizes[v], spans[v])):
        first, last = spans[value]
        size, offset = sizes[value], 0
        clashes = sorted((o, s) for o, s, f, la in placed if f <= last and first <= la)
        for other_offset, other_size in clashes:
            if offset + size <= other_offset:
                break
            offset = max(offset, other_offset + other_size)
        offsets[value] = offset
        placed.append((offset, size, first, last))
    return offsets


def plan_memory(
    graph: Graph, symbols: Mapping[str, int], alignment: int = 64, planner: str = "greedy"
) -> MemoryPlan:
    spans = lifetimes(graph)
    sizes: dict[Value, int] = {}
    for value in spans:
        node = graph.node(value.node)
        scratch = value.index >= len(node.types)
        tensor_type = node.types[0] if scratch else graph.type_of(value)
        count = 1
        for dim in tensor_type.shape:
            count *= int(compile_expr(dim)(symbols))
        dtype = SCRATCH_DTYPES[node.op] if scratch else tensor_type.dtype
        raw = count * torch_dtype(dtype).itemsize
        sizes[value] = (raw + alignment - 1) // alignment * alignment
    offsets = place(spans, sizes, planner)
    arena = max((offsets[v] + sizes[v] for v in offsets), default=0)
    return MemoryPlan(dict(symbols), offsets, sizes, arena, sum(sizes.values()))


def largest_shapes(symbols: Sequence[Symbol], example: Mapping[str, int]) -> dict[str, int]:
    """Each symbol at its upper bound (the example's value where it has none)."""
    return {s.name: s.max if s.max is not None else int(example[s.name]) for s in symbols}


def check_budget(
    graph: Graph, symbols: Sequence[Symbol], example: Mapping[str, int], policy: MemoryPolicy
) -> None:
    """Refuse a plan that needs more than ``policy.budget_bytes`` at the largest shapes."""
    if policy.budget_bytes is None:
        return
    at = largest_shapes(symbols, example)
    plan = plan_memory(graph, at, planner=policy.planner)
    if plan.arena_bytes > policy.budget_bytes:
        where = ", ".join(f"{name}={value}" for name, value in at.items()) or "its static shapes"
        raise MemoryBudgetError(
            f"the {policy.planner} memory plan needs {plan.arena_bytes} bytes of activations at "
            f"{where} (naive sum {plan.naive_bytes}), over the budget of "
            f"{policy.budget_bytes} bytes"
        )
