"""The staleness contract's moving parts, in-process: in-flight loads between engine steps tag every
token with the version that sampled it, the learner waits for generators that lag, generator idle time is
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
from asyncgrpo.contract import Ticket
from asyncgrpo.rollout.engine import Completion, FinishedGroup
from asyncgrpo.rollout.generator import Generator
from test_generator import make_generator
from asyncgrpo.weights.base import SaveWatch
from asyncgrpo.wire import Heartbeat, VersionAck, example_group

EOS = 2


class ScriptedEngine:
    """Sample s of a prompt samples token 100 + 10 s + i at position i, and EOS at its stop length
    (`stop_at`, from the prompt's first token). Each engine step decodes one token of every running
    sample, labelled with the version loaded then, its log-prob -(weight loads so far + 1), as if
    the weights changed the distribution; a group finishes when all its samples have."""

    weight_load_path = "scripted"

    def __init__(self, stop_lengths: list[int]) -> None:
        self.stop_lengths = stop_lengths
        self.loaded: list[int] = []
        self.version = 0
        self.requests: dict[str, dict] = {}

    def stop_at(self, prompt_id: int, sample: int) -> int:
        return self.stop_lengths[(prompt_id * 7 + sample) % len(self.stop_lengths)]

    @property
    def running_sequences(self) -> int:
        return sum(len(r["samples"]) for r in self.requests.values())

    def submit(self, request_id, prompt, *, n, max_tokens, temperature, stop=()) -> None:
        self.requests[request_id] = {"prompt_id": prompt[0], "max_tokens": max_tokens,
                                     "samples": [{"tokens": [], "logprobs": [], "versions": [], "done": False,
                                                  "finished": False} for _ in range(n)]}

    def step(self) -> list[FinishedGroup]:
        finished = []
        for request_id, request in list(self.requests.items()):
            for index, sample in enumerate(request["samples"]):
                if sample["done"]:
                    continue
                position = len(sample["tokens"])
                stops = position + 1 == self.stop_at(request["prompt_id"], index)
                sample["tokens"].append(EOS if stops else 100 + 10 * index + position)
                sample["logprobs"].append(-(len(self.loaded) + 1.0))
                sample["versions"].append(self.version)
                sample["finished"] = stops
                sample["done"] = stops or len(sample["tokens"]) == request["max_tokens"]
            if all(sample["done"] for sample in request["samples"]):
                del self.requests[request_id]
                finished.append(FinishedGroup(request_id, [
                    Completion(np.asarray(x["tokens"], np.int32), np.asarray(x["logprobs"], np.float32), x["finished"],
                               np.asarray(x["versions"], np.int32)) for x in request["samples"]]))
        return finished

    def abort(self, request_ids=None) -> list[str]:
        aborted = [r for r in self.requests if request_ids is None or r in request_ids]
        for request_id in aborted:
            del self.requests[request_id]
        return aborted

    def label_version(self, version: int) -> None:
        self.version = version

    def load_weights(self, named_tensors) -> None:
        self.loaded.append(len(self.loaded))


class PushBeforeEveryStep:
    """A weight receiver on which a new version is ready whenever the generator looks."""

    delta_mismatches = 0

    def __init__(self) -> None:
        self.newest_version = 0
        self.shutdown_reason = None
        self.saves = SaveWatch()

    def poll(self, timeout_s: float = 0.0) -> bool:
        self.newest_version += 1
        return True

    def rejections(self) -> tuple[int, str]:
        return 0, ""

    def apply_newest(self, target) -> int:
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
    """A generator on the scripted engine (no vLLM, no sockets); these tests drive its admission
    and engine steps directly."""
    cfg = copy.deepcopy(BASE_CONFIG)
    cfg.model.max_positions = 1024  # room for the long completions: the budget is max_new_tokens alone
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    generator = make_generator(cfg, engine=engine, quota=cfg.train.groups_per_step, sink=ListSink())
    generator.weights = PushBeforeEveryStep()
    return generator


def generate(generator: Generator, groups: int) -> list[tuple]:
    """Admit `groups` prompts, then run engine steps (loading weights between them, as the loop
    does) until all have finished; the finished (admitted, completions), in finishing order."""
    for position in range(groups):
        generator._submit(Ticket(position, position))
    finished = []
    while generator.episodes:
        generator._load_newest_weights(wait_s=0.0)
        generator._step_paced()
        finished += [(group.admitted, [episode.as_completion() for episode in group.episodes])
                     for group in generator.episodes.take_finished()]
    return finished


@settings(max_examples=40, deadline=None)
@given(stop_lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), max_new=st.integers(1, 9))
def test_inflight_updates_keep_every_token_and_tag_the_version_that_sampled_it(stop_lengths, max_new):
    samples = 3
    engine = ScriptedEngine(stop_lengths)
    generator = generator_for(engine, inflight_updates=True, max_new_tokens=max_new, samples_per_prompt=samples)
    for admitted, group in generate(generator, groups=2):
        assert len(group) == samples
        for sample, completion in enumerate(group):
            stop_at = engine.stop_at(admitted.prompt[0], sample)
            length = min(stop_at, max_new)
            # The same tokens as one uninterrupted generation: nothing lost, nothing repeated.
            expected = [100 + 10 * sample + i for i in range(length)]
            if stop_at <= max_new:
                expected[-1] = EOS
            assert completion.token_ids.tolist() == expected
            assert completion.finished == (stop_at <= max_new)
            # A push before every step: token i was sampled after i + 1 loads, by version i + 1.
            versions = completion.versions.tolist()
            assert versions == [i + 1 for i in range(length)]
            # Each token's log-prob comes from the weights that sampled it.
            assert (-completion.logprobs).tolist() == [v + 1 for v in versions]
            assert admitted.version == 0 <= min(versions)  # the admission version bounds the oldest token
    assert generator.version == len(engine.loaded) == generator.stats.weight_loads
    # Every load but the first came while sequences ran, each group admitted before the first step.
    assert generator.stats.inflight_switches == len(engine.loaded)


def test_inflight_updates_across_long_completions_need_no_prefill_again():
    # Completions of the lengths real runs use: one stops early, one at the budget, one runs past it.
    max_new = 256
    engine = ScriptedEngine([120, max_new + 1, 2 * max_new])
    generator = generator_for(engine, inflight_updates=True, max_new_tokens=max_new, samples_per_prompt=3)
    [(admitted, group)] = generate(generator, groups=1)
    for sample, completion in enumerate(group):
        length = min(engine.stop_at(admitted.prompt[0], sample), max_new)
        assert len(completion.token_ids) == length
        assert completion.versions.tolist() == list(range(1, length + 1))
    # One request for the group's whole life: a step per token, no segment submitted again.
    assert generator.stats.engine_steps == max_new and generator.stats.inflight_switches == max_new


def test_without_inflight_updates_a_push_waits_for_the_running_sequences_and_admission_stops():
    engine = ScriptedEngine([4])
    generator = generator_for(engine, max_new_tokens=5, samples_per_prompt=2)
    [(_, group)] = generate(generator, groups=1)
    assert engine.loaded == [] and generator.stats.inflight_switches == 0
    assert all(c.versions.tolist() == [0] * c.token_ids.size for c in group)
    generator._submit(Ticket(1, 1))
    assert generator._admission_paused() and generator.stats.drains == 1  # the push is waiting
    while generator.episodes:
        generator._load_newest_weights(wait_s=0.0)
        generator._step_paced()
        generator.episodes.take_finished()
    generator._load_newest_weights(wait_s=0.0)  # the engine is empty: now it loads
    assert len(engine.loaded) == 1 and not generator._admission_paused()


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
        {"time/gen_idle_s": 1.75, "reward/errors": 2, "reward/groups_dropped": 0, "reward/calls": 24,
         "env/calls": 0, "env/errors": 0})
    # A report older than the newest seen (reordered) adds nothing; new counts add only the
    # difference, including errors of groups the reward policy dropped (they never reach the learner).
    beat(0, 1.2), beat(0, 2.0, errors=5, dropped=1, calls=32), beat(1, 0.25, calls=8)
    assert registry.report_increments() == pytest.approx(
        {"time/gen_idle_s": 0.5, "reward/errors": 3, "reward/groups_dropped": 1, "reward/calls": 16,
         "env/calls": 0, "env/errors": 0})
    beat(1, 0.25, calls=8)
    assert registry.report_increments() == {"time/gen_idle_s": 0.0, "reward/errors": 0.0,
                                            "reward/groups_dropped": 0.0, "reward/calls": 0.0,
                                            "env/calls": 0.0, "env/errors": 0.0}
