"""Generator restarts and exact resume, in-process: the real `ReplayQueue` and `GeneratorRegistry`
with fake generators (prompt streams, sequence numbers, incarnations, the throttle), the learner's
waits with a fake weight sender, and the real `Generator` loop on the fakes of test_generator.py.

What they show: a restarted generator's groups are never taken for duplicates and its
predecessor's late ones are dropped; a down generator's share is lent by the others without
breaking the staleness bound or deadlocking anyone; and across crashes (resume from a checkpoint)
and restarts every prompt of each generator's stream is trained exactly once, in a prefix."""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_generator import config as generator_config
from test_generator import make_generator

from asyncgrpo.config import load
from asyncgrpo.learner.learner import Learner, wait_for_generators
from asyncgrpo.registry import GeneratorRegistry
from asyncgrpo.replay import QueueTimeout, ReplayQueue, StalenessEviction
from asyncgrpo.rollout.generator import throttle_limit
from asyncgrpo.tasks.stream import PromptStream
from asyncgrpo.wire import Heartbeat, ScoredGroup, VersionAck

ACCOUNTING_KEYS = ("queue/consumed", "queue/dropped_stale", "queue/dropped_full", "queue/dropped_restart",
                   "queue/depth")


def group(generator_id: int, seq: int, version: int = 0, *, pos: int = 0, incarnation: int = 0) -> ScoredGroup:
    tokens = np.array([5, 6], dtype=np.int32)
    return ScoredGroup(generator_id=generator_id, seq=seq, prompt_id=pos, prompt_tokens=np.array([1], dtype=np.int32),
                       tokens=tokens, logprobs=np.array([-1.0, -1.0], dtype=np.float32),
                       versions=np.full(2, version, dtype=np.int32), lengths=np.array([2], dtype=np.int32),
                       rewards=np.array([1.0], dtype=np.float32), incarnation=incarnation, pos=pos)


def queue_of(shares: list[int] | None, lend_steps: int = 0, max_staleness: int = 1,
             capacity: int = 10_000) -> ReplayQueue:
    return ReplayQueue(None, capacity, StalenessEviction(max_staleness, drop_stale=False, full_policy="block"),
                       limits=None, shares=shares, lend_steps=lend_steps)


def assert_accounted(queue: ReplayQueue) -> dict[str, float]:
    stats = queue.stats()
    assert stats["queue/received"] == sum(stats[key] for key in ACCOUNTING_KEYS), stats
    return stats


# ----------------------------------------------------------------------- the queue at a restart


def test_a_rejoin_drops_the_predecessors_queued_groups_counted_and_the_accounting_adds_up():
    queue = queue_of(None)
    for seq in range(4):
        queue.put(group(0, seq, pos=seq))
    queue.put(group(1, 0, pos=0))
    assert [g.pos for g in queue.take(2, 0, timeout_s=0)] == [0, 1]
    queue.generator_down(0)
    rejoin = queue.rejoin(0, incarnation=1, learner_version=1)
    # It continues past what was trained; positions 2 and 3 were queued, never trained: generated again.
    assert (rejoin.position, rejoin.dropped) == (2, 2)
    assert [(g.generator_id, g.pos) for g in queue.take(1, 1, timeout_s=0)] == [(1, 0)]
    queue.put(group(0, 3, pos=3))  # the dead process's last group, arriving late: dropped, counted
    queue.put(group(0, 0, pos=2, incarnation=1))  # the newcomer's first: not a duplicate of seq 0
    stats = assert_accounted(queue)
    assert (stats["queue/dropped_restart"], stats["queue/old_incarnation"], stats["queue/duplicates"]) == (2, 1, 0)
    assert [g.pos for g in queue.take(1, 2, timeout_s=0)] == [2]


