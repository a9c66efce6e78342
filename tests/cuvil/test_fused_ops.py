"""The fused-op table: rules build fused nodes through it, and the IR verifier refuses a graph
whose ``cuvil.*`` nodes it does not describe (an artifact cannot smuggle in an unknown op or a
misplaced argument)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import sympy

from cuvil.fused_ops import FUSED_OPS, LINEAR, FusedOpError, fused_node
from cuvil.ir import Graph, Node, TensorType, Value
from cuvil.ir_verify import IRVerificationError, verify_graph

ROWS = TensorType("f32", (sympy.Integer(2), sympy.Integer(4)))


def _graph(linear: Node) -> Graph:
    nodes = (
        Node("x", "input", (), (ROWS,)),
        Node("w", "const", (("key", "w"),), (replace(ROWS, shape=(sympy.Integer(4),) * 2),)),
        linear,
    )
    return Graph("g", nodes, ("x",), (("y", Value(linear.name)),), ())


def _linear(**args: object) -> Node:
    given = {"input": Value("x"), "weight": Value("w"), "activation": "relu"} | args
    return fused_node(LINEAR, "y", given, (ROWS,))  # type: ignore[arg-type]


def test_fused_node_puts_arguments_in_the_table_order() -> None:
    node = _linear()
    assert tuple(name for name, _ in node.args) == FUSED_OPS[LINEAR].arg_names
    assert node.arg("bias") is None and node.arg("residual") is None
    assert verify_graph(_graph(node))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"activation": "swish"}, "not one of"),
        ({"activation": 3}, "must be str"),
        ({"bias": 1.0}, "must be a tensor value"),
        ({"weight": None}, "is required"),
        ({"scale": 1.0}, "has no argument"),
    ],
)
def test_fused_node_refuses_what_the_table_does_not_allow(args: dict, message: str) -> None:
    with pytest.raises(FusedOpError, match=message):
        _linear(**args)


def test_the_verifier_refuses_unknown_and_misplaced_fused_ops() -> None:
    node = _linear()
    unknown = replace(node, op="cuvil.read_file")
    with pytest.raises(IRVerificationError, match=r"unknown fused op cuvil\.read_file"):
        verify_graph(_graph(unknown))
    swapped = replace(node, args=(node.args[1], node.args[0], *node.args[2:]))
    with pytest.raises(IRVerificationError, match="the table says"):
        verify_graph(_graph(swapped))
    literal = replace(node, args=(*node.args[:3], ("activation", Value("x")), *node.args[4:]))
    with pytest.raises(IRVerificationError, match="must be a literal"):
        verify_graph(_graph(literal))
