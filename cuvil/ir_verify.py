"""The IR verifier: the structural rules every Graph obeys between pipeline stages.

Runs after the frontend, after every pass in tests, and on every graph loaded from an artifact,
so that a malformed or tampered graph is refused before anything executes it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import sympy

from cuvil.fused_ops import fused_op_problems, in_place_ops
from cuvil.ir import DTYPES, LAYOUTS, Graph, Node, Value, free_symbols

NODE_NAME = re.compile(r"[A-Za-z_][\w.]*")
GRAPH_NAME = re.compile(r"[\w.\-]+")


class IRVerificationError(ValueError):
    pass


def verify_graph(graph: Graph) -> Graph:
    """Return ``graph`` if it is well formed; else raise IRVerificationError naming the fault."""
    problems = list(_problems(graph))
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise IRVerificationError(f"graph @{graph.name} is malformed:\n  {shown}{more}")
    return graph


def _problems(graph: Graph) -> Iterator[str]:
    if not GRAPH_NAME.fullmatch(graph.name):
        yield f"graph name {graph.name!r} has characters outside [A-Za-z0-9_.-]"
    declared = {symbol.name for symbol in graph.symbols}
    for symbol in graph.symbols:
        if symbol.min < 0 or (symbol.max is not None and symbol.max < symbol.min):
            yield f"symbol {symbol.name} has empty or negative range [{symbol.min}, {symbol.max}]"
    if len(declared) != len(graph.symbols):
        yield "a symbol is declared twice"

    seen: dict[str, Node] = {}
    for node in graph.nodes:
        yield from _node_problems(node, seen, declared)
        if node.name in seen:
            yield f"%{node.name} is defined twice"
        seen[node.name] = node

    input_nodes = tuple(node.name for node in graph.nodes if node.op == "input")
    if input_nodes != graph.inputs:
        yield f"graph inputs {list(graph.inputs)} differ from its input nodes {list(input_nodes)}"
    if not graph.outputs:
        yield "graph has no outputs"
    yield from _in_place_problems(graph)
    names = [name for name, _ in graph.outputs]
    if len(set(names)) != len(names):
        yield f"output names repeat: {names}"
    for name, value in graph.outputs:
        producer = seen.get(value.node)
        if producer is None or value.index >= len(producer.types):
            yield f"output {name!r} refers to undefined value {value}"


def _in_place_problems(graph: Graph) -> Iterator[str]:
    """An op that writes a tensor in place (``FusedOp.writes``) may write only a graph input,
    which no other node reads: every later reader goes through the op's result (the same
    tensor after the write), so the order of reads and writes is the graph's order, and no
    weight, constant or intermediate is ever overwritten."""
    writers = in_place_ops()
    readers: dict[Value, int] = {}
    for node in graph.nodes:
        for value in node.inputs:
            readers[value] = readers.get(value, 0) + 1
    outputs = {value for _, value in graph.outputs}
    for node in graph.nodes:
        written_arg = writers.get(node.op)
        if written_arg is None:
            continue
        written = node.arg(written_arg)
        where = f"%{node.name} ({node.op})"
        if not isinstance(written, Value) or written.node not in graph.by_name:
            continue  # reported by the argument checks
        if graph.node(written.node).op != "input":
            yield f"{where}: writes {written} in place, which is not a graph input"
        elif readers.get(written, 0) != 1 or written in outputs:
            yield f"{where}: writes input {written} in place, which another node also reads"


def _node_problems(node: Node, seen: dict[str, Node], declared: set[str]) -> Iterator[str]:
    where = f"%{node.name} ({node.op})"
    if not NODE_NAME.fullmatch(node.name):
        yield f"{where}: node name is not an identifier"
    if not node.op:
        yield f"{where}: empty op"
    if not node.types:
        yield f"{where}: no output type"
    for value in node.inputs:
        producer = seen.get(value.node)
        if producer is None:
            yield f"{where}: uses {value} before it is defined"
        elif value.index >= len(producer.types):
            yield f"{where}: uses {value} but %{value.node} has {len(producer.types)} output(s)"
    for tensor_type in node.types:
        if tensor_type.dtype not in DTYPES:
            yield f"{where}: unknown dtype {tensor_type.dtype!r}"
        if tensor_type.layout not in LAYOUTS:
            yield f"{where}: unknown layout {tensor_type.layout!r}"
        for dim in tensor_type.shape:
            if not isinstance(dim, sympy.Expr):
                yield f"{where}: dimension {dim!r} is not a sympy expression"
            elif dim.is_Integer and int(dim) < 0:
                yield f"{where}: negative dimension {dim}"
    used = free_symbols(tuple(node.types[0].shape) if node.types else ())
    for tensor_type in node.types[1:]:
        used |= free_symbols(tuple(tensor_type.shape))
    for _, arg in node.args:
        used |= free_symbols(arg)
    undeclared = sorted(str(s) for s in used if str(s) not in declared)
    if undeclared:
        yield f"{where}: uses undeclared symbol(s) {undeclared}"
    if node.op == "const" and not isinstance(node.arg("key"), str):
        yield f"{where}: a const needs a string 'key'"
    if node.op == "input" and node.args:
        yield f"{where}: an input takes no arguments"
    for problem in fused_op_problems(node):
        yield f"{where}: {problem}"
