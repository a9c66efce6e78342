"""Tensor lifetimes and a memory plan: offsets in one arena, peak against the naive sum.

Every intermediate value lives from the step that makes it to the last step that reads it
(graph outputs to the end). Views (reshape, transpose, slice, …) allocate nothing: they extend
their source's life; nor do ops that write a graph input in place (the KV-cache write), whose
result is that input. Buffers are placed largest first at the lowest offset that does not
overlap a buffer alive at the same time. ``naive_bytes`` is what keeping every intermediate
would cost; ``arena_bytes`` what the plan needs. The executor frees each value after its last
use, so its peak follows this plan's liveness.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cuvil.dtypes import torch_dtype
from cuvil.fused_ops import in_place_ops
from cuvil.ir import Graph, Value
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
    end = len(graph.nodes)
    for _, value in graph.outputs:
        source = root.get(value, value)
        if source in life:
            life[source][1] = end
    return {value: (first, last) for value, (first, last) in life.items()}


def plan_memory(graph: Graph, symbols: Mapping[str, int], alignment: int = 64) -> MemoryPlan:
    spans = lifetimes(graph)
    sizes: dict[Value, int] = {}
    for value in spans:
        tensor_type = graph.type_of(value)
        count = 1
        for dim in tensor_type.shape:
            count *= int(compile_expr(dim)(symbols))
        raw = count * torch_dtype(tensor_type.dtype).itemsize
        sizes[value] = (raw + alignment - 1) // alignment * alignment
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, first, last)
    offsets: dict[Value, int] = {}
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
    arena = max((o + s for o, s, _, _ in placed), default=0)
    return MemoryPlan(dict(symbols), offsets, sizes, arena, sum(sizes.values()))
