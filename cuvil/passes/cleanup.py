"""Clean-up passes: common-subexpression elimination and constant folding.

# op(a, b) twice                 -> one op(a, b)
# op(const, const) (small result) -> const
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cuvil.ir import Enum, Node, TensorType, Value, contains_value, free_symbols, map_values
from cuvil.passes.dead_code import eliminate_dead_code
from cuvil.passes.program import NameSource, Program, const_node
from cuvil.runtime.kernels import decode_enum, resolve_aten

FOLD_LIMIT = 1 << 20  # elements: larger results stay computed (they would bloat the artifact)
NEVER_FOLD = {
    "aten.rand.default",
    "aten.randn.default",
    "aten.randint.default",
    "aten.empty.memory_format",
}


def eliminate_common_subexpressions(program: Program) -> Program:
    seen: dict[tuple, Value] = {}
    redirect: dict[Value, Value] = {}
    nodes = []
    for node in program.graph.nodes:
        node = replace(node, args=tuple((k, map_values(a, redirect)) for k, a in node.args))
        if node.op not in ("input",) and node.op not in NEVER_FOLD:
            key = (node.op, node.args, node.types)
            if key in seen:
                for index in range(len(node.types)):
                    redirect[Value(node.name, index)] = Value(seen[key].node, index)
                continue
            seen[key] = node.value()
        nodes.append(node)
    if not redirect:
        return program
    outputs = tuple((name, redirect.get(v, v)) for name, v in program.graph.outputs)
    graph = eliminate_dead_code(replace(program.graph, nodes=tuple(nodes), outputs=outputs))
    return replace(program, graph=graph).with_hits({"cse": len({v.node for v in redirect})})


IDENTITY_OPS = {"aten.clone.default", "aten.alias.default", "aten.contiguous.default"}


def is_identity(node: Node, types: dict[Value, TensorType]) -> bool:
    """Ops that only copy or alias (dropout in eval exports as clone): same type in and out."""
    if node.op in IDENTITY_OPS:
        source = node.arg("self")
        keeps_layout = node.arg("memory_format") in (None, Enum("memory_format", "preserve_format"))
        return isinstance(source, Value) and keeps_layout and types[source] == node.type
    if node.op == "aten._to_copy.default":
        source = node.arg("self")
        extra = {k for k, _ in node.args} - {"self", "dtype", "device", "layout", "non_blocking"}
        return isinstance(source, Value) and not extra and types[source] == node.type
    return False


def remove_identities(program: Program) -> Program:
    """x.clone(), alias(x), x.to(x.dtype) -> x (all values are immutable here)."""
    types = {Value(n.name, i): t for n in program.graph.nodes for i, t in enumerate(n.types)}
    redirect: dict[Value, Value] = {}
    nodes = []
    for node in program.graph.nodes:
        node = replace(node, args=tuple((k, map_values(a, redirect)) for k, a in node.args))
        if is_identity(node, types):
            source = node.arg("self")
            assert isinstance(source, Value)
            redirect[node.value()] = source
            continue
        nodes.append(node)
    if not redirect:
        return program
    outputs = tuple((name, redirect.get(v, v)) for name, v in program.graph.outputs)
    graph = eliminate_dead_code(replace(program.graph, nodes=tuple(nodes), outputs=outputs))
    return replace(program, graph=graph).with_hits({"identity": len(redirect)})


def _literal(arg: object, consts: dict[str, torch.Tensor]) -> object:
    if isinstance(arg, Value):
        return consts[arg.node]
    if isinstance(arg, Enum):
        return decode_enum(arg, torch.device("cpu"))
    if isinstance(arg, tuple):
        return [_literal(item, consts) for item in arg]
    return arg


def fold_constants(program: Program) -> Program:
    """Evaluate aten nodes whose inputs are all constants, at compile time."""
    graph = program.graph
    names = NameSource(graph, program.weights)
    consts = {n.name: program.weights[str(n.arg("key"))] for n in graph.nodes if n.op == "const"}
    weights = dict(program.weights)
    nodes, folded = [], 0
    for node in graph.nodes:
        foldable = (
            node.op.startswith("aten.")
            and node.op not in NEVER_FOLD
            and len(node.types) == 1
            and contains_value(tuple(a for _, a in node.args))
            and all(v.node in consts for v in node.inputs)
            and not free_symbols(tuple(a for _, a in node.args))
            and node.type.is_static
            and _numel(node.type.shape) <= FOLD_LIMIT
        )
        if not foldable:
            nodes.append(node)
            continue
        op = resolve_aten(node.op)
        with torch.no_grad():
            result = op(**{k: _literal(a, consts) for k, a in node.args})
        key = names.fresh(f"folded_{node.name}")
        weights[key] = result.contiguous()
        consts[node.name] = weights[key]
        nodes.append(
            replace(const_node(node.name, key, weights[key], node.origin), types=node.types)
        )
        folded += 1
    if not folded:
        return program
    graph = eliminate_dead_code(replace(graph, nodes=tuple(nodes)))
    live = {str(n.arg("key")) for n in graph.nodes if n.op == "const"}
    return replace(
        program, graph=graph, weights={k: v for k, v in weights.items() if k in live}
    ).with_hits({"constant_fold": folded})


def _numel(shape: tuple) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count
