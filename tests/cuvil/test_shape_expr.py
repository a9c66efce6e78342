"""The shape-expression grammar: what sympy prints for the IR's shapes parses back to the same
expression; code, powers of powers, huge constants and deep nesting are refused quickly, naming
the expression; evaluation is exact and refuses overflow and division by zero."""

from __future__ import annotations

import time

import pytest
import sympy

from cuvil.ir import make_symbol
from cuvil.shape_bounds import interval
from cuvil.shape_expr import MAX_VALUE, ShapeExprError, compile_expr, parse_shape_expr

SYMBOLS = {name: make_symbol(name) for name in ("batch", "seq", "s0")}
batch, seq = SYMBOLS["batch"], SYMBOLS["seq"]

ROUND_TRIPS = [
    2 * batch,
    batch * seq - 1,
    sympy.floor(seq / 2),
    sympy.floor((seq - 1) / 2) + 1,
    sympy.ceiling(seq / 3),
    sympy.Mod(seq, 4),
    sympy.Max(seq, 2 * batch),
    sympy.Min(seq, 16),
    batch * seq**2,
    5 - seq,
    20 * SYMBOLS["s0"] - 4,
    3 * seq / 2,
]


@pytest.mark.parametrize("expr", ROUND_TRIPS, ids=str)
def test_what_sympy_prints_parses_back(expr: sympy.Expr) -> None:
    assert parse_shape_expr(str(expr), SYMBOLS) == expr


def test_the_grammars_own_operators() -> None:
    assert parse_shape_expr("seq // 2 + seq % 3", SYMBOLS) == sympy.floor(seq / 2) + sympy.Mod(
        seq, 3
    )
    assert parse_shape_expr("-(batch)*-2", SYMBOLS) == 2 * batch


REFUSED = {
    "9**9**9": "exponent",
    "9**99": "exponent",
    "seq**seq": "exponent",
    "(seq**2)**2": "power of a power",
    "__import__('os').system('true')": "unexpected character",
    "batch.__class__": "unexpected character",
    "lambda: 1": "unexpected character",
    "eval(seq)": "unknown name 'eval'",
    "open": "unknown name 'open'",
    "1" * 30: "constant",
    "(" * 40 + "seq" + ")" * 40: "nested deeper",
    "-" * 40 + "seq": "nested deeper",
    "seq + " * 300 + "1": "longer than",
    "seq / 0": "division by zero",
    "Mod(seq, 0)": "division by zero",
    "Max(seq)": "Max takes",
    "floor(seq, 2)": "floor takes",
    "seq +": "ends too early",
    "seq seq": "unexpected 'seq'",
    "": "empty",
    "1.5*seq": "unexpected character",
}


@pytest.mark.parametrize(("text", "why"), list(REFUSED.items()), ids=list(REFUSED)[:])
def test_refused_quickly_naming_the_expression(text: str, why: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ShapeExprError, match="shape expression") as raised:
        parse_shape_expr(text, SYMBOLS)
    assert time.perf_counter() - started < 0.1
    assert why in str(raised.value)
    assert text[:40] in str(raised.value)


def test_evaluation_is_exact_in_integers() -> None:
    evaluate = compile_expr(parse_shape_expr("floor((seq - 1)/2) + 1", SYMBOLS))
    assert [evaluate({"seq": n}) for n in (1, 2, 7, 8)] == [1, 1, 4, 4]
    assert isinstance(evaluate({"seq": 7}), int)
    assert compile_expr(3 * seq / 2)({"seq": 3}) == 4.5
    big = 2**61 + 1  # beyond a float's exact integers, still exact here
    assert compile_expr(seq + 1)({"seq": big}) == big + 1


def test_evaluation_refuses_overflow_and_division_by_zero() -> None:
    with pytest.raises(ShapeExprError, match="exceeds"):
        compile_expr(batch * seq**4)({"batch": 2**20, "seq": 2**12})
    with pytest.raises(ShapeExprError, match="exceeds"):
        compile_expr(batch * seq)({"batch": MAX_VALUE, "seq": 2})
    with pytest.raises(ShapeExprError, match="division by zero"):
        compile_expr(sympy.Mod(batch, seq))({"batch": 3, "seq": 0})


def test_intervals_over_declared_ranges() -> None:
    ranges = {"batch": (1, 8), "seq": (2, 64)}
    assert interval(batch * seq, ranges) == (2, 512)
    assert interval(sympy.floor((seq - 1) / 2) + 1, ranges) == (1, 32)
    assert interval(sympy.Max(seq, 2 * batch) - sympy.Min(seq, 3), ranges) == (-1, 62)
    assert interval(sympy.Mod(seq, 4), ranges)[1] <= 4
    assert interval(batch * seq, {"batch": (1, 8)})[1] == float("inf")


@pytest.mark.parametrize(
    "text", ["(((9**4)**4)**4)", "(((9**4))**4)**4", "(seq*seq**4)**4", "(1099511627776*2)**4"]
)
def test_nested_powers_are_refused(text: str) -> None:
    with pytest.raises(ShapeExprError, match="power of"):
        parse_shape_expr(text, SYMBOLS)


def test_a_power_past_the_limit_is_refused_before_it_is_computed() -> None:
    started = time.perf_counter()
    with pytest.raises(ShapeExprError, match="exceeds"):
        compile_expr(seq ** (10**9))({"seq": 3})
    assert time.perf_counter() - started < 0.1
