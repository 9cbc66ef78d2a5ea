"""The generator: keep a vLLM engine full, score the groups it finishes, stream them to the learner.

`Generator` runs on the parts it is given (rollout/parts.py: engine, tokenizer, task, prompt
stream, scorer, sink, weight receiver) as the generator its `GeneratorSpec` describes
(rollout/spec.py); `GeneratorActor` (rollout/actor.py) builds the real parts inside a Ray actor.
The pure parts live beside it: running.py (what the engine is running), groups.py (the message),
stats.py (its counters); so do channel.py (its messages on the sink: numbered groups, acks,
heartbeats) and pacing.py (the failpoints that slow it).

The loop drives the engine a step at a time (docs/ARCHITECTURE.md, The two loops): whenever the
engine has room for a group's samples (rollout.max_running_seqs) it asks learner rank 0 for the
next slots of the training order (rollout/tickets.py), which grants only slots within the
staleness bound of the weights it holds, and submits their prompts, read from the run's one prompt
stream; each group is scored and sent the moment its samples have all finished, while the others
decode on. Weights are loaded between two engine steps: with rollout.inflight_updates the running
sequences go on under the new weights (every token keeps the version that sampled it); without,
admission stops until they finish. rollout.continuous=false is the call-batched baseline: a call's
prompts are admitted only into an empty engine. A restarted generator (a new `incarnation` of the
same generator id, started by the driver) is told by `rejoin` which weights it must load before
generating, and then just asks.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any

import numpy as np

from asyncgrpo.contract import Ticket
from asyncgrpo.rollout.channel import GroupChannel
from asyncgrpo.rollout.episodes import EpisodeRunner
from asyncgrpo.rollout.evaluations import PeriodicEvaluations, held_out_accuracy
from asyncgrpo.rollout.groups import scored_group
from asyncgrpo.rollout.pacing import FailpointPace
from asyncgrpo.rollout.parts import GeneratorParts
from asyncgrpo.rollout.running import Admitted
from asyncgrpo.rollout.scoring import ScoringBatch
from asyncgrpo.rollout.spec import GeneratorSpec
from asyncgrpo.rollout.stats import GeneratorStats, turn_lengths
from asyncgrpo.rollout.waits import WaitLimit
from asyncgrpo.schema import Config
from asyncgrpo.tasks import Problem
from asyncgrpo.wire import SaveNotice, ScoredGroup

log = logging.getLogger(__name__)

# Granted no ticket, a generator waits this long for newer weights before it asks again.
TICKET_RETRY_S = 0.2
# With every episode waiting on its environment, a generator waits this long for an answer before
# it looks at the weight stream again: new weights bring new tickets, whose prompts can decode while
# the answers are out (a wait as long as the tool's latency would idle the engine through it).
ENV_WAIT_SLICE_S = 0.005


class GeneratorStopped(Exception):
    """The learner asked for shutdown while this generator was waiting."""


class Generator:
    """Keeps `engine` full, scores the groups it finishes with `scorer`, sends them to `sink`; loads
    new weights from `weights` between engine steps and while waiting."""

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
        self.pace = FailpointPace(spec.generator_id)
        self.groups_per_call = spec.groups_per_call
        self.version = spec.initial_version
        self.engine.label_version(self.version)
        self._rejoin_version = spec.initial_version  # the version to load before generating (`rejoin`)
        self.stats = GeneratorStats()
        # Environment calls run on threads while the engine decodes (none without an environment).
        self.env_calls = parts.episode_settings.env.calls() if parts.env else None
        self.episodes = EpisodeRunner(self.engine, self.tokenizer, parts.env, self.env_calls, parts.episode_settings,
                                      self.stats)
        self.episodes.version = self.version
        self.scoring: deque[ScoringBatch] = deque()  # finished, their rewards being computed
        self._asked_in_vain: tuple[int, float] | None = None  # (version, when): granted nothing while running
        self._paused = False  # admission held back for the running sequences to finish
        self.wait_limit = WaitLimit(spec.generator_id, parts.wait_timeout_s)
        self.channel = GroupChannel(self.sink, spec.generator_id, spec.incarnation, self.stats, self.scorer,
                                    self.wait_limit)
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
        """Generate until the learner says stop; returns this generator's counters and timings."""
        run_start = time.perf_counter()
        # The weights loaded from disk; acknowledging them tells the learner this generator is up.
        self.channel.acknowledge(self.version)
        try:
            if self.version < self._rejoin_version:  # restarted: the learner is further on
                with self.stats.timer("rejoin"):
                    self._wait_for_version(self._rejoin_version)
            while True:
                self._turn()
        except GeneratorStopped:
            self._drop_running()  # nothing more is trained; the engine is left empty for the next user
            self.weights.poll(0.0)
            self._apply_latest_weights()  # leave the engine at the final version
        finally:
            self.scorer.close()
            if self.env_calls is not None:
                self.env_calls.close()
        return self._summary(time.perf_counter() - run_start)

    def _turn(self) -> None:
        """One turn of the loop, each phase timed: load the newest weights (between two engine
        steps), evaluate them if due, admit granted prompts, run one engine step (or, with nothing to
        decode, wait for an environment's answer), score the groups whose episodes all ended, send
        those whose rewards are in; with nothing in flight, wait."""
        timer = self.stats.timer
        with timer("weights"):
            self._load_newest_weights(wait_s=0.0)
        if self.evaluations.due(self.version) and not self.episodes.engine_busy:
            with timer("eval"):
                self.evaluations.evaluate(self.version, self.evaluate)
        with timer("ask"):
            granted = self._admit()
        if self.episodes:
            if self.episodes.engine_busy:
                with timer("generate"):
                    self._step_paced()
            else:
                with timer("env_wait"):
                    self.episodes.collect_env(wait_s=ENV_WAIT_SLICE_S)
            finished = self.episodes.take_finished()
            if finished:
                with timer("score"):
                    self.scoring.append(ScoringBatch.submit(self.scorer, self.tokenizer, finished))
            self._send_scored(wait=False)
        elif self.scoring:  # nothing to decode meanwhile: wait for the rewards
            self._send_scored(wait=True)
        elif not granted:  # (granted, yet nothing runs: the engine refused every prompt; ask again)
            with timer("throttle"):
                self._wait_for_tickets()

    def _summary(self, wall_s: float) -> dict[str, Any]:
        tickets = {"gen/ticket_requests": self.tickets.request, "gen/ticket_requests_unanswered": self.tickets.unanswered}
        return {**self.stats.summary(self.cfg.rollout.max_running_seqs, wall_s, self.scorer.stats_snapshot()),
                **tickets, "gen/version": self.version, "gen/weight_load_path": self.engine.weight_load_path}

    # ---------------------------------------------------------------------------------- admission

    def _admission_paused(self) -> bool:
        """Whether the running sequences must finish before anything is admitted: the call-batched
        baseline (a call goes into an empty engine), a due evaluation (it runs on an empty engine),
        a push waiting without in-flight loads."""
        r = self.cfg.rollout
        push_waiting = not r.inflight_updates and self.weights.newest_version > self.version
        # Turns ready after an environment's answer wait too, or they could keep the engine from emptying.
        self.episodes.hold_turns = push_waiting
        paused = (not r.continuous and bool(self.episodes)) or (self.episodes.engine_busy and (
            self.evaluations.due(self.version) or push_waiting))
        if paused and not self._paused:
            self.stats.drains += 1
        self._paused = paused
        return paused

    def _admit(self) -> bool:
        """Ask for as many tickets as the engine has room for (rollout.max_running_seqs, at most a
        call's worth) and submit their prompts; whether any were granted. Granted nothing while the
        engine runs, ask again with newer weights or TICKET_RETRY_S later."""
        r = self.cfg.rollout
        if self._admission_paused():
            return False
        room = (r.max_running_seqs - self.engine.running_sequences) // r.samples_per_prompt
        wanted = min(self.groups_per_call, room) if r.continuous else self.groups_per_call
        refused = self._asked_in_vain
        if wanted < 1 or (self.episodes and refused is not None and refused[0] == self.version
                          and time.monotonic() - refused[1] < TICKET_RETRY_S):
            return False
        tickets = self.tickets.ask(self.version, wanted)
        self._asked_in_vain = None if tickets else (self.version, time.monotonic())
        if tickets:
            self._no_tickets_since = None
        for ticket in tickets:
            self._submit(ticket)
        return bool(tickets)

    def _submit(self, ticket: Ticket) -> None:
        """Start a granted prompt's episodes; one the engine refuses (longer than its context) is
        counted and its ticket given back (its slot goes to another prompt)."""
        problem = self.positioned.at(ticket.position)
        prompt = self._tokenize([problem])[0]
        try:
            self.episodes.start(Admitted(ticket, problem, prompt, self.version))
        except ValueError as err:
            if not self.stats.prompts_rejected:
                log.warning("generator %d: the engine refused prompt %d (counted, its slot goes to another "
                            "prompt; gen/prompts_rejected): %s", self.generator_id, ticket.position, err)
            self.stats.prompts_rejected += 1
            self.tickets.gave_back(ticket)

    def _step_paced(self) -> None:
        """One engine step. Slowed down by the failpoints that make a slower generator
        (generator_slowdown) or one paced as if on a device of its own (generator_pace_s: each group
        finished costs at least that long)."""
        started, answers_s = time.perf_counter(), self.stats.env_answers_s
        running = self.engine.running_sequences
        finished = self.episodes.step_engine()
        # The step's cost without the environment's answers applied after it (counted apart).
        self.stats.count_step(running, time.perf_counter() - started - (self.stats.env_answers_s - answers_s))
        self.pace.after_step(started, finished)

    def _drop_running(self) -> None:
        """Abort what the engine runs, end every episode and forget what is being scored (the run is over)."""
        self.episodes.drop_all()
        self.scoring.clear()

    def _wait_for_tickets(self) -> None:
        """Granted nothing and nothing running (the staleness bound of our weights, or the queue's
        room): wait a moment for newer weights, then ask again; fail loudly when nothing is granted
        for wire.timeout_s with no newer weights either. New weights mean the learner is stepping: a
        generator that other generators outpace to every slot (one step's slots open at
        max_staleness=0) is idle, not stuck."""
        self.stats.throttled_waits += 1
        if self._no_tickets_since is None:
            self._no_tickets_since, self._no_tickets_version = time.monotonic(), self.version
        self._load_newest_weights(wait_s=TICKET_RETRY_S, in_wait=True)
        if self.version != self._no_tickets_version:
            self._no_tickets_since, self._no_tickets_version = time.monotonic(), self.version
        self._heartbeat(periodic=True)
        self.wait_limit.check(self._no_tickets_since, self.weights.saves,
                              f"asking for tickets with version {self.version}", "learner rank 0 granted none")

    def _send_scored(self, wait: bool) -> None:
        """Send the groups whose rewards are in, oldest batch first (`wait`: the oldest batch's, waited
        for), then report (the heartbeat keeps the learner's per-step view of our counters current)."""
        timer = self.stats.timer
        while self.scoring and (wait or self.scoring[0].future.done()):
            batch, wait = self.scoring.popleft(), False
            with timer("score_wait"):
                scores = batch.scores(self.wait_limit.timeout_s)
            with timer("send"):
                for episodes, score in zip(batch.groups, scores):
                    admitted = episodes.admitted
                    group = scored_group(self.generator_id, episodes, score, self.episodes.settings.env.on_error)
                    if group is None:  # reward or env.on_error=drop_group: the slot goes to someone else
                        self.stats.env_groups_dropped += int(not score.dropped)
                        self.tickets.gave_back(admitted.ticket)
                        continue
                    group.pos = admitted.ticket.position
                    self.stats.tokens_generated += int(group.tokens.size)
                    self.stats.group_lengths.add(turn_lengths(group.lengths, group.policy_mask))
                    self._send(group)
                    self.tickets.sent(admitted.ticket)
            self._heartbeat(periodic=bool(self.episodes))

    def _tokenize(self, problems: list[Problem]) -> list[list[int]]:
        return [self.tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]

    # ------------------------------------------------------------------------------ transport

    def _send(self, group: ScoredGroup) -> None:
        """Send, waiting on a full queue; meanwhile new weights are loaded (a safe point) and a stop is heard."""
        self.channel.send(group, self.weights,
                          while_blocked=lambda: self._load_newest_weights(wait_s=0.0, in_wait=True))

    def _heartbeat(self, periodic: bool) -> None:
        self.channel.heartbeat(self.version, self.weights, periodic)

    def _apply_latest_weights(self, in_wait: bool = False) -> bool:
        start = time.perf_counter()
        version = self.weights.apply_newest(self.engine)
        if version is None:
            return False
        self.stats.count_weight_load(time.perf_counter() - start, in_wait)
        if self.episodes.engine_busy:
            self.stats.inflight_switches += 1
        self.version = self.episodes.version = version
        self.engine.label_version(version)
        self.weights.saves.weights_loaded(version)
        self.channel.acknowledge(version)
        return True

    def _load_newest_weights(self, wait_s: float, in_wait: bool = False) -> bool:
        """Read the weight stream (waiting up to `wait_s`) and apply the newest complete push if loads
        are allowed now (between two engine steps): with rollout.inflight_updates always, else only
        into an empty engine (admission stops meanwhile: `_admission_paused`); whether it loaded.
        Hears a stop either way. `in_wait`: called from a wait, whose timer includes the load
        (GeneratorStats.weight_load_in_wait_s)."""
        self._poll_weights(wait_s)
        loads_allowed = self.cfg.rollout.inflight_updates or not self.episodes.engine_busy
        loaded = self._apply_latest_weights(in_wait) if loads_allowed else False
        if self.weights.shutdown_reason is not None:
            raise GeneratorStopped(self.weights.shutdown_reason)
        return loaded

    def _poll_weights(self, wait_s: float) -> None:
        """Read what the weight stream brought; report rejected weight messages at once (the learner
        fails the run with the reason), and a delta it could not apply (the learner sends a full push)."""
        self.weights.poll(wait_s)
        if (self.weights.rejections()[0] > self.channel.reported_rejections
                or self.weights.delta_mismatches > self.channel.reported_mismatches):
            self._heartbeat(periodic=False)

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
        """Held-out accuracy with one episode per problem (temperature 0 = greedy), a turn of every
        episode per engine call, on the engine while it runs nothing else."""
        return held_out_accuracy(self.engine, self.tokenizer, self.task, self.episodes.env, self.episodes.settings,
                                 problems, temperature)

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
