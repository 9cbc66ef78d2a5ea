"""Multiplication, with or without the calculator tool: prompt ``123*45=``, answer ``5535``.

With the tool (env.name=calculator) the reference completion is an episode: the policy's call
``[123*45]``, the calculator's observation ``=5535\\n`` (written by the environment, so
Problem.extra[OBSERVATIONS_KEY] marks it and the warm start neither trains on it nor counts it), then
the policy's answer ``5535`` and EOS. Without the tool it is just ``5535``: a product the tiny model
cannot work out, the comparison that shows what the tool is worth. Either way the score is the last
line of the text the policy wrote last (an episode's last turn): exactly the product.

Problems are generated like longtail's: problem id k is always the same draw (seeded by k), ids below
`eval_size` are held out, and training draws ids above and skips any with a held-out prompt.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from asyncgrpo.tasks.longtail import final_answer
from asyncgrpo.tasks.problem import OBSERVATIONS_KEY, REFERENCE_KEY, Problem

# task.multiply_left_digits / task.multiply_right_digits stay in this range: the calculator takes numbers of
# at most 12 digits and values up to 1e18.
MIN_DIGITS, MAX_DIGITS = 1, 9
# The held-out problems may be at most this share of the distinct ones, so training has problems left.
MAX_EVAL_SHARE = 0.2
_MAX_ID = 2**31 - 1


def tool_trace(left: int, right: int) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The reference episode with the calculator, and its observation's character span: the policy's call
    ``[a*b]``, the calculator's ``=<product>\\n``, the policy's answer."""
    call, observation, product = f"[{left}*{right}]", f"={left * right}\n", str(left * right)
    return call + observation + product, ((len(call), len(call) + len(observation)),)


@dataclass(frozen=True, kw_only=True)
class MultiplyTask:
    """``left_digits``, ``right_digits`` and ``eval_size`` are task.multiply_left_digits,
    task.multiply_right_digits and task.eval_size; ``tool`` is env.name == "calculator" (no defaults here:
    config's are the only ones)."""

    left_digits: int
    right_digits: int
    eval_size: int
    tool: bool
    split_seed: int = 0

    def __post_init__(self) -> None:
        for name, digits in (("left_digits", self.left_digits), ("right_digits", self.right_digits)):
            if not MIN_DIGITS <= digits <= MAX_DIGITS:
                raise ValueError(f"{name} must be between {MIN_DIGITS} and {MAX_DIGITS}, got {digits}")
        if not 1 <= self.eval_size <= MAX_EVAL_SHARE * self.num_problems:
            raise ValueError(f"eval_size must be between 1 and {int(MAX_EVAL_SHARE * self.num_problems)} "
                             f"({MAX_EVAL_SHARE:.0%} of the {self.num_problems} problems), got {self.eval_size}")

    @property
    def num_problems(self) -> int:
        """Distinct prompts: every pair of operands with these digit counts (1-digit operands include 0)."""
        return operands(self.left_digits) * operands(self.right_digits)

    def settings(self) -> dict[str, int | bool | str]:
        """What identifies the problems and their references (part of the warm-start cache key)."""
        return {"task": "multiply", "left_digits": self.left_digits, "right_digits": self.right_digits,
                "eval_size": self.eval_size, "tool": self.tool, "split_seed": self.split_seed}

    @property
    def environment(self) -> str:
        """The env.name whose episodes the references are ("" for none): the warm start plays them so."""
        return "calculator" if self.tool else ""

    @property
    def max_answer_chars(self) -> int:
        product_digits = self.left_digits + self.right_digits
        if not self.tool:
            return product_digits
        # "[a*b]", "=<product>\n", "<product>"
        return (self.left_digits + self.right_digits + 3) + (product_digits + 2) + product_digits

    def problem(self, problem_id: int) -> Problem:
        rng = random.Random(f"multiply:{self.split_seed}:{problem_id}")
        left, right = (rng.randrange(smallest(d), 10**d) for d in (self.left_digits, self.right_digits))
        if self.tool:
            reference, observations = tool_trace(left, right)
            extra = {REFERENCE_KEY: reference, OBSERVATIONS_KEY: observations}
        else:
            extra = {}
        return Problem(id=problem_id, prompt=f"{left}*{right}=", answer=str(left * right), extra=extra)

    def eval_problems(self) -> list[Problem]:
        return [self.problem(i) for i in range(self.eval_size)]

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Endless seeded stream of problems, none with the operands of a held-out one."""
        held_out = {p.prompt for p in self.eval_problems()}
        rng = random.Random(f"multiply-train:{seed}")
        while True:
            problem = self.problem(rng.randint(self.eval_size, _MAX_ID))
            if problem.prompt not in held_out:
                yield problem

    def score(self, completion_text: str, problem: Problem) -> float:
        """1 when the last line is exactly the product (in an episode, the last line of the policy's last
        turn: an observation is never scored as the policy's answer)."""
        return 1.0 if final_answer(completion_text) == problem.answer else 0.0


def smallest(digits: int) -> int:
    """The smallest operand of `digits` digits (0 for one digit, else no leading zero)."""
    return 0 if digits == 1 else 10 ** (digits - 1)


def operands(digits: int) -> int:
    return 10**digits - smallest(digits)
