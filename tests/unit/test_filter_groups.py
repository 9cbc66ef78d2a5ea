"""algo.filter_groups (asyncgrpo/queue/filtering.py, DAPO's dynamic sampling) on the replay queue with
its dispatcher: a group whose rewards are all equal is dropped on arrival, counted, and its slot is
granted again with a new prompt, so the step fills with groups that carry signal and every slot is
accounted for; a task with no signal at all fails at the take's timeout, naming the filter."""

from __future__ import annotations

import numpy as np
import pytest
from test_replay_tickets import ACCOUNTING_KEYS, Grants

from asyncgrpo.algo import OverlongSettings
from asyncgrpo.learner.metrics import arrived_all_equal_fraction
from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.queue.filtering import SignalFilter
from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.queue.sources import QueueTimeout
from asyncgrpo.wire import ScoredGroup, TicketRequest, example_group, holder_identity

KEEP = OverlongSettings(mode="keep", max_new_tokens=10, buffer_tokens=2, penalty=1.0)


def queue_with(signal_filter: SignalFilter | None, groups_per_step: int = 2) -> tuple[ReplayQueue, Grants]:
    grants = Grants()
    dispatcher = Dispatcher(groups_per_step, max_staleness=1, capacity_groups=16)
    return ReplayQueue(None, 16, StalenessEviction(1, drop_stale=True), limits=None, dispatcher=dispatcher,
                       grants=grants, signal_filter=signal_filter), grants


class Sender:
    """Generator 0, incarnation 0: asks for tickets and sends groups with the rewards it is told."""

    def __init__(self, queue: ReplayQueue, grants: Grants) -> None:
        self.queue, self.grants = queue, grants
        self.request = self.newest_grant = self.seq = 0
        self.unsent: dict[int, int] = {}  # slot -> position

    def ask(self, wanted: int) -> list[tuple[int, int]]:
        self.request += 1
        self.queue.put(TicketRequest(0, 0, self.request, 0, wanted, self.newest_grant, sorted(self.unsent)))
        answer = self.grants.sent[holder_identity(0, 0)][-1]
        if answer.slots:
            self.newest_grant = answer.grant
            self.unsent.update(zip(answer.slots, answer.positions))
        return list(zip(answer.slots, answer.positions))

    def send(self, slot: int, rewards: list[float], lengths: list[int] | None = None) -> ScoredGroup:
        position = self.unsent.pop(slot)
        lengths = lengths or [3] * len(rewards)
        g = example_group(num_samples=len(rewards), tokens_per_sample=1, seed=position)
        total = sum(lengths)
        g.tokens, g.logprobs = np.ones(total, np.int32), np.full(total, -1.0, np.float32)
        g.versions, g.lengths = np.zeros(total, np.int32), np.asarray(lengths, np.int32)
        g.policy_mask = np.ones(total, np.uint8)
        g.rewards, g.truncated = np.asarray(rewards, np.float32), np.zeros(len(rewards), np.uint8)
        g.generator_id, g.incarnation, g.seq, g.pos = 0, 0, self.seq, position
        self.seq += 1
        self.queue.put(g)
        return g


def test_an_all_equal_group_is_dropped_counted_and_its_slot_granted_again_with_a_new_prompt():
    queue, grants = queue_with(SignalFilter(KEEP))
    sender = Sender(queue, grants)
    (slot0, position0), (slot1, _) = sender.ask(2)
    sender.send(slot0, [1.0, 1.0, 1.0, 1.0])  # all solved: no signal
    kept = sender.send(slot1, [1.0, 0.0, 0.0, 1.0])
    stats = queue.stats()
    assert (stats["queue/filtered"], stats["queue/received"], stats["dispatch/released"]) == (1, 1, 1)
    regranted = sender.ask(1)
    assert [slot for slot, _ in regranted] == [slot0]
    assert regranted[0][1] != position0  # a new prompt: the filtered one had no signal to give
    replacement = sender.send(slot0, [0.0, 1.0, 1.0, 1.0])
    taken = queue.take(2, learner_version=0, timeout_s=1)
    assert [g.pos for g in taken] == [replacement.pos, kept.pos]
    stats = queue.stats()
    assert stats["queue/received"] == sum(stats[key] for key in ACCOUNTING_KEYS)
    assert (stats["queue/filtered"], stats["queue/consumed"], stats["queue/duplicates"]) == (1, 2, 0)


def test_without_the_filter_an_all_equal_group_fills_its_slot():
    queue, grants = queue_with(None)
    sender = Sender(queue, grants)
    (slot0, _), (slot1, _) = sender.ask(2)
    sender.send(slot0, [1.0, 1.0])
    sender.send(slot1, [0.0, 1.0])
    assert len(queue.take(2, learner_version=0, timeout_s=1)) == 2
    assert queue.stats()["queue/filtered"] == 0


def test_a_task_without_signal_fails_at_the_takes_timeout_naming_the_filter():
    queue, grants = queue_with(SignalFilter(KEEP))
    sender = Sender(queue, grants)
    for _ in range(3):  # every grant comes back all-equal: the slots are granted again and again
        for slot, _ in sender.ask(2):
            sender.send(slot, [0.0, 0.0, 0.0])
    with pytest.raises(QueueTimeout, match=r"6 groups dropped for all-equal rewards \(algo.filter_groups=true\)"):
        queue.take(2, learner_version=0, timeout_s=0.05)


def test_under_the_overlong_penalty_equal_rewards_of_different_lengths_carry_signal():
    penalty = SignalFilter(OverlongSettings(mode="penalty", max_new_tokens=10, buffer_tokens=4, penalty=1.0))
    group = example_group(num_samples=2, tokens_per_sample=1)
    group.rewards, group.lengths = np.array([1.0, 1.0], np.float32), np.array([3, 10], np.int32)
    assert penalty.keeps(group) and not SignalFilter(KEEP).keeps(group)
    group.lengths = np.array([3, 6], np.int32)  # both before the window: the same shaped reward
    assert not penalty.keeps(group)


def test_the_arrived_all_equal_fraction_counts_the_groups_filtered_since_the_last_step():
    # 3 dropped since the last step (queue/filtered 5 -> 8), 1 of the step's 4 groups all-equal.
    filtered, fraction = arrived_all_equal_fraction({"queue/filtered": 8, "reward/all_equal_frac": 0.25}, 5, 4)
    assert (filtered, fraction) == (8, pytest.approx(4 / 7))
    # Without the filter (a source with no such counter) it is the step's own fraction.
    assert arrived_all_equal_fraction({"reward/all_equal_frac": 0.5}, 0, 4) == (0, 0.5)