def test_the_newcomer_is_counted_from_the_first_take_still_to_come():
    queue = queue_of([1])
    assert queue.rejoin(0, 1, learner_version=5).base_version == 5  # no take yet: the learner's version
    queue.put(group(0, 0, incarnation=1))
    queue.take(1, 5, timeout_s=0)
    # The learner trains on step 5, then takes at 6, whatever version it reads meanwhile.
    assert queue.rejoin(0, 2, learner_version=5).base_version == 6
    taking = threading.Thread(target=lambda: queue.take(1, 6, timeout_s=5))
    taking.start()
    time.sleep(0.2)
    assert queue.rejoin(0, 3, learner_version=6).base_version == 6  # the take in progress has popped nothing
    queue.put(group(0, 0, incarnation=3))
    taking.join()


def test_a_down_generators_share_is_lent_by_the_others_within_their_lead_then_told_back():
    # Two generators, one group each per step, max_staleness 1: each may lend one step of its share.
    queue = queue_of([1, 1], lend_steps=1)
    for seq in range(3):
        queue.put(group(0, seq, pos=seq))
    queue.put(group(1, 0, pos=0))
    queue.generator_down(1)
    # Step 0: generator 1's own queued group fills its share (it is on schedule).
    assert [(g.generator_id, g.pos) for g in queue.take(2, 0, timeout_s=0)] == [(0, 0), (1, 0)]
    # Step 1: generator 0's next group is lent for generator 1's share.
    assert [(g.generator_id, g.pos) for g in queue.take(2, 1, timeout_s=0)] == [(0, 1), (0, 2)]
    # Step 2: generator 0 has lent one step of its share: it lends no more, whatever it has queued.
    queue.put(group(0, 3, pos=3))
    queue.put(group(0, 4, pos=4))
    with pytest.raises(QueueTimeout):
        queue.take(2, 2, timeout_s=0)
    rejoin = queue.rejoin(1, incarnation=1, learner_version=2)
    assert rejoin.leads == {0: 1} and rejoin.base_version == 2 and rejoin.position == 1
    queue.put(group(1, 0, pos=1, incarnation=1))
    assert [(g.generator_id, g.pos) for g in queue.take(2, 2, timeout_s=0)] == [(0, 3), (1, 1)]
    assert_accounted(queue)


def test_with_one_generator_the_learner_waits_for_the_restart():
    queue = queue_of([2], lend_steps=1)
    queue.put(group(0, 0, pos=0))
    queue.generator_down(0)
    with pytest.raises(QueueTimeout):  # nobody to lend: the step waits for the newcomer
        queue.take(2, 0, timeout_s=0)
    rejoin = queue.rejoin(0, 1, learner_version=0)
    assert (rejoin.position, rejoin.dropped, rejoin.base_version) == (0, 1, 0)
    for seq in range(2):
        queue.put(group(0, seq, pos=seq, incarnation=1))
    assert [g.pos for g in queue.take(2, 0, timeout_s=0)] == [0, 1]


def test_a_down_generators_group_arriving_after_its_share_was_lent_is_not_trained_late():
    queue = queue_of([1, 1], lend_steps=2)
    for seq in range(3):
        queue.put(group(0, seq, pos=seq))
    queue.generator_down(1)
    queue.take(2, 0, timeout_s=0)  # generator 1's share came short: lent
    queue.put(group(1, 0, pos=0))  # its dead process's group, late: k = 0 would train at version 1 > 0 // 1
    queue.put(group(0, 3, pos=3))
    assert [(g.generator_id, g.pos) for g in queue.take(2, 1, timeout_s=0)] == [(0, 2), (0, 3)]
    assert queue.rejoin(1, 1, learner_version=2).dropped == 1  # and its prompt is generated again


# ------------------------------------------------------- staleness across restarts (simulation)


@dataclass
class SimGenerator:
    quota: int
    incarnation: int = 0
    loaded: int = 0
    started: int = 0
    lead: int = 0
    sent: int = 0
    down: bool = False
    in_flight: list[int] = field(default_factory=list)  # the weights version each group started with
    late: list[ScoredGroup] = field(default_factory=list)  # a dead process's groups still in the socket


