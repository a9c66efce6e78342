"""Precision: bf16 or fp16 where it pays, fp32 where accuracy needs it.

    # cuvil.linear / cuvil.conv2d / cuvil.swiglu with fp32 weights -> the same op with bf16
    # (or fp16) weights

The GEMM-like fused ops carry nearly all the FLOPs; their weights become the low precision and
the backend computes them in it (with fp32 accumulation) and fp32 at their borders. bf16 keeps
fp32's range; fp16 keeps three more mantissa bits but ends at 65504, so a GEMM whose outputs
pass that overflows (the verify stage sees it). Everything else — normalisations, softmax and
attention, residual sums, embeddings — stays fp32, so errors do not accumulate through the
network. This pass leaves the values between ops fp32; for bf16, a backend that declares
``Lowering.low_activations`` also gets passes/low_activations.py, which keeps them bf16
between the GEMM-like ops and attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

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


LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def low_precision_pass(precision: str) -> Callable[[Program], Program]:
    """The pass that gives the GEMM-like ops' weights the dtype of ``precision``."""
    return partial(to_low_precision, dtype=LOW_DTYPES[precision], suffix=precision)


def to_low_precision(program: Program, dtype: torch.dtype, suffix: str) -> Program:
    graph = program.graph
    names = NameSource(graph, program.weights)
    weights = dict(program.weights)
    converted: dict[str, Value] = {}  # fp32 const node -> its low-precision twin
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
            low = tensor.to(dtype)
            weight_key = names.fresh(f"{source.node}_{suffix}")
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
    return replace(program, graph=new_graph, weights=kept).with_hits({f"{suffix}_weights": count})
