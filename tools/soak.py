"""Soak: one long run with a generator SIGKILLed every few minutes, then undisturbed runs of as many steps.

    .venv/bin/python -m tools.soak                 # 30 min, a kill every 5, 3 undisturbed runs (~1 h 45 min in all)
    .venv/bin/python -m tools.soak --minutes 1.5 --kill-every-minutes 0.5 --references 1 --out /tmp/soak_smoke  # ~4 min
    .venv/bin/python -m tools.soak --minutes 60 rollout.num_generators=2   # key=value: overrides for every run

Every run is `python -m asyncgrpo.cli train` on the embedded tiny default (tools/chaos.py's `Context`,
`Train` and its base overrides, here with the evaluations at the start and at the end back on), with
`wire.record_dir=<run>/stream` and the same overrides.

Phase 1, the disturbed run (<out>/disturbed/run): `train.max_train_minutes=M` (the loop's bound on
training wall-clock, start-up and evaluations not included) and an unreachable train.max_steps.
Training starts when the loop does: the first step record's time/wall_s back from when it was seen.
From there a generator process is SIGKILLed every K minutes (`kill_schedule`: K, 2K, ... up to
END_MARGIN_S before the time bound, so that each kill lands while the loop still waits on steps: a
generator that dies after the last step is not restarted but left out of the evaluations, which
tools/chaos.py's generator_kill_at_end covers; here it would not be a restart to count), its pid read from run_dir/actors.json at that moment (a restart writes the new
one; generators in turn, 0 first). Each kill waits for its restart to be back (actors.json names a new
pid, and a step is logged after that) before the next one may come: a kill whose time comes while the
previous restart is still under way happens at its return, or not at all past the margin (reported).
rollout.max_restarts = planned kills + 1.
Phase 2, the undisturbed runs: train.max_steps = S, the steps the disturbed run trained, no time
bound, no kills: the same number of samples. The first (<out>/undisturbed/run) has the disturbed
run's `--seed`; `--references K` (default 3) runs K of them, the others at seeds seed+1, ...
(<out>/undisturbed_seed<s>/run). Why more than one: after its first kill the disturbed run's
trajectory is another one (which weights sample which prompts, the sampler's state), and two
trajectories of this many steps end apart by far more than one evaluation's sampling noise (the
first full soak: 0.694 disturbed, 0.548 undisturbed, 2 SE of the evaluation 0.061); their spread
across seeds is the noise a disturbed run must be within.

Checks (each printed PASS or FAIL; the exit code is 0 only if all pass):
  finished          exit 0 and status finished; the disturbed run stopped on its time bound (train_s >= M
                    minutes, steps < train.max_steps), the undisturbed one at step S
  kills             every planned kill happened and its generator was back; summary.json generator_restarts
                    equals the kills, and the driver logged as many "[restart] generator g rejoined"
  recording         the groups recorded (wire.record_dir, every group a learner took) number
                    steps x train.groups_per_step, which is also queue/consumed at the learner's finish
  duplicates        none: no (generator, incarnation, sequence number), no prompt position of the run's
                    stream, no prompt within one pass of it trained twice (chaos.account)
  no silent loss    prompt positions of the run's stream never trained below the highest trained (lost
                    actual) <= what the run counted as not trained (lost counted: queue/dropped_stale,
                    lost, the model limits' rejections, reward/groups_dropped; chaos.counted_lost).
                    A killed generator's queued groups keep their slots; its slots not arrived are granted
                    again with their prompts: neither lost nor duplicated
  queue identity    received == consumed + dropped_stale + dropped_unheld + depth (queue/*,
                    queue/replay_queue.py) in every step record of metrics.jsonl and at the learner's finish
                    (summary.json learner)
  sent = received + lost
                    as far as it can be known. A SIGKILLed process's own count (gen/groups_sent) dies with it:
                    summary.json has only each generator's last incarnation's. So, at the learner's finish:
                      replaced incarnations  received = their groups in the recording (exact when
                                             dropped_stale + dropped_unheld = 0);
                                             lost = the gaps in their recorded sequence numbers
                      last incarnations      sent (gen/groups_sent) = received (queue/received - the above)
                                             + lost (queue/lost - the above) + in flight at the shutdown
                    and the check is 0 <= in flight <= (train.max_staleness + 1) x train.groups_per_step, the
                    most the dispatcher grants beyond what the learner took (they go on
                    generating until the shutdown reaches them; what arrives after the learner's last count
                    is in flight). What a killed process sent that never arrived is not known to have existed
                    (its heartbeats announce numbers; anything they announced is in queue/lost): it is
                    generated again, which the duplicates and silent-loss checks cover.
  staleness         staleness/max of every step record, watched while the run goes and read again at its
                    end, and the recording's (learner version at the take - the group's oldest token
                    version), all <= train.max_staleness
  same start        eval_accuracy_start of the disturbed run and the undisturbed run of its seed identical
                    (same seed, same weights)
  accuracy          held-out sampled accuracy at the end (eval_accuracy_end) a of the disturbed run within
                    noise of the undisturbed runs' mean m (`within_references`): |a - m| <= the larger of
                    2 x sqrt(a(1-a)/n + m(1-m)/n), two standard errors of the difference of two binomial
                    proportions (n = task.eval_size of the run's config.yaml), and with K >= 2 references
                    the 95% prediction interval of one more run, t_0.975(K-1) x s x sqrt(1 + 1/K), s their
                    standard deviation
  leftovers         each run ends with what it started (processes, private socket and /dev/shm directories,
                    chaos.Context.stop_everything); anything left is killed or removed and reported

The table has one row per run: steps, samples, wall (the run's, start-up and evaluations included),
kills/restarts, groups lost counted/actual, duplicates, staleness max (of the step records), sampled
accuracy start -> end, and status. The last line is one JSON object with everything (also written to
<out>/soak.json). Every wait is bounded: a run still going M minutes + RUN_MARGIN_S after it started is
killed and reported. Run directories are removed when every check passes, unless --keep.

Schedules tied to train.max_steps (learner.lr_schedule=cosine) would differ between the runs: refused.
On 2 cores a 30-minute soak trains ~22,000 steps (each undisturbed run then takes ~23 min); each run's
recording takes ~0.25 GB under <out>.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.contract import admission_limit
from tools import chaos, check_overrides, positive_float
from tools.chaos import Context, RunResult, ScenarioError

REPO = chaos.REPO
# The last kill comes at least this long before the time bound: the loop must still be waiting on
# steps when the generator dies (the queue holds a few steps at most), or the shutdown meets a dead
# generator and the run fails.
END_MARGIN_S = 20.0
# Beyond the training minutes, what a run may take: start-up, two evaluations, restarts, the end.
RUN_MARGIN_S = 15 * 60.0
UNREACHABLE_STEPS = 10**9  # the disturbed run's train.max_steps: its time bound stops it
POLL_S = chaos.POLL_S
# The shortest interval between kills taken: each kill waits for its restart (seconds at least), and a
# shorter one would round to 0 s in the schedule.
MIN_KILL_EVERY_S = 1.0
MAX_KILLS = 100_000  # the schedule is a list: bounded (the run's own restarts bound it long before)
# Keys the soak sets itself for each run.
RESERVED_KEYS = ("run_dir", "seed", "resume", "train.max_steps", "train.max_train_minutes", "wire.record_dir",
                 "rollout.max_restarts", "eval.at_start", "eval.at_end")
QUEUE_TERMS = ("queue/consumed", "queue/dropped_stale", "queue/dropped_unheld", "queue/depth")

Check = tuple[bool, str]


# ------------------------------------------------------------------------------- pure parts


def kill_schedule(minutes: float, every_minutes: float, end_margin_s: float = END_MARGIN_S) -> list[float]:
    """Seconds after training started at which a generator is killed: every `every_minutes`, the last
    at least `end_margin_s` before the `minutes` bound."""
    times, k = [], 1
    while round(k * every_minutes * 60, 6) <= minutes * 60 - end_margin_s:
        times.append(round(k * every_minutes * 60, 6))
        k += 1
    return times


def kill_due(schedule: Sequence[float], done: int, elapsed_s: float, cutoff_s: float) -> bool:
    """Whether the next kill (`done` happened) is due `elapsed_s` into training; none after `cutoff_s`."""
    return done < len(schedule) and schedule[done] <= elapsed_s <= cutoff_s


def within_noise(acc_a: float, acc_b: float, n: int) -> tuple[bool, float, float]:
    """(|a - b| <= bound, a - b, bound): bound = 2 standard errors of the difference of two binomial
    proportions measured on `n` problems each."""
    diff = acc_a - acc_b
    bound = 2 * math.sqrt((acc_a * (1 - acc_a) + acc_b * (1 - acc_b)) / n)
    return abs(diff) <= bound + 1e-12, diff, bound


# Two-sided 95% quantiles of Student's t, t_0.975(df) for df = 1..30; beyond, the normal's 1.96.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_975(df: int) -> float:
    return T_975[df - 1] if df <= len(T_975) else 1.96


def within_references(acc: float, references: Sequence[float], n: int) -> tuple[bool, float, float]:
    """(|acc - m| <= bound, acc - m, bound), m the references' mean final accuracy. With one reference,
    bound = `within_noise`'s (the held-out sampling noise alone). With K >= 2, the larger of that and
    the half-width of the 95% prediction interval for one more run drawn like the references,
    t_0.975(K-1) x s x sqrt(1 + 1/K), s their sample standard deviation: the run-to-run spread of
    training itself, which the sampling noise of one evaluation leaves out."""
    if not references:
        raise ValueError("no reference accuracy")
    mean = sum(references) / len(references)
    _, diff, bound = within_noise(acc, mean, n)
    if len(references) >= 2:
        k = len(references)
        s = math.sqrt(sum((r - mean) ** 2 for r in references) / (k - 1))
        bound = max(bound, t_975(k - 1) * s * math.sqrt(1 + 1 / k))
    return abs(diff) <= bound + 1e-12, diff, bound


def queue_identity(record: dict[str, Any]) -> tuple[bool, str]:
    """received == consumed + dropped_stale + dropped_unheld + depth, in one record
    of the queue's counters (a step record, or the learner's finish)."""
    missing = [key for key in ("queue/received", *QUEUE_TERMS) if key not in record]
    if missing:
        return False, f"no {', '.join(missing)}"
    terms = [int(record[key]) for key in QUEUE_TERMS]
    received = int(record["queue/received"])
    text = (f"received {received} {'==' if received == sum(terms) else '!='} "
            + " + ".join(f"{key.split('/')[1]} {value}" for key, value in zip(QUEUE_TERMS, terms)))
    return received == sum(terms), text


@dataclass(frozen=True)
class Incarnation:
    """One generator process's groups in the recording."""

    consumed: int
    max_seq: int
    gaps: int  # numbers below max_seq never trained