class RestartSimulation:
    """The throttled generators of test_throttle_many_generators.py, which may also die (their
    groups in flight lost, their sent ones possibly arriving late) and rejoin as the driver brings
    them back (`ReplayQueue.rejoin`: stream position, base version, the lenders' leads)."""

    def __init__(self, quotas: list[int], max_staleness: int, max_deaths: int) -> None:
        self.max_staleness, self.max_deaths, self.deaths = max_staleness, max_deaths, 0
        self.step_groups = sum(quotas)
        self.generators = [SimGenerator(q) for q in quotas]
        # push_every_steps = 1: a generator may lend max_staleness steps of its share.
        self.queue = queue_of(quotas, lend_steps=max_staleness, max_staleness=max_staleness)
        self.version = 0
        self.staleness: list[int] = []

    def room(self, g: SimGenerator) -> int:
        return throttle_limit(self.max_staleness, g.loaded, g.quota) + g.lead - g.started

    def actions(self) -> list[tuple[str, int]]:
        possible = [("learn", -1)]
        for i, g in enumerate(self.generators):
            if g.late:
                possible.append(("late", i))
            if g.down:
                possible.append(("rejoin", i))
                continue
            if self.deaths < self.max_deaths:
                possible.append(("die", i))
            if self.room(g) > 0:
                possible.append(("start", i))
            if g.in_flight:
                possible += [("finish", i), ("give_back", i)]
            if g.loaded < self.version:
                possible.append(("load", i))
        return possible

    def do(self, action: str, i: int) -> bool:
        """Apply one action; False if the learner found no full step."""
        g = self.generators[i] if i >= 0 else None
        if action == "start":
            g.in_flight.append(g.loaded)
            g.started += 1
        elif action == "finish":
            self.queue.put(group(i, g.sent, g.in_flight.pop(0), incarnation=g.incarnation), timeout_s=0.0)
            g.sent += 1
        elif action == "give_back":
            g.in_flight.pop(0)
            g.started -= 1
        elif action == "load":
            g.loaded = self.version
        elif action == "die":  # what it had started was sent or not: either way it may still arrive, or never
            self.deaths += 1
            g.late = [group(i, g.sent + k, version, incarnation=g.incarnation) for k, version in enumerate(g.in_flight)]
            g.down, g.in_flight = True, []
            self.queue.generator_down(i)
        elif action == "late":
            self.queue.put(g.late.pop(0), timeout_s=0.0)
        elif action == "rejoin":  # the driver's restart: the newcomer loads the newest weights
            rejoin = self.queue.rejoin(i, g.incarnation + 1, self.version)
            fresh = SimGenerator(g.quota, incarnation=g.incarnation + 1, loaded=self.version,
                                 started=rejoin.base_version * g.quota, late=g.late)
            self.generators[i] = fresh
            for lender, lead in rejoin.leads.items():
                self.generators[lender].lead = lead
        else:
            try:
                batch = self.queue.take(self.step_groups, self.version, timeout_s=0.0)
            except QueueTimeout:
                return False
            self.staleness += [self.version - b.version_min for b in batch]
            self.version += 1
        return True

    def stuck(self) -> bool:
        """Nobody down, no generator can move and the learner finds no full step: a deadlock."""
        if any(g.down for g in self.generators) or any(a not in ("learn", "die") for a, _ in self.actions()):
            return False
        return not self.do("learn", -1)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(0, 3), st.integers(0, 2), st.data())
def test_across_restarts_every_trained_group_is_within_max_staleness_and_nobody_deadlocks(
        num_generators, max_staleness, extra_groups, data):
    cfg = load([f"rollout.num_generators={num_generators}", f"train.groups_per_step={num_generators + extra_groups}",
                "queue.capacity_groups=64"])
    from asyncgrpo.config import groups_per_generator

    sim = RestartSimulation(groups_per_generator(cfg), max_staleness, max_deaths=3)
    for _ in range(200):
        action, i = data.draw(st.sampled_from(sim.actions()))
        sim.do(action, i)
        assert not sim.stuck()
    assert all(0 <= s <= max_staleness for s in sim.staleness), sim.staleness
    assert_accounted(sim.queue)


