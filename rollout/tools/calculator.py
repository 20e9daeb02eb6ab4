"""The `calculator` tool: exact rational arithmetic by a recursive-descent parser, never `eval`.

Grammar: expr = term (('+'|'-') term)*; term = unary (('*'|'/') unary)*; unary = '-' unary | power;
power = atom ('^' unary)?  (right-associative); atom = integer | decimal | '(' expr ')'.
Invariants: results are Fractions (printed as integers or p/q); input length, exponent size and
nesting depth are bounded, so no input runs long or allocates much.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rollout.tools.registry import tool

MAX_CHARS = 500
MAX_EXPONENT = 1000  # |exponent| bound; the base is bounded by MAX_CHARS digits
MAX_RESULT_DIGITS = 5000
MAX_DEPTH = 100
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(.))")


class CalcError(ValueError):
    pass


def _tokens(text: str) -> list[str]:
    out = []
    for number, op in _TOKEN.findall(text):
        if number:
            out.append(number)
        elif op.strip():
            if op not in "+-*/^()":
                raise CalcError(f"unexpected character {op!r}: only numbers, + - * / ^ and parentheses")
            out.append(op)
    return out


class _Parser:
    def __init__(self, tokens: list[str]):
        self.toks, self.i, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        t = self.peek()
        if t is None:
            raise CalcError("unexpected end of expression")
        self.i += 1
        return t

    def expr(self) -> Fraction:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalcError(f"expression nested deeper than {MAX_DEPTH}")
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        self.depth -= 1
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.unary()
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def unary(self) -> Fraction:
        if self.peek() == "-":
            self.take()
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise CalcError(f"expression nested deeper than {MAX_DEPTH}")
            value = -self.unary()
            self.depth -= 1
            return value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() != "^":
            return base
        self.take()
        exp = self.unary()
        if exp.denominator != 1:
            raise CalcError("exponents must be integers")
        if abs(exp) > MAX_EXPONENT:
            raise CalcError(f"exponent {exp} exceeds the bound {MAX_EXPONENT}")
        if base == 0 and exp < 0:
            raise CalcError("division by zero")
        size = max(len(str(base.numerator)), len(str(base.denominator))) * abs(int(exp))
        if size > MAX_RESULT_DIGITS:
            raise CalcError(f"result would have about {size} digits (bound {MAX_RESULT_DIGITS})")
        return base ** int(exp)

    def atom(self) -> Fraction:
        t = self.take()
        if t == "(":
            value = self.expr()
            if self.take() != ")":
                raise CalcError("expected ')'")
            return value
        if t[0].isdigit():
            return Fraction(t)
        raise CalcError(f"unexpected {t!r}")


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`; CalcError with a clear message for anything else."""
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    parser = _Parser(_tokens(expression))
    value = parser.expr()
    if parser.peek() is not None:
        raise CalcError(f"unexpected {parser.peek()!r} after a complete expression")
    return value


def format_fraction(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


@tool(
    "calculator",
    "Exact arithmetic on integers and decimals: + - * / ^ and parentheses. Returns an integer or p/q.",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
)
def calculator(expression: str) -> str:
    return format_fraction(evaluate(expression))
