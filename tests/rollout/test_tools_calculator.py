"""rollout/tools: the calculator's exactness and refusals; registry validation never raises."""

from fractions import Fraction

import pytest

from rollout.tools.calculator import CalcError, evaluate
from rollout.tools.registry import REGISTRY, Registry, tool


@pytest.mark.parametrize(
    "expr, value",
    [
        ("123*45", 5535),
        ("1/3 + 1/6", Fraction(1, 2)),
        ("-2^2", -4),
        ("(-2)^3", -8),
        ("2^-2", Fraction(1, 4)),
        ("2^3^2", 512),
        ("0.1 + 0.2", Fraction(3, 10)),
        ("--3 - -(4)", 7),
        ("99999999999999999999 * 99999999999999999999", 99999999999999999999**2),
    ],
)
def test_calculator_is_exact(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr", ["__import__('os')", "2**3", "1/0", "2^0.5", "10^100000", "(1", "1 2", "", "x+1", "(" * 200 + "1"]
)
def test_calculator_refuses_non_arithmetic_and_unbounded_input(expr):
    with pytest.raises(CalcError):
        evaluate(expr)


def test_registry_call_validates_and_reports_errors_as_text():
    assert REGISTRY.call("calculator", {"expression": "6*7"}) == ("42", False)
    for name, args, msg in [
        ("calculator", {}, "missing required argument 'expression'"),
        ("calculator", {"expression": 3}, "must be string"),
        ("calculator", {"expression": "1/0"}, "division by zero"),
        ("nope", {}, "unknown tool"),
    ]:
        text, is_error = REGISTRY.call(name, args)
        assert is_error and msg in text


def test_a_new_tool_is_a_few_lines():
    reg = Registry()

    @tool("echo", "repeat", {"type": "object", "properties": {"n": {"type": "integer"}}}, registry=reg)
    def echo(n: int = 1) -> str:
        return "x" * n

    assert reg.call("echo", {"n": 3}) == ("xxx", False)
    assert reg.call("echo", {"n": True})[1]
