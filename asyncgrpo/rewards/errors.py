"""Reward errors over a run: one-line error texts, the error rate over a window of learner steps,
and the decision that a reward outage ends the run (reward.max_error_rate, reward.error_window_steps).

The generator's Scorer keeps each term's first error (`one_line`); the learner's registry keeps a
`RewardErrorWindow` of the generators' reported errors and calls, and raises with `outage_reason`.
Light to import (no numpy, no torch): the registry and the wire's users import it.
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
    """Failed reward calls out of all reward calls (completions x terms) over `steps` closed steps
    and the step in progress."""

    errors: int
    calls: int
    steps: int

    @property
    def rate(self) -> float:
        return self.errors / self.calls if self.calls else 0.0


class RewardErrorWindow:
    """The reward error rate over the last `window_steps` learner steps plus the step in progress.

    The step in progress counts so that an outage is heard while no step can complete (under
    reward.on_error=drop_group every group is dropped and the learner waits for groups). Not
    thread-safe: the registry calls it under its lock.
    """

    def __init__(self, max_rate: float, window_steps: int) -> None:
        if not 0.0 <= max_rate <= 1.0 or window_steps < 1:
            raise ValueError(f"max_rate must be in [0, 1] and window_steps >= 1, got {max_rate}, {window_steps}")
        self.max_rate, self.window_steps = max_rate, window_steps
        self._closed: deque[tuple[int, int]] = deque(maxlen=window_steps)

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> RewardErrorWindow:
        return cls(cfg.max_error_rate, cfg.error_window_steps)

    def close_step(self, errors: int, calls: int) -> None:
        """A learner step ended; `errors` of its `calls` reward calls failed (reported since the last step)."""
        self._closed.append((int(errors), int(calls)))

    def current(self, pending_errors: int = 0, pending_calls: int = 0) -> ErrorRate:
        """The window's rate, with what was reported since the last closed step."""
        errors = sum(e for e, _ in self._closed) + int(pending_errors)
        calls = sum(c for _, c in self._closed) + int(pending_calls)
        return ErrorRate(errors, calls, len(self._closed))

    def exceeded(self, rate: ErrorRate) -> bool:
        """Strictly beyond the limit: at max_rate=1 the run never stops, and no calls is no evidence."""
        return rate.calls > 0 and rate.rate > self.max_rate


def outage_reason(rate: ErrorRate, window: RewardErrorWindow, first_errors: dict[str, str]) -> str:
    """The one-line reason a run fails: the rate, the window and each failing term's first error."""
    firsts = "; ".join(f"[{term}] {text}" for term, text in sorted(first_errors.items())) or "none reported"
    return (f"reward error rate {rate.rate:.2f} ({rate.errors} of {rate.calls} reward calls failed over the last "
            f"{rate.steps} learner step(s) and the one in progress, reward.error_window_steps={window.window_steps}) "
            f"is beyond reward.max_error_rate={window.max_rate:g}; first error of each failing term: {firsts}")
