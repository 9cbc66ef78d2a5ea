"""Episodes on a scripted engine and scripted environments: turns, observations and their policy mask,
the episode's end (answer, budget, context, max turns, environment), failures counted per cause, the
turns held while a push waits, and evaluations' batched episodes. No vLLM, no threads but the calls'."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from asyncgrpo.contract import Ticket
from asyncgrpo.envs import episode_rules
from asyncgrpo.envs.base import EnvironmentSpec, EnvStep
from asyncgrpo.envs.calls import EnvCalls, checked_reset, checked_step
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.rewards.scorer import GroupScore
from asyncgrpo.rollout.engine import Completion, FinishedGroup
from asyncgrpo.rollout.episodes import EpisodeRunner, EpisodeSettings, play_episodes
from asyncgrpo.rollout.groups import scored_group
from asyncgrpo.rollout.running import Admitted
from asyncgrpo.rollout.stats import GeneratorStats
from asyncgrpo.schema import EnvConfig
from asyncgrpo.tasks import Problem

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class ScriptEngine:
    """Sample i's turn t writes script[i][t]: a text ending in "]" stops there (the tool's close tag),
    any other ends with EOS; a turn longer than its max_tokens is cut (not finished). Every submitted
    request finishes at the next step. Later turns name their sample in the request id
    (position.key.sample.turn), as the runner writes it."""

    weight_load_path = "scripted"

    def __init__(self, script: list[list[str]]) -> None:
        self.script = script
        self.requests: dict[str, tuple[list[int], int, int]] = {}  # id -> (prompt, n, max_tokens)
        self.submits: list[tuple[str, int]] = []  # (request id, n)

    @property
    def running_sequences(self) -> int:
        return sum(n for _, n, _ in self.requests.values())

    def submit(self, request_id, prompt, *, n, max_tokens, temperature, stop=()) -> None:
        self.requests[request_id] = (list(prompt), n, max_tokens)
        self.submits.append((request_id, n))

    def _turn(self, sample: int, turn: int, max_tokens: int) -> Completion:
        text = self.script[sample][turn]
        tokens = ids(text) if text.endswith("]") else ids(text) + [EOS]
        finished = len(tokens) <= max_tokens
        tokens = tokens[:max_tokens]
        return Completion(np.asarray(tokens, np.int32), np.full(len(tokens), -0.25, np.float32), finished,
                          stop_reason="]" if finished and text.endswith("]") else None)

    def step(self) -> list[FinishedGroup]:
        out = []
        for request_id, (prompt, n, max_tokens) in self.requests.items():
            parts = request_id.split(".")
            if len(parts) == 2:  # a group's first turns
                out.append(FinishedGroup(request_id, [self._turn(i, 0, max_tokens) for i in range(n)]))
            else:
                out.append(FinishedGroup(request_id, [self._turn(int(parts[2]), int(parts[3]), max_tokens)]))
        self.requests = {}
        return out

    def abort(self, request_ids=None) -> list[str]:
        aborted = [r for r in self.requests if request_ids is None or r in request_ids]
        for r in aborted:
            del self.requests[r]
        return aborted

    def generate(self, prompts, *, n, max_tokens, temperature, seed=None, stop=()):
        limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        # Evaluations: the observations so far (each has an "=", as the prompt does) say which turn this is.
        return [[self._turn(0, TOKENIZER.decode(p).count("=") - 1, limit)] for p, limit in zip(prompts, limits)]


class Calculator:
    """Answers "[a*b]" with "=<product>\\n", reward 0.5 per call."""

    def reset(self, problem):
        return ""

    def step(self, action):
        left, right = action.strip("[]").split("*")
        return EnvStep(observation=f"={int(left) * int(right)}\n", reward=0.5)

    def close(self):
        pass


def spec(env_class=Calculator) -> EnvironmentSpec:
    return EnvironmentSpec("scripted", env_class, ("]",))


def settings(max_turns: int = 4, **changes) -> EpisodeSettings:
    """The scripted runs' settings; the env.* rules at env.*'s defaults but `max_turns`."""
    values = dict(samples_per_prompt=2, max_new_tokens=40, temperature=1.0, context_tokens=64,
                  env=dataclasses.replace(episode_rules(EnvConfig()), max_turns=max_turns))
    values.update(changes)
    return EpisodeSettings(**values)


def admitted(prompt: str = "12*34=", version: int = 0) -> Admitted:
    return Admitted(Ticket(0, 7), Problem(7, prompt, "408"), ids(prompt), version)


def run_until_done(runner: EpisodeRunner, limit: int = 200) -> list:
    finished = []
    for _ in range(limit):
        if runner.engine_busy:
            runner.step_engine()
        else:
            runner.collect_env(wait_s=0.05)
        finished += runner.take_finished()
        if not runner:
            return finished
    raise AssertionError("episodes did not end")


def make_runner(script, env=None, calls=None, **changes) -> tuple[EpisodeRunner, ScriptEngine, GeneratorStats]:
    engine, stats = ScriptEngine(script), GeneratorStats()
    if env is not None and calls is None:
        calls = EnvCalls(threads=2, timeout_s=5.0, latency_s=0.0)
    return EpisodeRunner(engine, TOKENIZER, env, calls, settings(**changes), stats), engine, stats


def test_a_tool_episode_interleaves_policy_turns_and_observations_and_masks_the_observations():
    runner, engine, stats = make_runner([["[12*34]", "408"], ["[12*34]", "407"]], env=spec())
    runner.start(admitted())
    [group] = run_until_done(runner)
    episode = group.episodes[0]
    expected = ids("[12*34]") + ids("=408\n") + ids("408") + [EOS]
    assert episode.tokens == expected
    assert episode.policy == [1] * 7 + [0] * 5 + [1] * 4
    assert episode.logprobs[7:12] == [0.0] * 5  # an observation carries no log-prob
    assert episode.answer_text(TOKENIZER) == "408" and episode.turns == 2 and not episode.truncated
    # The second turn's prompt is the episode so far: prompt, first turn, observation.
    assert stats.env_calls == 2 * 2  # a reset and a step per episode
    assert stats.env_answers == stats.env_calls and stats.env_answers_s > 0  # each answer applied, its work timed
    completion = episode.as_completion()
    assert completion.policy_mask.tolist() == episode.policy and completion.finished


def test_without_an_environment_an_episode_is_one_turn_of_one_group_request():
    runner, engine, stats = make_runner([["408"], ["407"]])
    runner.start(admitted())
    [group] = run_until_done(runner)
    assert engine.submits == [("7.0", 2)]  # one request of n samples, as single-turn rollouts always were
    assert [e.answer_text(TOKENIZER) for e in group.episodes] == ["408", "407"]
    assert all(e.policy == [1] * len(e.tokens) and e.turns == 1 for e in group.episodes)
    assert stats.env_calls == 0


def test_the_rewards_add_the_environments_rewards_and_the_mask_travels_in_the_group():
    runner, _, _ = make_runner([["[12*34]", "408"], ["408"]], env=spec())
    runner.start(admitted())
    [group] = run_until_done(runner)
    score = GroupScore(rewards=np.asarray([1.0, 1.0], np.float32), terms={}, report_terms=False)
    message = scored_group(0, group, score, "zero")
    assert message.rewards.tolist() == [1.5, 1.0]  # one tool call rewarded 0.5
    assert message.meta["reward/env"] == pytest.approx(0.25)
    assert message.policy_mask.tolist() == group.episodes[0].policy + group.episodes[1].policy


def test_an_observation_that_would_overflow_the_budget_ends_the_episode_truncated_and_counted():
    # "[12*34]" is 7 tokens, "=408\n" 5 more: a budget of 11 has no room for the observation.
    runner, _, stats = make_runner([["[12*34]", "408"], ["408"]], env=spec(), max_new_tokens=11)
    runner.start(admitted())
    [group] = run_until_done(runner)
    first = group.episodes[0]
    assert first.truncated and first.tokens == ids("[12*34]") and stats.episodes_overflowed == 1
    assert not group.episodes[1].truncated


def test_an_observation_that_would_overflow_the_context_ends_the_episode_truncated():
    runner, _, stats = make_runner([["[12*34]", "408"], ["408"]], env=spec(), context_tokens=6 + 7 + 4)
    runner.start(admitted())
    [group] = run_until_done(runner)
    assert group.episodes[0].truncated and stats.episodes_overflowed == 1


def test_the_last_allowed_turn_ends_the_episode_and_its_call_still_earns_its_reward():
    runner, _, stats = make_runner([["[1*2]", "[3*4]", "x"], ["5"]], env=spec(), max_turns=2)
    runner.start(admitted())
    [group] = run_until_done(runner)
    first = group.episodes[0]
    assert first.turns == 2 and first.answer_text(TOKENIZER) == "[3*4]" and not first.truncated
    assert stats.env_calls == 2 + 2  # two resets, a step after each of the first episode's turns
    assert first.env_reward == 0.5 + 0.5  # the last call's reward counts (a game won on the last guess)
    assert first.tokens[-len(ids("=12\n")):] == ids("=12\n")  # its observation fits: kept, never trained


class Raising(Calculator):
    def step(self, action):
        raise ConnectionError("tool down")


class Garbage(Calculator):
    def step(self, action):
        return {"observation": "=1"}


class Hanging(Calculator):
    def step(self, action):
        time.sleep(30)


@pytest.mark.parametrize("env_class, cause", [(Raising, "exception"), (Garbage, "invalid"), (Hanging, "timeout")])
def test_a_failed_environment_call_ends_the_episode_with_reward_zero_and_is_counted_by_cause(env_class, cause):
    calls = EnvCalls(threads=2, timeout_s=0.2, latency_s=0.0)
    runner, _, stats = make_runner([["[1*2]", "2"], ["2"]], env=spec(env_class), calls=calls)
    runner.start(admitted())
    [group] = run_until_done(runner)
    assert group.episodes[0].failed == cause and stats.env_errors == {cause: 1}
    assert stats.env_first_error.startswith(cause)
    score = GroupScore(rewards=np.asarray([1.0, 1.0], np.float32), terms={}, report_terms=False)
    assert scored_group(0, group, score, "zero").rewards.tolist() == [0.0, 1.0]
    assert scored_group(0, group, score, "drop_group") is None


def test_turns_made_ready_while_a_push_waits_are_held_until_it_is_loaded():
    runner, engine, _ = make_runner([["[1*2]", "2"], ["[3*4]", "12"]], env=spec())
    runner.start(admitted())
    runner.hold_turns = True
    for _ in range(50):
        if runner.engine_busy:
            runner.step_engine()
        runner.collect_env(wait_s=0.05)
        if not runner.engine_busy and not runner.env_pending:
            break
    assert not runner.engine_busy and len(runner._ready) == 2  # both answered, neither resubmitted
    runner.hold_turns = False
    runner.collect_env(wait_s=0.0)
    assert runner.engine_busy
    assert [len(g.episodes) for g in run_until_done(runner)] == [2]


def test_a_prompt_with_no_room_in_the_context_is_refused_before_anything_starts():
    runner, engine, _ = make_runner([["1"], ["1"]], context_tokens=6)
    with pytest.raises(ValueError, match="no room in the context"):
        runner.start(admitted("12*34="))
    assert engine.submits == [] and not runner


def test_dropping_ends_every_episode_and_late_answers_are_ignored():
    runner, engine, _ = make_runner([["[1*2]", "2"], ["[3*4]", "12"]], env=spec())
    runner.start(admitted())
    runner.step_engine()  # resets answered or pending; no turn may be in the engine yet
    dropped = runner.drop_all()
    assert len(dropped) == 1 and all(e.done for e in dropped[0].episodes)
    runner.collect_env(wait_s=0.2)
    assert not runner and engine.requests == {}


def test_evaluation_plays_each_episode_to_its_answer():
    engine = ScriptEngine([["[12*34]", "408"]])
    problems = [Problem(1, "12*34=", "408"), Problem(2, "12*34=", "408")]
    episodes = play_episodes(engine, TOKENIZER, spec(), settings(),
                             [ids(p.prompt) for p in problems], problems, temperature=0.0)
    assert [e.answer_text(TOKENIZER) for e in episodes] == ["408", "408"]
    assert episodes[0].policy == [1] * 7 + [0] * 5 + [1] * 4


def test_env_calls_run_coroutines_and_name_the_cause_an_exception_carries():
    class CallError(Exception):
        cause = "http"

    async def answer(action):
        await asyncio.sleep(0)
        return EnvStep(observation=action)

    def failing(action):
        raise CallError("503 after 3 retries")

    calls = EnvCalls(threads=1, timeout_s=5.0, latency_s=0.0)
    calls.submit("a", answer, checked_step, "ok")
    calls.submit("b", failing, checked_step, "x")
    results = {}
    while len(results) < 2:
        results.update(calls.finished(wait_s=1.0))
    assert results["a"].value == EnvStep(observation="ok")
    assert results["b"].cause == "http" and "503" in results["b"].error
    assert calls.pending == 0
    calls.close()


@pytest.mark.parametrize("bad", [EnvStep(observation=3), EnvStep(observation="", reward=float("nan")),
                                 EnvStep(observation="", done=1), "text"])
def test_a_malformed_step_answer_is_invalid(bad):
    with pytest.raises(ValueError):
        checked_step(bad)


def test_an_episode_group_crosses_the_wire_and_the_learner_trains_only_the_policys_tokens():
    from asyncgrpo.learner.batch import collate
    from asyncgrpo.wire.codec import decode_group, encode_group

    runner, _, _ = make_runner([["[12*34]", "408"], ["408"]], env=spec())
    runner.start(admitted())
    [group] = run_until_done(runner)
    score = GroupScore(rewards=np.asarray([1.0, 0.0], np.float32), terms={}, report_terms=False)
    message = scored_group(0, group, score, "zero")
    message.seq = 0
    received = decode_group([bytes(frame) for frame in encode_group(message)])
    assert received.policy_mask.tolist() == message.policy_mask.tolist()
    batch = collate([received], pad_id=0)
    first = group.episodes[0]
    assert batch.mask[0, :len(first.tokens)].tolist() == [float(p) for p in first.policy]
    assert batch.completion_lengths.tolist() == [len(first.tokens), len(group.episodes[1].tokens)]


class Chat(Calculator):
    """A chat-like environment: every assistant message (ended by EOS) is answered with the tokens of
    "?" given as ids; the episode ends at the second answer."""

    def __init__(self) -> None:
        self.calls = 0

    def step(self, action):
        self.calls += 1
        return EnvStep(observation="(ignored)", observation_tokens=tuple(ids("?")), done=self.calls == 2)


def test_with_eos_calls_an_answers_end_calls_the_environment_and_its_tokens_are_appended_as_given():
    chat = EnvironmentSpec("chat", Chat, (), eos_calls=True)
    runner, _, _ = make_runner([["a", "b"], ["c", "d"]], env=chat)
    runner.start(admitted())
    [group] = run_until_done(runner)
    episode = group.episodes[0]
    assert episode.tokens == ids("a") + [EOS] + ids("?") + ids("b") + [EOS] + ids("?")
    assert episode.policy == [1, 1, 0, 1, 1, 0] and episode.turns == 2


def test_observation_tokens_must_be_token_ids():
    with pytest.raises(ValueError, match="observation_tokens"):
        checked_step(EnvStep(observation="", observation_tokens=(1, -2)))
    assert checked_step(EnvStep(observation="", observation_tokens=(1, 2))).observation_tokens == (1, 2)


class OwnPrompt(Calculator):
    """Replaces the prompt at reset with "q:<problem>" plus "!" for the second episode made, so the
    group's episodes share "q:12*34=" and differ after it; answers like Calculator."""

    made = 0

    def __init__(self) -> None:
        OwnPrompt.made += 1
        self.suffix = "!" * (OwnPrompt.made % 2 == 0)

    def reset(self, problem):
        return EnvStep(observation="", observation_tokens=tuple(ids("q:" + problem.prompt + self.suffix)),
                       replaces_prompt=True)


