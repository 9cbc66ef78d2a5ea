"""The generator: sample groups with vLLM, score them, stream them to the learner.

Plain Python; `train.py` wraps it in a Ray actor, tests may run it in-process.

Staleness throttle (DESIGN.md): with quota q = this generator's share of a step's groups, a
group may start only while groups started < (max_staleness + v + 1) * q, where v is the policy
version of the weights loaded in the engine. Generating with loaded weights v keeps every group
within max_staleness versions of the learner that consumes it.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

import numpy as np

from asyncgrpo.config import Config
from asyncgrpo.resources import pin_to_cores
from asyncgrpo.rollout.engine import Completion, VLLMEngine
from asyncgrpo.tasks import ArithmeticTask, Problem
from asyncgrpo.timing import PhaseTimer
from asyncgrpo.weights.zmq import ZmqWeightReceiver
from asyncgrpo.wire.security import CurveClientKeys
from asyncgrpo.wire import Heartbeat, ScoredGroup, Sender, Subscriber, VersionAck, WireTimeout


class GeneratorStopped(Exception):
    """The learner asked for shutdown while this generator was waiting."""


@dataclass
class GeneratorStats:
    groups_sent: int = 0
    tokens_generated: int = 0
    weight_loads: int = 0
    throttled_waits: int = 0
    timer: PhaseTimer = field(default_factory=PhaseTimer)

    def as_dict(self) -> dict[str, float]:
        return {
            "gen/groups_sent": self.groups_sent,
            "gen/tokens_generated": self.tokens_generated,
            "gen/weight_loads": self.weight_loads,
            "gen/throttled_waits": self.throttled_waits,
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
    ) -> None:
        pin_to_cores(cores or [])
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.generator_id = generator_id
        self.quota_per_step = quota_per_step
        self.throttle = cfg.train.stale_policy in ("throttle", "both")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.task = ArithmeticTask(num_digits=cfg.task.num_digits, eval_size=cfg.task.eval_size)
        self.problems = self.task.train_problems(seed=cfg.seed * 1000 + generator_id)
        self.engine = VLLMEngine(
            model_dir,
            seed=cfg.seed * 1000 + generator_id,
            max_model_len=cfg.model.max_positions,
            dtype=cfg.rollout.dtype,
            kv_cache_gib=cfg.rollout.kv_cache_gib,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        )
        self.sender = Sender(groups_endpoint, curve=curve)
        self.weights = ZmqWeightReceiver(Subscriber(weights_endpoint, cfg.wire.max_message_bytes, curve=curve))
        self.version = 0
        self.next_seq = 0
        self.groups_started = 0
        self.stats = GeneratorStats()
        self._last_heartbeat = 0.0

    def ready(self) -> dict[str, int]:
        return {"generator_id": self.generator_id, "pid": os.getpid(), "version": self.version}

    # ------------------------------------------------------------------------------------ the loop

    def run(self) -> dict[str, float]:
        """Generate until the learner says stop; returns this generator's counters and timings."""
        timer = self.stats.timer
        per_call = self.cfg.rollout.groups_per_call or self.quota_per_step
        try:
            while True:
                with timer("weights"):
                    self._load_newest_weights(wait_s=0.0)
                allowed = self._groups_allowed() - self.groups_started
                if allowed <= 0:
                    with timer("throttle"):
                        self.stats.throttled_waits += 1
                        self._wait_for_new_weights()
                    continue
                problems = list(itertools.islice(self.problems, min(per_call, allowed)))
                self.groups_started += len(problems)
                prompts = self._tokenize(problems)
                with timer("generate"):
                    completions = self._sample(prompts, self.cfg.rollout.temperature)
                with timer("score"):
                    groups = [self._scored_group(p, t, c) for p, t, c in zip(problems, prompts, completions)]
                with timer("send"):
                    for group in groups:
                        self._send(group)
        except GeneratorStopped:
            self.weights.poll(0.0)
            self._apply_latest_weights()  # leave the engine at the final version
        return {**self.stats.as_dict(), "gen/version": self.version}

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

    def _completion_text(self, completion: Completion) -> str:
        return self.tokenizer.decode(completion.token_ids.tolist(), skip_special_tokens=True)

    def _scored_group(self, problem: Problem, prompt_tokens: list[int], completions: list[Completion]) -> ScoredGroup:
        prompt = np.asarray(prompt_tokens, dtype=np.int32)
        rewards = np.asarray([self.task.score(self._completion_text(c), problem) for c in completions], dtype=np.float32)
        tokens = np.concatenate([c.token_ids for c in completions]).astype(np.int32)
        self.stats.tokens_generated += int(tokens.size)
        group = ScoredGroup(
            generator_id=self.generator_id,
            seq=-1,  # assigned when sent, so heartbeats and sequence numbers agree
            prompt_id=problem.id,
            prompt_tokens=prompt,
            tokens=tokens,
            logprobs=np.concatenate([c.logprobs for c in completions]).astype(np.float32),
            versions=np.full(tokens.size, self.version, dtype=np.int32),
            lengths=np.asarray([c.token_ids.size for c in completions], dtype=np.int32),
            rewards=rewards,
            meta={"version": self.version},
        )
        return group

    # ------------------------------------------------------------------------------ transport

    def _send(self, group: ScoredGroup) -> None:
        """Send, waiting on a full queue; keeps reading the weight stream so a stop is heard."""
        deadline = time.monotonic() + self.cfg.wire.timeout_s
        group.seq = self.next_seq
        while not self.sender.try_send(group, timeout_s=0.5):
            self._check_control()
            if time.monotonic() > deadline:
                raise WireTimeout(
                    f"generator {self.generator_id}: the learner took no group for {self.cfg.wire.timeout_s:.0f} s"
                )
        self.next_seq += 1
        self.stats.groups_sent += 1
        self._heartbeat()

    def _heartbeat(self, every_s: float = 1.0) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= every_s:
            self._last_heartbeat = now
            self.sender.try_send(Heartbeat(self.generator_id, self.next_seq, self.version), timeout_s=0.0)

    def _check_control(self) -> None:
        self.weights.poll(0.0)
        if self.weights.shutdown_reason is not None:
            raise GeneratorStopped(self.weights.shutdown_reason)

    def _apply_latest_weights(self) -> bool:
        latest = self.weights.take_latest()
        if latest is None:
            return False
        version, named_tensors = latest
        self.engine.load_weights(named_tensors)
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
