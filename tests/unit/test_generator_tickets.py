"""A generator against the real queue and dispatcher in process: it
generates exactly the slots it is granted, with the prompts of the run's one stream at the granted
positions, within the staleness bound, and reports what it gives back."""

from __future__ import annotations

import itertools
import time

import pytest
from test_generator import (
    TASK,
    TOKENIZER,
    AddingEngine,
    FlakyTask,
    Mailbox,
    PushesWhileWaiting,
    config,
    spec_on_fakes,
)

from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.rewards.scorer import Scorer
from asyncgrpo.rollout.generator import Generator
from asyncgrpo.rollout.parts import GeneratorParts, episode_settings
from asyncgrpo.rollout.tickets import PositionedPrompts, TicketClient
from asyncgrpo.wire import ScoredGroup, WireTimeout


class QueueSink:
    """The groups socket, delivering in order straight into the queue."""

    def __init__(self, queue: ReplayQueue) -> None:
        self.queue, self.sent = queue, []

    def try_send(self, message, timeout_s: float) -> bool:
        self.sent.append(message)
        self.queue.put(message)
        return True

    def close(self) -> None:
        pass


def ticketed(groups_per_step: int, max_staleness: int, versions: int, task=TASK, on_error: str = "zero"):
    cfg = config(train={"max_staleness": max_staleness, "groups_per_step": groups_per_step},
                 rollout={"groups_per_call": 3}, reward={"on_error": on_error})
    mailbox = Mailbox()
    queue = ReplayQueue(None, 64, StalenessEviction(max_staleness, drop_stale=True), limits=None,
                        dispatcher=Dispatcher(groups_per_step, max_staleness, capacity_groups=64), grants=mailbox)
    sink = QueueSink(queue)
    generator = Generator(cfg, spec_on_fakes(cfg, quota=3), GeneratorParts(
        engine=AddingEngine(), tokenizer=TOKENIZER, task=task, scorer=Scorer(task, cfg.reward), sink=sink,
        weights=PushesWhileWaiting(versions), tickets=TicketClient(sink, mailbox, 0, 0),
        positioned=PositionedPrompts(lambda: task.train_problems(seed=0)), env=None,
        episode_settings=episode_settings(cfg), wait_timeout_s=cfg.wire.timeout_s))
    return generator, queue, sink


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_generator_fills_the_granted_slots_with_their_prompts_within_the_bound(max_staleness):
    generator, queue, sink = ticketed(groups_per_step=2, max_staleness=max_staleness, versions=3)
    stats = generator.run()
    groups = [m for m in sink.sent if isinstance(m, ScoredGroup)]
    # Weights 0..3 were held in turn: slots below (3 + max_staleness + 1) * 2 were granted, no more.
    assert len(groups) == stats["gen/groups_sent"] == (3 + max_staleness + 1) * 2
    stream = list(itertools.islice(TASK.train_problems(seed=0), len(groups)))
    assert [g.prompt_id for g in groups] == [p.id for p in stream]  # the run's one stream, in order
    assert [g.pos for g in groups] == list(range(len(groups)))
    for group in groups:  # slot = position here (one generator, nothing given again)
        assert group.pos // 2 - group.version_min <= max_staleness
    assert queue.depth == len(groups) and queue.stats()["queue/dropped_unheld"] == 0
    assert stats["gen/throttled_waits"] >= 4


def test_a_group_whose_rewards_failed_gives_its_slot_back_for_another_prompt():
    flaky = FlakyTask(num_digits=TASK.num_digits, eval_size=TASK.eval_size)
    generator, queue, sink = ticketed(groups_per_step=3, max_staleness=0, versions=1, task=flaky, on_error="drop_group")
    generator.run()
    groups = [m for m in sink.sent if isinstance(m, ScoredGroup)]
    counts = queue.stats()
    assert counts["dispatch/released"] >= 1  # given back with the next request
    # Every slot of steps 0 and 1 ends filled, some by a later prompt than its first.
    assert set(queue.tickets.filled) == set(range(6)) and len(groups) == 6
    assert len({g.pos for g in groups}) == 6 and max(g.pos for g in groups) > 5


def refused_every_time(monkeypatch, weights_move_on: bool, timeout_s: float = 0.05):
    """A ticketed generator that is granted nothing, each wait lasting longer than wire.timeout_s;
    with `weights_move_on` each wait also loads the next version (the learner stepping)."""
    generator, _, _ = ticketed(groups_per_step=2, max_staleness=0, versions=0)
    generator.wait_limit.timeout_s = timeout_s

    def load_newest_weights(wait_s: float, in_wait: bool = False) -> bool:
        time.sleep(1.5 * timeout_s)
        if weights_move_on:
            generator.version += 1
        return weights_move_on

    monkeypatch.setattr(generator, "_load_newest_weights", load_newest_weights)
    monkeypatch.setattr(generator, "_heartbeat", lambda periodic: None)
    return generator


def test_a_generator_outpaced_to_every_slot_while_the_learner_steps_keeps_waiting(monkeypatch):
    generator = refused_every_time(monkeypatch, weights_move_on=True)
    for _ in range(6):  # 9 x wire.timeout_s without a grant, but new weights after every wait
        generator._wait_for_tickets()
    assert generator.version == 6


def test_a_generator_granted_nothing_and_no_new_weights_for_wire_timeout_fails_loudly(monkeypatch):
    generator = refused_every_time(monkeypatch, weights_move_on=False)
    with pytest.raises(WireTimeout, match="granted none"):
        for _ in range(6):
            generator._wait_for_tickets()
