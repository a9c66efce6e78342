"""A compiled model's signature and the input checks that guard every call.

The signature names each input and output with its dtype and a shape over named symbols
(``batch``, ``seq``) that carry inclusive bounds. ``bind`` checks a set of input tensors against
it and returns the symbol values; anything outside the declared contract (a missing or unknown
input, a wrong dtype or rank, a dim outside its range, two inputs disagreeing on one symbol) is
refused with an InputError that says which input, which dim, and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import sympy
import torch

from cuvil.dtypes import NAME_TO_TORCH, TORCH_TO_NAME
from cuvil.ir import Graph, Symbol, make_symbol
from cuvil.shape_expr import parse_shape_expr

MAX_ACCEPTED = 64  # distinct input dtypes and shapes whose binding is remembered


class InputError(ValueError):
    """A call's inputs do not fit the model's signature (maps to INVALID_ARGUMENT when served)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[sympy.Expr, ...]

    def shape_text(self) -> str:
        return "[" + ", ".join(str(dim) for dim in self.shape) + "]"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": [_dim_json(d) for d in self.shape]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], symbols: Mapping[str, sympy.Symbol]) -> TensorSpec:
        shape = tuple(_dim_from_json(dim, symbols) for dim in data["shape"])
        return cls(str(data["name"]), str(data["dtype"]), shape)


def _dim_json(dim: sympy.Expr) -> int | str:
    return int(dim) if dim.is_Integer else str(dim)


def _dim_from_json(dim: int | str, symbols: Mapping[str, sympy.Symbol]) -> sympy.Expr:
    if isinstance(dim, int):
        return sympy.Integer(dim)
    return parse_shape_expr(dim, symbols)


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    symbols: tuple[Symbol, ...]

    @classmethod
    def of_graph(cls, graph: Graph) -> Signature:
        inputs = tuple(
            TensorSpec(name, graph.node(name).type.dtype, graph.node(name).type.shape)
            for name in graph.inputs
        )
        outputs = tuple(
            TensorSpec(name, graph.type_of(value).dtype, graph.type_of(value).shape)
            for name, value in graph.outputs
        )
        return cls(inputs, outputs, graph.symbols)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)

    def symbol(self, name: str) -> Symbol:
        return next(symbol for symbol in self.symbols if symbol.name == name)

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [spec.to_json() for spec in self.inputs],
            "outputs": [spec.to_json() for spec in self.outputs],
            "symbols": [{"name": s.name, "min": s.min, "max": s.max} for s in self.symbols],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Signature:
        symbols = tuple(Symbol(str(s["name"]), int(s["min"]), s["max"]) for s in data["symbols"])
        scope = {s.name: make_symbol(s.name) for s in symbols}
        return cls(
            tuple(TensorSpec.from_json(spec, scope) for spec in data["inputs"]),
            tuple(TensorSpec.from_json(spec, scope) for spec in data["outputs"]),
            symbols,
        )

    def describe(self) -> str:
        lines = [
            f"  symbol {s.name} in [{s.min}, {'inf' if s.max is None else s.max}]"
            for s in self.symbols
        ]
        lines += [f"  input  {s.name}: {s.dtype}{s.shape_text()}" for s in self.inputs]
        lines += [f"  output {s.name}: {s.dtype}{s.shape_text()}" for s in self.outputs]
        return "\n".join(lines)


