"""The training loop: ask the learner for steps in chunks, write their metrics, show progress and
samples; meanwhile watch the generators: one whose process dies is restarted (`restart`, up to
rollout.max_restarts) while the step waits, one that raises fails the run at once, and so does
what learner rank 0 hears from them that ends the run (rejected weights, a reward outage beyond
reward.max_error_rate): that rank raises `registry.RunStopped`, and the run fails with its reason.

The loop sees the learner through `LearnerRanks` (blocking calls); `RemoteLearner` is that view of
the Ray actors, a fake one in tests.

A run that finishes having lost more than train.max_lost_fraction of the groups its generators made
(`lost_groups`: rejected at the learner, lost on the wire, dropped for reward errors) says so in
summary.json (`note_lost_groups`): it trained on a selection of its prompts, maybe a biased one.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncgrpo.composition import learner_wait_timeout_s, steps_wait_timeout_s
from asyncgrpo.driver import TrainingFailed
from asyncgrpo.driver.remote import get
from asyncgrpo.metrics import MetricsSink, SampleLogger
from asyncgrpo.queue.audit import departure
from asyncgrpo.queue.registry import RunStopped
from asyncgrpo.rewards.errors import one_line
from asyncgrpo.rollout.evaluations import periodic_eval_line
from asyncgrpo.runtime.interrupts import interrupts_held
from asyncgrpo.schema import Config


class LearnerRanks(Protocol):
    def train_steps(self, num_steps: int) -> list[dict[str, float]]:
        """`num_steps` steps on every rank; rank 0's metrics, one record per step."""

    def recent_samples(self, num_groups: int) -> list[dict[str, Any]]:
        """The first `num_groups` groups of the last step, as token ids (`metrics.samples.sample_records`)."""

    def steps_in_progress(self) -> list[dict[str, float]]:
        """The records of the last `train_steps` call, once the ranks have finished it (they do,
        whatever the driver does: an interrupt may have cut its wait short, or come after it returned
        and before its records were logged); each call's records once, [] if there is none."""


class StepsNotLogged(KeyboardInterrupt):
    """An interrupt after which the steps of the call in progress could not be logged (a second
    interrupt while waiting for them, or the call failed): a checkpoint would hold steps missing
    from metrics.jsonl, so the interrupt saves none (`train.save_on_interrupt`)."""


@dataclass
class Progress:
    """What the loop has seen: step and sample counts (from the resume point on), the reward trend,
    the worst staleness, the last step's record."""

    start_steps: int = 0
    start_samples: int = 0
    started: float = field(default_factory=time.monotonic)
    steps: int = field(init=False)
    samples: int = field(init=False)
    staleness_max: int = 0
    recent_rewards: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    last: dict[str, float] | None = None
    # Groups the generators dropped under reward.on_error=drop_group, as the steps reported them:
    # unlike a generator's final report, this counts the incarnations a restart replaced.
    reward_groups_dropped: int = 0

    def __post_init__(self) -> None:
        self.steps, self.samples = self.start_steps, self.start_samples

    @classmethod
    def from_resume(cls, resume: dict[str, Any] | None) -> Progress:
        """A resumed run goes on from the checkpoint's step up to train.max_steps in all."""
        if resume is None:
            return cls()
        return cls(start_steps=int(resume["version"]), start_samples=int(resume["states"]["learner"]["samples"]))

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def add(self, records: list[dict[str, float]]) -> list[dict[str, float]]:
        """Take in one chunk of step records; returns them stamped with time/wall_s."""
        for record in records:
            record["time/wall_s"] = self.elapsed()
            self.recent_rewards.append(record["reward/mean"])
            self.staleness_max = max(self.staleness_max, int(record["staleness/max"]))
            self.reward_groups_dropped += int(record.get("reward/groups_dropped", 0))
        if records:
            self.last = records[-1]
            self.steps, self.samples = int(self.last["step"]), int(self.last["samples"])
        return records

    def postfix(self) -> dict[str, Any]:
        """The progress bar's figures: mean reward of the last 20 steps, samples/s, worst staleness."""
        return {"reward": f"{sum(self.recent_rewards) / len(self.recent_rewards):.3f}",
                "samples_s": f"{(self.samples - self.start_samples) / self.elapsed():.0f}",
                "stale": self.staleness_max}

    def summary(self, resume: dict[str, Any] | None) -> dict[str, Any]:
        train_s = self.elapsed()
        summary: dict[str, Any] = {
            "steps": self.steps,
            "samples": self.samples,
            "train_s": train_s,
            "samples_per_s": (self.samples - self.start_samples) / train_s if train_s > 0 else 0.0,
            "staleness_max": self.staleness_max,
            "reward_groups_dropped": self.reward_groups_dropped,
        }
        if self.start_steps and resume is not None:
            summary["resumed_at_step"] = self.start_steps
            # The queue of this run counts from the resume (its identity holds per run); the
            # checkpointed run's counters are kept beside them.
            summary["queue_at_resume"] = resume["states"].get("queue", {}).get("counters", {})
        if self.last is not None:
            summary["groups_dropped_stale"] = int(self.last["queue/dropped_stale"])
            summary["queue"] = {k: v for k, v in self.last.items() if k.startswith(("queue/", "wire/"))}
            summary["audit"] = {k: v for k, v in self.last.items() if k.startswith("audit/")}
        return summary


