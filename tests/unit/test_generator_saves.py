"""A generator's waits while learner rank 0 saves a checkpoint, on a fake clock: a notice stretches
the wait for tickets, the full queue's and the restart's waits to the save's bound; without one (a
generator that missed it) wire.timeout_s holds; past the bound the error names the save."""

from __future__ import annotations

import types
from typing import Any

import pytest
from test_generator import ListSink, config, make_generator

from asyncgrpo.rollout import channel as channel_module
from asyncgrpo.rollout import generator as generator_module
from asyncgrpo.rollout import waits as waits_module
from asyncgrpo.rollout.generator import Generator
from asyncgrpo.weights.base import SaveWatch
from asyncgrpo.wire import SaveNotice, ScoredGroup, WireTimeout, example_group

TIMEOUT_S = 2.0  # wire.timeout_s in these tests (fake seconds)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedLearner:
    """A weight receiver on the fake clock. `events`: (time, what the learner published): a
    `SaveNotice`, a version number (a push) or a string (a shutdown); a poll waits (moves the clock)
    up to its timeout for the next one."""

    delta_mismatches = 0

    def __init__(self, clock: Clock, events: list[tuple[float, Any]]) -> None:
        self.clock, self.events = clock, sorted(events, key=lambda event: event[0])
        self.saves = SaveWatch(clock)
        self.newest_version, self.arrived = 0, None
        self.shutdown_reason: str | None = None

    def rejections(self) -> tuple[int, str]:
        return 0, ""

    def poll(self, timeout_s: float = 0.0) -> bool:
        later = self.clock.now + timeout_s
        self.clock.now = min(later, max(self.clock.now, self.events[0][0])) if self.events else later
        changed = False
        while self.events and self.events[0][0] <= self.clock.now:
            _, published = self.events.pop(0)
            if isinstance(published, SaveNotice):
                self.saves.note(published)
            elif isinstance(published, int):
                self.arrived = self.newest_version = published
                changed = True
            else:
                self.shutdown_reason = published
                changed = True
        return changed

    def apply_newest(self, target) -> int | None:
        version, self.arrived = self.arrived, None
        return version

    def close(self) -> None:
        pass


class FullUntil(ListSink):
    """A queue that takes nothing before `opens_at` (fake time): a try waits out its timeout."""

    def __init__(self, clock: Clock, opens_at: float) -> None:
        super().__init__()
        self.clock, self.opens_at = clock, opens_at

    def try_send(self, message: Any, timeout_s: float) -> bool:
        if self.clock.now < self.opens_at:
            self.clock.now += timeout_s
            return False
        return super().try_send(message, timeout_s)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    # perf_counter offset: a real one is never 0, and GroupChannel.send reads 0 as "not blocked yet".
    fake_time = types.SimpleNamespace(monotonic=clock, perf_counter=lambda: clock.now + 1000.0)
    monkeypatch.setattr(generator_module, "time", fake_time)
    monkeypatch.setattr(channel_module, "time", fake_time)  # the full queue's wait (GroupChannel.send)
    monkeypatch.setattr(waits_module, "time", fake_time)  # the waits' limits (WaitLimit)
    return clock


def generator_on(clock: Clock, events: list[tuple[float, Any]], sink: ListSink | None = None) -> Generator:
    cfg = config(train={"max_staleness": 0}, wire={"timeout_s": TIMEOUT_S})
    generator = make_generator(cfg, quota=2, sink=sink)
    generator.weights = ScriptedLearner(clock, events)
    return generator


def saving(version: int, bound_s: float) -> SaveNotice:
    return SaveNotice(version, saving=True, timeout_s=bound_s)


# -------------------------------------------------------------------------- waiting for tickets


def test_a_save_notice_lets_the_wait_for_tickets_outlast_wire_timeout_and_is_logged_once(clock, capsys):
    # Granted nothing at version 0 from t=0; the save is announced at t=1 and version 1 arrives at t=20,
    # ten wire timeouts later; it ends the save, and the next wait has wire.timeout_s again.
    generator = generator_on(clock, [(1.0, saving(0, 30.0)), (20.0, 1), (21.0, "training finished")])
    stats = generator.run()
    assert stats["gen/groups_sent"] == 4 and stats["gen/version"] == 1 and clock.now == 21.0
    assert generator.weights.saves.notice is None  # version 1 ended it
    logged = [line for line in capsys.readouterr().out.splitlines() if "saving a checkpoint" in line]
    assert len(logged) == 1 and "asking for tickets with version 0: learner rank 0 granted none" in logged[0]
    assert "learner rank 0 is saving a checkpoint of version 0" in logged[0]


def test_without_a_notice_the_wait_for_tickets_fails_after_wire_timeout(clock):
    generator = generator_on(clock, [(20.0, 1)])  # the same slow learner, unannounced (a missed notice)
    with pytest.raises(WireTimeout, match=r"generator 0 \(asking for tickets with version 0\): learner rank 0 granted none for "
                                          r"\d+ s \(wire.timeout_s=2\)"):
        generator.run()
    assert TIMEOUT_S < clock.now < TIMEOUT_S + 1


def test_past_the_saves_bound_the_wait_fails_naming_the_save(clock):
    generator = generator_on(clock, [(1.0, saving(0, 5.0)), (60.0, 1)])
    with pytest.raises(WireTimeout) as raised:
        generator.run()
    message = str(raised.value)
    assert "asking for tickets with version 0" in message and "checkpoint save of version 0" in message
    assert "train.checkpoint_timeout_s" in message and "has not ended" in message
    assert 6.0 < clock.now < 7.0  # the bound counts from the announcement, at t=1


def test_after_the_save_ends_a_wait_gets_wire_timeout_from_its_end(clock):
    generator = generator_on(clock, [(1.0, saving(0, 30.0)), (10.0, SaveNotice(0, saving=False, timeout_s=0.0))])
    with pytest.raises(WireTimeout, match="checkpoint save of version 0 ended"):
        generator.run()
    assert 10.0 + TIMEOUT_S < clock.now < 10.0 + TIMEOUT_S + 1


# ------------------------------------------------------------------------------ the full queue


def test_a_save_notice_lets_a_send_on_a_full_queue_outlast_wire_timeout(clock):
    sink = FullUntil(clock, opens_at=20.0)
    generator = generator_on(clock, [(0.2, saving(0, 30.0))], sink=sink)
    generator._send(example_group())
    assert [m.seq for m in sink.of(ScoredGroup)] == [0] and clock.now >= 20.0


def test_without_a_notice_a_send_on_a_full_queue_fails_after_wire_timeout(clock):
    generator = generator_on(clock, [], sink=FullUntil(clock, opens_at=20.0))
    with pytest.raises(WireTimeout, match=r"blocked on a full queue\): the learner took no group .*wire.timeout_s=2"):
        generator._send(example_group())


# ----------------------------------------------------------------------- a restart's first weights


def test_a_save_notice_lets_a_restarted_generator_wait_for_its_version_beyond_wire_timeout(clock):
    generator = generator_on(clock, [(1.0, saving(2, 30.0)), (15.0, 3)])
    generator._wait_for_version(3)
    assert generator.version == 3 and clock.now == 15.0


def test_without_a_notice_a_restarted_generator_fails_after_wire_timeout(clock):
    generator = generator_on(clock, [(15.0, 3)])
    with pytest.raises(WireTimeout, match=r"restarted, incarnation 0, holding version 0\): weights version 3 "
                                          r"did not arrive for \d+ s \(wire.timeout_s=2\)"):
        generator._wait_for_version(3)