def test_a_lender_told_its_lead_runs_as_far_ahead_as_before_the_restart():
    sim = RestartSimulation([1, 1], max_staleness=1, max_deaths=1)
    lender = sim.generators[0]
    for _ in range(2):  # max_staleness + 1 steps of its share ahead of the learner: the throttle's limit
        sim.do("start", 0)
        sim.do("finish", 0)
    sim.do("die", 1)
    assert sim.do("learn", -1)  # generator 0's two groups: its own share and one lent
    sim.do("load", 0)
    # Both consumed, one version on: it may start one more, one step of its share short of its lead.
    assert sim.room(lender) == 1 and sim.queue.depth == 0
    sim.do("rejoin", 1)
    assert lender.lead == 1 and sim.room(lender) == 2  # max_staleness + 1 steps ahead again


# ------------------------------------------------------- every prompt trained once (simulation)


@dataclass
class FakeProcess:
    """A generator process: its prompt stream (finite), sequence numbers, the groups it has sent
    that have not arrived yet (its socket)."""

    generator_id: int
    stream: PromptStream
    incarnation: int = 0
    seq: int = 0
    outbox: list[ScoredGroup] = field(default_factory=list)

    def produce(self) -> bool:
        problems = self.stream.take(1)
        if not problems:
            return False
        self.outbox.append(group(self.generator_id, self.seq, pos=self.stream.position - 1,
                                 incarnation=self.incarnation))
        self.seq += 1
        return True


STREAM_LENGTH = 40


def stream_at(position: int) -> PromptStream:
    stream = PromptStream(iter(range(STREAM_LENGTH)))  # the prompt at position p is prompt p
    stream.load_state_dict({"position": position})
    return stream


class ExactOnce:
    """A run that can crash (every process lost; resumed from the last checkpoint: the steps after it
    are lost with the learner's state) and whose generators can die and be restarted."""

    def __init__(self, num_generators: int, shares: bool) -> None:
        self.num_generators, self.shares = num_generators, shares
        self.trained: list[tuple[int, int]] = []  # (generator, position) of every trained group, in order
        self.checkpoint: tuple[dict, int, int] = ({}, 0, 0)  # registry state, groups trained, version
        self.start_run()

    def start_run(self) -> None:
        state, trained, version = self.checkpoint
        del self.trained[trained:]
        self.version = version
        self.queue = queue_of([1] * self.num_generators if self.shares else None, lend_steps=1)
        self.queue.registry.load_state_dict(state)
        self.processes = [FakeProcess(i, stream_at(self.queue.registry.position(i)))
                          for i in range(self.num_generators)]
        self.late: list[ScoredGroup] = []
        self.down: set[int] = set()

    def do(self, action: str, i: int) -> None:
        process = self.processes[i] if i >= 0 else None
        if action == "produce" and i not in self.down:
            process.produce()
        elif action == "deliver" and process.outbox and i not in self.down:
            self.queue.put(process.outbox.pop(0))
        elif action == "late" and self.late:
            self.queue.put(self.late.pop(0))
        elif action == "learn":
            try:
                batch = self.queue.take(self.num_generators, self.version, timeout_s=0.0)
            except QueueTimeout:
                return
            self.trained += [(g.generator_id, g.pos) for g in batch]
            self.version += 1
        elif action == "die" and i not in self.down:
            self.late += process.outbox  # sent before it died: may still arrive, before or after the rejoin
            self.down.add(i)
            self.queue.generator_down(i)
        elif action == "rejoin" and i in self.down:
            rejoin = self.queue.rejoin(i, process.incarnation + 1, self.version)
            self.processes[i] = FakeProcess(i, stream_at(rejoin.position), incarnation=process.incarnation + 1)
            self.down.discard(i)
        elif action == "checkpoint":
            self.checkpoint = (copy.deepcopy(self.queue.registry.state_dict()), len(self.trained), self.version)
        elif action == "crash":
            self.start_run()

    def check(self) -> None:
        """Per generator, the trained prompts are its stream's first ones, each once, with no gap."""
        registry: GeneratorRegistry = self.queue.registry
        for i in range(self.num_generators):
            positions = [pos for g, pos in self.trained if g == i]
            assert positions == list(range(registry.position(i))), (i, positions)


ACTIONS = ("produce", "deliver", "late", "learn", "die", "rejoin", "checkpoint", "crash")


