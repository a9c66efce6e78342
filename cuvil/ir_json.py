"""JSON form of the IR: what an artifact's graph layer (application/vnd.cuvil.graph.v1+json) holds.

Plain data only. Arguments are tagged where JSON alone would be ambiguous: ``{"v": [node, i]}``
a value, ``{"sym": "2*batch"}`` a shape expression (parsed by the guarded parser), ``{"enum":
[kind, name]}`` a torch enum, ``{"float": "inf"}`` a non-finite float; lists are tuples.
"""

from __future__ import annotations

import math
from typing import Any

import sympy

from cuvil.fused_ops import with_absent_optionals
from cuvil.ir import Arg, Enum, Graph, Node, Symbol, TensorType, Value, make_symbol
from cuvil.shape_expr import parse_shape_expr

FORMAT = "cuvil.graph.v1"


class GraphFormatError(ValueError):
    pass


def encode_arg(arg: Arg) -> Any:
    if isinstance(arg, Value):
        return {"v": [arg.node, arg.index]}
    if isinstance(arg, Enum):
        return {"enum": [arg.kind, arg.name]}
    if isinstance(arg, tuple):
        return [encode_arg(item) for item in arg]
    if isinstance(arg, float) and not math.isfinite(arg):
        return {"float": repr(arg)}
    if isinstance(arg, sympy.Expr):
        return {"sym": str(arg)}
    return arg


def decode_arg(data: Any, symbols: dict[str, sympy.Symbol]) -> Arg:
    if isinstance(data, list):
        return tuple(decode_arg(item, symbols) for item in data)
    if isinstance(data, dict):
        if "v" in data:
            node, index = data["v"]
            return Value(str(node), int(index))
        if "enum" in data:
            kind, name = data["enum"]
            return Enum(str(kind), str(name))
        if "float" in data:
            return float(data["float"])
        if "sym" in data:
            return parse_shape_expr(str(data["sym"]), symbols)
        raise GraphFormatError(f"unknown argument tag in {data!r}")
    if data is None or isinstance(data, bool | int | float | str):
        return data
    raise GraphFormatError(f"bad argument {data!r}")


def _encode_type(t: TensorType) -> dict[str, Any]:
    shape = [int(d) if d.is_Integer else str(d) for d in t.shape]
    return {"dtype": t.dtype, "shape": shape, "layout": t.layout}


def _decode_type(data: dict[str, Any], symbols: dict[str, sympy.Symbol]) -> TensorType:
    shape = tuple(
        sympy.Integer(d) if isinstance(d, int) else parse_shape_expr(str(d), symbols)
        for d in data["shape"]
    )
    return TensorType(str(data["dtype"]), shape, str(data.get("layout", "contiguous")))


def graph_to_json(graph: Graph) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "name": graph.name,
        "symbols": [{"name": s.name, "min": s.min, "max": s.max} for s in graph.symbols],
        "inputs": list(graph.inputs),
        "outputs": [[name, [v.node, v.index]] for name, v in graph.outputs],
        "nodes": [
            {
                "name": node.name,
                "op": node.op,
                "args": [[key, encode_arg(arg)] for key, arg in node.args],
                "types": [_encode_type(t) for t in node.types],
                **({"origin": node.origin} if node.origin else {}),
            }
            for node in graph.nodes
        ],
    }


def graph_from_json(data: dict[str, Any]) -> Graph:
    if data.get("format") != FORMAT:
        raise GraphFormatError(f"graph format {data.get('format')!r} is not {FORMAT!r}")
    try:
        symbols = tuple(
            Symbol(str(s["name"]), int(s["min"]), None if s["max"] is None else int(s["max"]))
            for s in data["symbols"]
        )
        scope = {s.name: make_symbol(s.name) for s in symbols}
        nodes = tuple(
            with_absent_optionals(
                Node(
                    name=str(n["name"]),
                    op=str(n["op"]),
                    args=tuple((str(key), decode_arg(arg, scope)) for key, arg in n["args"]),
                    types=tuple(_decode_type(t, scope) for t in n["types"]),
                    origin=str(n.get("origin", "")),
                )
            )
            for n in data["nodes"]
        )
        outputs = tuple((str(name), Value(str(v[0]), int(v[1]))) for name, v in data["outputs"])
        return Graph(str(data["name"]), nodes, tuple(map(str, data["inputs"])), outputs, symbols)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise GraphFormatError(f"malformed graph JSON: {error}") from error
