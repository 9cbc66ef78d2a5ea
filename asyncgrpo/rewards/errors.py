"""Reward and environment errors over a run: one-line error texts, the error rate over a window of
learner steps, and the decision that an outage ends the run (reward.max_error_rate and
reward.error_window_steps; env.max_error_rate and env.error_window_steps).

The generator's Scorer keeps each term's first error (`one_line`); the learner's registry keeps an
`ErrorWindow` of the generators' reported reward errors and calls, another of their environment
calls, and raises with `outage_reason` or `env_outage_reason`. Light to import (no numpy, no torch):
the registry and the wire's users import it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from asyncgrpo.schema import RewardConfig

# An error text travels in every heartbeat and ends up in summary.json's one-line reason.
MAX_ERROR_CHARS = 200


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line (whitespace runs collapsed), at most `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


@dataclass(frozen=True)
class ErrorRate:
    """Failed calls out of all calls (reward: completions x terms; environment: resets and steps)
    over `steps` closed steps and the step in progress."""

    errors: int
    calls: int
    steps: int

    @property
    def rate(self) -> float:
        return self.errors / self.calls if self.calls else 0.0


class ErrorWindow:
    """An error rate (reward or environment calls) over the last `window_steps` learner steps plus
    the step in progress.

    The step in progress counts so that an outage is heard while no step can complete (under
    on_error=drop_group every group is dropped and the learner waits for groups). Not thread-safe:
    the registry calls it under its lock.
    """

    def __init__(self, max_rate: float, window_steps: int) -> None:
        if not 0.0 <= max_rate <= 1.0 or window_steps < 1:
            raise ValueError(f"max_rate must be in [0, 1] and window_steps >= 1, got {max_rate}, {window_steps}")
        self.max_rate, self.window_steps = max_rate, window_steps
        self._closed: deque[tuple[int, int]] = deque(maxlen=window_steps)

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> ErrorWindow:
        """The window of reward.* (max_error_rate, error_window_steps). The environment's is built
        from env.max_error_rate and env.error_window_steps by the composition root (learner/parts.py):
        the env section is envs/'s."""
        return cls(cfg.max_error_rate, cfg.error_window_steps)

    def close_step(self, errors: int, calls: int) -> None:
        """A learner step ended; `errors` of its `calls` calls failed (reported since the last step)."""
        self._closed.append((int(errors), int(calls)))

    def current(self, pending_errors: int = 0, pending_calls: int = 0) -> ErrorRate:
        """The window's rate, with what was reported since the last closed step."""
        errors = sum(e for e, _ in self._closed) + int(pending_errors)
        calls = sum(c for _, c in self._closed) + int(pending_calls)
        return ErrorRate(errors, calls, len(self._closed))

    def exceeded(self, rate: ErrorRate) -> bool:
        """Strictly beyond the limit: at max_rate=1 the run never stops, and no calls is no evidence."""
        return rate.calls > 0 and rate.rate > self.max_rate


# Its name from before it served environment calls too, kept for the code that still says so.
RewardErrorWindow = ErrorWindow


def outage_reason(rate: ErrorRate, window: ErrorWindow, first_errors: dict[str, str]) -> str:
    """The one-line reason a run fails: the rate, the window and each failing term's first error."""
    firsts = "; ".join(f"[{term}] {text}" for term, text in sorted(first_errors.items())) or "none reported"
    return (f"reward error rate {rate.rate:.2f} ({rate.errors} of {rate.calls} reward calls failed over the last "
            f"{rate.steps} learner step(s) and the one in progress, reward.error_window_steps={window.window_steps}) "
            f"is beyond reward.max_error_rate={window.max_rate:g}; first error of each failing term: {firsts}")


def env_outage_reason(rate: ErrorRate, window: ErrorWindow, first_error: str) -> str:
    """The one-line reason a run fails on its environment: the rate, the window and the first error
    any generator reported."""
    return (f"environment error rate {rate.rate:.2f} ({rate.errors} of {rate.calls} environment calls failed over "
            f"the last {rate.steps} learner step(s) and the one in progress, env.error_window_steps="
            f"{window.window_steps}) is beyond env.max_error_rate={window.max_rate:g}; first error: "
            f"{first_error or 'none reported'}")
