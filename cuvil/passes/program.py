"""Program: a Graph and the weights its ``const`` nodes name — what passes take and return.

Passes never mutate a Program; they return a new one. Weights are shared between programs
(tensors are not copied) unless a pass computes new ones (BN folding, constant folding), which
get fresh keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import sympy
import torch

from cuvil.dtypes import dtype_name
from cuvil.ir import Graph, Node, TensorType, Value


@dataclass(frozen=True)
class Program:
    graph: Graph
    weights: Mapping[str, torch.Tensor]
    # How often each rewrite rule fired, accumulated over passes (for the report).
    hits: Mapping[str, int] = field(default_factory=dict)

    def const_tensor(self, value: Value) -> torch.Tensor | None:
        """The tensor behind ``value`` if a const node produces it, else None."""
        node = self.graph.by_name.get(value.node)
        if node is None or node.op != "const":
            return None
        return self.weights.get(str(node.arg("key")))

    def with_hits(self, counts: Mapping[str, int]) -> Program:
        merged = dict(self.hits)
        for name, count in counts.items():
            if count:
                merged[name] = merged.get(name, 0) + count
        return replace(self, hits=merged)


def const_node(name: str, key: str, tensor: torch.Tensor, origin: str = "") -> Node:
    shape = tuple(sympy.Integer(size) for size in tensor.shape)
    return Node(
        name, "const", (("key", key),), (TensorType(dtype_name(tensor.dtype), shape),), origin
    )


class NameSource:
    """Fresh node names and weight keys that do not clash with a graph's."""

    def __init__(self, graph: Graph, weights: Mapping[str, torch.Tensor]) -> None:
        self.taken = set(graph.by_name) | set(weights)

    def fresh(self, base: str) -> str:
        base = base.replace("-", "_")
        candidate, counter = base, 0
        while candidate in self.taken:
            counter += 1
            candidate = f"{base}_{counter}"
        self.taken.add(candidate)
        return candidate
