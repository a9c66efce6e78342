"""Values that depend on the input shapes only, computed once per shape and reused.

A decoder builds its rotary cos/sin tables, its causal mask and its position ids from
``arange(seq)``; an encoder slices its position ids to the sequence length. None of these read
an input's data, only the symbols (sequence length, batch size), so for a given set of symbol
values they are the same on every call. The plan runs those steps once per distinct shape
(a small LRU of shapes) and then only the steps that touch data: for a 128-token Llama that is
a quarter of the plan's steps.

A step is shape-only when none of its tensor operands comes from a graph input (constants and
symbols are fine), it is not random, and it does not produce a graph output (outputs are handed
to the caller, who may write to them). Only the shape-only values that later steps read are
kept in the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from cuvil.ir import Graph

MAX_SHAPES = 16  # distinct symbol bindings remembered per plan
RANDOM_OPS = ("rand", "normal", "bernoulli", "dropout", "uniform", "multinomial", "empty")


def shape_only_nodes(graph: Graph) -> set[str]:
    """Names of the non-const nodes whose values depend on symbols and constants only."""
    outputs = {value.node for _, value in graph.outputs}
    data_dependent = set(graph.inputs)
    shape_only: set[str] = set()
    for node in graph.nodes:
        if node.op in ("input", "const"):
            continue
        reads_data = any(value.node in data_dependent for value in node.inputs)
        random = any(word in node.op for word in RANDOM_OPS)
        if reads_data or random or node.name in outputs:
            data_dependent.add(node.name)
        else:
            shape_only.add(node.name)
    return shape_only


class ShapeCache:
    """symbol values -> the kept slots' values, least recently used dropped first."""

    def __init__(self, kept_slots: Sequence[int]) -> None:
        self.kept_slots = tuple(kept_slots)
        self._entries: OrderedDict[tuple[tuple[str, int], ...], tuple[Any, ...]] = OrderedDict()

    @staticmethod
    def key(symbols: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
        return tuple(sorted(symbols.items()))

    def get(self, key: tuple[tuple[str, int], ...]) -> tuple[Any, ...] | None:
        values = self._entries.get(key)
        if values is not None:
            self._entries.move_to_end(key)
        return values

    def put(self, key: tuple[tuple[str, int], ...], slots: list[Any]) -> None:
        self._entries[key] = tuple(slots[slot] for slot in self.kept_slots)
        self._entries.move_to_end(key)
        while len(self._entries) > MAX_SHAPES:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
