"""How long a call's episodes wait on their environment (docs/SIMULATOR.md, Environment waits).

A run records only how many environment step calls its episodes made on average, not how they
were spread. The model: every episode calls at least once with probability q and, after each call,
calls again with probability r (a bad action retried, another guess), up to `max_calls` calls
(env.max_turns: the last turn allowed still calls). q and r are fitted to the mean. Calls of one
episode run one after another (each answer starts its next turn), those of different episodes at
once, so a call of several episodes waits as many latencies as its episode with the most calls
made: the expected maximum over its episodes, `expected_rounds`."""

from __future__ import annotations


def continuation(calls_per_episode: float, max_calls: int) -> tuple[float, float]:
    """(q, r): the probability that an episode calls its environment at least once, and that it
    calls again after each call, such that the mean number of calls (capped at `max_calls`) is
    `calls_per_episode`. Episodes that call at all are assumed to be the rule: q < 1 only when the
    mean is below one call."""
    if calls_per_episode <= 0 or max_calls < 1:
        return 0.0, 0.0
    if calls_per_episode <= 1 or max_calls == 1:
        return min(1.0, calls_per_episode), 0.0
    if calls_per_episode >= max_calls:
        return 1.0, 1.0

    def mean(r: float) -> float:
        return sum(r ** j for j in range(max_calls))

    low, high = 0.0, 1.0  # mean() grows with r from 1 to max_calls: bisection
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if mean(middle) < calls_per_episode else (low, middle)
    return 1.0, (low + high) / 2


def expected_rounds(calls_per_episode: float, max_calls: int, episodes: int) -> float:
    """The expected largest number of calls among `episodes` independent episodes, each calling
    as `continuation` says: how many environment latencies a call of that many episodes waits
    (0 without calls)."""
    q, r = continuation(calls_per_episode, max_calls)
    if q <= 0 or episodes < 1:
        return 0.0
    # E[max] = sum over j of P(max >= j) = 1 - P(every episode makes fewer than j calls).
    return sum(1.0 - (1.0 - q * r ** (j - 1)) ** episodes for j in range(1, max_calls + 1))