def test_a_reset_that_replaces_the_prompt_is_the_episodes_context_and_the_group_sends_the_common_prefix():
    OwnPrompt.made = 0
    runner, engine, _ = make_runner([["[1*2]", "2"], ["3"]], env=spec(OwnPrompt))
    prompts, submit = {}, engine.submit
    engine.submit = lambda request_id, prompt, **kw: (prompts.setdefault(request_id, list(prompt)),
                                                     submit(request_id, prompt, **kw))
    runner.start(admitted())
    [group] = run_until_done(runner)
    first, second = group.episodes
    assert first.prompt == ids("q:12*34=") and second.prompt == ids("q:12*34=!")
    # Each episode's first turn is sampled after its own prompt, not the task's.
    assert prompts["7.0.0.0"] == ids("q:12*34=") and prompts["7.0.1.0"] == ids("q:12*34=!")
    assert first.tokens == ids("[1*2]") + ids("=2\n") + ids("2") + [EOS]
    score = GroupScore(rewards=np.asarray([1.0, 0.0], np.float32), terms={}, report_terms=False)
    message = scored_group(0, group, score, "zero")
    assert message.prompt_tokens.tolist() == ids("q:12*34=")
    # The second episode's own prompt token goes before its turn, as the environment's (never trained).
    assert message.lengths.tolist() == [len(first.tokens), 1 + len(second.tokens)]
    second_mask = message.policy_mask[len(first.tokens):].tolist()
    assert second_mask == [0] + second.policy and message.tokens[len(first.tokens)] == ids("!")[0]
    assert message.logprobs[len(first.tokens)] == 0.0


