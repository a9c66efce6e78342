"""Interval bounds of shape expressions over the graph's declared symbol ranges.

A loaded graph declares every symbol's range; from those ranges this computes, without choosing
any value, the largest a dim or size argument can become — so that a graph whose tensors could
outgrow the load limits is refused before anything is allocated (``cuvil.artifact.limits``).
Interval arithmetic over the same node kinds the grammar in ``cuvil.shape_expr`` builds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

import sympy

Bound = Fraction | float  # float only for ±inf
Interval = tuple[Bound, Bound]
INFINITY = math.inf


def interval(expr: sympy.Expr, ranges: Mapping[str, Interval]) -> Interval:
    """The smallest and largest values ``expr`` takes with each symbol inside ``ranges``."""
    if expr.is_Rational:
        value = Fraction(int(expr.p), int(expr.q))
        return value, value
    if isinstance(expr, sympy.Symbol):
        return ranges.get(expr.name, (-INFINITY, INFINITY))
    parts = [interval(arg, ranges) for arg in expr.args]
    if isinstance(expr, sympy.Add):
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    if isinstance(expr, sympy.Mul):
        low, high = parts[0]
        for part in parts[1:]:
            low, high = _product((low, high), part)
        return low, high
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) >= 0:
        result: Interval = (Fraction(1), Fraction(1))
        for _ in range(int(expr.exp)):
            result = _product(result, parts[0])
        return result
    if isinstance(expr, sympy.floor | sympy.ceiling):
        rounding = math.floor if isinstance(expr, sympy.floor) else math.ceil
        return tuple(_round(rounding, bound) for bound in parts[0])  # type: ignore[return-value]
    if isinstance(expr, sympy.Mod):
        reach = magnitude(parts[1])
        low = Fraction(0) if parts[0][0] >= 0 and parts[1][0] > 0 else -reach
        return low, reach
    if isinstance(expr, sympy.Max):
        return max(p[0] for p in parts), max(p[1] for p in parts)
    if isinstance(expr, sympy.Min):
        return min(p[0] for p in parts), min(p[1] for p in parts)
    return -INFINITY, INFINITY  # anything else (a negative power): no bound known


def magnitude(bounds: Interval) -> Bound:
    """The largest absolute value inside ``bounds``."""
    low, high = bounds
    return max(-low, high, key=float) if low < 0 else high


def upper_bound(expr: sympy.Expr, ranges: Mapping[str, Interval]) -> Bound:
    return interval(expr, ranges)[1]


def _product(a: Interval, b: Interval) -> Interval:
    corners = [_times(x, y) for x in a for y in b]
    return min(corners), max(corners)


def _times(x: Bound, y: Bound) -> Bound:
    """0 times infinity is 0 here: a dim that is 0 stays 0 however large the other factor."""
    if x == 0 or y == 0:
        return Fraction(0)
    return x * y


def _round(rounding: object, bound: Bound) -> Bound:
    if isinstance(bound, float):
        return bound
    return Fraction(rounding(bound))  # type: ignore[operator]
