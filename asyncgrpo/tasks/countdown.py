"""Countdown: reach a target with given numbers, each used once, with + - * / and parentheses.

Problems are generated, not loaded: problem id k is always the same problem (a seeded draw of
numbers and a random expression tree over all of them, whose value is the target), so every
problem is solvable and its generating expression is the reference answer. Ids below
`eval_size` are held out; training draws ids above it, and skips any whose numbers and target
repeat a held-out problem.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

from asyncgrpo.tasks.problem import Problem

ANSWER_FORMAT = r"<answer>.*?</answer>"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
MAX_EQUATION_CHARS = 200
# task.countdown_numbers: numbers given per problem.
MIN_NUMBERS, MAX_NUMBERS = 2, 6
_MAX_ID = 2**31 - 1


@dataclass(frozen=True, kw_only=True)
class CountdownTask:
    """``num_numbers``, ``max_number`` and ``eval_size`` are task.countdown_numbers,
    task.countdown_max_number and task.eval_size (no defaults here: config's are the only ones)."""

    num_numbers: int
    max_number: int
    eval_size: int
    max_target: int = 1000
    split_seed: int = 0

    answer_format = ANSWER_FORMAT

    def __post_init__(self) -> None:
        if not MIN_NUMBERS <= self.num_numbers <= MAX_NUMBERS:
            raise ValueError(f"num_numbers must be in [{MIN_NUMBERS}, {MAX_NUMBERS}], got {self.num_numbers}")
        if self.max_number < 2:
            raise ValueError(f"max_number must be >= 2, got {self.max_number}")

    def settings(self) -> dict[str, int | str]:
        return {"task": "countdown", "num_numbers": self.num_numbers, "max_number": self.max_number,
                "max_target": self.max_target, "eval_size": self.eval_size, "split_seed": self.split_seed}

    @property
    def max_answer_chars(self) -> int:
        return MAX_EQUATION_CHARS

    def problem(self, problem_id: int) -> Problem:
        rng = random.Random(f"countdown:{self.split_seed}:{problem_id}")
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            built = _random_expression(numbers, rng)
            if built is not None and 1 <= built[0] <= self.max_target:
                break
        target, equation = built
        prompt = (f"Using the numbers {numbers}, write an equation that equals {target}. Use each number exactly "
                  "once, with + - * / and parentheses. Think it through, then give the equation alone in "
                  "<answer></answer>, for example <answer>(1 + 2) * 3</answer>.")
        return Problem(id=problem_id, prompt=prompt, answer=equation, extra={"numbers": numbers, "target": target})

    def eval_problems(self) -> list[Problem]:
        return [self.problem(i) for i in range(self.eval_size)]

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Endless seeded stream of fresh problems, none equal to a held-out one."""
        held_out = {_key(p) for p in self.eval_problems()}
        rng = random.Random(f"countdown-train:{seed}")
        while True:
            problem = self.problem(rng.randint(self.eval_size, _MAX_ID))
            if _key(problem) not in held_out:
                yield problem

    def score(self, completion_text: str, problem: Problem) -> float:
        return countdown_reward(completion_text, problem.extra["numbers"], problem.extra["target"])


def _key(problem: Problem) -> tuple[tuple[int, ...], int]:
    return tuple(sorted(problem.extra["numbers"])), problem.extra["target"]


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[int, str] | None:
    """Combine random pairs until one value is left; every intermediate value a positive integer."""
    pool = [(Fraction(n), str(n)) for n in numbers]
    while len(pool) > 1:
        (a, a_text), (b, b_text) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
        options = [("+", a + b, f"{a_text} + {b_text}"), ("*", a * b, f"{_wrap(a_text)} * {_wrap(b_text)}")]
        if a > b:
            options.append(("-", a - b, f"{a_text} - {_wrap(b_text)}"))
        elif b > a:
            options.append(("-", b - a, f"{b_text} - {_wrap(a_text)}"))
        if b != 0 and (a / b).denominator == 1 and b != 1:
            options.append(("/", a / b, f"{_wrap(a_text)} / {_wrap(b_text)}"))
        elif a != 0 and (b / a).denominator == 1 and a != 1:
            options.append(("/", b / a, f"{_wrap(b_text)} / {_wrap(a_text)}"))
        _, value, text = rng.choice(options)
        pool.append((value, text))
    value, text = pool[0]
    return (int(value), text) if value.denominator == 1 else None


def _wrap(text: str) -> str:
    return f"({text})" if any(op in text for op in "+-*/") else text


def countdown_reward(completion: str, numbers: list[int], target: int) -> float:
    """1.0 when the last <answer>...</answer> is an equation using exactly `numbers` whose value is `target`."""
    found = _ANSWER.findall(completion)
    if not found:
        return 0.0
    equation = found[-1].strip().split("=")[0].strip()
    if not equation or len(equation) > MAX_EQUATION_CHARS:
        return 0.0
    try:
        tree = ast.parse(equation, mode="eval")
        used: list[int] = []
        value = _evaluate(tree.body, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    if Counter(used) != Counter(numbers):
        return 0.0
    return 1.0 if value == target else 0.0


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an expression of integer literals and + - * / only (no unary minus, no names)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            return left / right
    raise ValueError(f"not allowed in a countdown equation: {type(node).__name__}")