def test_without_a_replaced_prompt_the_group_is_sent_with_the_tasks_prompt():
    runner, _, _ = make_runner([["[1*2]", "2"], ["3"]], env=spec())
    runner.start(admitted())
    [group] = run_until_done(runner)
    score = GroupScore(rewards=np.asarray([1.0, 0.0], np.float32), terms={}, report_terms=False)
    message = scored_group(0, group, score, "zero")
    assert message.prompt_tokens.tolist() == ids("12*34=")
    assert message.lengths.tolist() == [len(e.tokens) for e in group.episodes]


class Disjoint(OwnPrompt):
    def reset(self, problem):
        text = "b:" if self.suffix else "a:"
        return EnvStep(observation="", observation_tokens=tuple(ids(text)), replaces_prompt=True)


class FailsSecondReset(OwnPrompt):
    def reset(self, problem):
        if self.suffix:  # the second episode
            raise RuntimeError("agent crashed")
        return super().reset(problem)


def test_replaced_prompts_with_no_common_token_cannot_be_sent_and_an_episode_without_tokens_does_not_count():
    score = GroupScore(rewards=np.asarray([1.0, 0.0], np.float32), terms={}, report_terms=False)
    OwnPrompt.made = 0
    runner, _, _ = make_runner([["1"], ["2"]], env=spec(Disjoint))
    runner.start(admitted())
    [group] = run_until_done(runner)
    assert scored_group(0, group, score, "zero") is None
    OwnPrompt.made = 0
    runner, _, stats = make_runner([["1"], ["2"]], env=spec(FailsSecondReset))
    runner.start(admitted())
    [group] = run_until_done(runner)
    assert stats.env_errors == {"exception": 1} and group.episodes[1].tokens == []
    message = scored_group(0, group, score, "zero")
    assert message.prompt_tokens.tolist() == ids("q:12*34=") and message.rewards.tolist() == [1.0, 0.0]


