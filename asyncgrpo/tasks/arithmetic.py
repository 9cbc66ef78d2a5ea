"""Verifiable integer-addition task: prompt ``37+48=``, answer ``85``."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from asyncgrpo.tasks.problem import Problem

# Trailing markers a decoder may leave on a completion (vLLM skips special tokens by
# default, but a caller decoding with skip_special_tokens=False would see the eos text).
EOS_TEXT = "<eos>"


@dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """All ``a+b`` with ``num_digits``-digit operands; a fixed random subset is held out.

    Problem ids enumerate the operand grid, so an id names the same problem for every
    seed, and the held-out split depends only on ``split_seed``. ``num_digits`` and ``eval_size``
    are task.num_digits and task.eval_size (no defaults here: config's are the only ones).
    """

    num_digits: int
    eval_size: int
    split_seed: int = 0

    def __post_init__(self) -> None:
        if self.num_digits < 1:
            raise ValueError(f"num_digits must be >= 1, got {self.num_digits}")
        if not 0 < self.eval_size < self.num_problems:
            raise ValueError(f"eval_size must be in (0, {self.num_problems}), got {self.eval_size}")

    @property
    def smallest_operand(self) -> int:
        # Single-digit operands include 0; longer ones have no leading zero.
        return 0 if self.num_digits == 1 else 10 ** (self.num_digits - 1)

    @property
    def operands_per_side(self) -> int:
        return 10**self.num_digits - self.smallest_operand

    @property
    def num_problems(self) -> int:
        return self.operands_per_side**2

    @property
    def max_answer_chars(self) -> int:
        return self.num_digits + 1

    def settings(self) -> dict[str, int | str]:
        """Everything that determines the problems and split (used for cache keys)."""
        return {
            "task": "arithmetic_addition",
            "num_digits": self.num_digits,
            "eval_size": self.eval_size,
            "split_seed": self.split_seed,
        }

    def problem_id(self, left: int, right: int) -> int:
        for operand in (left, right):
            if not 0 <= operand - self.smallest_operand < self.operands_per_side:
                raise ValueError(f"{operand} is not a {self.num_digits}-digit operand")
        return (left - self.smallest_operand) * self.operands_per_side + (
            right - self.smallest_operand
        )

    def problem(self, problem_id: int) -> Problem:
        left_index, right_index = divmod(problem_id, self.operands_per_side)
        left = self.smallest_operand + left_index
        right = self.smallest_operand + right_index
        return Problem(id=problem_id, prompt=f"{left}+{right}=", answer=str(left + right))

    def eval_ids(self) -> frozenset[int]:
        return frozenset(self._sorted_eval_ids())

    def _sorted_eval_ids(self) -> list[int]:
        rng = random.Random(self.split_seed)
        return sorted(rng.sample(range(self.num_problems), self.eval_size))

    def eval_problems(self) -> list[Problem]:
        return [self.problem(problem_id) for problem_id in self._sorted_eval_ids()]

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Endless stream of training problems, reshuffled each pass over the train split."""
        held_out = self.eval_ids()
        train_ids = [i for i in range(self.num_problems) if i not in held_out]
        rng = random.Random(seed)
        while True:
            rng.shuffle(train_ids)
            for problem_id in train_ids:
                yield self.problem(problem_id)

    def score(self, completion_text: str, problem: Problem) -> float:
        text = completion_text.rstrip()
        while text.endswith(EOS_TEXT):
            text = text.removesuffix(EOS_TEXT).rstrip()
        return 1.0 if text == problem.answer else 0.0
