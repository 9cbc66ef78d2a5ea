"""`algo.filter_groups`: DAPO's dynamic sampling on learner rank 0's replay queue.

A group whose rewards, as the advantages will see them (after `algo.overlong=penalty`), are all equal
has advantage 0 for every sample: it adds nothing to the policy gradient and only dilutes the step.
With the setting on, the replay queue (asyncgrpo/queue/replay_queue.py) drops such a group on
arrival, counts it (`queue/filtered`) and gives its slot back to the dispatcher, which grants it
again with a new prompt: a step waits until its slots hold groups with signal.

Liveness: a task on which no group ever has signal (every prompt solved, or none) would wait
forever; the learner's take is bounded by `wire.timeout_s`, and the queue's timeout message then
names the filter and how many groups it dropped.
"""

from __future__ import annotations

import torch

from asyncgrpo import algo
from asyncgrpo.wire import ScoredGroup


class SignalFilter:
    """Whether an arriving group carries a GRPO signal, under the run's `algo.overlong` settings."""

    def __init__(self, overlong: algo.OverlongSettings) -> None:
        self.overlong = overlong

    def keeps(self, group: ScoredGroup) -> bool:
        """False for a group whose rewards, shaped as the update will shape them, are all equal."""
        rewards = algo.advantage_rewards(torch.from_numpy(group.rewards.astype("float32")),
                                         torch.from_numpy(group.lengths.astype("int64")), self.overlong)
        return algo.carries_signal(rewards)
