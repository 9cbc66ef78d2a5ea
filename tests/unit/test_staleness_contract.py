"""The staleness contract's moving parts, in-process: in-flight updates tag every token with the
version that sampled it, the learner waits for generators that lag, generator idle time is
attributed to steps. The engine and weight receiver are stand-ins (pure logic); the queue is real."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.config import load
from asyncgrpo.learner.intake import wait_for_generators
from asyncgrpo.queue.registry import GeneratorRegistry
from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.rollout.engine import Completion
from asyncgrpo.rollout.generator import Generator
from test_generator import make_generator
from asyncgrpo.weights.base import SaveWatch
from asyncgrpo.wire import Heartbeat, VersionAck, example_group

EOS = 2


class ScriptedEngine:
    """Sample s of prompt p samples token 100 + 10 s + i at position i, and EOS at its stop length.

    A continuation prompt is [prompt id, 0, tokens so far...]; its first token names the sample.
    Every call and load is recorded."""

    def __init__(self, stop_lengths: list[int]) -> None:
        self.stop_lengths = stop_lengths
        self.calls: list[list[list[int]]] = []
        self.loaded: list[int] = []

    def stop_at(self, prompt_id: int, sample: int) -> int:
        return self.stop_lengths[(prompt_id * 7 + sample) % len(self.stop_lengths)]

    def generate(self, prompts, *, n, max_tokens, temperature, max_tokens_per_prompt=None, seed=None):
        self.calls.append([list(p) for p in prompts])
        limits = max_tokens_per_prompt or [max_tokens] * len(prompts)
        outputs = []
        for prompt, limit in zip(prompts, limits):
            so_far = list(prompt[2:])
            group = []
            for index in range(n):
                sample = (so_far[0] - 100) // 10 if so_far else index
                stop_at = self.stop_at(prompt[0], sample)
                tokens, finished = [], False
                while len(tokens) < limit:
                    position = len(so_far) + len(tokens)
                    if position + 1 == stop_at:
                        tokens.append(EOS)
                        finished = True
                        break
                    tokens.append(100 + 10 * sample + position)
                group.append(Completion(np.asarray(tokens, dtype=np.int32),
                                        -np.ones(len(tokens), dtype=np.float32) * (len(self.loaded) + 1), finished))
            outputs.append(group)
        return outputs

    def load_weights(self, named_tensors) -> None:
        self.loaded.append(len(self.loaded))


class PushEverySegment:
    """A weight receiver on which a new version is ready before every segment after the first."""

    def __init__(self) -> None:
        self.newest_version = 0
        self.shutdown_reason = None
        self.saves = SaveWatch()

    def poll(self, timeout_s: float = 0.0) -> bool:
        return True

    def rejections(self) -> tuple[int, str]:
        return 0, ""

    def apply_newest(self, target) -> int:
        self.newest_version += 1
        target.load_weights([])
        return self.newest_version


BASE_CONFIG = load([])


class ListSink(list):
    """The generator's sink: what it sent, in order."""

    def try_send(self, message, timeout_s: float) -> bool:
        self.append(message)
        return True

    def close(self) -> None:
        pass


def generator_for(engine, **rollout) -> Generator:
    """A generator on the scripted engine (no vLLM, no sockets); these tests use only its sampling."""
    cfg = copy.deepcopy(BASE_CONFIG)
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    generator = make_generator(cfg, engine=engine, quota=cfg.train.groups_per_step, sink=ListSink())
    generator.weights = PushEverySegment()
    return generator


@settings(max_examples=40, deadline=None)
@given(stop_lengths=st.lists(st.integers(1, 7), min_size=1, max_size=5), chunk=st.integers(1, 6),
       max_new=st.integers(1, 7))
