"""Shape expressions: a bounded grammar of their own for artifact text, and integer evaluation.

Shapes and size arguments in the IR are sympy expressions over named symbols (``2*batch``,
``floor(seq/2)``). Artifacts store them as the text sympy prints. That text is read here by a
small recursive-descent parser of its own — never by sympy's parser, ``ast`` or ``eval`` — with
limits on length, tokens, nesting and constant size, so that neither code nor a huge number
(``9**9**9``) can come out of an artifact:

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "/" | "//" | "%") unary)*
    unary  := "-" unary | power
    power  := atom ["**" INT]            exponent a literal in [1, MAX_EXPONENT]: sympy prints
                                         ``s*s`` as ``s**2``; a power of a power, or of a
                                         constant above MAX_CONSTANT, is refused
    atom   := INT | SYMBOL | "(" expr ")" | CALL "(" expr ("," expr)* ")"
    CALL   := floor | ceiling | Mod | Max | Min

``/`` is exact division (sympy prints floor division as ``floor(a/b)``). Evaluation at run time
walks a closure tree built once per expression, in exact integers and fractions, and refuses a
value beyond ``MAX_VALUE`` or a division by zero instead of computing it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from fractions import Fraction

import sympy

MAX_LENGTH = 1024  # characters of one expression
MAX_TOKENS = 400
MAX_DEPTH = 32  # nesting of parentheses, calls and unary minus
MAX_CONSTANT = 2**40  # an integer literal (a size, a stride, a padding)
MAX_EXPONENT = 4
MAX_VALUE = 2**62  # any value met while evaluating (stays inside int64)

CALLS: dict[str, Callable[..., sympy.Expr]] = {
    "floor": sympy.floor,
    "ceiling": sympy.ceiling,
    "Mod": sympy.Mod,
    "Max": sympy.Max,
    "Min": sympy.Min,
}
_ARITY = {"floor": (1, 1), "ceiling": (1, 1), "Mod": (2, 2), "Max": (2, 64), "Min": (2, 64)}
_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(\*\*|//|[-+*/%(),]))")


class ShapeExprError(ValueError):
    pass


def parse_shape_expr(text: str, symbols: Mapping[str, sympy.Symbol]) -> sympy.Expr:
    """Parse ``text`` over ``symbols`` by the grammar above; refuse anything else, naming it."""
    return _Parser(text, symbols).parse()


class _Parser:
    def __init__(self, text: str, symbols: Mapping[str, sympy.Symbol]) -> None:
        self.text = text
        self.symbols = symbols
        self.tokens = self._tokens()
        self.pos = 0
        self.depth = 0

    def fail(self, why: str) -> ShapeExprError:
        shown = self.text if len(self.text) <= 120 else self.text[:120] + "…"
        return ShapeExprError(f"shape expression {shown!r} refused: {why}")

    def _tokens(self) -> list[str]:
        if len(self.text) > MAX_LENGTH:
            raise self.fail(f"longer than {MAX_LENGTH} characters")
        tokens: list[str] = []
        pos = 0
        stripped = self.text.rstrip()
        while pos < len(stripped):
            match = _TOKEN.match(stripped, pos)
            if match is None:
                raise self.fail(f"unexpected character {stripped[pos:].lstrip()[:1]!r}")
            tokens.append(match.group(match.lastindex or 0))
            pos = match.end()
            if len(tokens) > MAX_TOKENS:
                raise self.fail(f"more than {MAX_TOKENS} tokens")
        if not tokens:
            raise self.fail("empty")
        return tokens

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None:
            raise self.fail("ends too early")
        if expected is not None and token != expected:
            raise self.fail(f"expected {expected!r}, found {token!r}")
        self.pos += 1
        return token

    def parse(self) -> sympy.Expr:
        expr = self.expr()
        if self.peek() is not None:
            raise self.fail(f"unexpected {self.peek()!r}")
        if expr.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo):
            raise self.fail("not finite (a division by zero)")
        return expr

    def nested(self, parse: Callable[[], sympy.Expr]) -> sympy.Expr:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(f"nested deeper than {MAX_DEPTH}")
        try:
            return parse()
        finally:
            self.depth -= 1

    def expr(self) -> sympy.Expr:
        value = self.term()
        while self.peek() in ("+", "-"):
            right = self.term() if self.take() == "+" else -self.term()
            value = value + right
        return value

    def term(self) -> sympy.Expr:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            operator = self.take()
            right = self.unary()
            if operator != "*" and right == 0:
                raise self.fail("division by zero")
            if operator == "*":
                value = value * right
            elif operator == "/":
                value = value / right
            elif operator == "//":
                value = sympy.floor(value / right)
            else:
                value = sympy.Mod(value, right)
        return value

    def unary(self) -> sympy.Expr:
        if self.peek() == "-":
            self.take()
            return -self.nested(self.unary)
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.atom()
        if self.peek() != "**":
            return base
        self.take()
        exponent = self.take()
        if not exponent.isdigit() or not 1 <= int(exponent) <= MAX_EXPONENT:
            raise self.fail(f"exponent {exponent!r} is not a literal in [1, {MAX_EXPONENT}]")
        if self.peek() == "**" or base.has(sympy.Pow):
            raise self.fail("a power of a power")
        if base.is_Number and abs(base) > MAX_CONSTANT:
            raise self.fail(f"a power of a constant larger than {MAX_CONSTANT}")
        return base ** int(exponent)

    def atom(self) -> sympy.Expr:
        token = self.take()
        if token.isdigit():
            if len(token) > 13 or int(token) > MAX_CONSTANT:
                raise self.fail(f"constant {token[:20]} is larger than {MAX_CONSTANT}")
            return sympy.Integer(int(token))
        if token == "(":
            inner = self.nested(self.expr)
            self.take(")")
            return inner
        if token in CALLS:
            return self.call(token)
        if token in self.symbols:
            return self.symbols[token]
        if token[0].isalpha() or token[0] == "_":
            raise self.fail(f"unknown name {token!r}")
        raise self.fail(f"unexpected {token!r}")

    def call(self, name: str) -> sympy.Expr:
        self.take("(")
        args = [self.nested(self.expr)]
        while self.peek() == ",":
            self.take()
            args.append(self.nested(self.expr))
        self.take(")")
        least, most = _ARITY[name]
        if not least <= len(args) <= most:
            raise self.fail(f"{name} takes {least}..{most} arguments, not {len(args)}")
        if name == "Mod" and args[1] == 0:
            raise self.fail("division by zero")
        return CALLS[name](*args)


Evaluator = Callable[[Mapping[str, int]], int | float]
_Exact = Callable[[Mapping[str, int]], int | Fraction]


def compile_expr(expr: sympy.Expr) -> Evaluator:
    """A function of the symbol values that computes ``expr`` in exact arithmetic; a whole
    result is an int, another a float. Raises ShapeExprError past MAX_VALUE or on x/0."""
    exact = _compile(expr)

    def evaluate(values: Mapping[str, int]) -> int | float:
        result = exact(values)
        if isinstance(result, Fraction):
            return int(result) if result.denominator == 1 else float(result)
        return result

    return evaluate


def _magnitude(value: int | Fraction) -> int:
    """|value| rounded down: what the limits compare."""
    return abs(int(value))


def _checked(value: int | Fraction) -> int | Fraction:
    if _magnitude(value) > MAX_VALUE:
        raise ShapeExprError(f"a shape value exceeds {MAX_VALUE}")
    if isinstance(value, Fraction) and value.denominator == 1:
        return value.numerator
    return value


def _divide(a: int | Fraction, b: int | Fraction) -> int | Fraction:
    if b == 0:
        raise ShapeExprError("division by zero in a shape expression")
    return _checked(Fraction(a) / b)


def _compile(expr: sympy.Expr) -> _Exact:
    if expr.is_Integer:
        constant = int(expr)
        return lambda values: constant
    if expr.is_Rational:
        fraction = Fraction(int(expr.p), int(expr.q))
        return lambda values: fraction
    if isinstance(expr, sympy.Symbol):
        name = expr.name
        return lambda values: values[name]
    parts = [_compile(arg) for arg in expr.args]
    if isinstance(expr, sympy.Add):
        return lambda values: _checked(sum(part(values) for part in parts))
    if isinstance(expr, sympy.Mul):
        return lambda values: _checked(math.prod(part(values) for part in parts))
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer:
        base, power = parts[0], int(expr.exp)
        return lambda values: _power(base(values), power)
    if isinstance(expr, sympy.floor | sympy.ceiling):
        (inner,) = parts
        rounding = math.floor if isinstance(expr, sympy.floor) else math.ceil
        return lambda values: rounding(inner(values))
    if isinstance(expr, sympy.Mod):
        left, right = parts
        return lambda values: left(values) % _nonzero(right(values))
    if isinstance(expr, sympy.Max | sympy.Min):
        choose = max if isinstance(expr, sympy.Max) else min
        return lambda values: choose(part(values) for part in parts)
    raise ShapeExprError(f"cannot evaluate {type(expr).__name__} in {expr}")


def _power(base: int | Fraction, power: int) -> int | Fraction:
    """``base ** power``, refused before computing when the result would exceed MAX_VALUE."""
    if _magnitude(base) > 1 and abs(power) * (_magnitude(base).bit_length() - 1) > 62:
        raise ShapeExprError(f"a shape value exceeds {MAX_VALUE}")
    if power >= 0:
        return _checked(base**power)
    return _divide(1, base**-power)


def _nonzero(value: int | Fraction) -> int | Fraction:
    if value == 0:
        raise ShapeExprError("division by zero in a shape expression")
    return value
