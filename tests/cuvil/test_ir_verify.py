"""The IR verifier names each structural fault."""

from __future__ import annotations

from dataclasses import replace

import pytest
import sympy

from cuvil.ir import Graph, Node, Symbol, TensorType, Value
from cuvil.ir_verify import IRVerificationError, verify_graph
from tests.cuvil.graphs import every_argument_kind, f32


def _with_node(graph: Graph, index: int, node: Node) -> Graph:
    nodes = list(graph.nodes)
    nodes[index] = node
    return replace(graph, nodes=tuple(nodes))


def test_well_formed_graph_passes() -> None:
    graph = every_argument_kind()
    assert verify_graph(graph) is graph


def _faults() -> list[tuple[str, Graph, str]]:
    g = every_argument_kind()
    lin = g.nodes[2]
    return [
        (
            "use before definition",
            replace(g, nodes=(g.nodes[0], lin, g.nodes[1], *g.nodes[3:])),
            "before it is defined",
        ),
        (
            "bad output index",
            _with_node(
                g, 4, replace(g.nodes[4], args=(("tensors", (Value("parts", 5),)), ("dim", 2)))
            ),
            "has 2 output",
        ),
        ("duplicate name", _with_node(g, 3, replace(g.nodes[3], name="lin")), "defined twice"),
        (
            "undeclared symbol",
            _with_node(
                g, 2, replace(lin, types=(f32(sympy.Symbol("heads", integer=True, positive=True)),))
            ),
            "undeclared symbol",
        ),
        (
            "unknown dtype",
            _with_node(g, 2, replace(lin, types=(TensorType("f8", lin.type.shape),))),
            "unknown dtype",
        ),
        (
            "unknown layout",
            _with_node(g, 2, replace(lin, types=(TensorType("f32", lin.type.shape, "tiled"),))),
            "unknown layout",
        ),
        (
            "const without key",
            _with_node(g, 1, replace(g.nodes[1], args=())),
            "needs a string 'key'",
        ),
        ("inputs mismatch", replace(g, inputs=("x", "w")), "differ from its input nodes"),
        ("undefined output", replace(g, outputs=(("y", Value("ghost")),)), "undefined value"),
        (
            "empty range",
            replace(g, symbols=(Symbol("batch", 5, 2), Symbol("seq", 8, None))),
            "empty or negative range",
        ),
        ("bad node name", _with_node(g, 2, replace(lin, name="lin-1")), "not an identifier"),
    ]


@pytest.mark.parametrize(("case", "graph", "message"), _faults(), ids=[f[0] for f in _faults()])
def test_fault_is_named(case: str, graph: Graph, message: str) -> None:
    with pytest.raises(IRVerificationError, match=message):
        verify_graph(graph)
