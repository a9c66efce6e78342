"""Horizontal fusion: linears that read the same input become one GEMM and slices of its output.

    # q = linear(x, Wq, bq); k = linear(x, Wk, bk); v = linear(x, Wv, bv)
    #   -> qkv = linear(x, [Wq; Wk; Wv], [bq; bk; bv]); q, k, v = slices of qkv's last dim

Attention's Q/K/V projections (and any other siblings: same input, same activation, no residual,
constant fp32 weights) then cost one weight read and one kernel launch instead of three; small
GEMMs (a 128-token Llama's K and V are 256 -> 64) run at a far better rate when merged. Each
sibling's node is replaced, under its own name, by the slice of the merged result, so its
consumers are untouched. Slices are strided views: the plan runs ``view`` as ``reshape``, which
copies only where a view of the slice is impossible.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import sympy
import torch

from cuvil.fused_ops import LINEAR, fused_node
from cuvil.ir import Node, TensorType, Value
from cuvil.passes.dead_code import eliminate_dead_code
from cuvil.passes.program import NameSource, Program, const_node

SLICE = "aten.slice.Tensor"


def _sibling_key(node: Node, program: Program) -> tuple[Value, str] | None:
    """(input, activation) for a linear that can merge with others; None if it cannot."""
    if node.op != LINEAR or node.arg("residual") is not None:
        return None
    source, weight = node.arg("input"), node.arg("weight")
    if not isinstance(source, Value) or not isinstance(weight, Value):
        return None
    tensor = program.const_tensor(weight)
    if tensor is None or tensor.dtype != torch.float32 or tensor.dim() != 2:
        return None
    bias = node.arg("bias")
    if bias is not None and (not isinstance(bias, Value) or program.const_tensor(bias) is None):
        return None
    return source, str(node.arg("activation"))


def _groups(program: Program) -> list[list[Node]]:
    by_key: dict[tuple[Value, str], list[Node]] = defaultdict(list)
    for node in program.graph.nodes:
        key = _sibling_key(node, program)
        if key is not None:
            by_key[key].append(node)
    return [group for group in by_key.values() if len(group) > 1]


def fuse_sibling_linears(program: Program) -> Program:
    groups = _groups(program)
    if not groups:
        return program
    names = NameSource(program.graph, program.weights)
    weights = dict(program.weights)
    before: dict[str, list[Node]] = {}  # first member's name -> nodes to put before its slice
    slices: dict[str, Node] = {}  # member name -> the slice that replaces it
    for group in groups:
        head, merged_nodes = _merge(group, program, names, weights)
        before[group[0].name] = merged_nodes
        offset = 0
        for member in group:
            width = int(member.types[0].shape[-1])
            slices[member.name] = _slice(member, head, offset, width)
            offset += width
    nodes: list[Node] = []
    for node in program.graph.nodes:
        nodes.extend(before.get(node.name, ()))
        nodes.append(slices.get(node.name, node))
    graph = eliminate_dead_code(replace(program.graph, nodes=tuple(nodes)))
    live = {str(n.arg("key")) for n in graph.nodes if n.op == "const"}
    kept = {k: v for k, v in weights.items() if k in live}
    return replace(program, graph=graph, weights=kept).with_hits({"sibling_linears": len(groups)})


def _merge(
    group: list[Node], program: Program, names: NameSource, weights: dict[str, torch.Tensor]
) -> tuple[Value, list[Node]]:
    """The merged weight/bias consts and the one linear over them; returns its value too."""
    first = group[0]
    tensors = [program.const_tensor(node.arg("weight")) for node in group]  # type: ignore[arg-type]
    weight = torch.cat([t for t in tensors if t is not None])
    nodes = [_const(f"{first.name}_merged_weight", weight, first, names, weights)]
    bias_arg: Value | None = None
    if any(node.arg("bias") is not None for node in group):
        parts = []
        for node, tensor in zip(group, tensors, strict=True):
            bias = node.arg("bias")
            if isinstance(bias, Value) and (values := program.const_tensor(bias)) is not None:
                parts.append(values.float())
            else:
                parts.append(torch.zeros(tensor.shape[0]))  # type: ignore[union-attr]
        nodes.append(_const(f"{first.name}_merged_bias", torch.cat(parts), first, names, weights))
        bias_arg = nodes[-1].value()
    out = first.types[0]
    shape = (*out.shape[:-1], sympy.Integer(int(weight.shape[0])))
    merged = fused_node(
        LINEAR,
        names.fresh(f"{first.name}_siblings"),
        {
            "input": first.arg("input"),
            "weight": nodes[0].value(),
            "bias": bias_arg,
            "activation": first.arg("activation"),
        },
        (TensorType(out.dtype, shape),),
        first.origin,
    )
    return merged.value(), [*nodes, merged]


def _const(base: str, tensor: torch.Tensor, near: Node, names: NameSource, weights: dict) -> Node:
    key = names.fresh(base)
    weights[key] = tensor.contiguous()
    return const_node(names.fresh(key), key, tensor, near.origin)


def _slice(member: Node, head: Value, offset: int, width: int) -> Node:
    rank = member.types[0].rank
    args = (
        ("self", head),
        ("dim", rank - 1),
        ("start", offset),
        ("end", offset + width),
        ("step", 1),
    )
    return Node(member.name, SLICE, args, member.types, member.origin)
