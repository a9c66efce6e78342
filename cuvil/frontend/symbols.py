"""Shape symbols: from torch.export's ShapeEnv (s0, s70, …) to Cuvil's named symbols.

torch names its symbols after allocation order; Cuvil names them after the user's ``Dim``s, so
that signatures, IR text and error messages speak the user's language ("batch", "seq").
Expressions built with torch's own sympy functions (FloorDiv, Mod, …) are rewritten into plain
sympy, so that the IR text can be parsed back without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch

from cuvil.ir import Symbol, make_symbol


class UnsupportedShapeError(ValueError):
    pass


def _floor_div(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    return sympy.floor(a / b)


def _ceil_div(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    return sympy.ceiling(a / b)


def _true_div(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    return a / b


# torch.utils._sympy function name -> plain sympy equivalent (for non-negative integer operands).
TORCH_SYMPY_FUNCTIONS: dict[str, Callable[..., sympy.Expr]] = {
    "FloorDiv": _floor_div,
    "CeilDiv": _ceil_div,
    "CleanDiv": _true_div,
    "IntTrueDiv": _true_div,
    "Mod": sympy.Mod,
    "PythonMod": sympy.Mod,
    "Max": sympy.Max,
    "Min": sympy.Min,
    "floor": sympy.floor,
    "ceiling": sympy.ceiling,
    "FloorToInt": sympy.floor,
    "CeilToInt": sympy.ceiling,
}


def to_cuvil_expr(expr: sympy.Expr, names: Mapping[sympy.Symbol, sympy.Symbol]) -> sympy.Expr:
    """Rewrite a torch shape expression over Cuvil's named symbols."""
    if isinstance(expr, sympy.Symbol):
        if expr not in names:
            kind = "data-dependent size" if str(expr).startswith("u") else "unnamed symbol"
            raise UnsupportedShapeError(f"{kind} {expr} in a shape")
        return names[expr]
    if expr.is_Number:
        return expr
    args = [to_cuvil_expr(arg, names) for arg in expr.args]
    if isinstance(expr, sympy.Add | sympy.Mul | sympy.Pow):
        return type(expr)(*args)
    rewrite = TORCH_SYMPY_FUNCTIONS.get(type(expr).__name__)
    if rewrite is None:
        raise UnsupportedShapeError(f"shape expression {expr} uses {type(expr).__name__}")
    return rewrite(*args)


def shape_symbol_names(
    ep: torch.export.ExportedProgram, dim_names: Mapping[tuple[str, int], str]
) -> tuple[dict[sympy.Symbol, sympy.Symbol], tuple[Symbol, ...]]:
    """Name torch's symbols from the user inputs' dims; return the map and the bounded symbols.

    ``dim_names`` maps (input name, dim index) to the user's Dim name; a dynamic dim the user did
    not name (Dim.AUTO) gets ``<input>_<dim>``. Dims of one ``Dim`` share one symbol even where
    torch keeps a symbol per input for them (it does when the example size equals a static dim
    of another input, as a decode step's rows equal its cache's slots at ``max_batch=2``); the
    binder checks at call time that they agree. A derived dim (``4 * d - 1``) whose root appears
    in no input on its own names that root; the binder solves for it at call time.
    """
    names: dict[sympy.Symbol, sympy.Symbol] = {}
    by_name: dict[str, sympy.Symbol] = {}  # one Cuvil symbol per Dim name

    def named(name: str) -> sympy.Symbol:
        identifier = _identifier(name)
        return by_name.setdefault(identifier, make_symbol(identifier))

    sizes = [
        (node.name, index, size.node.expr)
        for node in ep.graph.nodes
        if node.op == "placeholder" and node.name in ep.graph_signature.user_inputs
        for index, size in enumerate(getattr(node.meta.get("val"), "shape", ()))
        if isinstance(size, torch.SymInt)
    ]
    for input_name, index, expr in sizes:  # bare dims first: they name their symbols
        if isinstance(expr, sympy.Symbol) and expr not in names:
            names[expr] = named(dim_names.get((input_name, index), f"{input_name}_{index}"))
    for input_name, index, expr in sizes:  # then a derived dim's root seen nowhere bare
        free = [symbol for symbol in expr.free_symbols if symbol not in names]
        if len(free) == 1:
            names[free[0]] = named(dim_names.get((input_name, index), f"{input_name}_{index}_root"))
    ranges: dict[str, tuple[int, int | None]] = {}
    for torch_symbol, symbol in names.items():
        bounds = ep.range_constraints.get(torch_symbol)
        lower = int(bounds.lower) if bounds is not None else 0
        upper: Any = bounds.upper if bounds is not None else None
        finite = upper is not None and upper.is_finite and int(upper) < 2**62
        high = int(upper) if finite else None
        if symbol.name in ranges:  # torch kept two symbols for one Dim: the tighter range
            low_before, high_before = ranges[symbol.name]
            lower = max(lower, low_before)
            high = (
                high_before
                if high is None
                else high
                if high_before is None
                else min(high, high_before)
            )
        ranges[symbol.name] = (lower, high)
    symbols = tuple(Symbol(name, lower, upper) for name, (lower, upper) in ranges.items())
    return names, symbols


def _identifier(name: str) -> str:
    cleaned = "".join(char if char.isalnum() or char == "_" else "_" for char in name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"d_{cleaned}"