@pytest.mark.parametrize("shares", [True, False], ids=["throttled_shares", "first_come"])
@settings(max_examples=100, deadline=None)
@given(num_generators=st.integers(1, 3), data=st.data())
def test_across_crashes_and_restarts_every_prompt_is_trained_exactly_once_in_stream_order(
        shares, num_generators, data):
    run = ExactOnce(num_generators, shares)
    weights = [8, 8, 1, 6, 1, 1, 1, 1]  # mostly traffic; now and then a death, a checkpoint, a crash
    for _ in range(300):
        action = data.draw(st.sampled_from([a for a, w in zip(ACTIONS, weights) for _ in range(w)]))
        run.do(action, data.draw(st.integers(0, num_generators - 1)))
        run.check()
    assert_accounted(run.queue)


def test_resume_trains_the_groups_queued_at_the_crash_instead_of_skipping_them():
    run = ExactOnce(num_generators=1, shares=True)
    for _ in range(5):
        run.do("produce", 0)
        run.do("deliver", 0)
    run.do("learn", -1)
    run.do("learn", -1)  # positions 0 and 1 trained; 2, 3 and 4 queued
    run.do("checkpoint", -1)
    run.do("crash", -1)
    assert run.processes[0].stream.position == 2  # not 5: the groups queued at the crash come again
    for _ in range(3):
        run.do("produce", 0)
        run.do("deliver", 0)
        run.do("learn", -1)
    assert run.trained == [(0, p) for p in range(5)]


def test_a_restarted_generator_regenerates_what_its_predecessor_left_untrained():
    run = ExactOnce(num_generators=2, shares=False)
    for _ in range(3):
        run.do("produce", 0)
    run.do("deliver", 0)
    run.do("produce", 1)
    run.do("deliver", 1)
    run.do("learn", -1)  # generator 0's position 0 and generator 1's position 0
    run.do("deliver", 0)  # position 1 queued
    run.do("die", 0)  # position 2 still in its socket
    run.do("rejoin", 0)
    run.do("late", -1)  # arrives after the rejoin: dropped
    for _ in range(2):
        run.do("produce", 0)
        run.do("deliver", 0)
    run.do("produce", 1)
    run.do("deliver", 1)
    run.do("learn", -1)
    run.do("produce", 1)
    run.do("deliver", 1)
    run.do("learn", -1)
    assert sorted(run.trained) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    stats = assert_accounted(run.queue)
    assert (stats["queue/dropped_restart"], stats["queue/old_incarnation"]) == (1, 1)


# ------------------------------------------------------------------------- the learner's waits


class RecordingSender:
    """A weight sender that counts re-publications."""

    bytes_pushed = 0

    def __init__(self) -> None:
        self.republished = 0

    def republish(self) -> None:
        self.republished += 1

    def announce(self, notice: Any) -> None:
        self.announced = notice


def learner_on(queue: ReplayQueue, timeout_s: float) -> Learner:
    cfg = load(["rollout.num_generators=1", "train.groups_per_step=2", f"wire.timeout_s={timeout_s}"])
    return Learner(cfg, policy=None, model_dir="", pad_id=0, rank=0, world_size=1, source=queue,
                   registry=queue.registry, weights=RecordingSender(), owns_process_group=False)


def test_the_learners_take_outlasts_wire_timeout_while_a_generator_restarts():
    queue = queue_of([2])
    learner = learner_on(queue, timeout_s=0.3)
    with pytest.raises(QueueTimeout, match="no full step within wire.timeout_s"):
        learner._take()  # nothing restarting: the usual timeout
    learner.generator_down(0)
    taken: list[list[ScoredGroup]] = []
    taking = threading.Thread(target=lambda: taken.append(learner._take()))
    taking.start()
    taking.join(1.5)
    assert taking.is_alive(), "the take timed out while the generator was being restarted"
    info = learner.generator_rejoined(0, incarnation=1)
    assert (info["position"], info["base_version"], info["newest_version"]) == (0, 0, 0)
    for seq in range(2):
        queue.put(group(0, seq, pos=seq, incarnation=1))
    taking.join(5)
    assert [g.pos for g in taken[0]] == [0, 1]


