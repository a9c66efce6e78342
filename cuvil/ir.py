"""The Cuvil IR: one immutable node type and the graph that holds it.

Sits between the frontend (torch.export -> IR) and everything after it: passes rewrite a Graph
into a new Graph, analyses read it, backends turn it into an execution plan. Nodes are frozen
dataclasses with typed fields; change one with ``dataclasses.replace``.

A node's arguments are kept by name, in the order of the op's schema. An argument is a literal
(None, bool, int, float, str, a sympy expression over the graph's shape symbols, a dtype or other
torch enum), a ``Value`` (an output of another node), or a tuple of those. ``Node.inputs`` lists
the tensor operands; ``Node.attributes`` the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeAlias

import sympy

# Short dtype names used in the text form, the JSON form and artifact signatures.
DTYPES = ("f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool", "c64")
LAYOUTS = ("contiguous", "channels_last")


@dataclass(frozen=True, order=True)
class Value:
    """One output of one node: ``%name`` or ``%name#index`` in text."""

    node: str
    index: int = 0

    def __str__(self) -> str:
        return f"%{self.node}" if self.index == 0 else f"%{self.node}#{self.index}"


@dataclass(frozen=True)
class Enum:
    """A torch enum argument (dtype, device, layout, memory format) by kind and name."""

    kind: str  # "dtype" | "device" | "layout" | "memory_format"
    name: str

    def __str__(self) -> str:
        return f"{self.kind}<{self.name}>"


Arg: TypeAlias = "bool | int | float | str | sympy.Expr | Value | Enum | tuple[Arg, ...] | None"


@dataclass(frozen=True)
class Symbol:
    """A named dynamic dimension with inclusive bounds (``max`` None means unbounded)."""

    name: str
    min: int
    max: int | None

    @property
    def sym(self) -> sympy.Symbol:
        return make_symbol(self.name)


def make_symbol(name: str) -> sympy.Symbol:
    """All shape symbols share these assumptions, so that parsed text compares equal."""
    return sympy.Symbol(name, integer=True, positive=True)


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[sympy.Expr, ...]
    layout: str = "contiguous"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(dim.is_Integer for dim in self.shape)

    def __str__(self) -> str:
        dims = ", ".join(str(dim) for dim in self.shape)
        suffix = "" if self.layout == "contiguous" else f" {{{self.layout}}}"
        return f"{self.dtype}[{dims}]{suffix}"


@dataclass(frozen=True)
class Node:
    """One operation: ``op`` is ``aten.<name>.<overload>``, ``cuvil.<name>``, input or const."""

    name: str
    op: str
    args: tuple[tuple[str, Arg], ...]
    types: tuple[TensorType, ...]
    # Where the op came from in the user's model (module path, source line); not semantics.
    origin: str = field(default="", compare=False)

    @property
    def inputs(self) -> tuple[Value, ...]:
        return tuple(iter_values(tuple(arg for _, arg in self.args)))

    @property
    def attributes(self) -> dict[str, Arg]:
        return {key: arg for key, arg in self.args if not contains_value(arg)}

    def arg(self, key: str, default: Arg = None) -> Arg:
        for name, arg in self.args:
            if name == key:
                return arg
        return default

    def int_arg(self, key: str, default: int = 0) -> int:
        value = self.arg(key, default)
        if not isinstance(value, int | float):
            raise TypeError(f"%{self.name}: argument {key!r} is {value!r}, not a number")
        return int(value)

    def float_arg(self, key: str, default: float = 0.0) -> float:
        value = self.arg(key, default)
        if not isinstance(value, int | float):
            raise TypeError(f"%{self.name}: argument {key!r} is {value!r}, not a number")
        return float(value)

    @property
    def type(self) -> TensorType:
        return self.types[0]

    def value(self, index: int = 0) -> Value:
        return Value(self.name, index)


@dataclass(frozen=True)
class Graph:
    """A whole program: nodes in topological order, named inputs and outputs, shape symbols.

    ``inputs`` names the ``input`` nodes in call order; ``outputs`` pairs each output name with the
    value it returns. Weights are ``const`` nodes whose ``key`` names a tensor kept beside the
    graph (in safetensors), never inside it.
    """

    name: str
    nodes: tuple[Node, ...]
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, Value], ...]
    symbols: tuple[Symbol, ...] = ()

    def node(self, name: str) -> Node:
        return self.by_name[name]

    @property
    def by_name(self) -> dict[str, Node]:
        # Cached per instance: the graph is immutable.
        cached = self.__dict__.get("_by_name")
        if cached is None:
            cached = {node.name: node for node in self.nodes}
            object.__setattr__(self, "_by_name", cached)
        return cached

    def type_of(self, value: Value) -> TensorType:
        return self.node(value.node).types[value.index]

    def symbol(self, name: str) -> Symbol:
        for symbol in self.symbols:
            if symbol.name == name:
                return symbol
        raise KeyError(name)

    def users(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {node.name: [] for node in self.nodes}
        for node in self.nodes:
            for value in node.inputs:
                users[value.node].append(node)
        return users

    def op_histogram(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.op] = counts.get(node.op, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def iter_values(arg: Arg) -> Iterator[Value]:
    if isinstance(arg, Value):
        yield arg
    elif isinstance(arg, tuple):
        for item in arg:
            yield from iter_values(item)


def contains_value(arg: Arg) -> bool:
    return next(iter_values(arg), None) is not None


def map_values(arg: Arg, fn: dict[Value, Value]) -> Arg:
    """``arg`` with every Value replaced through ``fn`` (values not in it stay)."""
    if isinstance(arg, Value):
        return fn.get(arg, arg)
    if isinstance(arg, tuple):
        return tuple(map_values(item, fn) for item in arg)
    return arg


def free_symbols(arg: Arg) -> set[sympy.Symbol]:
    if isinstance(arg, sympy.Expr):
        return {s for s in arg.free_symbols if isinstance(s, sympy.Symbol)}
    if isinstance(arg, tuple):
        out: set[sympy.Symbol] = set()
        for item in arg:
            out |= free_symbols(item)
        return out
    return set()
