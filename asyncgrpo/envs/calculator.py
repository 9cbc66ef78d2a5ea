"""The calculator tool: the policy writes ``[expression]``, the environment answers ``=value``.

An action is the policy's turn up to and including the stop text ``]``; the environment evaluates its
last ``[...]`` with a small strict parser (non-negative integers, ``+ - *``, parentheses and spaces;
no eval, no unary minus, no division) and answers ``=<value>\\n``, after which the policy writes on (its
answer, then EOS). Anything else is answered ``=error\\n`` and counted as a bad action. Bounded so a
sampled call cannot cost much: at most MAX_EXPRESSION_CHARS characters, MAX_NUMBER_DIGITS digits per
number, MAX_DEPTH nested parentheses, and every intermediate value within +-MAX_VALUE.
docs/ENVIRONMENTS.md, Environments shipped.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from asyncgrpo.envs.base import EnvironmentSpec, EnvStep
from asyncgrpo.tasks.problem import Problem

if TYPE_CHECKING:
    from asyncgrpo.schema import EnvConfig

STOP = "]"
ERROR_OBSERVATION = "=error\n"
MAX_EXPRESSION_CHARS = 64
MAX_NUMBER_DIGITS = 12
MAX_DEPTH = 8
# Far above any product the tasks ask for, far below where Python's big integers get slow.
MAX_VALUE = 10**18
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")
_LAST_CALL = re.compile(r"\[([^\[\]]*)\]\s*$")


class CalculatorError(ValueError):
    """The expression does not parse, or leaves the bounds."""


class _Parser:
    """Recursive descent over: expression = term (("+" | "-") term)*; term = factor ("*" factor)*;
    factor = number | "(" expression ")"."""

    def __init__(self, text: str) -> None:
        if len(text) > MAX_EXPRESSION_CHARS:
            raise CalculatorError(f"longer than {MAX_EXPRESSION_CHARS} characters")
        self.tokens = [number or symbol for number, symbol in _TOKEN.findall(text) if (number or symbol).strip()]
        self.position = 0

    def parse(self) -> int:
        value = self._expression(0)
        if self.position != len(self.tokens):
            raise CalculatorError(f"unexpected {self.tokens[self.position]!r}")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise CalculatorError("ends too soon")
        self.position += 1
        return token

    def _expression(self, depth: int) -> int:
        value = self._term(depth)
        while self._peek() in ("+", "-"):
            sign = 1 if self._take() == "+" else -1
            value = _bounded(value + sign * self._term(depth))
        return value

    def _term(self, depth: int) -> int:
        value = self._factor(depth)
        while self._peek() == "*":
            self._take()
            value = _bounded(value * self._factor(depth))
        return value

    def _factor(self, depth: int) -> int:
        token = self._take()
        if token == "(":
            if depth >= MAX_DEPTH:
                raise CalculatorError(f"more than {MAX_DEPTH} nested parentheses")
            value = self._expression(depth + 1)
            if self._take() != ")":
                raise CalculatorError("unclosed parenthesis")
            return value
        if not token.isdigit():
            raise CalculatorError(f"unexpected {token!r}")
        if len(token) > MAX_NUMBER_DIGITS:
            raise CalculatorError(f"a number longer than {MAX_NUMBER_DIGITS} digits")
        return int(token)


def _bounded(value: int) -> int:
    if abs(value) > MAX_VALUE:
        raise CalculatorError(f"a value beyond {MAX_VALUE:.0e}")
    return value


def evaluate(expression: str) -> int:
    """The value of `expression` (digits, + - *, parentheses, spaces); CalculatorError if it does not
    parse or leaves the bounds."""
    return _Parser(expression).parse()


def last_call(action: str) -> str | None:
    """The expression inside the action's last ``[...]``, which must end the action; None if there is none."""
    match = _LAST_CALL.search(action)
    return match.group(1) if match else None


class CalculatorEnvironment:
    """One episode's calculator: stateless, never ends the episode itself."""

    def reset(self, problem: Problem) -> str:
        return ""

    def step(self, action: str) -> EnvStep:
        expression = last_call(action)
        if expression is None:
            return EnvStep(ERROR_OBSERVATION, bad_action=True)
        try:
            value = evaluate(expression)
        except CalculatorError:
            return EnvStep(ERROR_OBSERVATION, bad_action=True)
        return EnvStep(observation(value))

    def close(self) -> None:
        pass


def observation(value: int) -> str:
    """What the calculator answers for a call whose value is `value` (the tasks' references write it too)."""
    return f"={value}\n"


def calculator_spec(cfg: EnvConfig) -> EnvironmentSpec:
    """env.name=calculator: a fresh CalculatorEnvironment per episode; a turn ends at "]"."""
    return EnvironmentSpec(name=cfg.name, new=CalculatorEnvironment, stop=(STOP,))
