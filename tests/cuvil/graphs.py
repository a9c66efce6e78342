"""Small hand-built graphs that exercise every argument kind of the IR."""

from __future__ import annotations

import sympy

from cuvil.ir import Enum, Graph, Node, Symbol, TensorType, Value, make_symbol

batch, seq = make_symbol("batch"), make_symbol("seq")


def f32(*shape: object) -> TensorType:
    return TensorType("f32", tuple(sympy.sympify(d) for d in shape))


def every_argument_kind() -> Graph:
    nodes = (
        Node("x", "input", (), (f32(batch, seq, 8),)),
        Node("w", "const", (("key", "layer.weight"),), (f32(8, 8),)),
        Node(
            "lin",
            "aten.linear.default",
            (("input", Value("x")), ("weight", Value("w"))),
            (f32(batch, seq, 8),),
            origin="layer (model.py:12)",
        ),
        Node(
            "parts",
            "aten.split.Tensor",
            (("self", Value("lin")), ("split_size", 4), ("dim", -1)),
            (f32(batch, seq, 4), f32(batch, seq, 4)),
        ),
        Node(
            "cat",
            "aten.cat.default",
            (("tensors", (Value("parts", 1), Value("parts"))), ("dim", 2)),
            (f32(batch, seq, 8),),
        ),
        Node(
            "flat",
            "aten.view.default",
            (("self", Value("cat")), ("size", (batch * seq, 8))),
            (f32(batch * seq, 8),),
        ),
        Node(
            "cast",
            "aten._to_copy.default",
            (
                ("self", Value("flat")),
                ("dtype", Enum("dtype", "bf16")),
                ("device", Enum("device", "cpu")),
                ("non_blocking", False),
            ),
            (TensorType("bf16", (batch * seq, sympy.Integer(8))),),
        ),
        Node(
            "fill",
            "aten.full.default",
            (
                ("size", (sympy.floor(seq / 2), 3)),
                ("fill_value", float("-inf")),
                ("layout", None),
                ("note", 'a "quoted" string, with commas'),
            ),
            (f32(sympy.floor(seq / 2), 3),),
        ),
        Node(
            "scaled",
            "aten.mul.Tensor",
            (("self", Value("lin")), ("other", 0.125)),
            (f32(batch, seq, 8),),
        ),
    )
    return Graph(
        name="kinds",
        nodes=nodes,
        inputs=("x",),
        outputs=(("cast", Value("cast")), ("fill", Value("fill")), ("scaled", Value("scaled"))),
        symbols=(Symbol("batch", 1, 32), Symbol("seq", 8, None)),
    )
