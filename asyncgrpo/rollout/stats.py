"""A generator's counters and phase times (`GeneratorStats`), reported in its summary
(gen/*, gen_time/*) and, the idle time, on its heartbeats."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncgrpo.runtime.memory import peak_memory
from asyncgrpo.runtime.timing import PhaseTimer


# An engine's first steps are left out of its step-cost fit: on CPU vLLM compiles during them.
FIT_SKIPPED_STEPS = 20
# Groups whose completion lengths a generator keeps for the simulator (a uniform sample of those sent).
KEPT_GROUP_LENGTHS = 512


@dataclass
class EngineStepFit:
    """An engine step's seconds as fixed_s + per_sequence_s x the sequences it ran: least squares
    over the steps after the first FIT_SKIPPED_STEPS, summed as they come (the simulator's model of
    a continuous engine, docs/SIMULATOR.md)."""

    skipped: int = 0
    steps: int = 0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def add(self, sequences: int, seconds: float) -> None:
        if self.skipped < FIT_SKIPPED_STEPS:
            self.skipped += 1
            return
        self.steps += 1
        self.sum_x += sequences
        self.sum_y += seconds
        self.sum_xx += sequences * sequences
        self.sum_xy += sequences * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed_s, per_sequence_s); None with fewer than 2 steps or a single batch size. A
        negative intercept or slope (noise) is clamped at 0 with the other refitted through the mean."""
        n = self.steps
        spread = n * self.sum_xx - self.sum_x ** 2
        if n < 2 or spread <= 1e-9 * max(1.0, n * self.sum_xx):
            return None
        slope = (n * self.sum_xy - self.sum_x * self.sum_y) / spread
        fixed = (self.sum_y - slope * self.sum_x) / n
        if slope < 0:
            return self.sum_y / n, 0.0
        if fixed < 0:
            return 0.0, self.sum_xy / self.sum_xx
        return fixed, slope


def turn_lengths(lengths: np.ndarray, policy_mask: np.ndarray | None) -> list[list[int]]:
    """Each sample's policy tokens per turn (the runs of 1 in its `policy_mask`; one turn of all its
    `lengths` tokens without a mask); a sample of no policy token has no turn."""
    if policy_mask is None:
        return [[int(n)] for n in lengths]
    turns, start = [], 0
    for n in lengths:
        mask = np.asarray(policy_mask[start:start + int(n)], dtype=np.int8)
        start += int(n)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))  # starts and ends of the runs of 1
        turns.append([int(end - begin) for begin, end in zip(edges[::2], edges[1::2])])
    return turns


@dataclass
class GroupLengths:
    """A uniform sample (reservoir) of up to KEPT_GROUP_LENGTHS groups' completion lengths (each
    sample's policy tokens per turn, `turn_lengths`), seeded so that a run's summary is reproducible."""

    groups: list[list[list[int]]] = field(default_factory=list)
    seen: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def add(self, lengths: list[list[int]]) -> None:
        self.seen += 1
        if len(self.groups) < KEPT_GROUP_LENGTHS:
            self.groups.append(lengths)
            return
        slot = self.rng.randrange(self.seen)
        if slot < KEPT_GROUP_LENGTHS:
            self.groups[slot] = lengths


