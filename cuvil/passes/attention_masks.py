"""Boolean attention masks become one additive float bias, computed once and shared.

    # attention(q, k, v, mask: bool)  -> attention(q, k, v, where(mask, 0, -inf))

Given a boolean mask, scaled-dot-product attention converts it to an additive bias on every
call: an encoder with six layers sharing one padding mask converts it six times (at batch 8,
sequence 128: 0.5 MB each). Converting once, ahead of the first attention, is the same
arithmetic — ``-inf`` where the mask is False, as ATen does — and every layer reuses the result.
"""

from __future__ import annotations

from dataclasses import replace

from cuvil.fused_ops import ATTENTION
from cuvil.ir import Node, TensorType, Value
from cuvil.passes.program import NameSource, Program

WHERE = "aten.where.Scalar"


def _bool_mask_on_fp32(node: Node, mask: Value, program: Program) -> bool:
    query = node.arg("query")
    graph = program.graph
    return (
        graph.type_of(mask).dtype == "bool"
        and isinstance(query, Value)
        and graph.type_of(query).dtype == "f32"  # where(…, 0.0, -inf) is fp32
    )


def share_attention_mask_bias(program: Program) -> Program:
    graph = program.graph
    names = NameSource(graph, program.weights)
    bias_of: dict[Value, Node] = {}  # bool mask -> the node that turns it into a float bias
    nodes: list[Node] = []
    for node in graph.nodes:
        mask = node.arg("mask") if node.op == ATTENTION else None
        if not isinstance(mask, Value) or not _bool_mask_on_fp32(node, mask, program):
            nodes.append(node)
            continue
        if mask not in bias_of:
            shape = graph.type_of(mask).shape
            bias_of[mask] = Node(
                names.fresh(f"{mask.node}_bias"),
                WHERE,
                (("condition", mask), ("self", 0.0), ("other", float("-inf"))),
                (TensorType("f32", shape),),
                node.origin,
            )
            nodes.append(bias_of[mask])
        args = tuple((k, bias_of[mask].value() if k == "mask" else a) for k, a in node.args)
        nodes.append(replace(node, args=args))
    if not bias_of:
        return program
    new_graph = replace(graph, nodes=tuple(nodes))
    return replace(program, graph=new_graph).with_hits({"attention_mask_bias": len(bias_of)})
