"""Long-tail addition: multi-digit sums worked column by column, so completion lengths are heavy-tailed.

Prompt ``457+368=``; the reference completion writes one line per digit column, right to left, with
the column's digits, the carry in, and the two-digit column sum (carry out, digit), then the answer:

    7+8+0=15
    5+6+1=12
    4+3+1=08
    825

Every line is 8 characters, so a carry sits a fixed 9 tokens after the one it came from (learnable by
a tiny model), and a completion's length grows linearly with the operands' digit count d (10d or
10d+1 characters). d is drawn with probability proportional to d^-exponent between min_digits and
max_digits, which makes the lengths heavy-tailed: most problems are 2-3 digits, a few are 16.

Problems are generated, not enumerated (16-digit operands have no useful grid): problem id k is always
the same problem (a draw seeded by k). Ids below `eval_size` are held out; training draws ids above
it and skips any whose operands repeat a held-out problem (2-digit pairs do repeat: 8,100 of them).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from asyncgrpo.tasks.arithmetic import EOS_TEXT
from asyncgrpo.tasks.problem import REFERENCE_KEY, Problem

# task.longtail_min_digits / task.longtail_max_digits may not leave this range: 1-digit problems
# are too few (100) to hold out, and 18 digits would overrun the embedded model's 256-token context.
MIN_DIGITS, MAX_DIGITS = 2, 18
_MAX_ID = 2**31 - 1
_DIGITS = re.compile(r"[0-9]+")
# Characters of one scratchpad line ("7+8+0=15") and the newline after it.
LINE_CHARS = 9


def digit_weights(min_digits: int, max_digits: int, exponent: float) -> list[float]:
    """Unnormalised probability of each digit count min_digits..max_digits: d^-exponent."""
    return [d ** -exponent for d in range(min_digits, max_digits + 1)]


def scratchpad(left: int, right: int) -> str:
    """The reference completion of ``left+right=``: one line per column, then the sum."""
    left_digits, right_digits = str(left)[::-1], str(right)[::-1]
    columns = max(len(left_digits), len(right_digits))
    lines, carry = [], 0
    for column in range(columns):
        x = int(left_digits[column]) if column < len(left_digits) else 0
        y = int(right_digits[column]) if column < len(right_digits) else 0
        total = x + y + carry
        lines.append(f"{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    return "\n".join([*lines, str(left + right)])


def final_answer(completion_text: str) -> str | None:
    """The completion's last non-empty line if it is a plain number, else None (garbage scores 0)."""
    text = completion_text.rstrip()
    while text.endswith(EOS_TEXT):
        text = text.removesuffix(EOS_TEXT).rstrip()
    last = text.rsplit("\n", 1)[-1].strip()
    return last if _DIGITS.fullmatch(last) else None


@dataclass(frozen=True, kw_only=True)
class LongtailTask:
    """``min_digits``, ``max_digits``, ``exponent`` and ``eval_size`` are task.longtail_min_digits,
    task.longtail_max_digits, task.longtail_exponent and task.eval_size (no defaults here: config's
    are the only ones)."""

    min_digits: int
    max_digits: int
    exponent: float
    eval_size: int
    split_seed: int = 0

    def __post_init__(self) -> None:
        if not MIN_DIGITS <= self.min_digits <= self.max_digits <= MAX_DIGITS:
            raise ValueError(f"need {MIN_DIGITS} <= min_digits <= max_digits <= {MAX_DIGITS}, "
                             f"got {self.min_digits} and {self.max_digits}")
        if self.exponent < 0:
            raise ValueError(f"exponent must be >= 0, got {self.exponent}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")

    def settings(self) -> dict[str, int | float | str]:
        return {"task": "longtail_addition", "min_digits": self.min_digits, "max_digits": self.max_digits,
                "exponent": self.exponent, "eval_size": self.eval_size, "split_seed": self.split_seed}

    @property
    def max_answer_chars(self) -> int:
        # The longest reference completion: a line per column, then a sum one digit longer.
        return LINE_CHARS * self.max_digits + self.max_digits + 1

    def problem(self, problem_id: int) -> Problem:
        rng = random.Random(f"longtail:{self.split_seed}:{problem_id}")
        counts = range(self.min_digits, self.max_digits + 1)
        digits = rng.choices(counts, weights=digit_weights(self.min_digits, self.max_digits, self.exponent))[0]
        left, right = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
        return Problem(id=problem_id, prompt=f"{left}+{right}=", answer=str(left + right),
                       extra={REFERENCE_KEY: scratchpad(left, right)})

    def eval_problems(self) -> list[Problem]:
        return [self.problem(i) for i in range(self.eval_size)]

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Endless seeded stream of problems, none with the operands of a held-out one."""
        held_out = {p.prompt for p in self.eval_problems()}
        rng = random.Random(f"longtail-train:{seed}")
        while True:
            problem = self.problem(rng.randint(self.eval_size, _MAX_ID))
            if problem.prompt not in held_out:
                yield problem

    def score(self, completion_text: str, problem: Problem) -> float:
        """1 when the last line is exactly the sum; the scratchpad itself is not graded."""
        return 1.0 if final_answer(completion_text) == problem.answer else 0.0