class SampleSchedule:
    """Sample logs every `every` steps (0: never). Steps arrive in chunks of train.steps_per_call:
    a log is due at the first chunk boundary past each multiple."""

    def __init__(self, every: int, steps: int = 0) -> None:
        self.every = every
        self.next_step = self._after(steps)

    def _after(self, steps: int) -> int:
        return (steps // self.every + 1) * self.every if self.every else 0

    def due(self, steps: int) -> bool:
        if not self.every or steps < self.next_step:
            return False
        self.next_step = self._after(steps)
        return True


def run_loop(cfg: Config, learner: LearnerRanks, metrics: MetricsSink, sample_logger: SampleLogger,
             summary: dict[str, Any], resume: dict[str, Any] | None = None,
             evaluations: Callable[[], list[dict[str, Any]]] | None = None) -> None:
    """Train up to train.max_steps (or train.max_train_minutes); the loop's figures go into `summary`,
    also when it fails. `evaluations`: the periodic evaluations done since it was last called
    (eval.every_steps), written after each chunk of steps."""
    from tqdm import tqdm

    budget_s = cfg.train.max_train_minutes * 60 or float("inf")
    progress = Progress.from_resume(resume)
    samples = SampleSchedule(cfg.log.samples_every_steps, progress.steps)
    bar = tqdm(total=cfg.train.max_steps, initial=progress.steps, disable=not cfg.progress, unit="step",
               dynamic_ncols=True)
    try:
        while progress.steps < cfg.train.max_steps and progress.elapsed() < budget_s:
            chunk = min(cfg.train.steps_per_call, cfg.train.max_steps - progress.steps)
            records = learner.train_steps(chunk)
            # Steps taken in are logged whole: an interrupt half-way would leave steps the
            # interrupt's checkpoint holds missing from metrics.jsonl.
            with interrupts_held():
                for record in progress.add(records):
                    metrics.write(record)
            bar.update(len(records))
            bar.set_postfix(**progress.postfix(), refresh=False)
            for record in evaluations() if evaluations is not None else []:
                metrics.write(record)
                tqdm.write(periodic_eval_line(record))
            if samples.due(progress.steps):
                # tqdm.write keeps the progress bar intact below the table.
                tqdm.write(sample_logger.log(progress.steps, learner.recent_samples(cfg.log.samples_per_log)))
    except KeyboardInterrupt:
        if cfg.train.checkpoint_on_interrupt:  # the interrupt's checkpoint holds the call in progress
            for record in _steps_in_progress(learner, progress):
                metrics.write(record)
        raise
    finally:
        bar.close()
        summary.update(progress.summary(resume))


def _steps_in_progress(learner: LearnerRanks, progress: Progress) -> list[dict[str, float]]:
    """The last call's step records not yet logged, taken in: the ranks finish the call before they
    can save the interrupt's checkpoint, so without them metrics.jsonl would miss up to
    train.steps_per_call steps that the checkpoint (and a resume from it) has; the interrupt may
    have cut the wait short or come before its records were logged. Raises StepsNotLogged if they
    cannot be had."""
    print("[interrupt] waiting for the learner's steps in progress, to log them before the checkpoint "
          "(Ctrl-C again to skip the checkpoint)", flush=True)
    try:
        records = learner.steps_in_progress()
    except (KeyboardInterrupt, Exception) as err:  # the interrupt path goes on: stop the actors, write the summary
        raise StepsNotLogged(one_line(f"{type(err).__name__}: {err}")) from None
    return progress.add([record for record in records if int(record["step"]) > progress.steps])


# wire/rejected/<reason> of a group that decoded but that the learner cannot train on
# (queue.replay_queue.GroupLimits.untrainable): its sequence number counts as seen, so it is no gap under
# queue/lost. A frame the decoder rejects is a gap, counted there.
UNTRAINABLE_REASONS = ("empty_prompt", "too_many_samples", "too_long", "token_out_of_vocab")


@dataclass(frozen=True)
class LostGroups:
    """Groups the generators made that the learner never got to train on, by where they were lost.
    Groups the stale policy dropped, or still queued at the end, are not lost: the run chose so."""

    received: int  # queue/received: entered the learner's queue
    rejected_untrainable: int  # decoded, but the model cannot train on them (UNTRAINABLE_REASONS)
    lost_on_the_wire: int  # queue/lost: never arrived, or their frame was rejected (wire/rejected/<reason>)
    dropped_for_reward_errors: int  # reward.on_error=drop_group: never sent

    @property
    def lost(self) -> int:
        return self.rejected_untrainable + self.lost_on_the_wire + self.dropped_for_reward_errors

    @property
    def made(self) -> int:
        return self.received + self.lost

    @property
    def fraction(self) -> float:
        return self.lost / self.made if self.made else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"made": self.made, "lost": self.lost, "fraction": round(self.fraction, 4),
                "rejected_untrainable": self.rejected_untrainable, "lost_on_the_wire": self.lost_on_the_wire,
                "dropped_for_reward_errors": self.dropped_for_reward_errors}


