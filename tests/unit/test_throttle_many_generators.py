"""The staleness bound with any number of generators at any relative speeds: the generators'
throttle (`throttle_limit`) with the real `ReplayQueue` taking each generator's share per step;
and, with the learner's delayed publication (train.fixed_staleness), staleness held exactly.

A discrete simulation: each event is one generator starting, finishing, giving back (a group
dropped for its rewards), losing a group in transit, heartbeating, receiving the learner's credit
for written-off groups (`credit_written_off`) or loading weights, or the learner taking a step;
hypothesis picks the interleaving among the events possible at each point."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.config import ConfigError, groups_per_generator, load
from asyncgrpo.replay import QueueTimeout, ReplayQueue, StalenessEviction
from asyncgrpo.rollout.generator import throttle_limit
from asyncgrpo.wire import Heartbeat, ScoredGroup


def group(generator_id: int, seq: int, version: int) -> ScoredGroup:
    tokens = np.array([5, 6], dtype=np.int32)
    return ScoredGroup(generator_id=generator_id, seq=seq, prompt_id=seq, prompt_tokens=np.array([1], dtype=np.int32),
                       tokens=tokens, logprobs=np.array([-1.0, -1.0], dtype=np.float32),
                       versions=np.full(2, version, dtype=np.int32), lengths=np.array([2], dtype=np.int32),
                       rewards=np.array([1.0], dtype=np.float32), meta={})


class _Unseen:
    next_seq = 0  # a generator the registry has not heard from yet


@dataclass
class SimGenerator:
    quota: int
    loaded: int = 0
    started: int = 0
    sent: int = 0  # sequence numbers used, lost groups included
    credit: int = 0  # groups written off by the learner that the generator was told of
    in_flight: list[int] = field(default_factory=list)  # the weights version each group started with


class Simulation:
    def __init__(self, quotas: list[int], max_staleness: int, shares: bool, publish_delay: int = 0,
                 losses: bool = False, credit: bool = True) -> None:
        """`publish_delay` k: the learner at version v publishes version v - k (train.fixed_staleness).
        `losses`: groups may be lost in transit; `credit`: the learner's write-offs reach the throttle."""
        self.max_staleness = max_staleness
        self.losses, self.credit = losses, credit
        self.publish_delay = publish_delay
        self.steps_per_take = sum(quotas)
        self.generators = [SimGenerator(q) for q in quotas]
        self.queue = ReplayQueue(None, (max_staleness + 1) * sum(quotas),
                                 StalenessEviction(max_staleness, drop_stale=False, full_policy="block"),
                                 limits=None, shares=quotas if shares else None)
        self.version = 0
        self.staleness: list[int] = []
        self.trained: list[tuple[int, int]] = []  # (learner version that took it, its staleness)

    @property
    def lost(self) -> int:
        return self.queue.registry.lost

    @property
    def published(self) -> int:
        """The newest version a generator can load (the starting weights, 0, during the warm-up)."""
        return max(0, self.version - self.publish_delay)

    def actions(self) -> list[tuple[str, int]]:
        possible = [("learn", -1)]
        written_off = self.queue.registry.written_off()
        for i, g in enumerate(self.generators):
            if throttle_limit(self.max_staleness, g.loaded, g.quota) + g.credit - g.started > 0:
                possible.append(("start", i))
            if g.in_flight:
                possible += [("finish", i), ("give_back", i)] + ([("lose", i)] if self.losses else [])
            if self.losses and g.sent > self.queue.registry.generators.get(i, _Unseen).next_seq:
                possible.append(("heartbeat", i))
            if self.credit and written_off.get(i, (0, 0))[1] > g.credit:
                possible.append(("credit", i))
            if g.loaded < self.published:
                possible.append(("load", i))
        return possible

    def do(self, action: str, i: int) -> bool:
        """Apply one action; False if the learner found no full step."""
        g = self.generators[i] if i >= 0 else None
        if action == "start":
            g.in_flight.append(g.loaded)
            g.started += 1
        elif action == "finish":
            self.queue.put(group(i, g.sent, g.in_flight.pop(0)), timeout_s=0.0)  # QueueFull would fail the test
            g.sent += 1
        elif action == "give_back":  # reward.on_error=drop_group: never sent, quota returned
            g.in_flight.pop(0)
            g.started -= 1
        elif action == "lose":  # sent, never delivered: a gap in its sequence numbers
            g.in_flight.pop(0)
            g.sent += 1
        elif action == "heartbeat":  # announces the groups sent: a gap at the tail is loss too
            self.queue.put(Heartbeat(generator_id=i, next_seq=g.sent, version=g.loaded))
        elif action == "credit":  # the driver forwards the learner's write-offs (Actors.credit_write_offs)
            g.credit = self.queue.registry.written_off()[i][1]
        elif action == "load":
            g.loaded = self.published
        else:
            try:
                batch = self.queue.take(self.steps_per_take, self.version, timeout_s=0.0)
            except QueueTimeout:
                return False
            self.staleness += [self.version - b.version_min for b in batch]
            self.trained += [(self.version, self.version - b.version_min) for b in batch]
            self.version += 1
        return True