@dataclass
class GeneratorStats:
    groups_sent: int = 0
    tokens_generated: int = 0
    weight_loads: int = 0
    throttled_waits: int = 0
    # Pushes loaded while sequences were running (rollout.inflight_updates): they go on with the new weights.
    inflight_switches: int = 0
    # Times admission stopped so that the running sequences could finish first: for a push
    # without in-flight loads, for a periodic evaluation, or (the call-batched baseline) every call.
    drains: int = 0
    # Prompts the engine refused (longer than its context): their tickets were given back.
    prompts_rejected: int = 0
    send_blocked_s: float = 0.0
    # Engine steps, and the sequences running summed over them (mean / rollout.max_running_seqs is
    # the engine's occupancy while generating).
    engine_steps: int = 0
    running_sequences_sum: int = 0
    step_fit: EngineStepFit = field(default_factory=EngineStepFit)
    group_lengths: GroupLengths = field(default_factory=GroupLengths)
    # Assembling and loading pushes into the engine, wherever it happens (between engine steps,
    # while granted nothing): the generator's side of a weight transfer.
    weight_load_s: float = 0.0
    # The part of weight_load_s spent inside a wait (granted nothing, blocked on a full queue,
    # rejoining), whose timer (gen_time/throttle_s, ...) therefore includes it: work done while
    # otherwise waiting (tools/bench_async.py counts it as busy time).
    weight_load_in_wait_s: float = 0.0
    # Environment calls (reset and step) made, and those that failed (raised, timed out, answered
    # garbage), by cause; the first failure's one-line text (reported to the learner, which stops
    # the run beyond env.max_error_rate).
    env_calls: int = 0
    env_errors: dict[str, int] = field(default_factory=dict)
    env_first_error: str = ""
    # Policy turns whose call did not parse (the environment said so in its observation).
    env_bad_actions: int = 0
    # Environment answers applied (step and reset calls that ended), and the generator's own time
    # spent applying them and submitting the turns that follow (tokenizing, building the request):
    # inside whichever phase ran them (generate or env_wait), not a phase of its own.
    env_answers: int = 0
    env_answers_s: float = 0.0
    # Groups not sent because an environment call failed under env.on_error=drop_group (reported with
    # the reward's drops as groups_dropped: the run's loss accounting counts both).
    env_groups_dropped: int = 0
    # Episodes that ended because an observation would not fit the context or the token budget.
    episodes_overflowed: int = 0
    episodes_finished: int = 0
    episode_turns_sum: int = 0
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

    def count_env_answers(self, answers: int, seconds: float) -> None:
        self.env_answers += answers
        self.env_answers_s += seconds

    def count_step(self, running_sequences: int, seconds: float) -> None:
        """An engine step over `running_sequences` sequences (counted before the step) that took `seconds`."""
        self.engine_steps += 1
        self.running_sequences_sum += running_sequences
        self.step_fit.add(running_sequences, seconds)

    def summary(self, max_running_seqs: int, wall_s: float, rewards: dict[str, int]) -> dict[str, Any]:
        """The counters (`as_dict`), the scorer's `rewards` counters (groups dropped for an environment
        failure added to the reward's, as the heartbeats report them), the wall and idle times, the
        process's peak memory."""
        rewards = {**rewards, "reward/groups_dropped": rewards["reward/groups_dropped"] + self.env_groups_dropped}
        fit = self.step_fit.fit()
        return {**self.as_dict(max_running_seqs), **rewards, "gen/wall_s": wall_s, "gen/idle_s": self.idle_s,
                "gen/idle_frac": self.idle_s / wall_s if wall_s > 0 else 0.0,
                "gen/engine_step_fit": ({"fixed_s": fit[0], "per_sequence_s": fit[1], "steps": self.step_fit.steps}
                                        if fit else None),
                "gen/group_lengths": self.group_lengths.groups,
                **{f"gen/{key}": value for key, value in peak_memory().items()}}

    def as_dict(self, max_running_seqs: int) -> dict[str, float]:
        """The summary's gen/* and gen_time/* entries; `max_running_seqs` is rollout.max_running_seqs."""
        mean_running = self.running_sequences_sum / self.engine_steps if self.engine_steps else 0.0
        return {
            "gen/groups_sent": self.groups_sent,
            "gen/tokens_generated": self.tokens_generated,
            "gen/weight_loads": self.weight_loads,
            "gen/throttled_waits": self.throttled_waits,
            "gen/inflight_switches": self.inflight_switches,
            "gen/drains": self.drains,
            "gen/prompts_rejected": self.prompts_rejected,
            "gen/send_blocked_s": self.send_blocked_s,
            "gen/engine_steps": self.engine_steps,
            "gen/mean_running_sequences": mean_running,
            "gen/engine_occupancy": mean_running / max_running_seqs,
            "gen/env_calls": self.env_calls,
            "gen/env_errors": sum(self.env_errors.values()),
            **{f"gen/env_errors_{cause}": count for cause, count in sorted(self.env_errors.items())},
            "gen/env_bad_actions": self.env_bad_actions,
            "gen/env_answers": self.env_answers,
            "gen/env_answers_s": self.env_answers_s,
            "gen/env_groups_dropped": self.env_groups_dropped,
            "gen/episodes_overflowed": self.episodes_overflowed,
            "gen/mean_episode_turns": self.episode_turns_sum / max(1, self.episodes_finished),
            "gen/weight_load_s": self.weight_load_s,
            "gen/weight_load_in_wait_s": self.weight_load_in_wait_s,
            **self.timer.metrics("gen_time/"),
        }