def test_a_replaced_prompt_that_fills_the_context_ends_the_episode_as_overflowed():
    OwnPrompt.made = 0
    runner, _, stats = make_runner([["1"], ["2"]], env=spec(OwnPrompt), context_tokens=8)
    runner.start(admitted())
    [group] = run_until_done(runner)
    assert all(e.truncated and e.tokens == [] for e in group.episodes) and stats.episodes_overflowed == 2
    assert group.episodes[0].prompt == ids("12*34=")  # not replaced: nothing of it was used


@pytest.mark.parametrize("bad, match", [
    (EnvStep(observation="", done=True), "cannot end"),
    (EnvStep(observation="x", replaces_prompt=True), "observation_tokens"),
    (EnvStep(observation="", observation_tokens=(), replaces_prompt=True), "observation_tokens"),
    (3, "not text or an EnvStep")])
def test_a_malformed_reset_answer_is_invalid(bad, match):
    with pytest.raises(ValueError, match=match):
        checked_reset(bad)


def test_only_reset_may_replace_the_prompt():
    with pytest.raises(ValueError, match="reset's answer only"):
        checked_step(EnvStep(observation="", observation_tokens=(5,), replaces_prompt=True))
    assert checked_reset(EnvStep(observation="", observation_tokens=(5,), replaces_prompt=True)).replaces_prompt