class InputBinder:
    """Checks inputs against a Signature; built once per model so that calls do little work."""

    def __init__(self, signature: Signature) -> None:
        self.signature = signature
        self.names = signature.input_names
        self.dtypes = {spec.name: NAME_TO_TORCH[spec.dtype] for spec in signature.inputs}
        self.bounds = {s.name: (s.min, s.max) for s in signature.symbols}
        # Per input: static dims (index, size), symbol dims (index, name), derived (index, expr).
        self.static: dict[str, list[tuple[int, int]]] = {}
        self.symbolic: dict[str, list[tuple[int, str]]] = {}
        self.derived: dict[str, list[tuple[int, sympy.Expr]]] = {}
        for spec in signature.inputs:
            self.static[spec.name] = [(i, int(d)) for i, d in enumerate(spec.shape) if d.is_Integer]
            self.symbolic[spec.name] = [
                (i, d.name) for i, d in enumerate(spec.shape) if isinstance(d, sympy.Symbol)
            ]
            self.derived[spec.name] = [
                (i, d) for i, d in enumerate(spec.shape) if not d.is_Integer and not d.is_Symbol
            ]
        self.roots = _roots_to_solve(self.symbolic, self.derived)
        self._accepted: dict[tuple[Any, ...], dict[str, int]] = {}

    def bind(self, inputs: Mapping[str, Any]) -> dict[str, int]:
        """The symbol values of checked inputs. The outcome depends only on each input's type,
        dtype and shape, so inputs whose dtypes and shapes were accepted before are answered
        from a small cache of those (the check of a tiny model's call costs more than its
        arithmetic)."""
        key = self._key(inputs)
        if key is not None:
            cached = self._accepted.get(key)
            if cached is not None:
                return dict(cached)
        values = self._bind(inputs)
        if key is not None and len(self._accepted) < MAX_ACCEPTED:
            self._accepted[key] = dict(values)
        return values

    def _key(self, inputs: Mapping[str, Any]) -> tuple[Any, ...] | None:
        if len(inputs) != len(self.names):
            return None
        try:
            tensors = [inputs[name] for name in self.names]
        except KeyError:
            return None
        if not all(type(t) is torch.Tensor for t in tensors):
            return None
        return tuple((t.dtype, t.shape) for t in tensors)

    def _bind(self, inputs: Mapping[str, Any]) -> dict[str, int]:
        missing = [name for name in self.names if name not in inputs]
        unknown = [name for name in inputs if name not in self.dtypes]
        if missing or unknown:
            raise InputError(
                f"inputs do not match the signature: missing {missing}, unknown {unknown}; "
                f"expected {list(self.names)}"
            )
        values: dict[str, int] = {}
        for name in self.names:
            self._check_one(name, inputs[name], values)
        for root in self.roots:
            self._solve(root, inputs[root.input].shape[root.index], values)
        for name in self.names:
            for index, expr in self.derived[name]:
                expected = int(expr.subs({make_symbol(k): v for k, v in values.items()}))
                actual = inputs[name].shape[index]
                if actual != expected:
                    raise InputError(
                        f"input {name!r} dim {index} is {actual}, expected {expr} = {expected}"
                    )
        return values

    def _solve(self, root: Root, size: int, values: dict[str, int]) -> None:
        """The root's value from a dim ``size = scale * root + offset`` (then range-checked)."""
        value = (size - root.offset) / root.scale
        where = f"input {root.input!r} dim {root.index} ({root.expr})"
        if value != int(value):
            raise InputError(f"{where} is {size}: no integer {root.symbol} gives that size")
        low, high = self.bounds[root.symbol]
        if value < low or (high is not None and value > high):
            raise InputError(
                f"{where} is {size}: {root.symbol} = {int(value)}, outside its declared range "
                f"[{low}, {high}]"
            )
        values.setdefault(root.symbol, int(value))

    def _check_one(self, name: str, tensor: Any, values: dict[str, int]) -> None:
        spec_shape = self.signature.inputs[self.names.index(name)].shape
        if not isinstance(tensor, torch.Tensor):
            raise InputError(f"input {name!r} must be a tensor, got {type(tensor).__name__}")
        if tensor.dtype != self.dtypes[name]:
            got = TORCH_TO_NAME.get(tensor.dtype, str(tensor.dtype))
            expected = TORCH_TO_NAME[self.dtypes[name]]
            raise InputError(f"input {name!r} has dtype {got}, expected {expected}")
        if tensor.dim() != len(spec_shape):
            raise InputError(
                f"input {name!r} has rank {tensor.dim()} (shape {list(tensor.shape)}), expected "
                f"rank {len(spec_shape)} {list(map(str, spec_shape))}"
            )
        shape = tensor.shape
        for index, size in self.static[name]:
            if shape[index] != size:
                raise InputError(f"input {name!r} dim {index} is {shape[index]}, expected {size}")
        for index, symbol in self.symbolic[name]:
            size = shape[index]
            low, high = self.bounds[symbol]
            if size < low or (high is not None and size > high):
                raise InputError(
                    f"input {name!r} dim {index} ({symbol}) is {size}, outside its declared "
                    f"range [{low}, {high}]"
                )
            previous = values.setdefault(symbol, size)
            if previous != size:
                raise InputError(
                    f"input {name!r} dim {index} ({symbol}) is {size}, but another input set "
                    f"{symbol} = {previous}"
                )


@dataclass(frozen=True)
class Root:
    """A symbol that appears only inside derived dims: solved from the first, a linear one."""

    symbol: str
    input: str
    index: int
    expr: sympy.Expr
    scale: Fraction
    offset: Fraction


def _roots_to_solve(
    symbolic: Mapping[str, list[tuple[int, str]]],
    derived: Mapping[str, list[tuple[int, sympy.Expr]]],
) -> tuple[Root, ...]:
    bound = {symbol for dims in symbolic.values() for _, symbol in dims}
    roots: dict[str, Root] = {}
    for name, dims in derived.items():
        for index, expr in dims:
            free = [s for s in expr.free_symbols if s.name not in bound]
            if len(free) != 1 or free[0].name in roots or len(expr.free_symbols) != 1:
                continue
            symbol = free[0]
            scale, offset = expr.diff(symbol), expr.subs(symbol, 0)
            if scale.is_Rational and offset.is_Rational and scale != 0:  # linear: a*s + b
                exact = Fraction(int(scale.p), int(scale.q)), Fraction(int(offset.p), int(offset.q))
                roots[symbol.name] = Root(symbol.name, name, index, expr, *exact)
    return tuple(roots.values())
