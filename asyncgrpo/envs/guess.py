"""Guess the number: the policy guesses, the environment answers higher, lower or correct.

The secret is the problem's answer (asyncgrpo/tasks/guess.py: 1..task.guess_max). A policy turn is a
number and the stop text "\\n"; the environment answers "higher\\n" (the secret is above the guess) or
"lower\\n" (below), reward 0, and the episode goes on; "correct\\n" ends the episode with reward 1. A turn
that is not a number (at most MAX_GUESS_DIGITS digits, spaces around allowed) is answered "?\\n" and
counted as a bad action. docs/ENVIRONMENTS.md, Environments shipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncgrpo.envs.base import EnvironmentSpec, EnvStep
from asyncgrpo.tasks.problem import Problem

if TYPE_CHECKING:
    from asyncgrpo.schema import EnvConfig

STOP = "\n"
HIGHER, LOWER, CORRECT, NOT_A_NUMBER = "higher\n", "lower\n", "correct\n", "?\n"
MAX_GUESS_DIGITS = 9


def parse_guess(action: str) -> int | None:
    """The number a turn guesses, or None if the turn is not one number."""
    text = action.strip()
    if not text.isascii() or not text.isdigit() or len(text) > MAX_GUESS_DIGITS:
        return None
    return int(text)


def answer(guess: int, secret: int) -> EnvStep:
    """The environment's answer to `guess` (the tasks' reference traces write it too)."""
    if guess == secret:
        return EnvStep(CORRECT, reward=1.0, done=True)
    return EnvStep(HIGHER if secret > guess else LOWER)


class GuessEnvironment:
    """One episode's game: the secret is set by reset."""

    def __init__(self) -> None:
        self.secret: int | None = None

    def reset(self, problem: Problem) -> str:
        self.secret = int(problem.answer)
        return ""

    def step(self, action: str) -> EnvStep:
        if self.secret is None:
            raise RuntimeError("step before reset")
        guess = parse_guess(action)
        if guess is None:
            return EnvStep(NOT_A_NUMBER, bad_action=True)
        return answer(guess, self.secret)

    def close(self) -> None:
        pass


def guess_spec(cfg: EnvConfig) -> EnvironmentSpec:
    """env.name=guess: a fresh GuessEnvironment per episode; a turn ends at a newline."""
    return EnvironmentSpec(name=cfg.name, new=GuessEnvironment, stop=(STOP,))