class Tokens(Calculator):
    """Works in tokens: made with the tokenizer, stepped with the turn's ids too."""

    seen: list = []

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def step(self, action, token_ids):
        Tokens.seen.append((action, token_ids))
        return EnvStep(observation="", observation_tokens=tuple(self.tokenizer("?")["input_ids"]), done=True)


def test_an_environment_that_works_in_tokens_is_made_with_the_tokenizer_and_stepped_with_the_turns_ids():
    Tokens.seen = []
    runner, _, _ = make_runner([["ab"], ["c"]], env=EnvironmentSpec("tokens", Tokens, (), eos_calls=True,
                                                                      token_turns=True))
    runner.start(admitted())
    [group] = run_until_done(runner)
    assert sorted(Tokens.seen) == [("ab", tuple(ids("ab") + [EOS])), ("c", tuple(ids("c") + [EOS]))]
    assert group.episodes[0].tokens[-1] == ids("?")[0]
    engine = ScriptEngine([["ab"]])
    Tokens.seen = []
    play_episodes(engine, TOKENIZER, EnvironmentSpec("tokens", Tokens, (), eos_calls=True, token_turns=True),
                  settings(), [ids("1+1=")], [Problem(1, "1+1=", "2")], temperature=0.0)
    assert Tokens.seen == [("ab", tuple(ids("ab") + [EOS]))]


