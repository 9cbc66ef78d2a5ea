"""The generator: sample groups with vLLM, score them, stream them to the learner.

`Generator` runs on the parts it is given (rollout/parts.py: engine, tokenizer, task, prompt
stream, scorer, sink, weight receiver) as the generator its `GeneratorSpec` describes
(rollout/spec.py); `GeneratorActor` (rollout/actor.py) builds the real parts inside a Ray actor.
The pure parts live beside it: segments.py (in-flight updates), groups.py (the message).

Tickets: the generator asks learner rank 0 for the next slots of the training order
(rollout/tickets.py), which grants only slots within the staleness bound of the weights it holds,
and reads their prompts from the run's one prompt stream. A restarted generator (a new
`incarnation` of the same generator id, started by the driver) is told by `rejoin` which weights it
must load before generating, and then just asks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncgrpo.runtime import faults
from asyncgrpo.runtime.memory import peak_memory
from asyncgrpo.rollout.engine import Completion
from asyncgrpo.rollout.evaluations import PeriodicEvaluations
from asyncgrpo.rollout.groups import decode_completions, scored_group
from asyncgrpo.rollout.parts import GeneratorParts
from asyncgrpo.rollout.scoring import ScoringBatch
from asyncgrpo.rollout.segments import InFlight, tag_versions
from asyncgrpo.rollout.spec import GeneratorSpec
from asyncgrpo.rollout.waits import WaitLimit
from asyncgrpo.schema import Config
from asyncgrpo.tasks import Problem
from asyncgrpo.runtime.timing import PhaseTimer
from asyncgrpo.wire import (
    Heartbeat,
    SaveNotice,
    ScoredGroup,
    VersionAck,
)

# While waiting (for tickets, for new weights) the learner still hears from us this often.
HEARTBEAT_EVERY_S = 1.0
# Granted no ticket, a generator waits this long for newer weights before it asks again.
TICKET_RETRY_S = 0.2


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
    # Assembling and loading pushes into the engine, wherever it happens (top of the loop, while
    # granted nothing, between in-flight segments): the generator's side of a weight transfer.
    weight_load_s: float = 0.0
    # The part of weight_load_s spent inside a wait (granted nothing, blocked on a full queue,
    # rejoining), whose timer (gen_time/throttle_s, ...) therefore includes it: work done while
    # otherwise waiting (tools/bench_async.py counts it as busy time).
    weight_load_in_wait_s: float = 0.0
    timer: PhaseTimer = field(default_factory=PhaseTimer)

    @property
    def idle_s(self) -> float:
        """Seconds spent asking for and waiting for tickets, on rewards or on a full queue."""
        seconds = self.timer.seconds
        return seconds["throttle"] + seconds["ask"] + seconds["score_wait"] + self.send_blocked_s

    def count_weight_load(self, seconds: float, in_wait: bool) -> None:
        """A push loaded into the engine in `seconds`; `in_wait`: inside a wait whose timer includes them."""
        self.weight_loads += 1
        self.weight_load_s += seconds
        if in_wait:
            self.weight_load_in_wait_s += seconds

    def as_dict(self) -> dict[str, float]:
        return {
            "gen/groups_sent": self.groups_sent,
            "gen/tokens_generated": self.tokens_generated,
            "gen/weight_loads": self.weight_loads,
            "gen/throttled_waits": self.throttled_waits,
            "gen/inflight_switches": self.inflight_switches,
            "gen/send_blocked_s": self.send_blocked_s,
            "gen/weight_load_s": self.weight_load_s,
            "gen/weight_load_in_wait_s": self.weight_load_in_wait_s,
            **self.timer.metrics("gen_time/"),
        }


class Generator:
    """Samples groups with `engine`, scores them with `scorer`, sends them to `sink`; loads new
    weights from `weights` at safe points (between calls, between segments, while waiting)."""

    def __init__(self, cfg: Config, spec: GeneratorSpec, parts: GeneratorParts) -> None:
        """`spec`: who this generator is and which weights its engine starts with; `parts`: what it
        runs on (`tickets` and `positioned`: where slots and their prompts come from)."""
        self.cfg = cfg
        self.generator_id, self.incarnation = spec.generator_id, spec.incarnation
        self.engine, self.tokenizer, self.task = parts.engine, parts.tokenizer, parts.task
        self.scorer, self.sink, self.weights = parts.scorer, parts.sink, parts.weights
        self.tickets, self.positioned = parts.tickets, parts.positioned
        self._no_tickets_since: float | None = None  # the wait for a grant, across retries
        self._no_tickets_version = -1  # the weights held when that wait (re)started
        self.slowdown = faults.slowdown(spec.generator_id)
        self.pace_s = faults.pace_s(spec.generator_id)
        self.groups_per_call = spec.groups_per_call
        self.version = spec.initial_version
        self.next_seq = 0
        self._rejoin_version = spec.initial_version  # the version to load before generating (`rejoin`)
        self.stats = GeneratorStats()
        self._last_heartbeat = 0.0
        self._reported_rejections = 0
        self.wait_limit = WaitLimit(spec.generator_id, cfg.wire)
        # eval.every_steps (generator 0 only), taken by the driver (`take_evaluations`).
        self.evaluations = PeriodicEvaluations(cfg.eval.every_steps if spec.generator_id == 0 else 0,
                                               spec.initial_version, self.task)

    def join_weight_group(self, address: dict[str, Any]) -> None:
        """Join the learner's weight transport (`WeightSender.join_address`) as rank generator_id + 1."""
        self.weights.join({**address, "rank": self.generator_id + 1})

    def ready(self) -> dict[str, int]:
        return {"generator_id": self.generator_id, "pid": os.getpid(), "version": self.version,
                "incarnation": self.incarnation}

    def rejoin(self, newest_version: int, save: dict[str, Any] | None = None) -> None:
        """A restarted generator, before `run`: load version `newest_version` before generating
        anything, then ask for slots (nothing is counted or continued). `save`: the checkpoint save
        under way at learner rank 0 (`version`, `timeout_s` from now), whose announcement went out
        before we subscribed: our waits may last as long as it."""
        self._rejoin_version = newest_version
        if save is not None:
            self.weights.saves.note(SaveNotice(int(save["version"]), saving=True, timeout_s=float(save["timeout_s"])))

    # ------------------------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        """Generate until the learner says stop; returns this generator's counters and timings.

        Rewards that take time (an HTTP judge) are computed while the next batch generates: a
        batch is sent once the following vLLM call returns, or before waiting for tickets.
        """
        run_start = time.perf_counter()
        # The weights loaded from disk; acknowledging them tells the learner this generator is up.
        self.sink.try_send(VersionAck(self.generator_id, self.version, self.incarnation), timeout_s=1.0)
        try:
            if self.version < self._rejoin_version:  # restarted: the learner is further on
                with self.stats.timer("rejoin"):
                    self._wait_for_version(self._rejoin_version)
            pending: ScoringBatch | None = None
            while True:
                pending = self._one_call(pending)
        except GeneratorStopped:
            self.weights.poll(0.0)
            self._apply_latest_weights()  # leave the engine at the final version
        finally:
            self.scorer.close()
        return self._summary(time.perf_counter() - run_start)

    def _one_call(self, pending: ScoringBatch | None) -> ScoringBatch | None:
        """One turn of the loop, each phase timed: load the newest weights, evaluate them if due, ask
        for tickets, generate, score. `pending`: the last turn's batch whose rewards were not ready;
        returns this turn's."""
        timer = self.stats.timer
        with timer("weights"):
            self._load_newest_weights(wait_s=0.0)
        if self.evaluations.due(self.version):
            with timer("eval"):
                self.evaluations.evaluate(self.version, self.evaluate)
        with timer("ask"):
            problems, positions, slots = self._take_tickets()
        if not problems:
            if pending is not None:  # nothing to overlap its rewards with: send it now
                self._send_scored(pending)
            else:
                with timer("throttle"):
                    self._wait_for_tickets()
            return None
        prompts = self._tokenize(problems)
        with timer("generate"):
            completions = self._generate_paced(prompts)
        with timer("score"):
            scoring = ScoringBatch.submit(self.scorer, self.tokenizer, problems, positions, prompts, completions, slots)
        if pending is not None:  # its rewards were computed during this vLLM call
            self._send_scored(pending)
        if scoring.future.done():  # rewards computed inline (cheap terms): no reason to hold it
            self._send_scored(scoring)
            return None
        return scoring

    def _summary(self, wall_s: float) -> dict[str, Any]:
        tickets = {"gen/ticket_requests": self.tickets.request, "gen/ticket_requests_unanswered": self.tickets.unanswered}
        return {**self.stats.as_dict(), **self.scorer.stats_snapshot(), **tickets, "gen/version": self.version,
                "gen/weight_load_path": self.engine.weight_load_path, "gen/wall_s": wall_s,
                "gen/idle_s": self.stats.idle_s, "gen/idle_frac": self.stats.idle_s / wall_s if wall_s > 0 else 0.0,
                **{f"gen/{key}": value for key, value in peak_memory().items()}}

    def _take_tickets(self) -> tuple[list[Problem], list[int], list[int]]:
        """The next vLLM call's prompts, their positions and slots, as granted (none: wait, ask again)."""
        tickets = self.tickets.ask(self.version, self.groups_per_call)
        if tickets:
            self._no_tickets_since = None
        return ([self.positioned.at(t.position) for t in tickets], [t.position for t in tickets],
                [t.slot for t in tickets])

    def _wait_for_tickets(self) -> None:
        """Granted nothing (the staleness bound of our weights, or the queue's room): wait a moment
        for newer weights, then ask again; fail loudly when nothing is granted for wire.timeout_s
        with no newer weights either. New weights mean the learner is stepping: a generator that other
        generators outpace to every slot (one step's slots open at max_staleness=0) is idle, not stuck."""
        self.stats.throttled_waits += 1
        if self._no_tickets_since is None:
            self._no_tickets_since, self._no_tickets_version = time.monotonic(), self.version
        self._load_newest_weights(wait_s=TICKET_RETRY_S, in_wait=True)
        if self.version != self._no_tickets_version:
            self._no_tickets_since, self._no_tickets_version = time.monotonic(), self.version
        self._heartbeat(periodic=True)
        self.wait_limit.check(self._no_tickets_since, self.weights.saves,
                              f"asking for tickets with version {self.version}", "learner rank 0 granted none")

    def _send_scored(self, scoring: ScoringBatch) -> None:
        """Wait for a batch's rewards, send its groups, then report (a heartbeat per batch keeps the
        learner's per-step view of our counters current)."""
        timer = self.stats.timer
        with timer("score_wait"):
            scores = scoring.scores(self.cfg)
        with timer("send"):
            for problem, position, prompt, completions, score, slot in zip(
                    scoring.problems, scoring.positions, scoring.prompts, scoring.completions, scores, scoring.slots):
                group = scored_group(self.generator_id, problem.id, prompt, completions, score, self.version)
                if group is None:  # reward.on_error=drop_group: the slot goes to someone else
                    self.tickets.gave_back(slot)
                    continue
                group.pos = position
                self.stats.tokens_generated += int(group.tokens.size)
                self._send(group)
                self.tickets.sent(slot)
            self._heartbeat(periodic=False)

    # ---------------------------------------------------------------------------------- sampling

    def _tokenize(self, problems: list[Problem]) -> list[list[int]]:
        return [self.tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]

    def _sample(self, prompts: list[list[int]], temperature: float, n: int) -> list[list[Completion]]:
        return self.engine.generate(prompts, n=n, max_tokens=self.cfg.rollout.max_new_tokens, temperature=temperature)

    def _generate_paced(self, prompts: list[list[int]]) -> list[list[Completion]]:
        """`_generate`, slowed down by the failpoints that make a slower generator (generator_slowdown)
        or one paced as if on a device of its own (generator_pace_s)."""
        started = time.perf_counter()
        completions = self._generate(prompts)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        if self.pace_s > 0:
            time.sleep(max(0.0, started + self.pace_s * len(prompts) - time.perf_counter()))
        return completions

    def _generate(self, prompts: list[list[int]]) -> list[list[Completion]]:
        """`samples_per_prompt` completions per prompt, each token tagged with the version that sampled it.

        With `rollout.inflight_updates`, generation runs in segments of `rollout.inflight_chunk_tokens`;
        between segments the newest weights are loaded (segments.py), so a push never waits for a
        whole call and no sampled token is thrown away.
        """
        r = self.cfg.rollout
        if not r.inflight_updates:
            return tag_versions(self._sample(prompts, r.temperature, r.samples_per_prompt), self.version)
        segment = min(r.inflight_chunk_tokens, r.max_new_tokens)
        first = self.engine.generate(prompts, n=r.samples_per_prompt, max_tokens=segment, temperature=r.temperature)
        inflight = InFlight(prompts, first, self.version, r.max_new_tokens)
        while (call := inflight.next_call(segment)) is not None:
            if self._load_newest_weights(wait_s=0.0):
                self.stats.inflight_switches += 1
            inflight.extend(self.engine.generate(call.prompts, n=1, max_tokens=segment, temperature=r.temperature,
                                                 max_tokens_per_prompt=call.max_tokens), self.version)
        return inflight.completions()

    # ------------------------------------------------------------------------------ transport

    def _send(self, group: ScoredGroup) -> None:
        """Send, waiting on a full queue; meanwhile new weights are loaded (a safe point) and a stop is heard."""
        started = time.monotonic()
        group.seq, group.incarnation = self.next_seq, self.incarnation
        blocked_since = None
        while not self.sink.try_send(group, timeout_s=0.5 if blocked_since else 0.0):
            blocked_since = blocked_since or time.perf_counter()
            self._load_newest_weights(wait_s=0.0, in_wait=True)
            self.wait_limit.check(started, self.weights.saves, "blocked on a full queue", "the learner took no group")
        if blocked_since is not None:
            self.stats.send_blocked_s += time.perf_counter() - blocked_since
        self.next_seq += 1
        self.stats.groups_sent += 1

    def _heartbeat(self, periodic: bool) -> None:
        """Report sequence number, loaded version and cumulative counters (the learner logs their
        per-step increase); `periodic`: at most once per HEARTBEAT_EVERY_S. Never blocks: a lost
        heartbeat is made good by the next, its values being cumulative."""
        now = time.monotonic()
        if periodic and now - self._last_heartbeat < HEARTBEAT_EVERY_S:
            return
        self._last_heartbeat = now
        rewards = self.scorer.stats_snapshot()
        rejected, reason = self.weights.rejections()
        self._reported_rejections = rejected
        self.sink.try_send(Heartbeat(self.generator_id, self.next_seq, self.version, idle_s=self.stats.idle_s,
                                     reward_errors=rewards["reward/errors"],
                                     groups_dropped=rewards["reward/groups_dropped"],
                                     weights_rejected=rejected, rejection=reason,
                                     reward_calls=rewards["reward/calls"],
                                     reward_first_errors=self.scorer.first_errors(), incarnation=self.incarnation),
                           timeout_s=0.0)

    def _apply_latest_weights(self, in_wait: bool = False) -> bool:
        start = time.perf_counter()
        version = self.weights.apply_newest(self.engine)
        if version is None:
            return False
        self.stats.count_weight_load(time.perf_counter() - start, in_wait)
        self.version = version
        self.weights.saves.weights_loaded(version)
        self.sink.try_send(VersionAck(self.generator_id, version, self.incarnation), timeout_s=1.0)
        return True

    def _load_newest_weights(self, wait_s: float, in_wait: bool = False) -> bool:
        """Apply the newest complete push, if any (a safe point: no request is in flight). `in_wait`:
        called from a wait, whose timer includes the load (GeneratorStats.weight_load_in_wait_s)."""
        self.weights.poll(wait_s)
        if self.weights.rejections()[0] > self._reported_rejections:
            self._heartbeat(periodic=False)  # the learner fails the run with the reason, at once
        loaded = self._apply_latest_weights(in_wait)
        if self.weights.shutdown_reason is not None:
            raise GeneratorStopped(self.weights.shutdown_reason)
        return loaded

    def _wait_for_version(self, version: int) -> None:
        """Restarted: load the learner's newest weights (published again for us) before generating."""
        started = time.monotonic()
        while self.version < version:
            self._load_newest_weights(wait_s=0.5, in_wait=True)
            self._heartbeat(periodic=True)
            self.wait_limit.check(started, self.weights.saves,
                                  f"restarted, incarnation {self.incarnation}, holding version {self.version}",
                                  f"weights version {version} did not arrive")

    # ------------------------------------------------------------------------- eval and probes

    def evaluate(self, problems: list[Problem], temperature: float) -> float:
        """Held-out accuracy with one sample per problem (temperature 0 = greedy)."""
        completions = self._sample(self._tokenize(problems), temperature, n=1)
        texts = decode_completions(self.tokenizer, [group[0] for group in completions])
        return float(np.mean([self.task.score(text, p) for p, text in zip(problems, texts)]))

    def take_evaluations(self) -> list[dict[str, float]]:
        """The periodic evaluations since the last call (the driver's, in the control group)."""
        return self.evaluations.take()

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[np.ndarray]:
        return self.engine.sequence_logprobs(sequences, temperature=self.cfg.rollout.temperature)

    def loaded_version(self) -> int:
        return self.version

    def close(self) -> None:
        """Release the scorer's threads and both sockets (a run's actors are killed instead)."""
        self.scorer.close()
        self.weights.close()
        self.sink.close()
        self.tickets.close()
