"""The generator, in-process: its pure parts (groups) and its run loop on fakes (a scripted
engine, a list as the sink that delivers to the real queue and dispatcher, a weight receiver whose
learner pushes whenever the generator waits). No vLLM, no sockets, no Ray."""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from asyncgrpo.config import load

from asyncgrpo.composition import run_task
from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.contract import THROTTLING_STALE_POLICIES, call_sizes
from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.rewards.scorer import GroupScore, Scorer
from asyncgrpo.rollout.engine import Completion, FinishedGroup
from asyncgrpo.rollout.generator import Generator
from asyncgrpo.contract import Ticket
from asyncgrpo.rollout.episodes import Episode, EpisodeGroup
from asyncgrpo.rollout.groups import scored_group
from asyncgrpo.rollout.running import Admitted
from asyncgrpo.rollout.parts import GeneratorParts, episode_settings
from asyncgrpo.rollout.scoring import score_timeout_s
from asyncgrpo.rollout.spec import GeneratorSpec, generator_seed
from asyncgrpo.rollout.tickets import PositionedPrompts, TicketClient
from asyncgrpo.schema import Config, RewardTermConfig
from asyncgrpo.tasks import ArithmeticTask, Problem
from asyncgrpo.weights.base import SaveWatch
from asyncgrpo.wire import Grant, Heartbeat, ScoredGroup, VersionAck, WireTimeout

BASE_CONFIG = load([])
TOKENIZER = build_char_tokenizer()
TASK = run_task(BASE_CONFIG)  # arithmetic


def completion(tokens: list[int], finished: bool = True, logprob: float = -0.5,
               versions: list[int] | None = None) -> Completion:
    return Completion(np.asarray(tokens, np.int32), np.full(len(tokens), logprob, np.float32), finished,
                      None if versions is None else np.asarray(versions, np.int32))


# -------------------------------------------------------------------------------------- groups


def score(rewards: list[float], dropped: bool = False) -> GroupScore:
    return GroupScore(rewards=np.asarray(rewards, np.float32), terms={}, dropped=dropped, report_terms=False)


def one_turn_group(prompt_id: int, prompt: list[int], completions: list[Completion], version: int,
                   problem: Problem | None = None) -> EpisodeGroup:
    """The episodes of a single-turn group whose one turn each gave `completions`."""
    admitted = Admitted(Ticket(0, 0), problem or Problem(prompt_id, "", ""), prompt, version)
    episodes = []
    for c in completions:
        episode = Episode(prompt)
        episode.add_turn(c, version)
        episode.end(truncated=not c.finished)
        episodes.append(episode)
    return EpisodeGroup(admitted, episodes)


def test_a_group_packs_its_completions_end_to_end():
    completions = [completion([3, 4, 5], versions=[1, 1, 2]), completion([6], logprob=-1.0)]
    group = scored_group(7, one_turn_group(42, [1, 2], completions, version=2), score([1.0, 0.0]), "zero")
    assert isinstance(group, ScoredGroup)
    assert (group.generator_id, group.seq, group.prompt_id) == (7, -1, 42)
    assert group.prompt_tokens.tolist() == [1, 2] and group.prompt_tokens.dtype == np.int32
    assert group.tokens.tolist() == [3, 4, 5, 6] and group.lengths.tolist() == [3, 1]
    # A completion without per-token versions was sampled by the loaded version.
    assert group.versions.tolist() == [1, 1, 2, 2] and group.versions.dtype == np.int32
    assert group.logprobs.tolist() == [-0.5, -0.5, -0.5, -1.0] and group.logprobs.dtype == np.float32
    assert group.rewards.tolist() == [1.0, 0.0]
    assert group.meta == {"version": 2}


def test_a_group_marks_the_completions_cut_at_the_token_limit_as_truncated():
    completions = [completion([3, 4], finished=False), completion([5]), completion([6, 7], finished=False)]
    group = scored_group(0, one_turn_group(1, [1], completions, version=0), score([0.0, 1.0, 0.0]), "zero")
    assert group.truncated.tolist() == [1, 0, 1] and group.truncated.dtype == np.uint8


