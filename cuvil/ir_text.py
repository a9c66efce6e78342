"""Readable text form of the IR (MLIR-flavoured): print a Graph, parse it back to an equal Graph.

Used for debug dumps, golden tests and ``cuvil inspect``. One node per line::

    graph @mlp {
      symbol batch in [1, 64]
      %x = input() : f32[batch, 784]
      %fc1_weight = const(key="fc1.weight") : f32[256, 784]
      %linear = aten.linear.default(input=%x, weight=%fc1_weight, bias=none) : f32[batch, 256]
      return (logits=%linear)
    }

Arguments: ``none``/``true``/``false``, ints, floats (Python repr, so they round-trip exactly),
JSON strings, ``sym<2*batch>`` for shape expressions, ``dtype<f32>``-style enums, ``%value`` or
``%value#1``, and ``[...]`` lists. A trailing ``loc("...")`` keeps where the op came from.
"""

from __future__ import annotations

import json
import math
import re

import sympy

from cuvil.ir import Arg, Enum, Graph, Node, Symbol, TensorType, Value, make_symbol
from cuvil.shape_expr import parse_shape_expr

ENUM_KINDS = ("dtype", "device", "layout", "memory_format")


class IRParseError(ValueError):
    def __init__(self, message: str, line_number: int, line: str) -> None:
        super().__init__(f"line {line_number}: {message}\n    {line.strip()}")


# ---------------------------------------------------------------- printing


def format_arg(arg: Arg) -> str:
    if arg is None:
        return "none"
    if isinstance(arg, bool):
        return "true" if arg else "false"
    if isinstance(arg, int):
        return str(arg)
    if isinstance(arg, float):
        return repr(arg)
    if isinstance(arg, str):
        return json.dumps(arg)
    if isinstance(arg, Value | Enum):
        return str(arg)
    if isinstance(arg, tuple):
        return "[" + ", ".join(format_arg(item) for item in arg) + "]"
    if isinstance(arg, sympy.Expr):
        return f"sym<{arg}>"
    raise TypeError(f"cannot print argument {arg!r} of type {type(arg).__name__}")


def format_types(types: tuple[TensorType, ...]) -> str:
    if len(types) == 1:
        return str(types[0])
    return "(" + ", ".join(str(t) for t in types) + ")"


def format_node(node: Node) -> str:
    args = ", ".join(f"{key}={format_arg(arg)}" for key, arg in node.args)
    loc = f" loc({json.dumps(node.origin)})" if node.origin else ""
    return f"%{node.name} = {node.op}({args}) : {format_types(node.types)}{loc}"