def test_the_newest_weights_are_published_again_until_the_rejoined_generator_acknowledges_them():
    queue = queue_of([2])
    learner = learner_on(queue, timeout_s=5)
    learner.version = learner.pushed_version = 4
    learner.generator_down(0)
    assert learner.generator_rejoined(0, incarnation=1)["newest_version"] == 4
    learner._serve_rejoins()
    learner._serve_rejoins()  # within REPUBLISH_EVERY_S: once is enough for now
    assert learner.weights.republished == 1
    learner._next_republish = 0.0
    learner._serve_rejoins()
    assert learner.weights.republished == 2
    queue.put(VersionAck(0, 4, incarnation=0))  # the dead process's: counts for nothing
    learner._next_republish = 0.0
    learner._serve_rejoins()
    assert learner.weights.republished == 3
    queue.put(Heartbeat(0, next_seq=0, version=4, incarnation=1))
    learner._next_republish = 0.0
    learner._serve_rejoins()
    assert learner.weights.republished == 3 and not learner._awaiting_weights


def test_the_acknowledgement_wait_skips_a_down_generator():
    queue = queue_of(None)
    queue.put(VersionAck(0, 5))
    queue.put(VersionAck(1, 1))  # lags: the learner at 5 with max_staleness 1 would wait for it
    queue.generator_down(1)
    looks: list[int] = []
    assert not wait_for_generators(queue.registry, queue, range(2), floor=4, groups_per_step=2, timeout_s=0.2,
                                   max_staleness=1, on_wait=lambda: looks.append(1))
    assert looks  # the learner serves rejoins while it looks


# ------------------------------------------------------------------------ the generator's side


def test_a_restarted_generator_continues_its_stream_loads_the_newest_weights_then_counts_from_the_base():
    cfg = generator_config(train={"max_staleness": 1})
    generator = make_generator(cfg, versions=4, quota=2)
    generator.incarnation = 1
    generator.rejoin(position=5, base_version=3, newest_version=4)
    stats = generator.run()
    groups = generator.sink.of(ScoredGroup)
    # Loaded 4 before anything was generated; group k counts from 3 x 2: (1 + 4 + 1) x 2 - 6 groups.
    assert all(g.version_min == 4 for g in groups) and stats["gen/version"] == 4
    assert len(groups) == throttle_limit(1, 4, 2) - 3 * 2
    assert [g.pos for g in groups] == list(range(5, 5 + len(groups)))
    assert [g.seq for g in groups] == list(range(len(groups)))
    assert {m.incarnation for m in generator.sink if isinstance(m, ScoredGroup | VersionAck | Heartbeat)} == {1}


def test_a_lead_told_to_a_running_generator_lets_it_start_as_many_more_groups():
    cfg = generator_config(train={"max_staleness": 1})
    plain = make_generator(cfg, versions=0, quota=2)
    plain.run()
    lender = make_generator(cfg, versions=0, quota=2)
    lender.extend_lead(3)
    lender.run()
    assert len(lender.sink.of(ScoredGroup)) == len(plain.sink.of(ScoredGroup)) + 3


def test_a_generator_rejoining_during_a_checkpoint_save_is_told_of_it_and_waits_as_long():
    queue = queue_of([2])
    learner = learner_on(queue, timeout_s=0.3)
    learner.version = 7
    learner.generator_down(0)
    learner._announce_save(saving=True)  # the announcement goes out before the newcomer subscribes
    save = learner.generator_rejoined(0, incarnation=1)["save"]
    assert save["version"] == 7 and 0 < save["timeout_s"] <= learner.cfg.train.checkpoint_timeout_s
    generator = make_generator(generator_config(wire={"timeout_s": 0.3}), quota=2)
    generator.rejoin(position=0, base_version=7, newest_version=7, save=save)
    started = time.monotonic()
    # Its waits may now last until the save's bound, not wire.timeout_s.
    assert generator.weights.saves.deadline(started, 0.3) >= started + save["timeout_s"] - 1.0
    learner._announce_save(saving=False)
    learner.generator_down(0)
    assert learner.generator_rejoined(0, incarnation=2)["save"] is None