def incarnations(records: Sequence[chaos.Consumed]) -> dict[tuple[int, int], Incarnation]:
    """(generator, incarnation) -> what the learner trained of it."""
    seqs: dict[tuple[int, int], set[int]] = defaultdict(set)
    for record in records:
        seqs[(record.generator, record.incarnation)].add(record.seq)
    return {key: Incarnation(len(taken), max(taken), max(taken) + 1 - len(taken)) for key, taken in sorted(seqs.items())}


def sent_received_lost(sent_last: int, received: int, lost: int, replaced_received: int, replaced_lost: int,
                       lead: int) -> tuple[bool, int, str]:
    """(ok, in flight, text): the generators' last incarnations sent `sent_last` groups (their own
    count), of which the learner had, at its finish, received `received - replaced_received` and
    counted `lost - replaced_lost` lost (the totals less what the replaced incarnations account
    for); the rest was in flight at the shutdown, which the grants bound by `lead`."""
    last_received, last_lost = received - replaced_received, lost - replaced_lost
    in_flight = sent_last - last_received - last_lost
    ok = 0 <= in_flight <= lead
    text = (f"sent {sent_last} (last incarnations) = received {last_received} + lost {last_lost} + in flight at the "
            f"shutdown {in_flight} (0..{lead}); replaced incarnations: received {replaced_received}, lost "
            f"{replaced_lost}")
    return ok, in_flight, text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=positive_float, default=30.0, help="training minutes of the disturbed run")
    parser.add_argument("--kill-every-minutes", type=positive_float, default=5.0, help="minutes between generator kills")
    parser.add_argument("--out", default="", help="directory for every run (default: runs/soak/<date-time>)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (failed ones are kept anyway)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the disturbed run and the first undisturbed one")
    parser.add_argument("--references", type=int, default=3,
                        help="undisturbed runs, at seeds seed, seed+1, ...: their spread is the noise the disturbed "
                             "run's final accuracy must be within (1: the evaluation's sampling noise only)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = parser.parse_args(argv)
    if args.references < 1:
        parser.error("--references must be >= 1")
    if args.kill_every_minutes * 60 < MIN_KILL_EVERY_S:
        parser.error(f"--kill-every-minutes {args.kill_every_minutes:g}: kills at least {MIN_KILL_EVERY_S:g} s apart "
                     f"({MIN_KILL_EVERY_S / 60:.4g} min), a generator's restart takes longer")
    if (args.minutes * 60 - END_MARGIN_S) / (args.kill_every_minutes * 60) > MAX_KILLS:
        parser.error(f"--minutes {args.minutes:g} with a kill every {args.kill_every_minutes:g} min: more than "
                     f"{MAX_KILLS} kills")
    if not kill_schedule(args.minutes, args.kill_every_minutes):
        parser.error(f"--minutes {args.minutes:g} with a kill every {args.kill_every_minutes:g} min schedules no kill "
                     f"(the last must come {END_MARGIN_S:g} s before the end): nothing would be disturbed")
    check_overrides(parser, args.overrides, RESERVED_KEYS, "the soak")
    for override in args.overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "learner.lr_schedule" and value != "constant":  # a deletion (~) is the config's to refuse
            parser.error(f"{override}: a schedule tied to train.max_steps would differ between the two runs")
    return args


# ------------------------------------------------------------------------------------ a run


class Watch:
    """A run's metrics.jsonl, read as it grows (only the new bytes at each poll): the newest step, when
    training started, and every step record's staleness and queue identity."""

    def __init__(self, path: Path, bound: int) -> None:
        self.path, self.bound = path, bound
        self._offset, self._partial = 0, b""
        self.last_step = 0
        self.step_records = 0
        self.started: float | None = None  # time.monotonic() when the training loop started
        self.staleness_max = 0
        self.stale_steps: list[int] = []  # steps whose staleness/max was beyond the bound
        self.identity_breaks: list[str] = []  # the step records whose queue counters broke the identity

    def poll(self) -> None:
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                data = file.read()
        except OSError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # a line still being written
        for line in lines:
            with contextlib.suppress(ValueError):
                self.take(json.loads(line))

    def take(self, record: dict[str, Any]) -> None:
        if "loss/pg" not in record:  # evaluations
            return
        self.step_records += 1
        self.last_step = int(record["step"])
        if self.started is None:
            self.started = time.monotonic() - float(record.get("time/wall_s", 0.0))
        staleness = int(record["staleness/max"])
        self.staleness_max = max(self.staleness_max, staleness)
        if staleness > self.bound:
            self.stale_steps.append(self.last_step)
        ok, text = queue_identity(record)
        if not ok:
            self.identity_breaks.append(f"step {self.last_step}: {text}")


@dataclass
class Kill:
    generator: int
    pid: int
    at_s: float  # seconds into training
    step: int  # the newest step logged at the kill
    killed_at: float = 0.0  # time.monotonic()
    new_pid: int | None = None
    rejoin_step: int = 0  # the newest step logged when actors.json named the new pid
    back_s: float | None = None  # from the kill to the first step logged after the new pid appeared


@dataclass
class Phase:
    name: str
    overrides: list[str]
    ctx: Context | None = None
    watch: Watch | None = None
    kills: list[Kill] = field(default_factory=list)
    skipped_kills: int = 0
    result: RunResult | None = None
    error: str = ""
    leftovers: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


def reference_name(k: int, seed: int) -> str:
    """The k-th undisturbed run's name (and directory): the first has the disturbed run's seed."""
    return "undisturbed" if k == 0 else f"undisturbed_seed{seed + k}"


def run_phase(phase: Phase, out: Path, bound: int, timeout_s: float, schedule: Sequence[float],
              cutoff_s: float) -> None:
    """Run `phase`: its training process, watched, its generators killed on `schedule`; whatever it
    started is stopped at the end, whatever happens."""
    phase.ctx = ctx = Context(out / phase.name, timeout_s)
    print(f"[soak] {phase.name}: {' '.join(phase.overrides)}", flush=True)
    try:
        train = ctx.train(phase.overrides)
        phase.watch = watch = Watch(ctx.run_dir / "metrics.jsonl", bound)
        while train.running():
            ctx.track()
            watch.poll()
            if time.monotonic() > ctx.deadline:
                raise ScenarioError(f"still running {timeout_s / 60:.0f} min after it started: killed")
            if watch.started is not None:
                _disturb(phase, ctx, watch, schedule, cutoff_s)
            time.sleep(POLL_S)
        watch.poll()
        phase.result = ctx.finish(train)
    except ScenarioError as err:
        phase.error = str(err)
    except Exception as err:  # noqa: BLE001 - a bug here must not leave a run behind: the checks say what broke
        phase.error = f"the soak broke: {type(err).__name__}: {err}"
    finally:
        phase.leftovers = ctx.stop_everything()
    print(f"[soak] {phase.name}: {_status(phase)}" + (f" ({phase.error})" if phase.error else ""), flush=True)


def _disturb(phase: Phase, ctx: Context, watch: Watch, schedule: Sequence[float], cutoff_s: float) -> None:
    """One poll's share of the kills: see a pending restart back, or kill when the next one is due."""
    now = time.monotonic()
    elapsed = now - watch.started
    pids = ctx.actors().get("generator_pids", [])
    pending = phase.kills[-1] if phase.kills and phase.kills[-1].back_s is None else None
    if pending is not None:
        current = pids[pending.generator] if pending.generator < len(pids) else pending.pid
        if pending.new_pid is None and current != pending.pid:
            pending.new_pid, pending.rejoin_step = current, watch.last_step
        if pending.new_pid is not None and watch.last_step > pending.rejoin_step:
            pending.back_s = now - pending.killed_at
            print(f"[soak] generator {pending.generator} back (pid {pending.new_pid}) {pending.back_s:.0f} s after "
                  f"kill {len(phase.kills)}, at step {watch.last_step}", flush=True)
        return
    if len(phase.kills) + phase.skipped_kills < len(schedule) and elapsed > cutoff_s:
        phase.skipped_kills = len(schedule) - len(phase.kills)
        ctx.notes.append(f"{phase.skipped_kills} kill(s) skipped: due after the cutoff at {cutoff_s:.0f} s")
    if not pids or not kill_due(schedule, len(phase.kills), elapsed, cutoff_s):
        return
    generator = len(phase.kills) % len(pids)
    pid = pids[generator]
    if pid not in ctx.processes:  # only a process this run started (tracked every second)
        return
    try:
        ctx.signal(pid, signal.SIGKILL, f"generator {generator} at {elapsed:.0f} s, step {watch.last_step}")
    except ProcessLookupError:
        return
    phase.kills.append(Kill(generator, pid, round(elapsed, 1), watch.last_step, killed_at=now))
    print(f"[soak] kill {len(phase.kills)}: SIGKILL generator {generator} (pid {pid}) {elapsed:.0f} s into "
          f"training, step {watch.last_step}", flush=True)


def _status(phase: Phase) -> str:
    if phase.result is None:
        return "not run" if phase.ctx is None else "no result"
    return str(phase.result.summary.get("status", f"exit {phase.result.returncode}"))


# ------------------------------------------------------------------------------- the checks


def resolved_config(phase: Phase) -> dict[str, Any]:
    """The run's own config.yaml (what it resolved), {} if there is none."""
    import yaml

    try:
        return yaml.safe_load((phase.ctx.run_dir / "config.yaml").read_text()) or {}
    except (OSError, AttributeError, yaml.YAMLError):
        return {}


def assess(phase: Phase, cfg: Any, steps: int | None, minutes: float | None, planned_kills: int) -> None:
    """Fill phase.checks and phase.figures. `steps`: where the run must stop (None: on its time bound,
    `minutes`); `planned_kills`: the kills its schedule held."""
    checks: list[Check] = [(not phase.error, phase.error or "the run went to its end"),
                           (not phase.leftovers, f"nothing left behind ({'; '.join(phase.leftovers) or 'none'})")]
    phase.figures = {"kills": [asdict(k) for k in phase.kills], "notes": phase.ctx.notes if phase.ctx else [],
                     # what the leftover check looked at (chaos.Context.track)
                     "private_dirs_seen": sorted(phase.ctx.private_dirs) if phase.ctx else []}
    result = phase.result
    if result is not None:
        records = chaos.read_recording(phase.ctx.run_dir / "stream", [0])
        epoch_size = chaos.default_epoch_size() if cfg.task == type(cfg)().task else None
        accounting = chaos.account(records, epoch_size)
        bound, groups_per_step = cfg.train.max_staleness, cfg.train.groups_per_step
        checks += end_checks(result, steps, minutes)
        checks += kill_checks(phase, planned_kills)
        checks += accounting_checks(result, accounting, groups_per_step)
        checks += identity_checks(phase.watch, result)
        sent_ok, in_flight, sent_text = sent_check(result.summary, records, admission_limit(0, bound, groups_per_step))
        checks.append((sent_ok, sent_text))
        checks += staleness_checks(phase.watch, result, accounting, bound)
        phase.figures.update(figures(phase, result, accounting, records, cfg))
        phase.figures["in_flight_at_shutdown"] = in_flight
    phase.checks = checks


def end_checks(result: RunResult, steps: int | None, minutes: float | None) -> list[Check]:
    """Finished: at `steps`, or (None) on the time bound of `minutes`."""
    if steps is not None:
        return chaos.finished(result, steps)
    summary = result.summary
    train_s = float(summary.get("train_s", 0.0))
    said = f": {result.last_line[:160]}" if result.returncode else ""
    return [(result.returncode == 0, f"exits 0 (got {result.returncode}{said})"),
            (summary.get("status") == "finished", f"status finished (got {summary.get('status')})"),
            (train_s >= minutes * 60 and int(summary.get("steps", 0)) < UNREACHABLE_STEPS,
             f"stopped on its time bound: trained {train_s:.0f} s >= {minutes * 60:.0f} s")]


def kill_checks(phase: Phase, planned: int) -> list[Check]:
    """Every planned kill happened, came back, and is one restart in the summary and the driver's log."""
    kills, result = phase.kills, phase.result
    restarts = result.summary.get("generator_restarts")
    rejoined = sum("[restart] generator " in line and " rejoined" in line for line in result.output.splitlines())
    back = sum(k.back_s is not None for k in kills)
    return [(len(kills) == planned and not phase.skipped_kills,
             f"every planned kill happened: {len(kills)} of {planned}"),
            (back == len(kills), f"every killed generator came back ({back} of {len(kills)})"),
            (restarts == len(kills) == rejoined,
             f"generator_restarts {restarts} == kills {len(kills)} == rejoins logged {rejoined}")]


def accounting_checks(result: RunResult, accounting: chaos.Accounting, groups_per_step: int) -> list[Check]:
    """The recording against the steps and the queue; no duplicates; no silent loss."""
    steps = int(result.summary.get("steps", 0))
    consumed = (result.summary.get("learner") or {}).get("queue/consumed")
    counted = chaos.counted_lost([result.steps])
    return [(accounting.consumed == steps * groups_per_step == int(consumed if consumed is not None else -1),
             (f"recorded groups {accounting.consumed} == {steps} steps x {groups_per_step} == "
              f"queue/consumed at the finish {consumed}")),
            (accounting.duplicates == 0,
             (f"no group trained twice ({accounting.duplicate_seqs} sequence, "
              f"{accounting.duplicate_prompts} prompt duplicates)")),
            (accounting.skipped <= counted.lost,
             f"no silent loss: {accounting.skipped} prompts skipped, {counted.lost} counted")]


def identity_checks(watch: Watch, result: RunResult) -> list[Check]:
    """The queue identity in every step record (as watched) and at the learner's finish."""
    breaks = watch.identity_breaks
    ok, text = queue_identity(result.summary.get("learner") or {})
    return [(not breaks and watch.step_records == len(result.steps),
             (f"queue identity in all {watch.step_records} step records"
              + (f"; broken in {len(breaks)}, first {breaks[0]}" if breaks else ""))),
            (ok, f"queue identity at the finish: {text}")]


def sent_check(summary: dict[str, Any], records: Sequence[chaos.Consumed], lead: int) -> tuple[bool, int, str]:
    """`sent_received_lost` from summary.json (each generator's last incarnation, the learner's finish)
    and the recording (the replaced incarnations)."""
    reports = summary.get("generators") or []
    if not reports:
        return False, 0, "sent = received + lost: summary.json has no generator reports"
    learner = summary.get("learner") or {}
    last = {g: int(report.get("restarts", 0)) for g, report in enumerate(reports)}
    replaced = [inc for (g, i), inc in incarnations(records).items() if i < last.get(g, i + 1)]
    return sent_received_lost(
        sent_last=sum(int(report.get("gen/groups_sent", 0)) for report in reports),
        received=int(learner.get("queue/received", 0)), lost=int(learner.get("queue/lost", 0)),
        replaced_received=sum(inc.consumed for inc in replaced),
        replaced_lost=sum(inc.gaps for inc in replaced), lead=lead)


def staleness_checks(watch: Watch, result: RunResult, accounting: chaos.Accounting, bound: int) -> list[Check]:
    """staleness/max within the bound in every step, watched and at the end, and in the recording."""
    at_end = max((int(r["staleness/max"]) for r in result.steps), default=0)
    beyond = f"; beyond at steps {watch.stale_steps[:5]}" if watch.stale_steps else ""
    return [(not watch.stale_steps and at_end <= bound,
             (f"staleness/max <= {bound} in every step, watched (max {watch.staleness_max}{beyond}) "
              f"and at the end (max {at_end})")),
            (accounting.staleness_max <= bound, f"recorded staleness max {accounting.staleness_max} <= {bound}")]


def figures(phase: Phase, result: RunResult, accounting: chaos.Accounting, records: Sequence[chaos.Consumed],
            cfg: Any) -> dict[str, Any]:
    """The row's figures, and what they came from."""
    summary = result.summary
    counted = chaos.counted_lost([result.steps])
    learner = summary.get("learner") or {}
    return {
        "steps": int(summary.get("steps", 0)), "samples": summary.get("samples"), "wall_s": round(result.wall_s, 1),
        "train_s": summary.get("train_s"), "restarts": summary.get("generator_restarts"),
        "lost_counted": counted.lost, "lost_actual": accounting.skipped, "duplicates": accounting.duplicates,
        "staleness_max": max((int(r["staleness/max"]) for r in result.steps), default=0),
        "recorded_staleness_max": accounting.staleness_max,
        "accuracy_start": summary.get("eval_accuracy_start"), "accuracy_end": summary.get("eval_accuracy_end"),
        "eval_size": int(resolved_config(phase).get("task", {}).get("eval_size", cfg.task.eval_size)),
        "accounting": asdict(accounting), "counted": {**asdict(counted), "lost": counted.lost},
        "queue_at_finish": {k: v for k, v in learner.items() if k.startswith(("queue/", "wire/"))},
        "incarnations": {f"{g}.{i}": asdict(inc) for (g, i), inc in incarnations(records).items()},
        "generators_sent": [report.get("gen/groups_sent") for report in summary.get("generators") or []],
        "error": summary.get("error")}


def compare(disturbed: Phase, references: Sequence[Phase]) -> list[Check]:
    """Held-out accuracies: the disturbed run's the same at the start as the undisturbed run of its
    seed (references[0]), and at the end within noise of the references' (`within_references`)."""
    a = disturbed.figures
    phases = [disturbed, *references]
    if any(p.figures.get(key) is None for p in phases for key in ("accuracy_start", "accuracy_end", "eval_size")):
        return [(False, "every run's eval_accuracy_start and eval_accuracy_end (missing: "
                        f"{', '.join(p.name for p in phases if p.figures.get('accuracy_end') is None) or 'a start'})")]
    b = references[0].figures
    n = int(b["eval_size"])
    ends = [float(p.figures["accuracy_end"]) for p in references]
    ok, diff, bound = within_references(a["accuracy_end"], ends, n)
    if len(ends) == 1:
        how = f"|diff| <= 2 SE of the evaluation = {bound:.4f} (n = {n})"
    else:
        how = (f"|diff| <= {bound:.4f}, the larger of the 95% prediction interval from the {len(ends)} undisturbed "
               f"runs' spread ({', '.join(f'{e:.4f}' for e in ends)}) and 2 SE of the evaluation (n = {n})")
    mean = sum(ends) / len(ends)
    return [(a["accuracy_start"] == b["accuracy_start"],
             f"the same accuracy at the start: {a['accuracy_start']:.4f} and {b['accuracy_start']:.4f}"),
            (ok, f"final accuracy within noise: {a['accuracy_end']:.4f} - {mean:.4f} = {diff:+.4f}, {how}")]


# ---------------------------------------------------------------------------------- output


def _cell(figures: dict[str, Any], key: str, fmt: str = "{}") -> str:
    return "-" if figures.get(key) is None else fmt.format(figures[key])


def table(phases: Sequence[Phase]) -> str:
    header = ("run", "steps", "samples", "wall", "kills/restarts", "lost counted/actual", "duplicates",
              "staleness max", "accuracy start -> end", "status")
    lines = [header]
    for phase in phases:
        f = phase.figures
        accuracy = (f"{_cell(f, 'accuracy_start', '{:.3f}')} -> {_cell(f, 'accuracy_end', '{:.3f}')}"
                    if "accuracy_start" in f else "-")
        lines.append((phase.name, _cell(f, "steps"), _cell(f, "samples"), _cell(f, "wall_s", "{:.0f} s"),
                      f"{len(phase.kills)}/{_cell(f, 'restarts')}",
                      f"{_cell(f, 'lost_counted')}/{_cell(f, 'lost_actual')}", _cell(f, "duplicates"),
                      _cell(f, "staleness_max"), accuracy, _status(phase)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def checks_text(sections: Sequence[tuple[str, Sequence[Check]]]) -> str:
    return "\n".join(f"{'PASS' if ok else 'FAIL'}  {name}: {what}" for name, checks in sections for ok, what in checks)


# ------------------------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from asyncgrpo.config import load
    from asyncgrpo.schema import ConfigError

    base = [*args.overrides, "eval.at_start=true", "eval.at_end=true"]
    try:
        cfg = load([*chaos.BASE_OVERRIDES, *base, f"seed={args.seed}"])
    except ConfigError as err:
        print(f"soak: {err}", file=sys.stderr)
        return 2
    schedule = kill_schedule(args.minutes, args.kill_every_minutes)
    cutoff_s = args.minutes * 60 - END_MARGIN_S
    out = Path(args.out or REPO / "runs" / "soak" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    timeout_s = args.minutes * 60 + RUN_MARGIN_S
    print(f"[soak] {args.minutes:g} min, {len(schedule)} kill(s) at {[f'{t:g} s' for t in schedule]} into training; "
          f"runs in {out}", flush=True)
    start = time.monotonic()
    common = [*base, f"rollout.max_restarts={len(schedule) + 1}"]
    disturbed = Phase("disturbed", [*common, f"seed={args.seed}", f"train.max_train_minutes={args.minutes}",
                                    f"train.max_steps={UNREACHABLE_STEPS}"])
    run_phase(disturbed, out, cfg.train.max_staleness, timeout_s, schedule, cutoff_s)
    assess(disturbed, cfg, None, args.minutes, len(schedule))
    steps = int(disturbed.figures.get("steps") or 0)
    references = [Phase(reference_name(k, args.seed), [*common, f"seed={args.seed + k}", "train.max_train_minutes=0",
                                                       f"train.max_steps={steps}"])
                  for k in range(args.references)]
    if steps > 0:
        for reference in references:
            run_phase(reference, out, cfg.train.max_staleness, timeout_s, [], 0.0)
            assess(reference, cfg, steps, None, 0)
        comparison = compare(disturbed, references)
    else:
        comparison = [(False, "the undisturbed runs need the disturbed run's steps: it trained none")]
    phases = [disturbed, *references]
    sections = [*((p.name, p.checks) for p in phases), ("all", comparison)]
    passed = all(ok for _, checks in sections for ok, _ in checks)
    total_s = time.monotonic() - start
    if passed and not args.keep:
        for phase in phases:
            shutil.rmtree(out / phase.name, ignore_errors=True)
    print(table(phases))
    print(checks_text(sections))
    print(f"soak {'PASS' if passed else 'FAIL'} in {total_s / 60:.1f} min; runs in {out}")
    result = {"soak": "PASS" if passed else "FAIL", "minutes": args.minutes,
              "kill_every_minutes": args.kill_every_minutes, "seed": args.seed, "references": args.references,
              "overrides": args.overrides,
              "kill_schedule_s": schedule,
              "runs": {p.name: {"status": _status(p), "error": p.error, "overrides": p.overrides, **p.figures,
                                "leftovers": p.leftovers} for p in phases},
              "checks": {name: [{"ok": ok, "what": what} for ok, what in checks] for name, checks in sections},
              "total_s": round(total_s, 1), "out": str(out)}
    (out / "soak.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, default=str))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
