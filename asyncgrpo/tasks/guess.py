"""Guess the number, played against asyncgrpo/envs/guess.py: prompt ``guess 1-64:``, the secret is the answer.

Every problem has the same prompt (the secret is what the environment knows and the policy does not);
a problem's secret is its id modulo task.guess_max, plus one. The reference completion is the episode a
binary search from the middle plays: each guess and its newline (the policy's turn), each answer of the
environment ("higher\\n", "lower\\n", marked in Problem.extra[OBSERVATIONS_KEY] so the warm start neither
trains on nor counts them), ending with the right guess and "correct\\n", which ends the episode (so there
is no EOS to imitate). It takes at most max_turns(guess_max) = ceil(log2 guess_max) + 1 guesses.

Held out: with one prompt there is nothing to hide from training; the held-out problems are ids
0..eval_size-1, whose secrets cycle through 1..guess_max so every secret is played about as often.
Score: the last line of the policy's last turn is the secret (in an episode, the turn "correct" answered).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from asyncgrpo.tasks.longtail import final_answer
from asyncgrpo.tasks.problem import OBSERVATIONS_KEY, REFERENCE_KEY, Problem

# task.guess_max stays in this range: 2 is the smallest game, and 1,000 (11 guesses of up to 4 characters
# and their answers) fits the embedded model's context with room.
MIN_MAX_NUMBER, MAX_MAX_NUMBER = 2, 1000
_MAX_ID = 2**31 - 1


def max_turns(max_number: int) -> int:
    """Guesses a binary search from the middle needs at most over secrets 1..max_number (env.max_turns)."""
    return math.ceil(math.log2(max_number)) + 1


def binary_search_trace(secret: int, max_number: int) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The reference episode for `secret`, and the character spans of the environment's answers in it."""
    low, high, text, observations = 1, max_number, "", []
    while True:
        guess = (low + high) // 2
        text += f"{guess}\n"
        feedback = "correct\n" if guess == secret else "higher\n" if secret > guess else "lower\n"
        observations.append((len(text), len(text) + len(feedback)))
        text += feedback
        if guess == secret:
            return text, tuple(observations)
        low, high = (guess + 1, high) if secret > guess else (low, guess - 1)


@dataclass(frozen=True, kw_only=True)
class GuessTask:
    """``max_number`` and ``eval_size`` are task.guess_max and task.eval_size (no defaults here: config's
    are the only ones)."""

    max_number: int
    eval_size: int

    def __post_init__(self) -> None:
        if not MIN_MAX_NUMBER <= self.max_number <= MAX_MAX_NUMBER:
            raise ValueError(f"max_number must be between {MIN_MAX_NUMBER} and {MAX_MAX_NUMBER}, got {self.max_number}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")

    def settings(self) -> dict[str, int | str]:
        """What identifies the problems and their references (part of the warm-start cache key)."""
        return {"task": "guess", "max_number": self.max_number, "eval_size": self.eval_size}

    @property
    def prompt(self) -> str:
        return f"guess 1-{self.max_number}:"

    @property
    def environment(self) -> str:
        """The env.name whose episodes the references are: the warm start plays them so."""
        return "guess"

    @property
    def max_answer_chars(self) -> int:
        return max(len(binary_search_trace(secret, self.max_number)[0]) for secret in range(1, self.max_number + 1))

    def problem(self, problem_id: int) -> Problem:
        secret = problem_id % self.max_number + 1
        reference, observations = binary_search_trace(secret, self.max_number)
        return Problem(id=problem_id, prompt=self.prompt, answer=str(secret),
                       extra={REFERENCE_KEY: reference, OBSERVATIONS_KEY: observations})

    def eval_problems(self) -> list[Problem]:
        return [self.problem(i) for i in range(self.eval_size)]

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Endless seeded stream of problems with uniformly drawn secrets, ids above the held-out ones."""
        rng = random.Random(f"guess-train:{seed}")
        while True:
            yield self.problem(rng.randint(self.eval_size, _MAX_ID))

    def score(self, completion_text: str, problem: Problem) -> float:
        """1 when the last line is the secret (the number's value: the environment reads "037" as 37 too)."""
        answer = final_answer(completion_text)
        return 1.0 if answer is not None and int(answer) == int(problem.answer) else 0.0
