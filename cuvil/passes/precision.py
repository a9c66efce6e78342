"""Precision: bf16 where it pays, fp32 where accuracy needs it.

    # cuvil.linear / cuvil.conv2d / cuvil.swiglu with fp32 weights -> the same op with bf16 weights

The GEMM-like fused ops carry nearly all the FLOPs; their weights become bf16 and the backend
computes them in bf16 with fp32 at their borders. Everything else — normalisations, softmax and
attention, residual sums, embeddings — stays fp32, so errors do not accumulate through the
network. Values between ops stay fp32: the graph's types do not change.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cuvil.fused_ops import CONV2D, LINEAR, SWIGLU
from cuvil.ir import Node, Value
from cuvil.passes.dead_code import eliminate_dead_code
from cuvil.passes.program import NameSource, Program, const_node

WEIGHT_ARGUMENTS = {
    LINEAR: "weight",
    CONV2D: "weight",
    SWIGLU: "gate_up_weight",
}


def to_bf16(program: Program) -> Program:
    graph = program.graph
    names = NameSource(graph, program.weights)
    weights = dict(program.weights)
    converted: dict[str, Value] = {}  # fp32 const node -> its bf16 twin
    nodes: list[Node] = []
    count = 0
    for node in graph.nodes:
        key = WEIGHT_ARGUMENTS.get(node.op)
        source = node.arg(key) if key else None
        tensor = program.const_tensor(source) if isinstance(source, Value) else None
        if key is None or tensor is None or tensor.dtype != torch.float32:
            nodes.append(node)
            continue
        assert isinstance(source, Value)
        if source.node not in converted:
            low = tensor.to(torch.bfloat16)
            weight_key = names.fresh(f"{source.node}_bf16")
            weights[weight_key] = low
            twin = const_node(names.fresh(weight_key), weight_key, low, node.origin)
            nodes.append(twin)
            converted[source.node] = twin.value()
        args = tuple((k, converted[source.node] if k == key else a) for k, a in node.args)
        nodes.append(replace(node, args=args))
        count += 1
    if not count:
        return program
    new_graph = eliminate_dead_code(replace(graph, nodes=tuple(nodes)))
    live = {str(n.arg("key")) for n in new_graph.nodes if n.op == "const"}
    kept = {k: v for k, v in weights.items() if k in live}
    return replace(program, graph=new_graph, weights=kept).with_hits({"bf16_weights": count})
