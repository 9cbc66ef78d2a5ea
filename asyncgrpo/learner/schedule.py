"""The learning-rate schedule (`learner.lr_schedule`): a multiplier of `learner.lr` per optimizer step.

Plain Python, no torch: `asyncgrpo.config` reads `LR_SCHEDULES` from here to validate the key.
"""

from __future__ import annotations

import math

from asyncgrpo.schema import LearnerConfig

# learner.lr_schedule: constant = lr after the warm-up; cosine = down to min_lr_ratio * lr at train.max_steps.
LR_SCHEDULES = ("constant", "cosine")


def lr_multiplier(step: int, learner: LearnerConfig, total_steps: int) -> float:
    """Linear warm-up over `warmup_steps`, then constant or cosine decay to `min_lr_ratio`."""
    if learner.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"learner.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {learner.lr_schedule!r}")
    if step < learner.warmup_steps:
        return (step + 1) / learner.warmup_steps
    if learner.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - learner.warmup_steps) / max(1, total_steps - learner.warmup_steps))
    return learner.min_lr_ratio + (1 - learner.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