def print_graph(graph: Graph) -> str:
    lines = [f"graph @{graph.name} {{"]
    for symbol in graph.symbols:
        upper = "inf" if symbol.max is None else str(symbol.max)
        lines.append(f"  symbol {symbol.name} in [{symbol.min}, {upper}]")
    lines += ["  " + format_node(node) for node in graph.nodes]
    outputs = ", ".join(f"{name}={value}" for name, value in graph.outputs)
    lines += [f"  return ({outputs})", "}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- parsing

_NAME = r"[A-Za-z_][\w.]*"
_VALUE = re.compile(rf"%({_NAME})(?:#(\d+))?")
_NUMBER = re.compile(r"-?(?:inf|nan|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)")
_HEADER = re.compile(r"graph @([\w.\-]+) \{$")
_SYMBOL = re.compile(rf"symbol ({_NAME}) in \[(\d+), (\d+|inf)\]$")
_NODE = re.compile(rf"%({_NAME}) = ([\w.]+)\(")
_RETURN = re.compile(r"return \((.*)\)$")


class _Cursor:
    """A position in one line, with the symbols the line's expressions may use."""

    def __init__(self, text: str, symbols: dict[str, sympy.Symbol]) -> None:
        self.text, self.pos, self.symbols = text, 0, symbols

    def peek(self, prefix: str) -> bool:
        return self.text.startswith(prefix, self.pos)

    def expect(self, prefix: str) -> None:
        if not self.peek(prefix):
            raise ValueError(f"expected {prefix!r} at column {self.pos + 1}")
        self.pos += len(prefix)

    def match(self, pattern: re.Pattern[str]) -> re.Match[str] | None:
        found = pattern.match(self.text, self.pos)
        if found:
            self.pos = found.end()
        return found

    def until_closing(self, opener: str, closer: str) -> str:
        """Text up to the ``closer`` that balances an already consumed ``opener``."""
        depth, start = 1, self.pos
        while self.pos < len(self.text):
            char = self.text[self.pos]
            depth += (char == opener) - (char == closer)
            self.pos += 1
            if depth == 0:
                return self.text[start : self.pos - 1]
        raise ValueError(f"unbalanced {opener!r}")

    def expr(self, text: str) -> sympy.Expr:
        return parse_shape_expr(text, self.symbols)

    def arg(self) -> Arg:
        for word, literal in (("none", None), ("true", True), ("false", False)):
            if self.peek(word):
                self.pos += len(word)
                return literal
        if self.peek("%"):
            found = self.match(_VALUE)
            if not found:
                raise ValueError(f"bad value reference at column {self.pos + 1}")
            return Value(found.group(1), int(found.group(2) or 0))
        if self.peek('"'):
            decoded, end = json.JSONDecoder().raw_decode(self.text, self.pos)
            self.pos = end
            return str(decoded)
        if self.peek("["):
            self.pos += 1
            items: list[Arg] = []
            while not self.peek("]"):
                items.append(self.arg())
                if not self.peek("]"):
                    self.expect(", ")
            self.pos += 1
            return tuple(items)
        if self.peek("sym<"):
            self.pos += 4
            return self.expr(self.until_closing("<", ">"))
        for kind in ENUM_KINDS:
            if self.peek(kind + "<"):
                self.pos += len(kind) + 1
                return Enum(kind, self.until_closing("<", ">"))
        found = self.match(_NUMBER)
        if not found:
            raise ValueError(f"cannot read an argument at column {self.pos + 1}")
        text = found.group(0)
        if re.fullmatch(r"-?\d+", text):
            return int(text)
        return float(text) if "nan" not in text else math.nan

    def tensor_type(self) -> TensorType:
        found = self.match(re.compile(r"(\w+)\["))
        if not found:
            raise ValueError(f"expected a tensor type at column {self.pos + 1}")
        dims_text = self.until_closing("[", "]")
        dims = tuple(self.expr(dim) for dim in _split_top_level(dims_text)) if dims_text else ()
        layout = "contiguous"
        if self.peek(" {"):
            self.pos += 2
            layout = self.until_closing("{", "}")
        return TensorType(found.group(1), dims, layout)

    def types(self) -> tuple[TensorType, ...]:
        if not self.peek("("):
            return (self.tensor_type(),)
        self.pos += 1
        types = [self.tensor_type()]
        while self.peek(", "):
            self.pos += 2
            types.append(self.tensor_type())
        self.expect(")")
        return tuple(types)


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([") - (char in ")]")
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def _parse_node(cursor: _Cursor) -> Node:
    found = cursor.match(_NODE)
    if not found:
        raise ValueError("expected '%name = op(' ")
    args: list[tuple[str, Arg]] = []
    while not cursor.peek(")"):
        key = cursor.match(re.compile(r"(\w+)="))
        if not key:
            raise ValueError(f"expected 'name=' at column {cursor.pos + 1}")
        args.append((key.group(1), cursor.arg()))
        if not cursor.peek(")"):
            cursor.expect(", ")
    cursor.expect(") : ")
    types = cursor.types()
    origin = ""
    if cursor.peek(" loc("):
        cursor.pos += 5
        decoded, cursor.pos = json.JSONDecoder().raw_decode(cursor.text, cursor.pos)
        origin = str(decoded)
        cursor.expect(")")
    if cursor.pos != len(cursor.text):
        raise ValueError(f"unexpected text at column {cursor.pos + 1}")
    return Node(found.group(1), found.group(2), tuple(args), types, origin)


def parse_graph(text: str) -> Graph:
    """Parse the output of ``print_graph``; errors name the line."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise IRParseError("empty text", 1, "")
    header = _HEADER.match(lines[0].strip())
    if not header:
        raise IRParseError("expected 'graph @name {'", 1, lines[0])
    symbols: list[Symbol] = []
    nodes: list[Node] = []
    outputs: tuple[tuple[str, Value], ...] | None = None
    for number, line in enumerate(lines[1:], start=2):
        stripped = line.strip()
        scope = {s.name: make_symbol(s.name) for s in symbols}
        try:
            if stripped == "}":
                break
            if found := _SYMBOL.match(stripped):
                upper = None if found.group(3) == "inf" else int(found.group(3))
                symbols.append(Symbol(found.group(1), int(found.group(2)), upper))
            elif found := _RETURN.match(stripped):
                outputs = _parse_outputs(found.group(1), scope)
            else:
                nodes.append(_parse_node(_Cursor(stripped, scope)))
        except ValueError as error:
            raise IRParseError(str(error), number, line) from None
    if outputs is None:
        raise IRParseError("missing 'return (...)'", len(lines), lines[-1])
    inputs = tuple(node.name for node in nodes if node.op == "input")
    return Graph(header.group(1), tuple(nodes), inputs, outputs, tuple(symbols))


def _parse_outputs(text: str, scope: dict[str, sympy.Symbol]) -> tuple[tuple[str, Value], ...]:
    outputs = []
    for part in _split_top_level(text) if text else []:
        name, _, ref = part.partition("=")
        value = _Cursor(ref, scope).arg()
        if not isinstance(value, Value):
            raise ValueError(f"output {name!r} must name a value, got {ref!r}")
        outputs.append((name, value))
    return tuple(outputs)
