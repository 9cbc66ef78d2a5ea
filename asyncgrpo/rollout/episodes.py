"""Episodes: a group's n rollouts, each the policy's turns with an environment's answers between them.

Invariants (docs/ENVIRONMENTS.md, How the generator runs episodes):
- One path. Every rollout is an episode; without an environment (env.name="") an episode is the
  policy's one turn, ended by EOS or the token budget, and no environment is ever called.
- A group's first turns are one engine request of n samples of the prompt (without an environment,
  exactly the single-turn rollout); every later turn is a request of one sample whose prompt is its
  episode so far (prompt, turns, observations), so episodes run apart: one waiting on its environment
  holds back no other, and the engine decodes other episodes meanwhile.
- Each token is the policy's (sampled: its log-prob and the version that sampled it are kept) or the
  environment's (an observation: `policy_mask` 0, never trained). Versions are per token, so a weight
  load between turns is allowed; the group's admission version stays the oldest any token can have.
- The budget rollout.max_new_tokens counts every token after the prompt, observations included, so
  an episode always fits the learner's context as a single-turn completion does. An observation that
  would not fit ends the episode as truncated (gen/episodes_overflowed), not the run.
- The rewards see the text of the policy's last turn only (an observation is never scored as if the
  policy wrote it), plus the environment's rewards summed over the episode (logged as reward/env).
- A failed environment call (raised, timed out, answered garbage) ends its episode and is counted per
  cause; env.on_error says whether the group is sent with that episode's reward 0 or dropped.
- An environment's reset may replace an episode's prompt with tokens of its own (an agent's rendered
  first request: EnvStep.replaces_prompt); the budget counts from that prompt, and the group goes out
  with its episodes' common prefix as the prompt (rollout/groups.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncgrpo.envs import EpisodeRules
from asyncgrpo.envs.base import EnvironmentSpec, Environment, EnvStep
from asyncgrpo.envs.calls import EnvCallResult, EnvCalls, checked_reset, checked_step
from asyncgrpo.rollout.engine import Completion
from asyncgrpo.rollout.running import Admitted
from asyncgrpo.rollout.stats import GeneratorStats


@dataclass(frozen=True)
class EpisodeSettings:
    """rollout.samples_per_prompt, rollout.max_new_tokens (the episode's budget after the prompt),
    rollout.temperature, the engine's context in tokens (model.max_positions) and the env.* rules
    (envs.episode_rules: max_turns, on_error, how the calls run); the composition root builds it
    (rollout/parts.py: episode_settings)."""

    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    context_tokens: int
    env: EpisodeRules


@dataclass
class Episode:
    """One rollout: the tokens after the prompt, whose they are, and how it ended."""

    prompt: list[int]  # the task's prompt, or what the environment's reset replaced it with
    env: Environment | None = None
    tokens: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)  # 1 = sampled by the policy, 0 = an observation
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    last_turn: tuple[int, int] = (0, 0)  # the latest policy turn's span in `tokens`
    env_reward: float = 0.0
    truncated: bool = False  # the budget or the context ran out
    failed: str = ""  # the cause of the environment failure that ended it
    done: bool = False

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def add_turn(self, completion: Completion, version: int) -> None:
        start = len(self.tokens)
        ids = completion.token_ids.tolist()
        self.tokens += ids
        self.policy += [1] * len(ids)
        self.logprobs += completion.logprobs.tolist()
        self.versions += completion.versions.tolist() if completion.versions is not None else [version] * len(ids)
        self.turns += 1
        self.last_turn = (start, len(self.tokens))

    def add_observation(self, ids: list[int], version: int) -> None:
        self.tokens += ids
        self.policy += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)  # not the policy's: ignored wherever versions count

    def end(self, truncated: bool = False, failed: str = "") -> None:
        self.done, self.truncated, self.failed = True, truncated, failed

    def release_env(self, calls: EnvCalls | None) -> None:
        """Close the episode's environment on `calls`' threads (a close may be a request to a slow
        server: never on the generator's loop), once."""
        env, self.env = self.env, None
        if env is not None and calls is not None:
            calls.background(env.close)

    def as_completion(self) -> Completion:
        """The episode as one completion: every token after the prompt, with its policy mask."""
        return Completion(token_ids=np.asarray(self.tokens, dtype=np.int32),
                          logprobs=np.asarray(self.logprobs, dtype=np.float32), finished=not self.truncated,
                          versions=np.asarray(self.versions, dtype=np.int32),
                          policy_mask=np.asarray(self.policy, dtype=np.uint8))

    def answer_text(self, tokenizer: Any) -> str:
        """The text of the policy's last turn: what the rewards score (and an environment is called with)."""
        start, end = self.last_turn
        return tokenizer.decode(self.tokens[start:end], skip_special_tokens=True)


@dataclass
class EpisodeGroup:
    """A granted prompt's n episodes."""

    admitted: Admitted
    episodes: list[Episode]

    @property
    def done(self) -> bool:
        return all(e.done for e in self.episodes)

    @property
    def failed(self) -> bool:
        return any(e.failed for e in self.episodes)


def after_turn(episode: Episode, completion: Completion, version: int, env: EnvironmentSpec | None,
               max_turns: int) -> str:
    """Add a policy turn to `episode`; what comes next: "truncated" (cut at its token limit), "end"
    (the answer's end, or no environment) or "call" (its environment answers it: also after the last
    turn allowed, whose rewards count though nothing follows it; `after_answer`)."""
    episode.add_turn(completion, version)
    if not completion.finished:
        return "truncated"
    if env is None or (completion.stop_reason is None and not env.eos_calls):
        return "end"
    return "call"


def after_answer(tokenizer: Any, settings: EpisodeSettings, episode: Episode, answer: EnvStep, version: int) -> str:
    """Add the environment's answer to `episode`; what comes next: "overflow" (its observation would
    not fit the budget or the context: nothing added), "end" (the environment ended it) or "turn".
    An answer that replaces the prompt (reset's) sets `episode.prompt` instead, its budget untouched."""
    episode.env_reward += float(answer.reward)
    observation = (list(answer.observation_tokens) if answer.observation_tokens is not None
                   else tokenizer(answer.observation, add_special_tokens=False)["input_ids"])
    if answer.replaces_prompt:  # reset's only (calls.checked_reset): the episode has no tokens yet
        if len(observation) >= settings.context_tokens:
            return "overflow"
        episode.prompt = observation
        return "turn"
    fits = (len(episode.tokens) + len(observation) <= settings.max_new_tokens
            and len(episode.context) + len(observation) <= settings.context_tokens)
    if answer.done or episode.turns >= settings.env.max_turns:  # nothing follows: the observation if it fits
        if fits:
            episode.add_observation(observation, version)
        return "end"
    if not fits or len(episode.tokens) + len(observation) == settings.max_new_tokens or (
            len(episode.context) + len(observation) == settings.context_tokens):
        return "overflow"  # no room left for another turn
    episode.add_observation(observation, version)
    return "turn"


def new_environment(env: EnvironmentSpec, tokenizer: Any) -> Environment:
    """A fresh environment of `env` (given the tokenizer if it works in tokens: spec.token_turns)."""
    return env.new(tokenizer) if env.token_turns else env.new()


def step_arguments(env: EnvironmentSpec, episode: Episode, tokenizer: Any) -> tuple[Any, ...]:
    """What `step` is called with for `episode`'s last turn: its text (and its token ids, for an
    environment that works in tokens)."""
    text = episode.answer_text(tokenizer)
    if not env.token_turns:
        return (text,)
    start, end = episode.last_turn
    return text, tuple(episode.tokens[start:end])


class EpisodeRunner:
    """Runs the episodes of admitted groups on `engine`, calling the environment of `env` on
    `calls`' threads; `take_finished` hands over the groups whose episodes have all ended."""

    def __init__(self, engine: Any, tokenizer: Any, env: EnvironmentSpec | None, calls: EnvCalls | None,
                 settings: EpisodeSettings, stats: GeneratorStats) -> None:
        self.engine, self.tokenizer, self.env, self.calls = engine, tokenizer, env, calls
        self.settings, self.stats = settings, stats
        self.version = 0  # the weights loaded: observations and unlabelled turns are recorded with it
        # Set while a weight push waits for the engine to empty (no in-flight loads): turns made ready
        # by an environment's answer wait in `_ready` instead of refilling the engine.
        self.hold_turns = False
        self._ready: list[tuple[int, int]] = []
        self._groups: dict[int, EpisodeGroup] = {}
        # engine request id -> (group key, episode index; None: the group's first turns, one per episode)
        self._requests: dict[str, tuple[int, int | None]] = {}
        self._keys = itertools.count()

    # ---- admission and the engine

    def start(self, admitted: Admitted) -> None:
        """Start a granted prompt's n episodes. ValueError, with nothing started, for a prompt that
        leaves no room in the context."""
        s = self.settings
        if len(admitted.prompt) >= s.context_tokens:
            raise ValueError(f"prompt of {len(admitted.prompt)} tokens leaves no room in the context of "
                             f"{s.context_tokens} (model.max_positions)")
        key = next(self._keys)
        group = EpisodeGroup(admitted, [Episode(admitted.prompt) for _ in range(s.samples_per_prompt)])
        self._groups[key] = group
        if self.env is None:
            self._submit_first_turns(key)
            return
        for index, episode in enumerate(group.episodes):
            try:
                episode.env = new_environment(self.env, self.tokenizer)
            except Exception as err:  # noqa: BLE001 - counted as the episode's failure
                self.stats.env_calls += 1  # a call that failed: the error window counts it as one
                self._answered(("reset", key, index), EnvCallResult(cause="exception", error=f"new(): {err}"))
                continue
            self._call(("reset", key, index), episode.env.reset, checked_reset, admitted.problem)

    def _submit_first_turns(self, key: int) -> None:
        """Submit a group's first turns as one request of n samples of its prompt; if the engine
        refuses it (ValueError), the group is forgotten."""
        group, s = self._groups[key], self.settings
        request_id = f"{group.admitted.ticket.position}.{key}"
        try:
            self.engine.submit(request_id, group.admitted.prompt, n=s.samples_per_prompt,
                               max_tokens=min(s.max_new_tokens, s.context_tokens - len(group.admitted.prompt)),
                               temperature=s.temperature, stop=self.env.stop if self.env is not None else ())
        except ValueError:
            del self._groups[key]
            raise
        self._requests[request_id] = (key, None)

    def _submit_turn(self, key: int, index: int) -> None:
        """Submit an episode's next turn (ValueError if the engine refuses it); an episode with no
        room left ends as truncated instead."""
        group = self._groups[key]
        episode = group.episodes[index]
        s = self.settings
        room = min(s.max_new_tokens - len(episode.tokens), s.context_tokens - len(episode.context))
        if room < 1:
            self._overflowed(episode)
            return
        request_id = f"{group.admitted.ticket.position}.{key}.{index}.{episode.turns}"
        self.engine.submit(request_id, episode.context, n=1, max_tokens=room, temperature=s.temperature,
                           stop=self.env.stop if self.env is not None else ())
        self._requests[request_id] = (key, index)

    @property
    def engine_busy(self) -> bool:
        """Whether the engine has turns to decode."""
        return bool(self._requests)

    def step_engine(self) -> int:
        """One engine step: turns that ended go to their environment or end their episode; then the
        environment's answers that are in are applied (without waiting). Returns how many groups
        this step finished."""
        done_before = sum(group.done for group in self._groups.values())
        for finished in self.engine.step():
            key, index = self._requests.pop(finished.request_id, (None, None))
            if key is None:
                continue
            turns = enumerate(finished.completions) if index is None else [(index, finished.completions[0])]
            for i, completion in turns:
                self._turn_ended(key, i, completion)
        self.collect_env(wait_s=0.0)
        return sum(group.done for group in self._groups.values()) - done_before

    def _turn_ended(self, key: int, index: int, completion: Completion) -> None:
        episode = self._groups[key].episodes[index]
        outcome = after_turn(episode, completion, self.version, self.env, self.settings.env.max_turns)
        if outcome == "call":
            self._call(("step", key, index), episode.env.step, checked_step,
                       *step_arguments(self.env, episode, self.tokenizer))
        else:
            self._end(episode, truncated=outcome == "truncated")

    # ---- the environment

    def _call(self, key: Hashable, call: Any, check: Any, *arguments: Any) -> None:
        self.stats.env_calls += 1
        self.calls.submit(key, call, check, *arguments, step=key[0] == "step")

    @property
    def env_pending(self) -> int:
        """Environment calls whose answer has not been applied."""
        return self.calls.pending if self.calls is not None else 0

    def collect_env(self, wait_s: float) -> None:
        """Apply the environment's answers that are in, waiting up to `wait_s` for the first; the
        work of applying them (not the wait) is counted in `stats.env_answers_s`."""
        answers = self.calls.finished(wait_s) if self.calls is not None and self.calls.pending else []
        started = time.perf_counter()
        for key, result in answers:
            self._answered(key, result)
        if not self.hold_turns:
            ready, self._ready = self._ready, []
            for key, index in ready:
                self._next_turn(key, index)
        self.stats.count_env_answers(len(answers), time.perf_counter() - started)

    def _answered(self, key: Hashable, result: EnvCallResult) -> None:
        _, group_key, index = key
        group = self._groups.get(group_key)
        if group is None:  # dropped meanwhile
            return
        episode = group.episodes[index]
        if result.failed:
            self.stats.env_errors[result.cause] = self.stats.env_errors.get(result.cause, 0) + 1
            self.stats.env_first_error = self.stats.env_first_error or f"{result.cause}: {result.error}"
            self._end(episode, failed=result.cause)
            return
        answer = result.value if isinstance(result.value, EnvStep) else EnvStep(observation=result.value)
        self.stats.env_bad_actions += int(answer.bad_action)
        outcome = after_answer(self.tokenizer, self.settings, episode, answer, self.version)
        if outcome == "overflow":
            self._overflowed(episode)
        elif outcome == "end":
            self._end(episode)
        else:
            self._ready.append((group_key, index))

    def _next_turn(self, key: int, index: int) -> None:
        group = self._groups.get(key)
        if group is None:
            return
        try:
            self._submit_turn(key, index)
        except ValueError:  # the engine refused the longer context: as if it had not fitted
            self._overflowed(group.episodes[index])

    def _overflowed(self, episode: Episode) -> None:
        self.stats.episodes_overflowed += 1
        self._end(episode, truncated=True)

    def _end(self, episode: Episode, truncated: bool = False, failed: str = "") -> None:
        episode.end(truncated, failed)
        episode.release_env(self.calls)
        self.stats.episodes_finished += 1
        self.stats.episode_turns_sum += episode.turns

    # ---- groups out

    def take_finished(self) -> list[EpisodeGroup]:
        """The groups whose episodes have all ended, in the order they were started."""
        done = [key for key, group in self._groups.items() if group.done]
        return [self._groups.pop(key) for key in done]

    def drop_all(self) -> list[EpisodeGroup]:
        """Abort every turn in the engine and end every episode (the run is over, or the engine
        must be emptied); the groups dropped."""
        self.engine.abort()
        self._requests.clear()
        self._ready.clear()
        dropped, self._groups = list(self._groups.values()), {}
        for group in dropped:
            for episode in group.episodes:
                if not episode.done:
                    episode.end(truncated=True)
                episode.release_env(self.calls)
        return dropped

    def __len__(self) -> int:
        """Groups started and not yet taken."""
        return len(self._groups)


def play_episodes(engine: Any, tokenizer: Any, env: EnvironmentSpec | None, settings: EpisodeSettings,
                  prompts: list[list[int]], problems: list[Any], temperature: float) -> list[Episode]:
    """One episode per problem on an engine running nothing else (held-out evaluations): each round
    samples a turn of every running episode in one `generate` call, then waits for the environment's
    answers (on threads of its own: `settings.env.calls()`). The same episode rules as
    `EpisodeRunner`, at `temperature` (0 = greedy)."""
    calls = settings.env.calls() if env is not None else None
    episodes = [Episode(prompt) for prompt in prompts]
    try:
        _play(engine, tokenizer, env, calls, settings, episodes, problems, temperature)
    finally:
        for episode in episodes:
            episode.release_env(calls)
        if calls is not None:
            calls.close()
    return episodes


def _play(engine: Any, tokenizer: Any, env: EnvironmentSpec | None, calls: EnvCalls | None,
          settings: EpisodeSettings, episodes: list[Episode], problems: list[Any], temperature: float) -> None:
    active = list(range(len(episodes)))
    if env is not None:
        for i in list(active):
            try:
                episodes[i].env = new_environment(env, tokenizer)
            except Exception:  # noqa: BLE001 - the episode fails, as in training
                episodes[i].end(failed="exception")
                active.remove(i)
                continue
            calls.submit(i, episodes[i].env.reset, checked_reset, problems[i])
        active = _applied_answers(tokenizer, calls, settings, episodes, active)
    while active:
        rooms = {i: min(settings.max_new_tokens - len(episodes[i].tokens),
                        settings.context_tokens - len(episodes[i].context)) for i in active}
        for i in active:
            if rooms[i] < 1:
                episodes[i].end(truncated=True)
        active = [i for i in active if not episodes[i].done]
        if not active:
            break
        limits = [rooms[i] for i in active]
        outputs = engine.generate([episodes[i].context for i in active], n=1,
                                  max_tokens=limits[0] if len(set(limits)) == 1 else limits,
                                  temperature=temperature, stop=env.stop if env is not None else ())
        waiting = []
        for i, (completion,) in zip(active, outputs):
            outcome = after_turn(episodes[i], completion, 0, env, settings.env.max_turns)
            if outcome == "call":
                calls.submit(i, episodes[i].env.step, checked_step, *step_arguments(env, episodes[i], tokenizer),
                             step=True)
                waiting.append(i)
            else:
                episodes[i].end(truncated=outcome == "truncated")
        active = _applied_answers(tokenizer, calls, settings, episodes, waiting)


def _applied_answers(tokenizer: Any, calls: EnvCalls, settings: EpisodeSettings, episodes: list[Episode],
                     waiting: list[int]) -> list[int]:
    """Wait for the environment's answers to the episodes `waiting`, apply them; those that go on."""
    answers: dict[int, EnvCallResult] = {}
    while len(answers) < len(waiting):  # each call ends by env.timeout_s at the latest
        answers.update(calls.finished(wait_s=min(1.0, calls.timeout_s)))
    going_on = []
    for i in waiting:
        episode, result = episodes[i], answers[i]
        if result.failed:
            episode.end(failed=result.cause)
            continue
        answer = result.value if isinstance(result.value, EnvStep) else EnvStep(observation=result.value)
        outcome = after_answer(tokenizer, settings, episode, answer, 0)
        if outcome == "turn":
            going_on.append(i)
        else:
            episode.end(truncated=outcome == "overflow")
    return going_on