def lost_groups(summary: dict[str, Any]) -> LostGroups:
    """The run's lost groups from its summary: the last step's queue/* and wire/* counters
    (`Progress.summary`), the steps' reward/groups_dropped and the generators' final reports."""
    queue = summary.get("queue", {})
    rejected = sum(int(queue.get(f"wire/rejected/{reason}", 0)) for reason in UNTRAINABLE_REASONS)
    # The generators' reports include what was dropped after the last step's report, the steps'
    # sum what incarnations replaced by a restart dropped: the larger is the nearer.
    reported = sum(int(report.get("reward/groups_dropped", 0)) for report in summary.get("generators", []))
    dropped = max(int(summary.get("reward_groups_dropped", 0)), reported)
    return LostGroups(received=int(queue.get("queue/received", 0)), rejected_untrainable=rejected,
                      lost_on_the_wire=int(queue.get("queue/lost", 0)), dropped_for_reward_errors=dropped)


def note_lost_groups(summary: dict[str, Any], max_fraction: float) -> str | None:
    """Put the run's lost groups into `summary` (groups_lost) and, beyond `max_fraction` of the
    groups made (train.max_lost_fraction), a one-line `warning`, also printed; returns the warning."""
    lost = lost_groups(summary)
    summary["groups_lost"] = lost.as_dict()
    if lost.fraction <= max_fraction:
        return None
    warning = (f"lost {lost.lost} of {lost.made} groups ({lost.fraction:.2f} > "
               f"train.max_lost_fraction={max_fraction:g}): {lost.rejected_untrainable} rejected at the learner as untrainable, {lost.lost_on_the_wire} lost on "
               f"the wire (queue/lost; frames the learner rejected are under wire/rejected/<reason>), "
               f"{lost.dropped_for_reward_errors} dropped for reward errors (reward/groups_dropped); the run trained "
               "on the others only, which may be a biased selection of its prompts")
    summary["warning"] = warning
    print(f"[warning] {warning}", flush=True)
    return warning


def note_audit_departure(summary: dict[str, Any], max_ks: float, min_groups: int) -> str | None:
    """Put into `summary`'s audit (the last step's audit/* counters) whether the trained groups
    depart from the sampled ones (`departure`: one line, also printed, or None); returns it."""
    audit = summary.get("audit")
    if not audit:
        return None
    audit["departure"] = departure(audit, max_ks, min_groups)
    if audit["departure"]:
        print(f"[audit] {audit['departure']}", flush=True)
    return audit["departure"]


# Generator index, why its process died -> the `run()` reference of its next incarnation.
Restart = Callable[[int, BaseException], Any]