def test_evaluation_plays_an_episode_from_the_prompt_its_reset_replaced():
    OwnPrompt.made = 0
    engine = ScriptEngine([["[12*34]", "408"]])
    prompts, generate = [], engine.generate
    engine.generate = lambda contexts, **kw: (prompts.append([list(c) for c in contexts]), generate(contexts, **kw))[1]
    problems = [Problem(1, "12*34=", "408")]
    [episode] = play_episodes(engine, TOKENIZER, spec(OwnPrompt), settings(),
                              [ids(p.prompt) for p in problems], problems, temperature=0.0)
    assert episode.prompt == ids("q:12*34=") and prompts[0] == [ids("q:12*34=")]
    assert episode.answer_text(TOKENIZER) == "408"


class Winning(Calculator):
    """Ends the episode at its first call, answering "=ok" with reward 1."""

    def step(self, action):
        return EnvStep(observation="=ok", reward=1.0, done=True)


def test_an_episode_its_environment_ends_is_finished_even_when_the_last_observation_exactly_fills_the_budget():
    # "[1*2]" is 5 tokens and "=ok" 3: a budget of 8 holds both, and nothing needs to follow.
    runner, _, stats = make_runner([["[1*2]"], ["[1*2]"]], env=spec(Winning), max_new_tokens=8)
    runner.start(admitted())
    [group] = run_until_done(runner)
    episode = group.episodes[0]
    assert episode.tokens == ids("[1*2]") + ids("=ok") and not episode.truncated and episode.env_reward == 1.0
    assert stats.episodes_overflowed == 0


def test_an_environment_that_cannot_be_made_counts_a_failed_call_for_the_error_window():
    def broken():
        raise OSError("no port free")

    runner, _, stats = make_runner([["1"], ["1"]], env=EnvironmentSpec("broken", broken, ("]",)))
    runner.start(admitted())
    [group] = run_until_done(runner)
    assert all(e.failed == "exception" for e in group.episodes)
    assert stats.env_calls == 2 and stats.env_errors == {"exception": 2}  # a rate of 1, not "no calls"


def test_a_slow_close_runs_beside_the_loop_never_on_it():
    import threading

    release, closing, closed = threading.Event(), threading.Event(), threading.Event()

    class SlowClose(Calculator):
        def close(self):
            closing.set()
            release.wait(2)  # a close POSTed to a server that does not answer
            closed.set()

    runner, _, _ = make_runner([["5"], ["6"]], env=spec(SlowClose))
    runner.start(admitted())
    [group] = run_until_done(runner)  # returns while the closes still wait (on the loop, it would not)
    assert not closed.is_set() and all(e.env is None for e in group.episodes)
    assert closing.wait(5)
    release.set()


def test_when_every_thread_is_held_by_a_hung_call_queued_calls_time_out_too():
    import threading

    forever = threading.Event()
    calls = EnvCalls(threads=1, timeout_s=0.05, latency_s=0.0)  # 4 threads at most, each then hung
    for key in range(7):
        calls.submit(key, lambda _: forever.wait(), checked_step, "x")
    results = {}
    for _ in range(400):
        results.update(calls.finished(wait_s=0.05))
        if len(results) == 7:
            break
    assert sorted(results) == list(range(7)) and all(r.cause == "timeout" for r in results.values())
    assert calls.pending == 0
    forever.set()
