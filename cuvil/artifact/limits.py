"""Resource limits at load: what an artifact may ask of the node before anything runs or allocates.

Digests prove that files are those the config names, not that they are reasonable. After the
digests and before a plan is built, a loaded artifact is refused (``ArtifactLimitError``, naming
what and by how much) when the sizes the config declares differ from the files; the graph has
more nodes than ``max_nodes``; it holds an op outside the allowlist (``cuvil.allowed_ops``); a
tensor it declares could, with every symbol inside its declared range, grow past
``max_tensor_bytes`` (a symbol with no upper bound cannot be bounded and is refused); a size
argument (of ``full``, ``arange``, ``repeat``, ``pad``…) could; the constants declare other
sizes than the weights file holds; or the golden data is larger than the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import sympy
import torch

from cuvil.allowed_ops import SIZE_ARGUMENTS, op_problems
from cuvil.artifact.errors import ArtifactError
from cuvil.dtypes import torch_dtype
from cuvil.ir import Arg, Graph
from cuvil.shape_bounds import INFINITY, Bound, Interval, interval, magnitude, upper_bound


class ArtifactLimitError(ArtifactError):
    """An artifact asks for more than the load limits allow, or declares sizes it lacks."""


@dataclass(frozen=True)
class LoadLimits:
    """Limits a loaded artifact must keep; the sidecar takes them from its environment."""

    max_tensor_bytes: int = 16 * 2**30  # one tensor at the largest sizes the ranges allow
    max_nodes: int = 100_000
    golden_allowance_bytes: int = 64 * 2**20  # golden data may exceed the model by this much


DEFAULT_LIMITS = LoadLimits()


def check_declared_sizes(
    config: Mapping[str, Any], files: Mapping[str, bytes], origin: str
) -> None:
    """Every file's size recorded in the config equals the file's."""
    for name, entry in (config.get("files") or {}).items():
        if name in files and entry.get("size") != len(files[name]):
            raise ArtifactLimitError(
                f"{origin}: {name} is {len(files[name])} bytes, the config declares "
                f"{entry.get('size')}"
            )


def check_node_count(graph_json: Mapping[str, Any], limits: LoadLimits, origin: str) -> None:
    """Before the graph is parsed: no more nodes than ``max_nodes``."""
    nodes = graph_json.get("nodes")
    if isinstance(nodes, list) and len(nodes) > limits.max_nodes:
        raise ArtifactLimitError(
            f"{origin}: the graph has {len(nodes)} nodes, more than the limit {limits.max_nodes}"
        )


def check_graph(graph: Graph, limits: LoadLimits, origin: str) -> None:
    """The allowlist, declared tensor sizes and size arguments of a parsed, verified graph."""
    for problem in op_problems(graph):
        raise ArtifactLimitError(f"{origin}: {problem}; refusing the artifact")
    ranges = symbol_ranges(graph)
    for problem in _size_problems(graph, ranges, limits):
        raise ArtifactLimitError(f"{origin}: {problem}")


def check_contents(
    graph: Graph,
    weights: Mapping[str, torch.Tensor],
    golden: Mapping[str, torch.Tensor],
    weights_blob: int,
    limits: LoadLimits,
    origin: str,
) -> None:
    """Constants match the weights file; golden data is no larger than the model."""
    for node in graph.nodes:
        if node.op != "const":
            continue
        key = node.arg("key")
        tensor = weights.get(key) if isinstance(key, str) else None
        declared = node.types[0]
        if tensor is None:
            raise ArtifactLimitError(f"{origin}: const %{node.name} names missing weight {key!r}")
        shape = tuple(int(d) if d.is_Integer else None for d in declared.shape)
        if shape != tuple(tensor.shape) or torch_dtype(declared.dtype) != tensor.dtype:
            raise ArtifactLimitError(
                f"{origin}: const %{node.name} declares {declared.dtype}{list(shape)}, the "
                f"weights file holds {tensor.dtype}{list(tensor.shape)} for {key!r}"
            )
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    golden_bytes = sum(t.numel() * t.element_size() for t in golden.values())
    if golden_bytes > max(model_bytes, weights_blob) + limits.golden_allowance_bytes:
        raise ArtifactLimitError(
            f"{origin}: golden data is {golden_bytes} bytes, larger than the model "
            f"({model_bytes} bytes of weights) by more than "
            f"{limits.golden_allowance_bytes} bytes"
        )


def symbol_ranges(graph: Graph) -> dict[str, Interval]:
    return {
        s.name: (Fraction(s.min), INFINITY if s.max is None else Fraction(s.max))
        for s in graph.symbols
    }


def _size_problems(
    graph: Graph, ranges: Mapping[str, Interval], limits: LoadLimits
) -> Iterator[str]:
    for node in graph.nodes:
        for tensor_type in node.types:
            itemsize = torch_dtype(tensor_type.dtype).itemsize
            largest = _product(upper_bound(dim, ranges) for dim in tensor_type.shape) * itemsize
            if largest > limits.max_tensor_bytes:
                shape = ", ".join(map(str, tensor_type.shape))
                yield (
                    f"%{node.name} ({node.op}) declares a {tensor_type.dtype}[{shape}] tensor "
                    f"of up to {_shown(largest)} bytes over the symbols' ranges, more than the "
                    f"limit {limits.max_tensor_bytes}"
                )
        for name in SIZE_ARGUMENTS.get(node.op, ()):
            largest = _product(_arg_bounds(node.arg(name), ranges))
            if largest * 8 > limits.max_tensor_bytes:
                yield (
                    f"%{node.name} ({node.op}) has size argument {name}={node.arg(name)} of up "
                    f"to {_shown(largest)}, past the limit {limits.max_tensor_bytes} bytes"
                )


def _arg_bounds(arg: Arg, ranges: Mapping[str, Interval]) -> Iterator[Bound]:
    """The largest magnitude of each integer in a size argument (a literal, an expression or a
    list of them); a tensor-valued argument is bounded by its own declared type."""
    if isinstance(arg, tuple):
        for item in arg:
            yield from _arg_bounds(item, ranges)
    elif isinstance(arg, bool) or arg is None:
        return
    elif isinstance(arg, int | float):
        yield Fraction(abs(arg)) if math.isfinite(arg) else INFINITY
    elif isinstance(arg, sympy.Expr):
        yield magnitude(interval(arg, ranges))


def _product(bounds: Iterator[Bound]) -> Bound:
    result: Bound = Fraction(1)
    for bound in bounds:
        if bound == 0:
            return Fraction(0)
        result = max(result, Fraction(1)) * max(bound, Fraction(1))
    return result


def _shown(bound: Bound) -> str:
    return "unbounded (no declared max bounds it)" if bound == INFINITY else str(int(bound))