def test_inflight_updates_keep_every_token_and_tag_its_version(stop_lengths, chunk, max_new):
    samples = 3
    engine = ScriptedEngine(stop_lengths)
    generator = generator_for(engine, inflight_updates=True, inflight_chunk_tokens=chunk, max_new_tokens=max_new,
                              samples_per_prompt=samples)
    prompts = [[1, 0], [2, 0]]
    groups = generator._generate(prompts)
    for prompt, group in zip(prompts, groups):
        assert len(group) == samples
        for sample, completion in enumerate(group):
            stop_at = engine.stop_at(prompt[0], sample)
            length = min(stop_at, max_new)
            # The same tokens as one uninterrupted call: nothing lost, nothing repeated.
            expected = [100 + 10 * sample + i for i in range(length)]
            if stop_at <= max_new:
                expected[-1] = EOS
            assert completion.token_ids.tolist() == expected
            assert completion.finished == (stop_at <= max_new)
            # Token i was sampled in segment i // chunk, after that many weight loads.
            versions = completion.versions.tolist()
            assert versions == [i // chunk for i in range(length)]
            assert versions == sorted(versions)
            # Each token's log-prob comes from the call (and so the weights) that sampled it.
            assert (-completion.logprobs).tolist() == [v + 1 for v in versions]
    assert generator.version == len(engine.loaded)


@pytest.mark.parametrize("max_new", [256, 1024])
def test_inflight_updates_across_long_completions_keep_every_token_in_version_order(max_new):
    # Completions of the lengths real runs use: one stops early, one at the budget, one runs past it.
    engine = ScriptedEngine([120, max_new + 1, 2 * max_new])
    chunk = 32
    generator = generator_for(engine, inflight_updates=True, inflight_chunk_tokens=chunk, max_new_tokens=max_new,
                              samples_per_prompt=3)
    (group,) = generator._generate([[1, 0]])
    for sample, completion in enumerate(group):
        length = min(engine.stop_at(1, sample), max_new)
        assert len(completion.token_ids) == length
        assert completion.token_ids[:-1].tolist() == [100 + 10 * sample + i for i in range(length - 1)]
        assert completion.versions.tolist() == [i // chunk for i in range(length)]
    # A push per segment: ceil(max_new / chunk) - 1 weight switches inside one generation.
    assert generator.stats.inflight_switches == -(-max_new // chunk) - 1


def test_without_inflight_updates_one_call_and_one_version():
    engine = ScriptedEngine([4])
    generator = generator_for(engine, max_new_tokens=5, samples_per_prompt=2)
    groups = generator._generate([[1, 0]])
    assert len(engine.calls) == 1 and engine.loaded == []
    assert all(c.versions.tolist() == [0] * c.token_ids.size for c in groups[0])


# ------------------------------------------------------------------------- learner waits for acks


class AckWait:
    """The learner's acknowledgement wait over a real registry and queue, fed in-process."""

    def __init__(self, version: int, max_staleness: int, num_generators: int = 2, timeout_s: float = 5.0) -> None:
        self.cfg = copy.deepcopy(BASE_CONFIG)
        self.version, self.max_staleness, self.num_generators, self.timeout_s = (
            version, max_staleness, num_generators, timeout_s)
        self.queue = ReplayQueue(None, 64, StalenessEviction(max_staleness, drop_stale=True), limits=None)
        self.ack_waits = 0

    def __call__(self) -> None:
        if wait_for_generators(self.queue.registry, self.queue, range(self.num_generators), self.version,
                               self.max_staleness, self.cfg.train.groups_per_step, self.timeout_s):
            self.ack_waits += 1


def learner_stub(version: int, max_staleness: int, num_generators: int = 2, timeout_s: float = 5.0):
    wait = AckWait(version, max_staleness, num_generators, timeout_s)
    return wait, wait


def test_no_wait_while_generators_are_within_the_bound():
    stub, wait = learner_stub(version=5, max_staleness=2)
    stub.queue.put(VersionAck(0, 3))
    stub.queue.put(VersionAck(1, 4))
    wait()
    assert stub.ack_waits == 0


def test_learner_waits_for_a_lagging_generator_then_continues():
    stub, wait = learner_stub(version=5, max_staleness=2)
    stub.queue.put(VersionAck(0, 5))
    stub.queue.put(VersionAck(1, 2))  # lags by 3 > 2
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (wait(), done.set()))
    waiter.start()
    assert not done.wait(0.3), "the learner must hold while generator 1 lags"
    stub.queue.put(VersionAck(1, 3))
    assert done.wait(5.0)
    waiter.join()
    assert stub.ack_waits == 1


def test_synchronous_mode_waits_for_the_current_version():
    stub, wait = learner_stub(version=3, max_staleness=0, num_generators=1, timeout_s=0.3)
    stub.queue.put(VersionAck(0, 2))
    with pytest.raises(TimeoutError, match=r"load version >= 3 .*\{0: 2\}"):
        wait()


def test_a_generator_never_heard_from_counts_as_lagging():
    stub, wait = learner_stub(version=4, max_staleness=1, num_generators=2, timeout_s=0.2)
    stub.queue.put(VersionAck(0, 4))
    with pytest.raises(TimeoutError, match=r"\{1: -1\}"):
        wait()


def test_a_heartbeat_makes_good_an_acknowledgement_that_was_dropped():
    stub, wait = learner_stub(version=5, max_staleness=2, num_generators=1, timeout_s=5.0)
    stub.queue.put(Heartbeat(generator_id=0, next_seq=0, version=3))
    wait()
    assert stub.ack_waits == 0


def test_a_full_step_already_queued_is_trained_without_waiting_for_acks():
    # Without the throttle (stale_policy=drop) a generator blocked on a full queue cannot deliver
    # its acknowledgement until the learner takes: waiting for it would deadlock.
    stub, wait = learner_stub(version=6, max_staleness=1, num_generators=1, timeout_s=0.3)
    stub.queue.put(VersionAck(0, 2))
    with pytest.raises(TimeoutError):
        wait()
    for seq in range(stub.cfg.train.groups_per_step):
        g = example_group(2, 4)
        g.generator_id, g.seq = 0, seq
        g.versions[:] = 5
        stub.queue.put(g)
    wait()


def test_early_steps_need_no_acknowledgement():
    stub, wait = learner_stub(version=2, max_staleness=2, timeout_s=0.1)
    wait()
    assert stub.ack_waits == 0


# --------------------------------------------------------------------- generator idle attribution


def test_generator_reports_are_attributed_once_per_step():
    registry = GeneratorRegistry()

    def beat(generator_id: int, idle: float, errors: int = 0, dropped: int = 0, calls: int = 0) -> None:
        registry.on_heartbeat(Heartbeat(generator_id, next_seq=0, version=0, idle_s=idle, reward_errors=errors,
                                        groups_dropped=dropped, reward_calls=calls))

    beat(0, 1.0), beat(0, 1.5, errors=2, calls=16), beat(1, 0.25, calls=8)
    assert registry.report_increments() == pytest.approx(
        {"time/gen_idle_s": 1.75, "reward/errors": 2, "reward/groups_dropped": 0, "reward/calls": 24})
    # A report older than the newest seen (reordered) adds nothing; new counts add only the
    # difference, including errors of groups the reward policy dropped (they never reach the learner).
    beat(0, 1.2), beat(0, 2.0, errors=5, dropped=1, calls=32), beat(1, 0.25, calls=8)
    assert registry.report_increments() == pytest.approx(
        {"time/gen_idle_s": 0.5, "reward/errors": 3, "reward/groups_dropped": 1, "reward/calls": 16})
    beat(1, 0.25, calls=8)
    assert registry.report_increments() == {"time/gen_idle_s": 0.0, "reward/errors": 0.0,
                                            "reward/groups_dropped": 0.0, "reward/calls": 0.0}
