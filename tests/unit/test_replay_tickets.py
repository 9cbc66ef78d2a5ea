"""The replay queue with its dispatcher: ticket requests answered in order with the
groups, steps taken in slot order whoever filled them, exact accounting through deaths, losses,
stale drops and a checkpoint."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.runtime import faults
from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.queue.sources import QueueTimeout
from asyncgrpo.wire import (
    Grant,
    ScoredGroup,
    TicketRequest,
    example_group,
    holder_identity,
)

ACCOUNTING_KEYS = ("queue/consumed", "queue/dropped_stale", "queue/dropped_unheld", "queue/depth")


class Grants:
    """Stands in for the GrantRouter: records what each generator process was answered."""

    def __init__(self) -> None:
        self.sent: dict[bytes, list[Grant]] = {}

    def send_to(self, identity: bytes, grant: Grant) -> bool:
        self.sent.setdefault(identity, []).append(grant)
        return True


class Gen:
    """One generator process talking to the queue as the real one does (rollout/tickets.py)."""

    def __init__(self, queue: ReplayQueue, grants: Grants, generator_id: int, incarnation: int = 0) -> None:
        self.queue, self.grants, self.id, self.incarnation = queue, grants, generator_id, incarnation
        self.request = self.newest_grant = self.seq = 0
        self.unsent: dict[int, int] = {}  # slot -> position

    def ask(self, version: int, wanted: int) -> list[tuple[int, int]]:
        self.request += 1
        self.queue.put(TicketRequest(self.id, self.incarnation, self.request, version, wanted, self.newest_grant,
                                     sorted(self.unsent.values())))
        answer = self.grants.sent[holder_identity(self.id, self.incarnation)][-1]
        assert answer.request == self.request
        if answer.slots:
            self.newest_grant = answer.grant
            self.unsent.update(zip(answer.slots, answer.positions))
        return list(zip(answer.slots, answer.positions))

    def send(self, slot: int, version: int, lose: bool = False) -> ScoredGroup:
        position = self.unsent.pop(slot)
        g = example_group(num_samples=2, tokens_per_sample=3, seed=position)
        g.generator_id, g.incarnation, g.seq, g.pos = self.id, self.incarnation, self.seq, position
        g.versions[:] = version
        self.seq += 1
        if not lose:
            self.queue.put(g)
        return g


def tickets_queue(groups_per_step: int = 4, max_staleness: int = 1, capacity: int = 16, throttle: bool = True,
                  drop_stale: bool = True) -> tuple[ReplayQueue, Grants]:
    grants = Grants()
    dispatcher = Dispatcher(groups_per_step, max_staleness, throttle=throttle, capacity_groups=capacity)
    queue = ReplayQueue(None, capacity, StalenessEviction(max_staleness, drop_stale=drop_stale),
                        limits=None, dispatcher=dispatcher, grants=grants)
    return queue, grants


def assert_accounted(queue: ReplayQueue) -> dict[str, float]:
    stats = queue.stats()
    assert stats["queue/received"] == sum(stats[key] for key in ACCOUNTING_KEYS), stats
    return stats


def test_a_fast_generator_fills_most_of_a_step_and_the_take_is_in_slot_order():
    queue, grants = tickets_queue(groups_per_step=4, max_staleness=0)
    fast, slow = Gen(queue, grants, 0), Gen(queue, grants, 1)
    assert fast.ask(0, 3) == [(0, 0), (1, 1), (2, 2)]
    assert slow.ask(0, 3) == [(3, 3)]  # the bound at max_staleness 0: one step's slots only
    for slot in (2, 0, 1):
        fast.send(slot, version=0)
    with pytest.raises(QueueTimeout, match=r"misses slots \[3\]"):
        queue.take(4, learner_version=0, timeout_s=0.05)
    slow.send(3, version=0)
    batch = queue.take(4, learner_version=0, timeout_s=1)
    assert [(g.generator_id, g.pos) for g in batch] == [(0, 0), (0, 1), (0, 2), (1, 3)]
    assert assert_accounted(queue)["queue/consumed"] == 4


def test_a_dead_generators_slots_go_to_the_next_asker_and_its_late_group_is_counted_unheld():
    queue, grants = tickets_queue(groups_per_step=2, max_staleness=0)
    doomed, other = Gen(queue, grants, 0), Gen(queue, grants, 1)
    assert doomed.ask(0, 2) == [(0, 0), (1, 1)]
    doomed.send(0, version=0)  # queued before the death: it keeps its slot
    late = doomed.send(1, version=0, lose=True)  # still on its way when the driver notices the death
    queue.generator_down(0)
    assert other.ask(0, 2) == [(1, 1)]  # the prompt is given again with the slot
    queue.put(late)
    assert assert_accounted(queue)["queue/dropped_unheld"] == 1
    other.send(1, version=0)
    assert [(g.generator_id, g.pos) for g in queue.take(2, 0, timeout_s=1)] == [(0, 0), (1, 1)]


def test_a_group_lost_in_transit_is_granted_again_once_its_sender_asks_again():
    queue, grants = tickets_queue(groups_per_step=2, max_staleness=0)
    gen = Gen(queue, grants, 0)
    gen.ask(0, 2)
    gen.send(0, version=0)
    gen.send(1, version=0, lose=True)
    assert gen.ask(0, 2) == [(1, 1)]  # its report (slot 1 neither unsent nor arrived) came first
    gen.send(1, version=0)
    assert len(queue.take(2, 0, timeout_s=1)) == 2
    assert queue.stats()["dispatch/lost"] == 1


def test_without_the_throttle_a_too_stale_group_is_dropped_and_its_slot_granted_again():
    queue, grants = tickets_queue(groups_per_step=1, max_staleness=0, throttle=False, capacity=4)
    gen = Gen(queue, grants, 0)
    assert gen.ask(0, 2) == [(0, 0), (1, 1)]
    gen.send(0, version=0)
    gen.send(1, version=0)
    assert len(queue.take(1, 0, timeout_s=1)) == 1
    with pytest.raises(QueueTimeout):  # slot 1's group is one version too stale at version 1
        queue.take(1, 1, timeout_s=0.05)
    assert gen.ask(1, 1) == [(1, 2)]  # the slot again, with a new prompt (a stale group is dropped for what it is)
    gen.send(1, version=1)
    assert queue.take(1, 1, timeout_s=1)[0].pos == 2
    assert assert_accounted(queue)["queue/dropped_stale"] == 1


def test_a_checkpoint_resumes_at_the_next_step_giving_the_untrained_prompts_first():
    queue, grants = tickets_queue(groups_per_step=2, max_staleness=1)
    gen = Gen(queue, grants, 0)
    gen.ask(0, 4)
    for slot in range(3):
        gen.send(slot, version=0)
    queue.take(2, 0, timeout_s=1)
    state = queue.state_dict()
    resumed, resumed_grants = tickets_queue(groups_per_step=2, max_staleness=1)
    resumed.load_state_dict(state)
    assert Gen(resumed, resumed_grants, 0).ask(1, 4) == [(2, 2), (3, 3), (4, 4), (5, 5)]
    with pytest.raises(ValueError, match="written under the shares dispatch, which was removed"):
        resumed.load_state_dict({"counters": {}})


def test_the_learner_and_the_dispatcher_must_agree_on_the_step():
    queue, _ = tickets_queue(groups_per_step=2)
    with pytest.raises(RuntimeError, match="dispatcher is at step 0"):
        queue.take(2, learner_version=3, timeout_s=0.01)
    with pytest.raises(ValueError, match="one step of 2 groups"):
        queue.take(1, learner_version=0, timeout_s=0.01)


def test_after_a_reported_death_a_late_request_of_the_dead_process_is_refused_and_its_slots_go_to_the_living():
    queue, grants = tickets_queue(groups_per_step=2, max_staleness=0)
    doomed, other = Gen(queue, grants, 0), Gen(queue, grants, 1)
    assert doomed.ask(0, 2) == [(0, 0), (1, 1)]
    queue.generator_down(0)
    # A request the dead process sent before it died, read after the driver's report: were it granted,
    # the step would wait for the dead process's slots until its successor's first request.
    assert doomed.ask(0, 2) == []
    assert other.ask(0, 2) == [(0, 0), (1, 1)]
    for slot in (0, 1):
        other.send(slot, version=0)
    assert [(g.generator_id, g.pos) for g in queue.take(2, 0, timeout_s=1)] == [(1, 0), (1, 1)]
    assert queue.stats()["dispatch/stale_requests"] == 1


def test_a_reported_death_refuses_a_restarted_process_that_died_before_its_first_request_was_read():
    queue, grants = tickets_queue(groups_per_step=2, max_staleness=0)
    queue.generator_down(0)
    queue.rejoin(0, 1)
    queue.generator_down(0)  # incarnation 1 died too, its first request still on its way
    assert Gen(queue, grants, 0, incarnation=1).ask(0, 2) == []
    assert Gen(queue, grants, 0, incarnation=2).ask(0, 2) == [(0, 0), (1, 1)]


def test_failpoint_grant_drop_every_loses_every_nth_answer_carrying_tickets(monkeypatch):
    monkeypatch.setenv(faults.ENV, json.dumps({"grant_drop_every": 2}))
    queue, grants = tickets_queue(groups_per_step=2, max_staleness=0)
    queue.put(TicketRequest(0, 0, 1, 0, 1, 0, []))  # grant 1: slot 0, answered
    queue.put(TicketRequest(0, 0, 2, 0, 1, 1, [0]))  # grant 2: slot 1, the answer lost
    queue.put(TicketRequest(0, 0, 3, 0, 1, 1, [0]))  # grant 2 reported unreceived: slot 1 again
    queue.put(TicketRequest(0, 0, 4, 0, 1, 3, [0, 1]))  # nothing left within the bound: an empty answer
    answers = grants.sent[holder_identity(0, 0)]
    assert [(a.request, a.slots, a.positions) for a in answers] == [(1, [0], [0]), (3, [1], [1]), (4, [], [])]
    assert queue.stats()["dispatch/unreceived"] == 1


def test_grants_without_a_dispatcher_are_refused_not_dropped():
    with pytest.raises(ValueError, match="grants without a dispatcher"):
        ReplayQueue(None, 4, StalenessEviction(0, drop_stale=True), limits=None, grants=Grants())