def test_a_dropped_group_is_not_built():
    group = one_turn_group(1, [1], [completion([2])], version=0)
    assert scored_group(0, group, score([0.0], dropped=True), "zero") is None


def test_rewards_see_the_text_without_special_tokens():
    ids = TOKENIZER("85", add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
    assert one_turn_group(1, [1], [completion(ids)], version=0).episodes[0].answer_text(TOKENIZER) == "85"


# ------------------------------------------------------------------------------- fakes for a run


class ListSink(list):
    """Every message the generator sent, in order, each also handed to `deliver` (the learner's
    queue). `refuse`: how many sends to turn down (a full socket)."""

    def __init__(self, on_send: Callable[[Any], None] | None = None) -> None:
        super().__init__()
        self.refuse = 0
        self.closed = False
        self.on_send = on_send
        self.deliver: Callable[[Any], None] | None = None

    def try_send(self, message: Any, timeout_s: float) -> bool:
        if self.refuse > 0:
            self.refuse -= 1
            return False
        self.append(message)
        if self.deliver is not None:
            self.deliver(message)
        if self.on_send is not None:
            self.on_send(message)
        return True

    def close(self) -> None:
        self.closed = True

    def of(self, kind: type) -> list[Any]:
        return [m for m in self if isinstance(m, kind)]


class AddingEngine:
    """Answers `a+b=`: sample i of a prompt says a + b + i, then EOS (so sample 0 alone is right).

    Driven a step at a time, it finishes at the next step every request submitted since the last, as
    one `generate` call (recorded in `calls`), every token labelled with the version loaded then."""

    weight_load_path = "scripted"

    def __init__(self, before_call: Callable[[], None] | None = None, max_prompt_tokens: int = 64) -> None:
        self.calls: list[dict[str, Any]] = []
        self.loads = 0
        self.before_call = before_call
        self.max_prompt_tokens = max_prompt_tokens
        self.version = 0  # the label_version of the weights loaded
        self.submitted: list[tuple[str, list[int], int, int, float]] = []

    @property
    def running_sequences(self) -> int:
        return sum(n for _, _, n, _, _ in self.submitted)

    def submit(self, request_id, prompt, *, n, max_tokens, temperature, stop=()) -> None:
        if len(prompt) > self.max_prompt_tokens:
            raise ValueError(f"prompt of {len(prompt)} tokens, longer than the context")
        self.submitted.append((request_id, list(prompt), n, max_tokens, temperature))

    def step(self) -> list[FinishedGroup]:
        batch, self.submitted = self.submitted, []
        if not batch:
            return []
        _, _, n, max_tokens, temperature = batch[0]
        groups = self.generate([prompt for _, prompt, *_ in batch], n=n, max_tokens=max_tokens, temperature=temperature)
        for group in groups:
            for c in group:
                c.versions = np.full(c.token_ids.size, self.version, np.int32)
        return [FinishedGroup(request_id, group) for (request_id, *_), group in zip(batch, groups)]

    def abort(self, request_ids=None) -> list[str]:
        aborted = [r for r, *_ in self.submitted if request_ids is None or r in request_ids]
        self.submitted = [s for s in self.submitted if s[0] not in aborted]
        return aborted

    def label_version(self, version: int) -> None:
        self.version = version

    def generate(self, prompts, *, n, max_tokens, temperature, seed=None, stop=()):
        if self.before_call is not None:
            self.before_call()
        self.calls.append({"prompts": [list(p) for p in prompts], "n": n, "max_tokens": max_tokens,
                           "temperature": temperature})
        out = []
        for prompt in prompts:
            left, right = TOKENIZER.decode(list(prompt)).rstrip("=").split("+")
            texts = [str(int(left) + int(right) + i) for i in range(n)]
            out.append([completion(TOKENIZER(t, add_special_tokens=False)["input_ids"][:max_tokens - 1]
                                   + [TOKENIZER.eos_token_id]) for t in texts])
        return out

    def sequence_logprobs(self, sequences, *, temperature):
        self.calls.append({"sequences": sequences, "temperature": temperature})
        return [np.zeros(len(s) - 1, np.float32) for s in sequences]

    def load_weights(self, named_tensors) -> None:
        self.loads += 1


class PushesWhileWaiting:
    """A weight receiver whose learner pushes the next version whenever the generator waits for one
    (polls with a timeout), `versions` times; at the wait after that, it asks the generator to stop."""

    delta_mismatches = 0

    def __init__(self, versions: int, first_version: int = 0) -> None:
        self.remaining = versions
        self.newest_version = first_version
        self.arrived: int | None = None
        self.shutdown_reason: str | None = None
        self.joined: list[dict[str, Any]] = []
        self.closed = False
        self.rejected, self.rejection = 0, ""
        self.saves = SaveWatch()

    def join(self, address: dict[str, Any]) -> None:
        self.joined.append(address)

    def rejections(self) -> tuple[int, str]:
        return self.rejected, self.rejection

    def poll(self, timeout_s: float = 0.0) -> bool:
        if timeout_s <= 0:
            return False
        if self.remaining == 0:
            self.shutdown_reason = "training finished"
        else:
            self.remaining -= 1
            self.newest_version += 1
            self.arrived = self.newest_version
        return True

    def apply_newest(self, target) -> int | None:
        version, self.arrived = self.arrived, None
        if version is not None:
            target.load_weights([])
        return version

    def close(self) -> None:
        self.closed = True


class FlakyTask(ArithmeticTask):
    """Its check fails on every third problem id: reward errors."""

    def score(self, completion_text: str, problem: Problem) -> float:
        if problem.id % 3 == 0:
            raise RuntimeError("the verifier is down")
        return super().score(completion_text, problem)


class DeferredScorer:
    """A Scorer whose results arrive when the engine's next call starts, or when waited for (a slow reward)."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer
        self.waiting: list[tuple[concurrent.futures.Future, list[Problem], list[list[str]]]] = []

    def submit(self, problems, texts) -> concurrent.futures.Future:
        scorer = self

        class Pending(concurrent.futures.Future):
            def result(self, timeout=None):
                scorer.release()
                return super().result(timeout)

        future = Pending()
        self.waiting.append((future, problems, texts))
        return future

    def release(self) -> None:
        for future, problems, texts in self.waiting:
            future.set_result(self.scorer.score(problems, texts))
        self.waiting = []

    def stats_snapshot(self) -> dict[str, int]:
        return self.scorer.stats_snapshot()

    def calls_bound_s(self, calls: int) -> float:
        return self.scorer.calls_bound_s(calls)

    def first_errors(self) -> dict[str, str]:
        return self.scorer.first_errors()

    def close(self) -> None:
        self.scorer.close()


def config(**sections: dict[str, Any]) -> Config:
    cfg = copy.deepcopy(BASE_CONFIG)
    cfg.rollout.samples_per_prompt = 2
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


class Mailbox:
    """The grant channel: the queue's answers (send_to) wait here for the generator (recv)."""

    def __init__(self) -> None:
        self.waiting: list[Grant] = []

    def send_to(self, identity: bytes, grant: Grant) -> bool:
        self.waiting.append(grant)
        return True

    def recv(self, timeout_s: float) -> Grant | None:
        return self.waiting.pop(0) if self.waiting else None

    def close(self) -> None:
        pass


def spec_on_fakes(cfg: Config, quota: int, generator_id: int = 0, initial_version: int = 0,
                  incarnation: int = 0) -> GeneratorSpec:
    """A generator's spec whose model directory and sockets nothing opens (its parts are fakes)."""
    return GeneratorSpec(generator_id=generator_id, model_dir="unused", groups_endpoint="unused",
                         weights_endpoint="unused", tickets_endpoint="unused",
                         groups_per_call=call_sizes(cfg.rollout.groups_per_call, 1, quota)[0], seed=generator_seed(cfg, generator_id),
                         initial_version=initial_version, incarnation=incarnation)


def make_generator(cfg: Config, *, versions: int = 0, quota: int = 2, task: ArithmeticTask = TASK,
                   problems: Callable[[], Iterator[Problem]] | None = None, engine: AddingEngine | None = None,
                   scorer: Any = None, sink: ListSink | None = None, generator_id: int = 0,
                   initial_version: int = 0, incarnation: int = 0, env: Any = None) -> Generator:
    """The generator alone in a run whose steps are `quota` groups, against the real queue and
    dispatcher in process (nothing is taken: the generator runs until its versions are used up).
    `problems`: the run's prompt stream (default: the task's, seeded 0)."""
    sink = sink if sink is not None else ListSink()
    mailbox = Mailbox()
    dispatcher = Dispatcher(quota, cfg.train.max_staleness, throttle=cfg.train.stale_policy in THROTTLING_STALE_POLICIES,
                            capacity_groups=64, first_step=initial_version)
    queue = ReplayQueue(None, 64, StalenessEviction(cfg.train.max_staleness, drop_stale=False), limits=None,
                        dispatcher=dispatcher, grants=mailbox)
    sink.deliver = queue.put
    stream = problems if problems is not None else (lambda: task.train_problems(seed=0))
    spec = spec_on_fakes(cfg, quota, generator_id, initial_version, incarnation)
    generator = Generator(cfg, spec, GeneratorParts(
        engine=engine or AddingEngine(), tokenizer=TOKENIZER, task=task, scorer=scorer or Scorer(task, cfg.reward),
        sink=sink, weights=PushesWhileWaiting(versions, initial_version),
        tickets=TicketClient(sink, mailbox, generator_id, incarnation), positioned=PositionedPrompts(stream), env=env,
        episode_settings=episode_settings(cfg), wait_timeout_s=cfg.wire.timeout_s))
    generator.queue = queue  # type: ignore[attr-defined]  # for the tests that look at what arrived
    return generator


def recording(stream: Iterator[Problem], taken: list[Problem]) -> Iterator[Problem]:
    for problem in stream:
        taken.append(problem)
        yield problem


# ------------------------------------------------------------------------------------ the run


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_the_grants_allow_max_staleness_plus_one_steps_per_loaded_version(max_staleness):
    cfg = config(train={"max_staleness": max_staleness})
    generator = make_generator(cfg, versions=3, quota=2)
    stats = generator.run()
    sink = generator.sink
    groups = sink.of(ScoredGroup)
    assert len(groups) == (max_staleness + 3 + 1) * 2 == stats["gen/groups_sent"]
    assert [g.seq for g in groups] == list(range(len(groups)))
    assert stats["gen/throttled_waits"] == 4  # once per version, the last one ended by the stop
    assert stats["gen/weight_loads"] == 3 and stats["gen/version"] == 3 and generator.loaded_version() == 3
    # The loaded version is acknowledged first (the generator is up), then every load.
    assert [(a.generator_id, a.version) for a in sink.of(VersionAck)] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    # Every group was sampled within max_staleness of the version that will train on it.
    for k, group in enumerate(groups):
        assert k // 2 - group.version_min <= max_staleness
    assert stats["gen/tokens_generated"] == sum(g.tokens.size for g in groups)
    assert stats["gen/weight_load_path"] == "scripted"
    for key in ("gen_time/weights_s", "gen_time/generate_s", "gen_time/score_s", "gen_time/send_s",
                "gen_time/throttle_s", "gen/wall_s", "gen/idle_s", "gen/idle_frac", "reward/errors",
                "reward/groups_dropped", "gen/inflight_switches", "gen/send_blocked_s"):
        assert key in stats


def test_without_the_throttle_generation_runs_on_until_stopped():
    cfg = config(train={"stale_policy": "drop", "max_staleness": 0})
    generator = make_generator(cfg)

    def stop_after_the_fifth_group(message: Any) -> None:  # nothing throttles: the learner says stop
        if isinstance(message, ScoredGroup) and message.seq == 4:
            generator.weights.shutdown_reason = "enough"

    generator.sink.on_send = stop_after_the_fifth_group
    stats = generator.run()
    assert stats["gen/groups_sent"] == 6  # the stop is heard at the next call's weight check
    assert stats["gen/throttled_waits"] == 0 and len(generator.engine.calls) == 3


def test_a_heartbeat_follows_each_batch_with_the_cumulative_report():
    cfg = config(train={"max_staleness": 1})
    generator = make_generator(cfg, versions=1, task=FlakyTask(num_digits=TASK.num_digits, eval_size=TASK.eval_size))
    generator.run()
    sent = 0
    for message in generator.sink:
        if isinstance(message, ScoredGroup):
            sent += 1
            assert set(message.meta) == {"version"}  # counters travel on heartbeats only
        elif isinstance(message, Heartbeat):
            assert message.next_seq == sent
    beats = generator.sink.of(Heartbeat)
    calls = len(generator.engine.calls)
    assert len(beats) == calls  # one per call's batch (no wait here lasted long enough for a periodic one)
    last = beats[-1]
    rewards = generator.scorer.stats_snapshot()
    assert rewards["reward/errors"] > 0, "the stream should hold a problem the flaky check fails on"
    assert (last.reward_errors, last.groups_dropped) == (rewards["reward/errors"], 0)
    # The error rate's denominator, and each failing term's first error for the learner's reason.
    assert last.reward_calls == rewards["reward/calls"] == sum(len(m.lengths) for m in generator.sink.of(ScoredGroup))
    assert last.reward_first_errors == {"task": "RuntimeError: the verifier is down"}
    assert last.version == generator.version
    assert [b.idle_s for b in beats] == sorted(b.idle_s for b in beats)  # cumulative


def test_dropped_groups_give_their_slots_back_and_are_reported():
    cfg = config(reward={"on_error": "drop_group"}, train={"max_staleness": 1})
    taken: list[Problem] = []
    task = FlakyTask(num_digits=TASK.num_digits, eval_size=TASK.eval_size)
    generator = make_generator(cfg, versions=1, task=task, problems=lambda: recording(task.train_problems(seed=0), taken))
    stats = generator.run()
    groups = generator.sink.of(ScoredGroup)
    dropped = [p for p in taken if p.id % 3 == 0]
    assert dropped, "the stream should hold a problem the flaky check fails on"
    # Their slots were granted again, with new prompts: every slot the bound allows was filled.
    assert len(groups) == (1 + 1 + 1) * 2 == len(taken) - len(dropped)
    assert all(g.prompt_id % 3 != 0 for g in groups)
    assert [g.seq for g in groups] == list(range(len(groups)))  # a dropped group leaves no gap
    last = generator.sink.of(Heartbeat)[-1]
    assert last.groups_dropped == len(dropped) == stats["reward/groups_dropped"]
    assert last.reward_errors == len(dropped) * cfg.rollout.samples_per_prompt == stats["reward/errors"]


class ResetFailsEveryThirdProblem:
    """An environment whose reset raises for problems whose id is a multiple of 3 (the episode
    then fails); the others play one turn, as the AddingEngine never writes the stop text."""

    def reset(self, problem: Problem) -> str:
        if problem.id % 3 == 0:
            raise ConnectionError("the environment is down")
        return ""

    def step(self, action: str):
        raise AssertionError("never called: no turn ends at the stop text")

    def close(self) -> None:
        pass


def test_groups_whose_environment_fails_give_their_slots_back_and_are_reported_under_drop_group():
    from asyncgrpo.envs.base import EnvironmentSpec

    cfg = config(env={"on_error": "drop_group"}, train={"max_staleness": 1})
    taken: list[Problem] = []
    env = EnvironmentSpec("flaky", ResetFailsEveryThirdProblem, ("]",))
    generator = make_generator(cfg, versions=1, problems=lambda: recording(TASK.train_problems(seed=0), taken),
                               env=env)
    stats = generator.run()
    groups = generator.sink.of(ScoredGroup)
    dropped = [p for p in taken if p.id % 3 == 0]
    assert dropped, "the stream should hold a problem whose environment fails"
    assert len(groups) == (1 + 1 + 1) * 2 == len(taken) - len(dropped)  # their slots were granted again
    assert all(g.prompt_id % 3 != 0 for g in groups)
    samples = cfg.rollout.samples_per_prompt
    assert stats["gen/env_groups_dropped"] == len(dropped) == stats["reward/groups_dropped"]
    assert stats["gen/env_errors_exception"] == len(dropped) * samples
    last = generator.sink.of(Heartbeat)[-1]
    assert last.groups_dropped == len(dropped) and last.env_errors == len(dropped) * samples
    assert last.env_calls == len(taken) * samples and "the environment is down" in last.env_first_error


class SlowReset:
    """An environment whose reset answers after 50 ms; its episodes then play one turn (the
    AddingEngine never writes the stop text)."""

    def reset(self, problem: Problem) -> str:
        time.sleep(0.05)
        return ""

    def step(self, action: str):
        raise AssertionError("never called: no turn ends at the stop text")

    def close(self) -> None:
        pass


def test_a_generator_waiting_on_its_environment_looks_at_the_weight_stream_every_few_milliseconds(monkeypatch):
    # New weights bring new tickets, whose prompts can decode while the answers are out: a wait for
    # an answer as long as the tool's latency would keep the engine idle through it.
    from asyncgrpo.envs.base import EnvironmentSpec
    from asyncgrpo.rollout.episodes import EpisodeRunner
    from asyncgrpo.rollout.generator import ENV_WAIT_SLICE_S

    events: list[tuple[str, float]] = []
    collect_env = EpisodeRunner.collect_env
    monkeypatch.setattr(EpisodeRunner, "collect_env",
                        lambda self, wait_s: events.append(("env", wait_s)) or collect_env(self, wait_s))
    generator = make_generator(config(train={"max_staleness": 1}), versions=2,
                               env=EnvironmentSpec("slow", SlowReset, ("]",)))
    poll = generator.weights.poll
    monkeypatch.setattr(generator.weights, "poll", lambda timeout_s=0.0: events.append(("poll", timeout_s)) or poll(timeout_s))
    generator.run()
    waits = [i for i, (kind, wait_s) in enumerate(events) if kind == "env" and wait_s > 0]
    assert len(waits) >= 2, "the generator should have waited on its environment"
    assert max(events[i][1] for i in waits) == ENV_WAIT_SLICE_S <= 0.01  # far below a tool's latency
    assert all(any(kind == "poll" for kind, _ in events[i + 1:j]) for i, j in zip(waits, waits[1:]))


def test_slow_rewards_are_sent_once_the_next_vllm_call_returns():
    cfg = config(rollout={"groups_per_call": 1}, train={"max_staleness": 0})
    scorer = DeferredScorer(Scorer(TASK, cfg.reward))
    engine = AddingEngine(before_call=scorer.release)
    sink = ListSink(on_send=lambda message: isinstance(message, ScoredGroup) and sent_after.append(len(engine.calls)))
    sent_after: list[int] = []
    generator = make_generator(cfg, quota=2, engine=engine, scorer=scorer, sink=sink)
    generator.run()
    # Group 0's rewards were computed during call 2, and it went out after that call; group 1 had
    # nothing to overlap with (no more slots were granted) and went out before the wait.
    assert sent_after == [2, 2]
    assert [g.rewards.tolist() for g in sink.of(ScoredGroup)] == [[1.0, 0.0], [1.0, 0.0]]


def test_a_full_queue_is_waited_on_and_counted_as_idle():
    generator = make_generator(config(train={"max_staleness": 0}), quota=2)
    # Full after the first group: the second, of the same call, waits for room.
    generator.sink.on_send = lambda message: isinstance(message, ScoredGroup) and message.seq == 0 \
        and setattr(generator.sink, "refuse", 3)
    stats = generator.run()
    assert [g.seq for g in generator.sink.of(ScoredGroup)] == [0, 1]
    assert stats["gen/groups_sent"] == 2 and stats["gen/send_blocked_s"] > 0
    assert stats["gen/idle_s"] >= stats["gen/send_blocked_s"]


def test_a_queue_that_never_takes_fails_loudly():
    cfg = config(wire={"timeout_s": 0.05})
    generator = make_generator(cfg)
    generator.sink.on_send = lambda message: isinstance(message, ScoredGroup) and setattr(generator.sink, "refuse", 10**9)
    with pytest.raises(WireTimeout, match="took no group"):
        generator.run()


def test_a_resumed_generator_starts_at_its_version():
    cfg = config(train={"max_staleness": 0})
    generator = make_generator(cfg, quota=2, initial_version=5)
    stats = generator.run()
    assert generator.sink[0] == VersionAck(0, 5)
    assert stats["gen/groups_sent"] == 2  # one step's worth ahead of version 5, not six
    assert generator.ready()["version"] == 5


def test_join_weight_group_joins_as_rank_generator_id_plus_one():
    generator = make_generator(config(), generator_id=2)
    generator.join_weight_group({"host": "10.0.0.1", "port": 29500, "world_size": 4})
    assert generator.weights.joined == [{"host": "10.0.0.1", "port": 29500, "world_size": 4, "rank": 3}]


def test_evaluate_and_sequence_logprobs_use_the_engine():
    cfg = config(rollout={"temperature": 0.7})
    generator = make_generator(cfg)
    problems = TASK.eval_problems()[:4]
    assert generator.evaluate(problems, temperature=0.0) == 1.0  # sample 0 is always right
    assert generator.engine.calls[-1]["n"] == 1 and generator.engine.calls[-1]["temperature"] == 0.0
    [logprobs] = generator.sequence_logprobs([[1, 2, 3]])
    assert logprobs.shape == (2,) and generator.engine.calls[-1]["temperature"] == 0.7


def test_close_releases_the_parts():
    generator = make_generator(config())
    generator.close()
    assert generator.sink.closed and generator.weights.closed


def test_problems_are_taken_one_call_at_a_time():
    cfg = config(rollout={"groups_per_call": 3}, train={"max_staleness": 0})
    generator = make_generator(cfg, quota=4)
    generator.run()
    # 4 granted: a call of 3, then a call of the 1 left, the run's stream read in order.
    assert [len(c["prompts"]) for c in generator.engine.calls] == [3, 1]
    assert [g.pos for g in generator.sink.of(ScoredGroup)] == [0, 1, 2, 3]


class VirtualClock:
    """Stands in for the `time` of the generator's modules: sleeps advance it and are recorded."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def perf_counter(self) -> float:
        return self.now

    monotonic = perf_counter

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("paced", [True, False])
def test_a_paced_generator_sleeps_out_each_call_to_its_seconds_per_group(monkeypatch, paced):
    import asyncgrpo.rollout.generator as generator_module
    import asyncgrpo.rollout.pacing as pacing_module

    clock = VirtualClock()
    monkeypatch.setattr(generator_module, "time", clock)
    monkeypatch.setattr(pacing_module, "time", clock)  # the failpoints' sleeps
    monkeypatch.setenv("ASYNCGRPO_FAULTS", '{"generator_pace_s": {"%d": 0.05}}' % (0 if paced else 1))
    cfg = config(rollout={"groups_per_call": 3}, train={"max_staleness": 0})
    engine = AddingEngine(before_call=lambda: setattr(clock, "now", clock.now + 0.01))  # the call's own work
    generator = make_generator(cfg, quota=4, engine=engine)
    generator.run()
    assert [len(c["prompts"]) for c in engine.calls] == [3, 1]
    pace_sleeps = [s for s in clock.sleeps if s > 0]
    assert pace_sleeps == ([pytest.approx(0.15 - 0.01), pytest.approx(0.05 - 0.01)] if paced else [])


def test_the_generators_wait_for_rewards_is_the_wire_timeout_beyond_what_the_rewards_may_take():
    from asyncgrpo.rewards.judge import call_budget_s

    cfg = config()
    judged = dataclasses.replace(cfg.reward, terms=[RewardTermConfig(name="judge")])
    scorer, samples = Scorer(TASK, judged), cfg.rollout.samples_per_prompt
    assert samples <= cfg.reward.judge.concurrency  # one wave: every call within one call's budget
    assert score_timeout_s(scorer, samples, cfg.wire.timeout_s) == cfg.wire.timeout_s + call_budget_s(cfg.reward.judge)
    assert score_timeout_s(Scorer(TASK, cfg.reward), samples, cfg.wire.timeout_s) == cfg.wire.timeout_s  # inline rewards


# --------------------------------------------------------------------------- periodic evaluation


@pytest.mark.parametrize("every, evaluated", [(2, [2, 4]), (3, [3]), (0, [])])
def test_generator_0_evaluates_the_first_loaded_version_at_or_past_each_multiple(every, evaluated):
    cfg = config(train={"max_staleness": 0}, eval={"every_steps": every}, task={"eval_size": 20})
    generator = make_generator(cfg, versions=5, quota=2)
    stats = generator.run()
    records = generator.take_evaluations()
    assert [r["step"] for r in records] == evaluated
    for record in records:  # the adding engine's sample 0 is right: every answer, sampled or greedy
        assert record["eval/accuracy"] == record["eval/greedy_accuracy"] == 1.0
        assert record["eval/when"] == "periodic"
    assert generator.take_evaluations() == []  # handed over once
    assert ("gen_time/eval_s" in stats) == bool(evaluated)


def test_other_generators_do_not_evaluate():
    cfg = config(train={"max_staleness": 0}, eval={"every_steps": 1}, task={"eval_size": 20})
    generator = make_generator(cfg, versions=3, quota=2, generator_id=1)
    generator.run()
    assert generator.take_evaluations() == []


def test_a_resumed_generator_evaluates_from_the_next_multiple_after_its_version():
    cfg = config(train={"max_staleness": 0}, eval={"every_steps": 2}, task={"eval_size": 20})
    generator = make_generator(cfg, versions=3, quota=2, initial_version=4)
    generator.run()
    assert [r["step"] for r in generator.take_evaluations()] == [6]


def test_a_prompt_longer_than_the_context_is_counted_and_its_slot_goes_to_the_next_prompt():
    cfg = config(train={"max_staleness": 0})

    def problems() -> Iterator[Problem]:  # every third prompt is too long for the engine
        for i in itertools.count():
            yield Problem(i, "1234+5678=" if i % 3 == 1 else "12+34=", "6912" if i % 3 == 1 else "46")

    generator = make_generator(cfg, quota=4, problems=problems, engine=AddingEngine(max_prompt_tokens=6))
    stats = generator.run()
    groups = generator.sink.of(ScoredGroup)
    # Positions 1 and 4 were refused and their slots granted again with new prompts: the step is full.
    assert [g.pos for g in groups] == [0, 2, 3, 5]
    assert stats["gen/prompts_rejected"] == 2 and generator.queue.stats()["dispatch/released"] == 2


def test_an_engine_step_that_raises_ends_the_run_with_its_error():
    class Broken(AddingEngine):
        def step(self):
            raise RuntimeError("CUDA error: an illegal memory access")

    generator = make_generator(config(), engine=Broken())
    with pytest.raises(RuntimeError, match="illegal memory access"):
        generator.run()  # the actor dies with it: the driver restarts it and its slots go to others
