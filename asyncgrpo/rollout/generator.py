"""The generator: sample groups with vLLM, score them, stream them to the learner.

Plain Python; `train.py` wraps it in a Ray actor, tests may run it in-process.

Staleness throttle (DESIGN.md): with quota q = this generator's share of a step's groups, a
group may start only while groups started < (max_staleness + v + 1) * q, where v is the policy
version of the weights loaded in the engine. Generating with loaded weights v keeps every group
within max_staleness versions of the learner that consumes it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncgrpo.schema import Config
from asyncgrpo.resources import pin_to_cores
from asyncgrpo.rollout.engine import Completion, VLLMEngine
from asyncgrpo.rewards.scorer import GroupScore, Scorer
from asyncgrpo.tasks import Problem, make_task, train_stream
from asyncgrpo.timing import PhaseTimer
from asyncgrpo.weights import WeightReceiver
from asyncgrpo.weights.zmq import ZmqWeightReceiver
from asyncgrpo.wire.security import CurveClientKeys
from asyncgrpo.wire import Heartbeat, ScoredGroup, Sender, Subscriber, VersionAck, WireTimeout, encode_group


class _Growing:
    """A sequence generated in segments, possibly by several policy versions (in-flight updates)."""

    def __init__(self, first: Completion, version: int) -> None:
        self.tokens, self.logprobs = [first.token_ids], [first.logprobs]
        self.versions = [np.full(first.token_ids.size, version, dtype=np.int32)]
        self.finished = first.finished
        self.length = int(first.token_ids.size)

    def extend(self, more: Completion, version: int) -> None:
        self.tokens.append(more.token_ids)
        self.logprobs.append(more.logprobs)
        self.versions.append(np.full(more.token_ids.size, version, dtype=np.int32))
        self.finished = more.finished
        self.length += int(more.token_ids.size)

    def token_list(self) -> list[int]:
        return np.concatenate(self.tokens).tolist()

    def completion(self) -> Completion:
        return Completion(token_ids=np.concatenate(self.tokens), logprobs=np.concatenate(self.logprobs),
                          finished=self.finished, versions=np.concatenate(self.versions))


@dataclass
class _Scoring:
    """A generated batch whose rewards are being computed."""

    problems: list[Problem]
    prompts: list[list[int]]
    completions: list[list[Completion]]
    future: concurrent.futures.Future


class GeneratorStopped(Exception):
    """The learner asked for shutdown while this generator was waiting."""


@dataclass
class GeneratorStats:
    groups_sent: int = 0
    tokens_generated: int = 0
    weight_loads: int = 0
    throttled_waits: int = 0
    inflight_switches: int = 0
    send_blocked_s: float = 0.0
    exhausted: bool = False
    timer: PhaseTimer = field(default_factory=PhaseTimer)

    def as_dict(self) -> dict[str, float]:
        return {
            "gen/groups_sent": self.groups_sent,
            "gen/tokens_generated": self.tokens_generated,
            "gen/weight_loads": self.weight_loads,
            "gen/throttled_waits": self.throttled_waits,
            "gen/inflight_switches": self.inflight_switches,
            "gen/send_blocked_s": self.send_blocked_s,
            **self.timer.metrics("gen_time/"),
        }


def throttle_limit(max_staleness: int, loaded_version: int, quota_per_step: int) -> int:
    """How many groups a generator may have started in total while it holds `loaded_version`.

    Group k (0-based) of this generator is consumed at learner version >= k // quota, so starting
    it only while k < (max_staleness + v + 1) * quota, with weights v, bounds its staleness by
    max_staleness. max_staleness = 0 gives lock-step synchronous GRPO.
    """
    return (max_staleness + loaded_version + 1) * quota_per_step


class Generator:
    def __init__(
        self,
        cfg: Config,
        generator_id: int,
        model_dir: str,
        groups_endpoint: str,
        weights_endpoint: str,
        quota_per_step: int,
        cores: list[int] | None = None,
        curve: CurveClientKeys | None = None,
        initial_version: int = 0,
        skip_problems: int = 0,
    ) -> None:
        """`initial_version` / `skip_problems`: resuming from a checkpoint, `model_dir` holds that
        version's weights and the first `skip_problems` prompts of this generator's stream were used."""
        pin_to_cores(cores or [])
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.generator_id = generator_id
        self.quota_per_step = quota_per_step
        self.throttle = cfg.train.stale_policy in ("throttle", "both")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.task = make_task(cfg, self.tokenizer)
        self.problems = train_stream(self.task, cfg, generator_id)
        if skip_problems:
            self.problems = itertools.islice(self.problems, skip_problems, None)
        # Rewards (asyncgrpo/rewards/scorer.py): scorer.submit() scores without blocking generation.
        self.scorer = Scorer(self.task, cfg.reward)
        self.engine = VLLMEngine(
            model_dir,
            seed=cfg.seed * 1000 + generator_id,
            max_model_len=cfg.model.max_positions,
            dtype=cfg.rollout.dtype,
            kv_cache_gib=cfg.rollout.kv_cache_gib,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        )
        # Room on the wire for one vLLM call's groups: a call's batch goes out without waiting for
        # the learner's receiving thread, which competes with training for its core and the GIL.
        # Memory stays bounded: a call's groups in the socket buffers, the rest by the throttle.
        self.groups_per_call = cfg.rollout.groups_per_call or quota_per_step
        self.sender = Sender(groups_endpoint, high_water_mark=max(8, self.groups_per_call), curve=curve)
        subscriber = Subscriber(weights_endpoint, cfg.wire.max_message_bytes, curve=curve)
        self.weights: WeightReceiver
        if cfg.weights.backend == "nccl":
            import torch

            from asyncgrpo.weights.nccl import NcclWeightReceiver

            device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
            self.weights = NcclWeightReceiver(subscriber, model_dir, device, timeout_s=cfg.wire.startup_timeout_s)
        else:
            self.weights = ZmqWeightReceiver(subscriber)
        self.version = initial_version
        self.next_seq = 0
        # As if the steps before the checkpoint had been generated here: the throttle then allows
        # max_staleness + 1 steps ahead of the resumed version, not of version 0.
        self.groups_started = initial_version * quota_per_step
        self.stats = GeneratorStats()
        self._last_heartbeat = 0.0

    def connect_weight_group(self, address: dict[str, Any]) -> None:
        """weights.backend=nccl: join the learner's weight group as rank generator_id + 1."""
        self.weights.connect(address["host"], address["port"], self.generator_id + 1,  # type: ignore[attr-defined]
                             address["world_size"])

    def ready(self) -> dict[str, int]:
        return {"generator_id": self.generator_id, "pid": os.getpid(), "version": self.version}

    # ------------------------------------------------------------------------------------ the loop

    def run(self) -> dict[str, float]:
        """Generate until the learner says stop; returns this generator's counters and timings.

        Rewards that take time (an HTTP judge) are computed while the next batch generates: a
        batch is sent once the following vLLM call returns, or before waiting on the throttle.
        """
        timer = self.stats.timer
        per_call = self.groups_per_call
        run_start = time.perf_counter()
        pending: _Scoring | None = None
        # Version 0 is loaded from disk; acknowledging it tells the learner this generator is up.
        self.sender.try_send(VersionAck(self.generator_id, self.version), timeout_s=1.0)
        try:
            while True:
                with timer("weights"):
                    self._load_newest_weights(wait_s=0.0)
                allowed = self._groups_allowed() - self.groups_started
                problems = list(itertools.islice(self.problems, min(per_call, allowed))) if allowed > 0 else []
                if not problems:
                    if pending is not None:
                        self._send_scored(pending)
                        pending = None
                    elif allowed > 0:
                        with timer("exhausted"):
                            self._wait_for_shutdown()  # a finite dataset ran out
                    else:
                        with timer("throttle"):
                            self.stats.throttled_waits += 1
                            self._wait_for_new_weights()
                    continue
                self.groups_started += len(problems)
                prompts = self._tokenize(problems)
                with timer("generate"):
                    completions = self._generate(prompts)
                with timer("score"):
                    scoring = _Scoring(problems, prompts, completions,
                                       self.scorer.submit(problems, [self.completion_texts(c) for c in completions]))
                if pending is not None:  # its rewards were computed during this vLLM call
                    self._send_scored(pending)
                    pending = None
                if scoring.future.done():
                    self._send_scored(scoring)
                else:
                    pending = scoring
        except GeneratorStopped:
            self.weights.poll(0.0)
            self._apply_latest_weights()  # leave the engine at the final version
        finally:
            self.scorer.close()
        wall_s = time.perf_counter() - run_start
        return {**self.stats.as_dict(), **self.scorer.stats_snapshot(), "gen/version": self.version,
                "gen/weight_load_path": self.engine.weight_load_path,
                "gen/wall_s": wall_s, "gen/idle_s": self.idle_s, "gen/idle_frac": self.idle_s / wall_s if wall_s > 0 else 0.0}

    def _send_scored(self, scoring: _Scoring) -> None:
        """Wait for a batch's rewards, then send its groups."""
        timer = self.stats.timer
        with timer("score_wait"):
            scores = scoring.future.result(timeout=self._score_timeout_s(len(scoring.problems)))
        with timer("send"):
            for problem, prompt, completions, score in zip(scoring.problems, scoring.prompts, scoring.completions,
                                                           scores):
                group = self._scored_group(problem, prompt, completions, score)
                if group is None:  # reward.on_error=drop_group: give the throttle quota back
                    self.groups_started -= 1
                    continue
                self._send(group)

    def _score_timeout_s(self, num_groups: int) -> float:
        """Generous: every reward call is bounded by its own timeout and retries; this only catches a hang."""
        judge = self.cfg.reward.judge
        calls = num_groups * self.cfg.rollout.samples_per_prompt
        waves = -(-calls // max(1, judge.concurrency))
        per_call = max(self.cfg.reward.timeout_s, judge.timeout_s * (judge.retries + 1) + judge.backoff_s * 2 ** judge.retries)
        return self.cfg.wire.timeout_s + waves * per_call

    def _wait_for_shutdown(self) -> None:
        """Nothing left to generate: keep loading weights and heartbeating until the learner says stop."""
        if not self.stats.exhausted:
            self.stats.exhausted = True
            print(f"[generator {self.generator_id}] the training data is exhausted (data.epochs="
                  f"{self.cfg.data.epochs}); waiting for the learner to stop", flush=True)
        self._load_newest_weights(wait_s=0.5)
        self._heartbeat()

    @property
    def idle_s(self) -> float:
        """Seconds spent waiting on the throttle, on new weights or on a full queue."""
        seconds = self.stats.timer.seconds
        return seconds["throttle"] + seconds["score_wait"] + seconds["exhausted"] + self.stats.send_blocked_s

    def _groups_allowed(self) -> float:
        if not self.throttle:
            return float("inf")
        return throttle_limit(self.cfg.train.max_staleness, self.version, self.quota_per_step)

    # ---------------------------------------------------------------------------------- sampling

    def _tokenize(self, problems: list[Problem]) -> list[list[int]]:
        return [self.tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]

    def _sample(self, prompts: list[list[int]], temperature: float, n: int | None = None) -> list[list[Completion]]:
        return self.engine.generate(
            prompts,
            n=n or self.cfg.rollout.samples_per_prompt,
            max_tokens=self.cfg.rollout.max_new_tokens,
            temperature=temperature,
        )

    def _generate(self, prompts: list[list[int]]) -> list[list[Completion]]:
        """`samples_per_prompt` completions per prompt, each token tagged with the version that sampled it.

        With `rollout.inflight_updates`, generation runs in segments of `rollout.inflight_chunk_tokens`;
        between segments the newest weights are loaded and every unfinished sequence resumes from its
        prompt plus the tokens it already has, so a push never waits for a whole call and no sampled
        token is thrown away.
        """
        r = self.cfg.rollout
        if not r.inflight_updates:
            completions = self._sample(prompts, r.temperature)
            for group in completions:
                for c in group:
                    c.versions = np.full(c.token_ids.size, self.version, dtype=np.int32)
            return completions
        segment = min(r.inflight_chunk_tokens, r.max_new_tokens)
        first = self.engine.generate(prompts, n=r.samples_per_prompt, max_tokens=segment, temperature=r.temperature)
        groups = [[_Growing(c, self.version) for c in group] for group in first]
        while True:
            unfinished = [(prompt, s) for prompt, group in zip(prompts, groups) for s in group
                          if not s.finished and s.length < r.max_new_tokens]
            if not unfinished:
                return [[s.completion() for s in group] for group in groups]
            if self._load_newest_weights(wait_s=0.0):
                self.stats.inflight_switches += 1
            outputs = self.engine.generate(
                [prompt + s.token_list() for prompt, s in unfinished], n=1,
                max_tokens=segment, temperature=r.temperature,
                max_tokens_per_prompt=[min(segment, r.max_new_tokens - s.length) for _, s in unfinished],
            )
            for (_, s), out in zip(unfinished, outputs):
                s.extend(out[0], self.version)

    def _completion_text(self, completion: Completion) -> str:
        return self.tokenizer.decode(completion.token_ids.tolist(), skip_special_tokens=True)

    def completion_texts(self, completions: list[Completion]) -> list[str]:
        return [self._completion_text(c) for c in completions]

    def _scored_group(self, problem: Problem, prompt_tokens: list[int], completions: list[Completion],
                      score: GroupScore | None = None) -> ScoredGroup | None:
        """The group to send; `score` from `self.scorer.submit(...)`, or None to score here (blocking).

        Returns None when the reward policy drops the group (reward.on_error=drop_group and a
        reward failed): the caller must not send it, and may start a replacement.
        """
        if score is None:
            score = self.scorer.score([problem], [self.completion_texts(completions)])[0]
        if score.dropped:
            return None
        prompt = np.asarray(prompt_tokens, dtype=np.int32)
        rewards = score.rewards
        tokens = np.concatenate([c.token_ids for c in completions]).astype(np.int32)
        self.stats.tokens_generated += int(tokens.size)
        group = ScoredGroup(
            generator_id=self.generator_id,
            seq=-1,  # assigned when sent, so heartbeats and sequence numbers agree
            prompt_id=problem.id,
            prompt_tokens=prompt,
            tokens=tokens,
            logprobs=np.concatenate([c.logprobs for c in completions]).astype(np.float32),
            versions=np.concatenate([c.versions if c.versions is not None else np.full(c.token_ids.size, self.version)
                                     for c in completions]).astype(np.int32),
            lengths=np.asarray([c.token_ids.size for c in completions], dtype=np.int32),
            rewards=rewards,
            meta={"version": self.version, **score.meta()},
        )
        return group

    # ------------------------------------------------------------------------------ transport

    def _send(self, group: ScoredGroup) -> None:
        """Send, waiting on a full queue; meanwhile new weights are loaded (a safe point) and a stop is heard."""
        deadline = time.monotonic() + self.cfg.wire.timeout_s
        group.seq = self.next_seq
        # Cumulative counters; the learner logs their increase per step (learner.GENERATOR_COUNTERS).
        reward_stats = self.scorer.stats_snapshot()
        group.meta.update(gen_idle_s=self.idle_s, gen_reward_errors=reward_stats["reward/errors"],
                          gen_reward_groups_dropped=reward_stats["reward/groups_dropped"])
        blocked_since = None
        while not self.sender.try_send(group, timeout_s=0.5 if blocked_since else 0.0):
            blocked_since = blocked_since or time.perf_counter()
            self._load_newest_weights(wait_s=0.0)
            if time.monotonic() > deadline:
                raise WireTimeout(
                    f"generator {self.generator_id}: the learner took no group for {self.cfg.wire.timeout_s:.0f} s"
                )
        if blocked_since is not None:
            self.stats.send_blocked_s += time.perf_counter() - blocked_since
        self.next_seq += 1
        self.stats.groups_sent += 1
        self._heartbeat()

    def _heartbeat(self, every_s: float = 1.0) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= every_s:
            self._last_heartbeat = now
            self.sender.try_send(Heartbeat(self.generator_id, self.next_seq, self.version), timeout_s=0.0)

    def _apply_latest_weights(self) -> bool:
        version = self.weights.apply_newest(self.engine)
        if version is None:
            return False
        self.version = version
        self.stats.weight_loads += 1
        self.sender.try_send(VersionAck(self.generator_id, version), timeout_s=1.0)
        return True

    def _load_newest_weights(self, wait_s: float) -> bool:
        """Apply the newest complete push, if any (a safe point: no request is in flight)."""
        self.weights.poll(wait_s)
        loaded = self._apply_latest_weights()
        if self.weights.shutdown_reason is not None:
            raise GeneratorStopped(self.weights.shutdown_reason)
        return loaded

    def _wait_for_new_weights(self) -> None:
        deadline = time.monotonic() + self.cfg.wire.timeout_s
        while not self._load_newest_weights(wait_s=0.5):
            self._heartbeat()
            if time.monotonic() > deadline:
                raise WireTimeout(
                    f"generator {self.generator_id} (throttled at version {self.version}) received no new "
                    f"weights for {self.cfg.wire.timeout_s:.0f} s"
                )

    # ------------------------------------------------------------------------- eval and probes

    def evaluate(self, problems: list[Problem], temperature: float) -> float:
        """Held-out accuracy with one sample per problem (temperature 0 = greedy)."""
        completions = self._sample(self._tokenize(problems), temperature, n=1)
        correct = [self.task.score(self._completion_text(c[0]), p) for p, c in zip(problems, completions)]
        return float(np.mean(correct))

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[np.ndarray]:
        return self.engine.sequence_logprobs(sequences, temperature=self.cfg.rollout.temperature)

    def loaded_version(self) -> int:
        return self.version

    def generate_alone(self, num_groups: int) -> dict[str, Any]:
        """Benchmark: generate and score `num_groups` groups with no learner (no throttle, no sends).

        Returns the timing and the groups' encoded frames, which the learner can train on alone.
        """
        per_call = self.groups_per_call
        frames: list[list[bytes]] = []
        tokens = 0
        start = time.perf_counter()
        while len(frames) < num_groups:
            problems = list(itertools.islice(self.problems, min(per_call, num_groups - len(frames))))
            prompts = self._tokenize(problems)
            completions = self._generate(prompts)
            for problem, prompt, group_completions in zip(problems, prompts, completions):
                group = self._scored_group(problem, prompt, group_completions)
                if group is None:  # reward.on_error=drop_group
                    continue
                group.seq = len(frames)
                tokens += int(group.tokens.size)
                frames.append([bytes(frame) for frame in encode_group(group)])
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "groups": num_groups, "samples": num_groups * self.cfg.rollout.samples_per_prompt,
                "tokens": tokens, "frames": frames}
