"""Generator restarts, in-process: the learner's waits over the real `ReplayQueue` and
`GeneratorRegistry` with a fake weight sender, and the real `Generator` loop on the fakes of
test_generator.py. Under tickets nothing is lent, counted or dropped at a rejoin (the dispatcher's
side of a death is in tests/unit/test_dispatch.py): a restarted generator loads the newest weights,
then asks."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from test_generator import config as generator_config
from test_generator import make_generator

from asyncgrpo.config import load
from asyncgrpo.learner.intake import wait_for_generators
from asyncgrpo.learner.learner import Learner
from asyncgrpo.learner.parts import outside_sections
from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.queue.sources import QueueTimeout
from asyncgrpo.wire import Heartbeat, ScoredGroup, VersionAck


def group(generator_id: int, seq: int, version: int = 0, *, pos: int = 0, incarnation: int = 0) -> ScoredGroup:
    tokens = np.array([5, 6], dtype=np.int32)
    return ScoredGroup(generator_id=generator_id, seq=seq, prompt_id=pos, prompt_tokens=np.array([1], dtype=np.int32),
                       tokens=tokens, logprobs=np.array([-1.0, -1.0], dtype=np.float32),
                       versions=np.full(2, version, dtype=np.int32), lengths=np.array([2], dtype=np.int32),
                       rewards=np.array([1.0], dtype=np.float32), incarnation=incarnation, pos=pos)


def queue_of(max_staleness: int = 1) -> ReplayQueue:
    """A queue fed in-process in arrival order (no dispatcher): the learner's waits are under test."""
    return ReplayQueue(None, 10_000, StalenessEviction(max_staleness, drop_stale=False), limits=None)


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
                   registry=queue.registry, weights=RecordingSender(), owns_process_group=False,
                   **outside_sections(cfg))


def test_the_learners_take_outlasts_wire_timeout_while_a_generator_restarts():
    queue = queue_of()
    learner = learner_on(queue, timeout_s=0.3)
    with pytest.raises(QueueTimeout, match="no full step within wire.timeout_s"):
        learner.intake.take(learner.version)  # nothing restarting: the usual timeout
    learner.generator_down(0)
    taken: list[list[ScoredGroup]] = []
    taking = threading.Thread(target=lambda: taken.append(learner.intake.take(learner.version)))
    taking.start()
    taking.join(1.5)
    assert taking.is_alive(), "the take timed out while the generator was being restarted"
    assert learner.generator_rejoined(0, incarnation=1)["newest_version"] == 0
    for seq in range(2):
        queue.put(group(0, seq, pos=seq, incarnation=1))
    taking.join(5)
    assert [g.pos for g in taken[0]] == [0, 1]


def test_the_newest_weights_are_published_again_until_the_rejoined_generator_acknowledges_them():
    queue = queue_of()
    learner = learner_on(queue, timeout_s=5)
    learner.version = learner.publisher.pushed_version = 4
    learner.generator_down(0)
    assert learner.generator_rejoined(0, incarnation=1)["newest_version"] == 4
    learner.intake.rejoins.serve()
    learner.intake.rejoins.serve()  # within REPUBLISH_EVERY_S: once is enough for now
    assert learner.weights.republished == 1
    learner.intake.rejoins.next_republish = 0.0
    learner.intake.rejoins.serve()
    assert learner.weights.republished == 2
    queue.put(VersionAck(0, 4, incarnation=0))  # the dead process's: counts for nothing
    learner.intake.rejoins.next_republish = 0.0
    learner.intake.rejoins.serve()
    assert learner.weights.republished == 3
    queue.put(Heartbeat(0, next_seq=0, version=4, incarnation=1))
    learner.intake.rejoins.next_republish = 0.0
    learner.intake.rejoins.serve()
    assert learner.weights.republished == 3 and not learner.intake.rejoins.awaiting


def test_the_acknowledgement_wait_skips_a_down_generator():
    queue = queue_of()
    queue.put(VersionAck(0, 5))
    queue.put(VersionAck(1, 1))  # lags: the learner at 5 with a lag bound of 1 would wait for it
    queue.generator_down(1)
    looks: list[int] = []
    assert not wait_for_generators(queue.registry, queue, range(2), version=5, lag_bound=1, groups_per_step=2,
                                   timeout_s=0.2, on_wait=lambda: looks.append(1))
    assert looks  # the learner serves rejoins while it looks


# ------------------------------------------------------------------------ the generator's side


def test_a_restarted_generator_loads_the_newest_weights_before_generating_then_asks():
    cfg = generator_config(train={"max_staleness": 1})
    generator = make_generator(cfg, versions=4, quota=2, incarnation=1)
    generator.rejoin(newest_version=4)
    stats = generator.run()
    groups = generator.sink.of(ScoredGroup)
    # Loaded 4 before anything was generated; then granted every slot the bound allows weights 4.
    assert groups and all(g.version_min == 4 for g in groups) and stats["gen/version"] == 4
    assert len(groups) == (1 + 4 + 1) * 2
    assert [g.seq for g in groups] == list(range(len(groups)))
    assert {m.incarnation for m in generator.sink if isinstance(m, ScoredGroup | VersionAck | Heartbeat)} == {1}


def test_a_generator_rejoining_during_a_checkpoint_save_is_told_of_it_and_waits_as_long():
    queue = queue_of()
    learner = learner_on(queue, timeout_s=0.3)
    learner.version = 7
    learner.generator_down(0)
    learner._announce_save(saving=True)  # the announcement goes out before the newcomer subscribes
    save = learner.generator_rejoined(0, incarnation=1)["save"]
    assert save["version"] == 7 and 0 < save["timeout_s"] <= learner.cfg.train.checkpoint_timeout_s
    generator = make_generator(generator_config(wire={"timeout_s": 0.3}), quota=2)
    generator.rejoin(newest_version=7, save=save)
    started = time.monotonic()
    # Its waits may now last until the save's bound, not wire.timeout_s.
    assert generator.weights.saves.deadline(started, 0.3) >= started + save["timeout_s"] - 1.0
    learner._announce_save(saving=False)
    learner.generator_down(0)
    assert learner.generator_rejoined(0, incarnation=2)["save"] is None