class RemoteLearner:
    """`LearnerRanks` over the learner actors; a step's wait restarts a generator whose process
    dies (`restart`; None: it fails the run), fails the run as soon as a generator (one of `runs`,
    their `run()` calls, replaced in place on a restart) otherwise ends or a rank fails."""

    def __init__(self, cfg: Config, ranks: list[Any], runs: list[Any], restart: Restart | None = None) -> None:
        self.ranks, self.runs, self.restart = ranks, runs, restart
        self.timeout_s = learner_wait_timeout_s(cfg)
        self.steps_timeout_s = steps_wait_timeout_s(cfg)  # the steps may include a checkpoint save
        self._last_call: list[Any] | None = None  # the last train_steps call, for steps_in_progress

    def train_steps(self, num_steps: int) -> list[dict[str, float]]:
        with interrupts_held():  # every rank gets the call or none does, and it is remembered
            self._last_call = [rank.train_steps.remote(num_steps) for rank in self.ranks]
        return wait_for_ranks(self._last_call, self.runs, self.steps_timeout_s, self.restart)

    def steps_in_progress(self) -> list[dict[str, float]]:
        pending, self._last_call = self._last_call, None
        if pending is None:
            return []
        return wait_for_ranks(pending, self.runs, self.steps_timeout_s)  # a generator that dies now fails it

    def recent_samples(self, num_groups: int) -> list[dict[str, Any]]:
        return get(self.ranks[0].recent_samples.remote(num_groups), self.timeout_s, "learner rank 0 (recent_samples)")


def wait_for_ranks(pending: list[Any], runs: list[Any], timeout_s: float, restart: Restart | None = None) -> Any:
    """Rank 0's result once every rank is done. A generator whose process dies first is restarted
    (`restart` replaces its entry of `runs`); one that raises or returns, or a rank that fails,
    fails the run loudly."""
    import ray

    waiting = list(pending)
    deadline = time.monotonic() + timeout_s
    while waiting:
        ready, _ = ray.wait([*waiting, *runs], num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready and time.monotonic() >= deadline:
            raise TrainingFailed(f"no learner progress for {timeout_s:.0f} s")
        for index, run in enumerate(runs):
            if run in ready:
                runs[index] = generator_ended(index, run, restart)
                deadline = time.monotonic() + timeout_s  # the restart took its own (bounded) time
        for ref in ready:
            if ref in waiting:
                get_rank_result(ref, rank=pending.index(ref))
                waiting.remove(ref)
    return ray.get(pending[0])


def generator_ended(index: int, run: Any, restart: Restart | None) -> Any:
    """Generator `index`'s `run()` ended: its next incarnation's `run()` if its process died and
    `restart` brings it back; otherwise the run fails with the generator's own error."""
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(run)  # re-raises the generator's own error
    except RayActorError as died:  # the process is gone (killed, out of memory, crashed), not an exception in run()
        if restart is None:
            raise
        return restart(index, died)
    raise TrainingFailed(f"generator {index} stopped before the learner asked it to")


def get_rank_result(ref: Any, rank: int = 0) -> Any:
    """A rank's result, re-raising its own error. Failures whose reason is all there is to say end
    the run with that reason on one line (summary.json, the console), not a rank's traceback: a run
    stopped by the generators' reports, a rank whose process died (the steps since the last
    checkpoint are lost with it), and an OSError of the rank's environment (a full disk during a
    checkpoint save, a directory it may not write) or a wait of its that timed out (a TimeoutError,
    which is an OSError: the replay queue's take, the acknowledgement wait)."""
    import ray
    from ray.exceptions import RayActorError

    try:
        return ray.get(ref)
    except RunStopped as err:  # Ray raises a subclass of both RayTaskError and the rank's exception
        raise TrainingFailed(str(getattr(err, "cause", err))) from None
    except RayActorError as died:  # killed, out of memory, crashed: not an exception in the rank's code
        pid = re.search(r"\bpid: (\d+)", str(died))  # Ray's text spreads its details over several lines
        who = f"learner rank {rank}" + (f" (pid {pid.group(1)})" if pid else "")
        first = str(died).splitlines()[0] if str(died) else type(died).__name__
        raise TrainingFailed(f"{who} died: {one_line(first).rstrip('.')}; the steps since the newest complete "
                             "checkpoint are lost (resume=auto continues from it)") from None
    except OSError as err:
        cause = getattr(err, "cause", err)
        raise TrainingFailed(one_line(f"learner rank {rank}: {type(cause).__name__}: {cause}", limit=500)) from None
