"""Shape expressions: parse them safely from artifact text, evaluate them fast without exec.

Shapes and size arguments in the IR are sympy expressions over named symbols (``2*batch``,
``floor(seq/2)``). Artifacts store them as text; since sympy's parser evaluates Python, the text
is checked first against a strict alphabet and the known names, so that an artifact can never
run code. Evaluation at run time walks a closure tree built once per expression.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from functools import reduce

import sympy
from sympy.parsing.sympy_parser import parse_expr

FUNCTIONS = {"floor", "ceiling", "Mod", "Max", "Min"}
_ALPHABET = re.compile(r"^[A-Za-z0-9_+\-*/(), ]*$")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


class ShapeExprError(ValueError):
    pass


def parse_shape_expr(text: str, symbols: Mapping[str, sympy.Symbol]) -> sympy.Expr:
    """Parse ``text`` over ``symbols``; refuse anything but arithmetic on known names."""
    if not _ALPHABET.match(text) or "__" in text or len(text) > 500:
        raise ShapeExprError(f"not a shape expression: {text!r}")
    unknown = set(_IDENTIFIER.findall(text)) - set(symbols) - FUNCTIONS
    if unknown:
        raise ShapeExprError(f"unknown name(s) {sorted(unknown)} in shape expression {text!r}")
    local = dict(symbols) | {name: getattr(sympy, name) for name in FUNCTIONS}
    return sympy.sympify(
        parse_expr(
            text,
            local_dict=local,
            global_dict={
                "Integer": sympy.Integer,
                "Symbol": sympy.Symbol,
                "Rational": sympy.Rational,
                "Float": sympy.Float,
            },
        )
    )


Evaluator = Callable[[Mapping[str, int]], int | float]


def compile_expr(expr: sympy.Expr) -> Evaluator:
    """A function of the symbol values that computes ``expr`` (ints stay exact)."""
    if expr.is_Integer:
        constant = int(expr)
        return lambda values: constant
    if expr.is_Rational:
        numerator, denominator = int(expr.p), int(expr.q)
        return lambda values: numerator / denominator
    if expr.is_Number:
        number = float(expr)
        return lambda values: number
    if isinstance(expr, sympy.Symbol):
        name = expr.name
        return lambda values: values[name]
    parts = [compile_expr(arg) for arg in expr.args]
    if isinstance(expr, sympy.Add):
        return lambda values: sum(part(values) for part in parts)
    if isinstance(expr, sympy.Mul):
        return lambda values: _exact(reduce(lambda a, b: a * b, (part(values) for part in parts)))
    if isinstance(expr, sympy.Pow):
        base, exponent = parts
        return lambda values: _exact(base(values) ** exponent(values))
    unary = {sympy.floor: math.floor, sympy.ceiling: math.ceil}
    for function, python in unary.items():
        if isinstance(expr, function):
            (inner,) = parts
            return lambda values: python(inner(values))
    if isinstance(expr, sympy.Mod):
        left, right = parts
        return lambda values: left(values) % right(values)
    if isinstance(expr, sympy.Max | sympy.Min):
        choose = max if isinstance(expr, sympy.Max) else min
        return lambda values: choose(part(values) for part in parts)
    raise ShapeExprError(f"cannot evaluate {type(expr).__name__} in {expr}")


def _exact(number: int | float) -> int | float:
    """Products of integers and rationals that land on a whole number are ints (sizes)."""
    if isinstance(number, float) and number.is_integer():
        return int(number)
    return number