def random_run(num_generators: int, max_staleness: int, extra_groups: int, data: st.DataObject, events: int,
               losses: bool = False) -> Simulation:
    """`events` events drawn by hypothesis among those possible, checking after each that the run is
    never stuck: the learner, or some generator, can always move (no deadlock), however many
    groups were lost."""
    # Shares as hypothesis likes them: even, or any rollout.generator_shares (each >= 1).
    shares = [1] * num_generators
    for i in data.draw(st.lists(st.integers(0, num_generators - 1), min_size=extra_groups, max_size=extra_groups)):
        shares[i] += 1
    cfg = load([f"rollout.num_generators={num_generators}", f"train.groups_per_step={num_generators + extra_groups}",
                f"rollout.generator_shares=[{','.join(map(str, shares))}]", "queue.capacity_groups=64",
                "rollout.dispatch=shares"])
    sim = Simulation(groups_per_generator(cfg), max_staleness, shares=True, losses=losses)
    for _ in range(events):
        action, i = data.draw(st.sampled_from(sim.actions()))
        sim.do(action, i)
        assert len(sim.actions()) > 1 or sim.queue.depth >= sim.steps_per_take
    return sim


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(0, 3), st.integers(0, 2), st.data())
def test_every_trained_group_is_within_max_staleness_for_any_generators_and_speeds(
        num_generators, max_staleness, extra_groups, data):
    sim = random_run(num_generators, max_staleness, extra_groups, data, events=150)
    assert all(0 <= s <= max_staleness for s in sim.staleness), sim.staleness
    accounted = sum(g.sent for g in sim.generators)
    assert accounted == sim.version * sim.steps_per_take + sim.queue.depth  # nothing dropped or lost


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(0, 3), st.integers(0, 2), st.data())
def test_groups_lost_in_transit_are_credited_back_so_the_throttle_never_stalls_and_staleness_stays_bounded(
        num_generators, max_staleness, extra_groups, data):
    sim = random_run(num_generators, max_staleness, extra_groups, data, events=250, losses=True)
    assert all(0 <= s <= max_staleness for s in sim.staleness), sim.staleness
    assert sim.queue.received == sim.version * sim.steps_per_take + sim.queue.depth
    # Counted lost once a later group or a heartbeat shows the gap; never more than were lost.
    assert sim.lost <= sum(g.sent for g in sim.generators) - sim.queue.received


def lose_then_learn(credit: bool, losses: int) -> Simulation:
    """One generator, one group per step, max_staleness 1: `losses` groups lost in transit first
    (announced by a heartbeat), then as many steps as the throttle lets it deliver."""
    sim = Simulation([1], max_staleness=1, shares=True, losses=True, credit=credit)
    for _ in range(losses):
        while ("start", 0) not in sim.actions() and ("credit", 0) in sim.actions():
            sim.do("credit", 0)
        if ("start", 0) not in sim.actions():
            break
        sim.do("start", 0)
        sim.do("lose", 0)
        sim.do("heartbeat", 0)
    for _ in range(10):
        for move in [("credit", 0), ("load", 0), ("start", 0), ("finish", 0)]:
            while move in sim.actions():
                sim.do(*move)
        sim.do("learn", -1)
    return sim


def test_without_the_credit_losses_beyond_the_lead_stall_the_learner():
    # The throttle lets it start max_staleness + 1 = 2 groups ahead; both lost, it may start none.
    stalled = lose_then_learn(credit=False, losses=2)
    assert stalled.version == 0 and stalled.actions() == [("learn", -1)]


def test_with_the_credit_every_lost_group_is_replaced_and_training_goes_on():
    sim = lose_then_learn(credit=True, losses=5)
    assert sim.lost == 5 and sim.version == 10
    assert max(sim.staleness) <= 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(0, 3), st.integers(0, 2), st.data())
