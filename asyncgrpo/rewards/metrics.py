"""Per-term reward metrics over a learner batch, from the groups' flat meta entries."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# reward/<name> entries that are not terms (reward/mean, reward/std: the learner's batch statistics;
# reward/errors, reward/calls, reward/error_rate, reward/groups_dropped: the generators' reports;
# reward/env: the environments' rewards of multi-turn episodes),
# so no reward.terms[].name may take these names.
RESERVED_TERM_NAMES = ("mean", "std", "errors", "calls", "error_rate", "groups_dropped", "env")


def reward_term_metrics(groups: Iterable[Any]) -> dict[str, float]:
    """reward/<term>: mean over the groups that report it. Other meta keys are ignored, reward/errors
    included: the step's count comes from the generators' reports (asyncgrpo/queue/registry.py), which
    also hold the errors of groups that were dropped and never reached the learner."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for group in groups:
        for key, value in group.meta.items():
            if not key.startswith("reward/") or key == "reward/errors" or isinstance(value, str):
                continue
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}
