"""What a generator tells learner rank 0 on its sink (`GroupChannel`): its scored groups, numbered
in sending order, acknowledgements of the weights it loaded, and heartbeats with its cumulative
report. The generator (generator.py) decides when; this holds what the messages need between
calls: the next sequence number, the heartbeat clock and what the last heartbeat reported."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncgrpo.rollout.sink import GroupSink
from asyncgrpo.rollout.stats import GeneratorStats
from asyncgrpo.rollout.waits import WaitLimit
from asyncgrpo.wire import Heartbeat, ScoredGroup, VersionAck

if TYPE_CHECKING:
    from asyncgrpo.rewards.scorer import Scorer
    from asyncgrpo.weights import WeightReceiver

# While waiting (for tickets, for new weights) the learner still hears from us this often.
HEARTBEAT_EVERY_S = 1.0


class GroupChannel:
    """Sends generator `generator_id` (process `incarnation`)'s messages on `sink`, counting in
    `stats`; a heartbeat reads `scorer`'s counters and the environment counters in `stats`. The
    weight receiver is passed to each call that reads it (tests swap a generator's receiver after
    construction)."""

    def __init__(self, sink: GroupSink, generator_id: int, incarnation: int, stats: GeneratorStats,
                 scorer: Scorer, wait_limit: WaitLimit) -> None:
        self.sink, self.generator_id, self.incarnation = sink, generator_id, incarnation
        self.stats, self.scorer, self.wait_limit = stats, scorer, wait_limit
        # The next group's number: the learner's registry counts a gap in the numbers as groups lost.
        self.next_seq = 0
        self.reported_rejections = 0  # rejected weight messages, as the last heartbeat counted them
        self.reported_mismatches = 0  # weights.delta: deltas it could not apply, as the last heartbeat counted them
        self._last_heartbeat = 0.0

    def acknowledge(self, version: int) -> None:
        """Tell the learner the engine holds `version` now (it waits on lagging acknowledgements)."""
        self.sink.try_send(VersionAck(self.generator_id, version, self.incarnation), timeout_s=1.0)

    def send(self, group: ScoredGroup, weights: WeightReceiver, while_blocked: Callable[[], None]) -> None:
        """Number and send `group`, waiting on a full queue: `while_blocked` runs between tries (the
        generator loads new weights there, a safe point, and hears a stop), and the wait fails past
        its limit (`weights.saves`: a checkpoint save stretches it)."""
        started = time.monotonic()
        group.seq, group.incarnation = self.next_seq, self.incarnation
        blocked_since = None
        while not self.sink.try_send(group, timeout_s=0.5 if blocked_since else 0.0):
            blocked_since = blocked_since or time.perf_counter()
            while_blocked()
            self.wait_limit.check(started, weights.saves, "blocked on a full queue", "the learner took no group")
        if blocked_since is not None:
            self.stats.send_blocked_s += time.perf_counter() - blocked_since
        self.next_seq += 1
        self.stats.groups_sent += 1

    def heartbeat(self, version: int, weights: WeightReceiver, periodic: bool) -> None:
        """Report sequence number, loaded `version` and cumulative counters (the learner logs their
        per-step increase); `periodic`: at most once per HEARTBEAT_EVERY_S. Never blocks: a lost
        heartbeat is made good by the next, its values being cumulative."""
        now = time.monotonic()
        if periodic and now - self._last_heartbeat < HEARTBEAT_EVERY_S:
            return
        self._last_heartbeat = now
        rewards = self.scorer.stats_snapshot()
        rejected, reason = weights.rejections()
        self.reported_rejections = rejected
        self.reported_mismatches = weights.delta_mismatches
        self.sink.try_send(Heartbeat(self.generator_id, self.next_seq, version, idle_s=self.stats.idle_s,
                                     reward_errors=rewards["reward/errors"],
                                     groups_dropped=rewards["reward/groups_dropped"] + self.stats.env_groups_dropped,
                                     weights_rejected=rejected, rejection=reason,
                                     reward_calls=rewards["reward/calls"],
                                     reward_first_errors=self.scorer.first_errors(), incarnation=self.incarnation,
                                     env_calls=self.stats.env_calls, env_errors=sum(self.stats.env_errors.values()),
                                     env_first_error=self.stats.env_first_error,
                                     delta_mismatches=self.reported_mismatches),
                           timeout_s=0.0)
