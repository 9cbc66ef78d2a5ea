"""The calculator tool: a strict, bounded parser of the last [expression] and its =value answers."""

import pytest

from asyncgrpo.envs import make_environment
from asyncgrpo.envs.calculator import (
    ERROR_OBSERVATION,
    MAX_DEPTH,
    MAX_EXPRESSION_CHARS,
    MAX_NUMBER_DIGITS,
    MAX_VALUE,
    CalculatorError,
    evaluate,
    last_call,
)
from asyncgrpo.schema import EnvConfig
from asyncgrpo.tasks.problem import Problem


@pytest.mark.parametrize(("expression", "value"), [
    ("123*45", 5535),
    ("7", 7),
    ("2+3*4", 14),  # * binds tighter than + and -
    ("10-4-3", 3),  # - is left-associative
    ("(2+3)*4", 20),
    ("((1+2)*(3+4))-(5)", 16),
    (" 12 * ( 3 - 5 ) ", -24),  # spaces between tokens; a negative result is a value like any other
    ("007*2", 14),
])
def test_valid_expressions_evaluate_like_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", [
    "", "1+", "*2", "2**3", "-5", "(1+2", "1+2)", "()", "1/2", "2^3", "1 2", "a+1", "__import__('os')", "1e3",
    "3.5*2", "[1]",
])
def test_garbage_does_not_parse(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_bounds_refuse_long_numbers_deep_nesting_long_text_and_huge_values():
    assert evaluate("9" * MAX_NUMBER_DIGITS) == int("9" * MAX_NUMBER_DIGITS)
    with pytest.raises(CalculatorError):
        evaluate("9" * (MAX_NUMBER_DIGITS + 1))
    assert evaluate("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH) == 1
    with pytest.raises(CalculatorError):
        evaluate("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1))
    with pytest.raises(CalculatorError):
        evaluate("+".join(["1"] * (MAX_EXPRESSION_CHARS // 2 + 1)))
    # Each factor is within the digit limit, but the product leaves the value bound: refused as it grows,
    # not computed to a number of hundreds of digits.
    big = "9" * MAX_NUMBER_DIGITS
    with pytest.raises(CalculatorError):
        evaluate("*".join([big] * 4))
    assert evaluate("1000000*1000000*1000000") == MAX_VALUE


@pytest.mark.parametrize(("action", "expression"), [
    ("[123*45]", "123*45"),
    ("let me see [1+1] no, [2*3]", "2*3"),  # the last call
    ("[2*3] ", "2*3"),
    ("2*3]", None),  # no opening bracket
    ("[2*[3]", "3"),
    ("[2*3]x", None),  # the call must end the turn
])
def test_the_call_is_the_last_bracketed_expression_ending_the_turn(action, expression):
    assert last_call(action) == expression


def calculator():
    spec = make_environment(EnvConfig(name="calculator"))
    env = spec.new()
    assert env.reset(Problem(id=0, prompt="123*45=", answer="5535")) == ""
    return spec, env


def test_the_calculator_answers_a_call_with_its_value_and_never_ends_the_episode():
    spec, env = calculator()
    assert spec.stop == ("]",)
    step = env.step("[123*45]")
    assert (step.observation, step.reward, step.done, step.bad_action) == ("=5535\n", 0.0, False, False)
    assert env.step("[(1+2)*3]").observation == "=9\n"  # the same environment answers again


@pytest.mark.parametrize("action", ["]", "[]", "[12/4]", "[hello]", "[" + "9" * 40 + "]", "[1+]"])
def test_a_call_that_does_not_parse_is_an_error_observation_and_a_bad_action(action):
    _, env = calculator()
    step = env.step(action)
    assert (step.observation, step.done, step.bad_action) == (ERROR_OBSERVATION, False, True)