def test_delayed_publication_trains_every_group_of_step_k_on_exactly_k_versions_stale(
        num_generators, k, extra_groups, data):
    # train.fixed_staleness=k: the throttle at max_staleness=k, the queue's shares, and the learner
    # publishing version v - k at version v (asyncgrpo/learner/publication.py).
    cfg = load([f"rollout.num_generators={num_generators}", f"train.groups_per_step={num_generators + extra_groups}",
                "queue.capacity_groups=64", f"train.fixed_staleness={k}"])
    assert cfg.train.max_staleness == k
    sim = Simulation(groups_per_generator(cfg), cfg.train.max_staleness, shares=True, publish_delay=k)
    for _ in range(200):
        action, i = data.draw(st.sampled_from(sim.actions()))
        sim.do(action, i)
        assert len(sim.actions()) > 1 or sim.queue.depth >= sim.steps_per_take  # no deadlock
    # Step u >= k: exactly k. The warm-up (u < k) is sampled by the starting weights: staleness u.
    assert all(s == (k if u >= k else u) for u, s in sim.trained), sim.trained
    accounted = sum(g.sent for g in sim.generators)
    assert accounted == sim.version * sim.steps_per_take + sim.queue.depth


def test_a_generator_as_fast_as_allowed_warms_up_for_k_steps_then_stays_exactly_k_stale():
    sim = Simulation([2], max_staleness=2, shares=True, publish_delay=2)
    for _ in range(30):
        # Everything the generator may do (load, start, finish) before each step.
        while moves := [(a, i) for a, i in sim.actions() if a in ("start", "finish", "load")]:
            sim.do(*moves[0])
        assert sim.do("learn", -1)
    assert [s for _, s in sim.trained] == [0, 0, 1, 1] + [2] * (2 * 30 - 4)
    # Beyond the warm-up it can never start a group of a step the learner has not reached: the
    # 30 steps taken are all it started. Generation and training alternate.
    assert sim.generators[0].started == 2 * 30 and sim.queue.depth == 0


def run_scenario(shares: bool) -> list[int]:
    """Two generators, one group each per step, max_staleness 1: generator 1 starts two groups with
    the first weights and is slow; generator 0 is fast."""
    sim = Simulation([1, 1], max_staleness=1, shares=shares)
    script = [("start", 1), ("start", 1), ("start", 0), ("start", 0), ("finish", 0), ("finish", 0), ("learn", -1),
              ("load", 0), ("start", 0), ("finish", 0), ("finish", 1), ("learn", -1),
              ("load", 0), ("start", 0), ("finish", 0), ("finish", 1), ("learn", -1)]
    for action, i in script:
        if (action, i) in sim.actions():
            sim.do(action, i)
    while sim.do("learn", -1):
        pass
    return sim.staleness


def test_first_come_first_served_would_train_a_slow_generators_group_beyond_the_bound():
    # What the throttle alone allowed before shares: 2 versions stale at max_staleness=1.
    assert max(run_scenario(shares=False)) == 2


def test_taking_each_generators_share_keeps_the_same_schedule_within_the_bound():
    staleness = run_scenario(shares=True)
    assert staleness and max(staleness) <= 1


def test_the_queue_must_hold_max_staleness_plus_one_steps_with_several_throttled_generators():
    with pytest.raises(ConfigError, match=r"queue.capacity_groups.*>= \(train.max_staleness \+ 1\) x"):
        load(["rollout.num_generators=2", "train.max_staleness=4", "train.groups_per_step=16",
              "queue.capacity_groups=64"])
    load(["rollout.num_generators=2", "train.max_staleness=4", "train.groups_per_step=16", "queue.capacity_groups=80"])
    load(["rollout.num_generators=1", "train.max_staleness=4", "train.groups_per_step=16", "queue.capacity_groups=64"])


def test_a_group_from_a_generator_the_run_does_not_have_is_rejected_not_held():
    queue = ReplayQueue(None, 4, StalenessEviction(1, drop_stale=False, full_policy="block"), limits=None,
                        shares=[1, 1])
    queue.put(group(7, 0, 0))
    assert queue.depth == 0
    assert queue.stats()["wire/rejected/unknown_generator"] == 1


def test_a_take_with_shares_is_one_whole_step():
    queue = ReplayQueue(None, 4, StalenessEviction(1, drop_stale=False, full_policy="block"), limits=None,
                        shares=[1, 1])
    for seq in range(2):
        queue.put(group(0, seq, 0))
    with pytest.raises(QueueTimeout):  # generator 1's share has not come
        queue.take(2, 0, timeout_s=0.0)
    queue.put(group(1, 0, 0))
    batch = queue.take(2, 0, timeout_s=0.0)
    assert [(b.generator_id, b.seq) for b in batch] == [(0, 0), (1, 0)]
    assert queue.depth == 1  # generator 0's second group waits for the next step
    with pytest.raises(ValueError, match="one step of 2 groups"):
        queue.take(1, 1, timeout_s=0.0)
