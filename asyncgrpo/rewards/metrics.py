"""Per-term reward metrics over a learner batch, from the groups' flat meta entries."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# reward/<name> entries that are not terms (reward/mean, reward/std: the learner's batch statistics;
# reward/errors: failed term calls), so no reward.terms[].name may take these names.
RESERVED_TERM_NAMES = ("mean", "std", "errors")


def reward_term_metrics(groups: Iterable[Any]) -> dict[str, float]:
    """reward/<term>: mean over the groups that report it; reward/errors: sum. Other meta keys are ignored."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    errors = 0
    seen_errors = False
    for group in groups:
        for key, value in group.meta.items():
            if not key.startswith("reward/") or isinstance(value, str):
                continue
            if key == "reward/errors":
                errors += int(value)
                seen_errors = True
            else:
                sums[key] = sums.get(key, 0.0) + float(value)
                counts[key] = counts.get(key, 0) + 1
    metrics = {key: sums[key] / counts[key] for key in sums}
    if seen_errors:
        metrics["reward/errors"] = float(errors)
    return metrics
