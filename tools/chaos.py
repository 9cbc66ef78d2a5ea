"""Chaos suite: each fault injected into a real `asyncgrpo train` run, checked against what should happen.

    .venv/bin/python -m tools.chaos                          # every scenario (12-25 min on 2 cores)
    .venv/bin/python -m tools.chaos --scenarios generator_kill,wire_drop
    .venv/bin/python -m tools.chaos --list                   # scenarios, faults and expected outcomes
    .venv/bin/python -m tools.chaos --keep --out runs/chaos/x  # keep every scenario's run directory

Each scenario runs `python -m asyncgrpo.cli train` on the embedded tiny default (eval and export
off, 200-300 learner steps: 15-60 s of training after 25-60 s of start-up, as loaded as the machine) with
`wire.record_dir=<run>/stream`, injects its fault for real, and, where the run stops, continues it
with `resume=auto` in the same run_dir. Faults: SIGKILL of a generator or a learner rank (pids
from run_dir/actors.json) and SIGTERM of the driver, timed by the steps in metrics.jsonl (and, mid-
checkpoint, by the step_N.tmp directory of a save slowed by the `checkpoint_save_delay_s`
failpoint); groups dropped and corrupted on the wire (failpoints `wire_drop_every`,
`wire_corrupt_every` in the generator's sender, asyncgrpo/runtime/faults.py); ticket answers lost
(`grant_drop_every`, learner rank 0) beside failing rewards; an HTTP judge on 127.0.0.1
served from here that answers 500 for 30 s mid-run; a reward function, written into the scenario's
directory, that hangs forever on some calls; a full disk: run_dir/checkpoints on a small tmpfs
(`mount`, so root; else the `checkpoint_enospc` failpoint, said in the row).

What each row reports, from the recording of every group the learner consumed (generator,
incarnation, sequence number, prompt position, versions) and the runs' metrics and summaries:
  lost counted   what the runs counted as not trained: queue/dropped_stale,
                 queue/lost (sequence gaps, which include frames the decoder rejected), groups the
                 model limits rejected and reward/groups_dropped; over the surviving lineage of runs
                 (a run's steps after the checkpoint its successor resumed from are not counted)
  lost actual    prompt positions of the run's one stream never trained below the highest trained
                 (a prompt lost in transit is given again: then lost counted may exceed it);
                 actual > counted is silent loss (the tail beyond the last trained group, untrained
                 because the run ended, is neither)
  duplicates     groups trained twice: the same (run, generator, incarnation, sequence number), the
                 same prompt position, or the same prompt twice in one pass of the stream
  staleness max  learner version at the take minus the group's oldest token version, recorded
A scenario's outcome is PASS when every expectation holds; the first unmet ones are printed. Every
scenario ends by killing whatever its runs started that is still alive (reported as leftover), and
reports the private socket directories and /dev/shm weight slots its actors held that are still there.

Prints a table, then one JSON line with every row. Needs Linux (/proc) and, for the real full disk, root.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.contract import staleness
from tools import check_overrides, load_config

REPO = Path(__file__).resolve().parents[1]

# A run's steps are logged in chunks of this many: the faults are timed by them.
STEPS_PER_CALL = 2
# Where every scenario's runs start from: the embedded default, quick to start and to stop.
BASE_OVERRIDES = ("model.warmstart_max_seconds=5", "progress=false", "eval.at_start=false", "eval.at_end=false",
                  "train.export_at_end=false", f"train.steps_per_call={STEPS_PER_CALL}", "log.samples_every_steps=0")
# --set: overrides for every run, before each scenario's own (which win).
EXTRA_OVERRIDES: list[str] = []
# What --set may not name: where each run writes (set by `Train`, and --set comes after), whether it
# resumes, and the train.* settings the checks assume (MAX_STALENESS, GROUPS_PER_STEP,
# STEPS_PER_CALL; runs that end at their train.max_steps).
RESERVED_KEYS = ("run_dir", "wire.record_dir", "resume", "train.max_steps", "train.max_train_minutes",
                 "train.max_staleness", "train.groups_per_step", "train.steps_per_call")
# The default's train.max_staleness and train.groups_per_step, which every scenario keeps (one
# generator: its share of a step is all of it).
MAX_STALENESS, GROUPS_PER_STEP = 2, 16
# The group rejections that happen after decoding (queue.replay_queue.GroupLimits and the queue): their sequence
# numbers were seen, so they are not in queue/lost. Every other wire/rejected reason is a frame the
# codec could not read, whose number the registry then counts as a gap (queue/lost).
LIMIT_REJECTIONS = ("empty_prompt", "too_many_samples", "too_long", "token_out_of_vocab", "unknown_generator")
SCENARIO_TIMEOUT_S = 15 * 60
STOP_WITHIN_S = 60  # an interrupted run must stop (checkpoint included) within this (docs/ARCHITECTURE.md)
POLL_S = 0.2
TRACK_EVERY_S = 1.0


# ---------------------------------------------------------------------------------- accounting


@dataclass(frozen=True)
class Consumed:
    """One group a learner took to train on, as recorded."""

    run: int  # which `asyncgrpo train` process of the scenario took it: 0, then +1 per resume
    version: int  # the learner's version when it took the group
    generator: int
    incarnation: int
    seq: int
    pos: int  # its prompt's position in the generator's prompt stream
    prompt_id: int
    version_min: int  # the oldest policy version among its tokens


@dataclass
class Accounting:
    consumed: int = 0
    duplicate_seqs: int = 0  # a (run, generator, incarnation, seq) taken again
    duplicate_prompts: int = 0  # a (generator, position) taken again, or a prompt id again within one pass
    duplicates: int = 0  # groups that are either
    seq_gaps: int = 0  # numbers below an incarnation's highest taken that were never taken
    skipped: int = 0  # prompt positions below a generator's highest taken that were never taken
    staleness_max: int = 0


def account(records: Sequence[Consumed], epoch_size: int | None = None) -> Accounting:
    """What the learners actually trained on, from the recorded groups in the order they were taken.

    Positions are in the run's one prompt stream, whoever generated them. `epoch_size`: prompts in
    one pass of the stream (a position // epoch_size is the pass); None leaves out the prompt-id
    check, which only the position check then covers."""
    result = Accounting(consumed=len(records))
    seen_seqs: set[tuple[int, int, int, int]] = set()
    seen_prompts: set[tuple[Any, ...]] = set()
    seqs: dict[tuple[int, int, int], set[int]] = defaultdict(set)
    positions: set[int] = set()
    for record in records:
        seq_key = (record.run, record.generator, record.incarnation, record.seq)
        prompt_keys = [("pos", record.pos)]
        if epoch_size:
            prompt_keys.append(("prompt", record.pos // epoch_size, record.prompt_id))
        repeated_seq = seq_key in seen_seqs
        repeated_prompt = any(key in seen_prompts for key in prompt_keys)
        result.duplicate_seqs += repeated_seq
        result.duplicate_prompts += repeated_prompt
        result.duplicates += repeated_seq or repeated_prompt
        seen_seqs.add(seq_key)
        seen_prompts.update(prompt_keys)
        seqs[seq_key[:3]].add(record.seq)
        positions.add(record.pos)
        result.staleness_max = max(result.staleness_max, staleness(record.version_min, record.version))
    result.seq_gaps = sum(max(taken) + 1 - len(taken) for taken in seqs.values())
    result.skipped = max(positions) + 1 - len(positions) if positions else 0
    return result


@dataclass
class Counted:
    dropped_stale: int = 0
    lost_in_transit: int = 0  # queue/lost: sequence gaps, frames the decoder rejected included
    rejected: int = 0  # wire/rejected, every reason
    rejected_limits: int = 0  # of which the model's limits (their numbers were seen: not in queue/lost)
    reward_dropped: int = 0

    @property
    def lost(self) -> int:
        return self.dropped_stale + self.lost_in_transit + self.rejected_limits + self.reward_dropped


def counted_lost(runs: Sequence[Sequence[dict[str, Any]]]) -> Counted:
    """What the runs counted as not trained, over their surviving steps (`lineage`). Queue and wire
    counters are cumulative per process, so each run's last surviving step has its total;
    reward/groups_dropped is per step."""
    counted = Counted()
    for records in runs:
        if not records:
            continue
        last = records[-1]
        counted.dropped_stale += int(last.get("queue/dropped_stale", 0))
        counted.lost_in_transit += int(last.get("queue/lost", 0))
        counted.rejected += int(last.get("wire/rejected", 0))
        counted.rejected_limits += sum(int(last.get(f"wire/rejected/{reason}", 0)) for reason in LIMIT_REJECTIONS)
        counted.reward_dropped += sum(int(record.get("reward/groups_dropped", 0)) for record in records)
    return counted


def lineage(runs: Sequence[Sequence[dict[str, Any]]], starts: Sequence[int]) -> list[list[dict[str, Any]]]:
    """Each run's step records that the runs after it kept: run k's steps up to the version run k+1
    resumed from (`starts[k + 1]`; 0: a fresh start, which keeps nothing of run k)."""
    kept = []
    for k, records in enumerate(runs):
        end = starts[k + 1] if k + 1 < len(starts) else None
        kept.append([r for r in records if end is None or int(r["step"]) <= end])
    return kept


def run_of(version: int, starts: Sequence[int]) -> int:
    """The run that took a step at `version`: the last to start at or before it (each resume cut the
    recording back to its checkpoint's version)."""
    return max(k for k, start in enumerate(starts) if start <= version)


def read_recording(directory: Path, starts: Sequence[int]) -> list[Consumed]:
    """Every group recorded in `directory` (wire.record_dir), in the order taken."""
    from asyncgrpo.recording.stream import STREAM_FILE, read_group, scan

    stream = directory / STREAM_FILE
    if not stream.is_file():
        return []
    index = scan(stream, check_groups=False)
    records = []
    with stream.open("rb") as file:
        for step in index.steps:
            for offset in step.offsets:
                group = read_group(file, offset)
                records.append(Consumed(run=run_of(step.version, starts), version=step.version,
                                        generator=group.generator_id, incarnation=group.incarnation, seq=group.seq,
                                        pos=group.pos, prompt_id=group.prompt_id, version_min=group.version_min))
    return records


def default_epoch_size() -> int | None:
    """Prompts in one pass of a generator's stream on the default task (arithmetic: its train split)."""
    from asyncgrpo.schema import Config
    from asyncgrpo.tasks.arithmetic import ArithmeticTask

    task = Config().task
    if task.name != "arithmetic":
        return None
    return ArithmeticTask(num_digits=task.num_digits, eval_size=task.eval_size).num_problems - task.eval_size


# ------------------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, session id, start time in clock ticks) of a live process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    if fields[0] == "Z":  # a zombie has exited; only its parent's wait is missing
        return None
    return int(fields[1]), int(fields[3]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(roots: set[int]) -> dict[int, int]:
    """pid -> start time of every live process under `roots` (roots included), or in a session one
    of them leads (a child whose parent exited is no longer under it, but keeps its session)."""
    children: dict[int, list[int]] = defaultdict(list)
    starts: dict[int, int] = {}
    in_sessions = []
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None:
            children[stat[0]].append(pid)
            starts[pid] = stat[2]
            if stat[1] in roots:
                in_sessions.append(pid)
    found: dict[int, int] = {}
    stack = [pid for pid in [*roots, *in_sessions] if pid in starts]
    while stack:
        pid = stack.pop()
        if pid not in found:
            found[pid] = starts[pid]
            stack.extend(children.get(pid, []))
    return found


def _unix_socket_paths() -> dict[str, str]:
    """inode -> bound path of every Unix socket of this machine bound in an asyncgrpo wire directory."""
    paths = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and "asyncgrpo-wire-" in parts[7]:
                paths[parts[6]] = parts[7]
    return paths


def private_dirs_of(pids: Sequence[int]) -> set[str]:
    """The asyncgrpo private directories these processes hold: shared-memory weight slots they map,
    and the directories of Unix sockets they bound (the learner's wire endpoints)."""
    found: set[str] = set()
    sockets = _unix_socket_paths()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if "/asyncgrpo-weights-" in path:
                    found.add(os.path.dirname(path))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:[") and target[8:-1] in sockets:
                        found.add(os.path.dirname(sockets[target[8:-1]]))
    return found


class ScenarioError(RuntimeError):
    """The scenario could not go on (a run ended early, a wait timed out); its row fails with this."""


@dataclass
class RunResult:
    index: int
    returncode: int
    summary: dict[str, Any]
    last_line: str  # the CLI's last line of output
    output: str  # everything it printed
    steps: list[dict[str, Any]]  # its step records (metrics.jsonl lines it appended with loss/pg)
    wall_s: float


class Train:
    """One `asyncgrpo train` process, in a session of its own, its output in <scenario>/train.<k>.log."""

    def __init__(self, ctx: Context, index: int, overrides: Sequence[str], faults: dict[str, Any] | None,
                 env: dict[str, str] | None) -> None:
        self.ctx, self.index = ctx, index
        self.metrics_offset = len(_lines(ctx.run_dir / "metrics.jsonl"))
        self.log = ctx.directory / f"train.{index}.log"
        command = [sys.executable, "-m", "asyncgrpo.cli", "train", f"run_dir={ctx.run_dir}",
                   f"wire.record_dir={ctx.run_dir / 'stream'}", *BASE_OVERRIDES, *EXTRA_OVERRIDES, *overrides]
        environment = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ASYNCGRPO_FAULTS")}
        environment.update(env or {})
        if faults:
            environment["ASYNCGRPO_FAULTS"] = json.dumps(faults)
        (ctx.directory / f"train.{index}.command").write_text(f"{' '.join(command)}\n{json.dumps(faults or {})}\n")
        self.started = time.monotonic()
        with self.log.open("w") as output:
            # Its own session: nothing it starts is tied to this terminal, and all of it can be found.
            self.proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=environment,
                                         cwd=REPO, start_new_session=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def steps(self) -> list[dict[str, Any]]:
        lines = _lines(self.ctx.run_dir / "metrics.jsonl")[self.metrics_offset:]
        return [r for r in _parse_json_lines(lines) if "loss/pg" in r]

    def last_step(self) -> int:
        steps = self.steps()
        return int(steps[-1]["step"]) if steps else 0


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _parse_json_lines(lines: Sequence[str]) -> list[dict[str, Any]]:
    parsed = []
    for line in lines:
        with contextlib.suppress(ValueError):  # a line still being written
            parsed.append(json.loads(line))
    return parsed


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


class Context:
    """One scenario's directory, deadline, runs and the processes and private directories they started."""

    def __init__(self, directory: Path, timeout_s: float) -> None:
        self.directory = directory
        self.run_dir = directory / "run"
        self.deadline = time.monotonic() + timeout_s
        self.trains: list[Train] = []
        self.results: list[RunResult] = []
        self.processes: dict[int, int] = {}  # pid -> start time, of everything the runs started
        self.private_dirs: set[str] = set()
        self.notes: list[str] = []
        self._next_track = 0.0
        directory.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------------------- runs

    def train(self, overrides: Sequence[str], faults: dict[str, Any] | None = None,
              env: dict[str, str] | None = None) -> Train:
        train = Train(self, len(self.trains), overrides, faults, env)
        self.trains.append(train)
        return train

    def track(self) -> None:
        """Note every process the runs started and the private directories their actors hold (at
        most every TRACK_EVERY_S: reading /proc costs a shared machine's cores too)."""
        if time.monotonic() < self._next_track:
            return
        self._next_track = time.monotonic() + TRACK_EVERY_S
        roots = {t.proc.pid for t in self.trains if t.running()}
        if roots:
            self.processes.update(descendants(roots))
        actors = self.actors()
        pids = [*actors.get("learner_pids", []), *actors.get("generator_pids", [])]
        self.private_dirs |= private_dirs_of([p for p in pids if p in self.processes])

    def actors(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "actors.json").read_text())
        except (OSError, ValueError):
            return {}

    def wait(self, train: Train, predicate: Callable[[], bool], what: str, timeout_s: float | None = None) -> None:
        """Until `predicate` holds; a run that ends first, or the timeout, ends the scenario."""
        deadline = min(self.deadline, time.monotonic() + (timeout_s or float("inf")))
        while not predicate():
            self.track()
            if not train.running():
                raise ScenarioError(f"run {train.index} ended (exit {train.proc.returncode}) before {what}: "
                                    f"{_last_line(train.log.read_text())[:200]}")
            if time.monotonic() > deadline:
                raise ScenarioError(f"timed out waiting for {what}")
            time.sleep(POLL_S)

    def wait_for_step(self, train: Train, step: int) -> None:
        self.wait(train, lambda: train.last_step() >= step, f"learner step {step}")

    def finish(self, train: Train, timeout_s: float | None = None) -> RunResult:
        """Wait for the run to end on its own; its result (summary.json is read now: the next run
        renames it)."""
        deadline = min(self.deadline, time.monotonic() + (timeout_s or float("inf")))
        while train.running():
            self.track()
            if time.monotonic() > deadline:
                raise ScenarioError(f"run {train.index} did not end in time")
            time.sleep(POLL_S)
        output = train.log.read_text()
        try:
            summary = json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            summary = {}
        result = RunResult(train.index, train.proc.returncode, summary, _last_line(output), output, train.steps(),
                           time.monotonic() - train.started)
        self.results.append(result)
        return result

    def signal(self, pid: int, signum: signal.Signals, what: str) -> None:
        os.kill(pid, signum)
        self.notes.append(f"{signum.name} {what} (pid {pid})")

    # ---------------------------------------------------------------------------- the end

    def stop_everything(self) -> list[str]:
        """Kill what the runs left running; returns the leftovers (processes alive after their run
        ended, and private directories still there), which are removed."""
        leftovers = []
        for train in self.trains:
            if train.running():  # the scenario failed or timed out: its run is stopped the hard way
                self.track()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(train.proc.pid, signal.SIGKILL)
                train.proc.wait()
        # What a run started must exit with it: give Ray's processes a moment, then kill the rest.
        deadline = time.monotonic() + 15
        alive = self._alive()
        while alive and time.monotonic() < deadline:
            time.sleep(0.5)
            alive = self._alive()
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if alive:
            leftovers.append(f"{len(alive)} process(es) alive after their run ended (killed): "
                             + ", ".join(_command(pid) for pid in list(alive)[:3]))
        for directory in sorted(self.private_dirs):
            if os.path.exists(directory):
                leftovers.append(f"{directory} left behind (removed)")
                shutil.rmtree(directory, ignore_errors=True)
        return leftovers

    def _alive(self) -> list[int]:
        """The runs' processes still alive: those seen, and whatever they started since. Only live
        processes seen before are roots: a run's own pid may already belong to another process."""
        def seen_alive() -> list[int]:
            return [pid for pid, start in self.processes.items() if (_proc_stat(pid) or (0, 0, -1))[2] == start]

        self.processes.update(descendants(set(seen_alive())))
        return seen_alive()


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
    except OSError:
        return str(pid)


# ---------------------------------------------------------------------------------- evaluation


@dataclass
class Row:
    scenario: str
    outcome: str = "FAIL"
    lost_counted: int | None = None
    lost_actual: int | None = None
    duplicates: int | None = None
    staleness_max: int | None = None
    status: str = ""  # each run's final status, in order
    wall_s: float = 0.0
    unmet: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


Check = tuple[bool, str]


def one_line_error(result: RunResult, *needles: str) -> list[Check]:
    """A failed run: exit 1, status failed, its error on one line naming each of `needles`, and the
    CLI's last line is that error."""
    error = str(result.summary.get("error", ""))
    checks = [(result.returncode == 1, f"run {result.index} exits 1 (got {result.returncode})"),
              (result.summary.get("status") == "failed", f"run {result.index} status failed"),
              (bool(error) and "\n" not in error, f"run {result.index}'s error is one line (got {error[:160]!r})"),
              (result.last_line.startswith("asyncgrpo: training failed:"),
               f"run {result.index}'s last line is the error (got {result.last_line[:160]!r})")]
    checks += [(needle.lower() in error.lower(), f"run {result.index}'s error names {needle!r}") for needle in needles]
    return checks


def finished(result: RunResult, max_steps: int) -> list[Check]:
    return [(result.returncode == 0, f"run {result.index} exits 0 (got {result.returncode}: {result.last_line[:160]})"),
            (result.summary.get("status") == "finished", f"run {result.index} status finished"),
            (result.summary.get("steps") == max_steps,
             f"run {result.index} reaches step {max_steps} (got {result.summary.get('steps')})")]


def evaluate(ctx: Context, row: Row, max_steps: int | None, checks: list[Check]) -> None:
    """Fill `row` from the scenario's runs and recording; PASS if `checks` and the common
    expectations hold: the last run finished at `max_steps` (None: it is not meant to finish, and
    `checks` say how it ends) with every step it logged recorded; no group trained twice; nothing
    lost that was not counted; staleness within the bound. Leftovers are added by `run_scenario`."""
    results = ctx.results
    starts = [int(r.summary.get("resumed_at_step", 0)) for r in results]
    records = read_recording(ctx.run_dir / "stream", starts)
    accounting = account(records, default_epoch_size())
    counted = counted_lost(lineage([r.steps for r in results], starts))
    row.lost_counted, row.lost_actual = counted.lost, accounting.skipped
    row.duplicates, row.staleness_max = accounting.duplicates, accounting.staleness_max
    row.status = " -> ".join(str(r.summary.get("status", f"exit {r.returncode}")) for r in results)
    last = results[-1]
    tail = {}  # per generator of the last run: groups its final incarnation sent after the last one trained
    for g, report in enumerate(last.summary.get("generators", []) or []):
        mine = [r for r in records if r.run == len(results) - 1 and r.generator == g]
        if mine:
            newest = max(mine, key=lambda r: (r.incarnation, r.seq))
            tail[g] = int(report.get("gen/groups_sent", 0)) - (newest.seq + 1)
    row.details = {"accounting": asdict(accounting), "counted": {**asdict(counted), "lost": counted.lost},
                   "untrained_tail": tail, "resumed_at": starts[1:],
                   "errors": [r.summary.get("error") for r in results if r.summary.get("error")]}
    steps = max_steps if max_steps is not None else max((int(r["step"]) for r in last.steps), default=0)
    # A run that fails may have taken (and recorded) the groups of the steps of the driver's last call
    # (train.steps_per_call), which it never logged: those trained before the failure and the one it failed in.
    recorded_steps = {steps} if max_steps is not None else set(range(steps, steps + STEPS_PER_CALL + 1))
    common = [*(finished(last, max_steps) if max_steps is not None else []),
              (accounting.consumed in {k * GROUPS_PER_STEP for k in recorded_steps},
               f"the recording holds {steps} steps of {GROUPS_PER_STEP} groups"
               f"{'' if max_steps is not None else f' (or up to {STEPS_PER_CALL} more: its last call)'} "
               f"(got {accounting.consumed} groups)"),
              (accounting.duplicates == 0, (f"no group trained twice (got {accounting.duplicate_seqs} sequence and "
                                            f"{accounting.duplicate_prompts} prompt duplicates)")),
              (accounting.skipped <= counted.lost,
               f"no silent loss: {accounting.skipped} prompts skipped, {counted.lost} counted"),
              (accounting.staleness_max <= MAX_STALENESS,
               f"staleness max {accounting.staleness_max} <= {MAX_STALENESS}")]
    row.unmet = [what for ok, what in [*checks, *common] if not ok]


# --------------------------------------------------------------------------------------- helpers


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """A request handler of the stand-in servers below: JSON answers, nothing on the console."""

    protocol_version = "HTTP/1.1"  # keep-alive: a client that can reuses its connections

    def _reply(self, status: int, value: dict[str, Any]) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:  # tens of thousands of requests: not on the console
        pass


class LoopbackServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # A client without keep-alive (the HTTP environment adapter) opens a connection per call: with
    # socketserver's backlog of 5 a burst waits for a SYN retry (1 s) and times out without any hang.
    request_queue_size = 256

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The client drops a connection whose 500 it did not read: a reset, not news.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class Judge:
    """A stand-in for an OpenAI-compatible judge on 127.0.0.1 (the endpoints reward.judge uses: GET
    /v1/models at start-up, POST /v1/chat/completions per completion). Its prompt template is
    "{answer}|{completion}"; it scores 10 for the exact answer (as the task does), 0 otherwise, and
    answers HTTP 500 while an outage (`fail_for`) lasts."""

    def __init__(self) -> None:
        from asyncgrpo.tasks.arithmetic import EOS_TEXT

        judge = self
        self.fail_until = 0.0
        self.answered = self.failed = 0
        self._lock = threading.Lock()

        class Handler(JsonHandler):

            def do_GET(self) -> None:  # http.server's name for the GET handler
                self._reply(200 if self.path.rstrip("/") == "/v1/models" else 404,
                            {"object": "list", "data": [{"id": "chaos"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if time.monotonic() < judge.fail_until:
                    with judge._lock:
                        judge.failed += 1
                    self._reply(500, {"error": "chaos: the judge is down"})
                    return
                answer, _, completion = body["messages"][0]["content"].partition("|")
                completion = completion.rstrip()
                while completion.endswith(EOS_TEXT):
                    completion = completion.removesuffix(EOS_TEXT).rstrip()
                with judge._lock:
                    judge.answered += 1
                score = 10 if completion == answer else 0
                self._reply(200, {"choices": [{"index": 0, "message": {"role": "assistant",
                                                                       "content": f"Score: {score}"}}]})

        self.server = LoopbackServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def fail_for(self, seconds: float) -> None:
        self.fail_until = time.monotonic() + seconds

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


class EnvServer:
    """A stand-in for an environment served over HTTP on 127.0.0.1 (docs/ENVIRONMENTS.md, HTTP
    environments) for the default task: a policy turn ends at the digit "0" and the environment
    answers with nothing (the episode goes on), so the episodes of answers holding a 0 call it (their
    rewards see only the last turn: what is learnt is not what these scenarios test). Every `hang_every`-th reset never gets an answer (only the generator's
    timeouts get past it), and while an outage (`fail_for`) lasts every request is answered HTTP 500."""

    def __init__(self, hang_every: int = 0) -> None:
        server = self
        self.fail_until = 0.0
        self.hang_every = hang_every
        self.resets = self.steps = self.failed = self.hung = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

        class Handler(JsonHandler):

            def do_GET(self) -> None:  # http.server's name for the GET handler
                self._reply(200 if self.path.rstrip("/") == "/info" else 404, {"stop": ["0"], "name": "chaos-echo"})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if time.monotonic() < server.fail_until:
                    with server._lock:
                        server.failed += 1
                    self._reply(500, {"error": "chaos: the environment is down"})
                    return
                route = self.path.rstrip("/")
                if route == "/reset":
                    with server._lock:
                        server.resets += 1
                        hang = server.hang_every > 0 and server.resets % server.hang_every == 0
                        server.hung += hang
                        episode = f"e{server.resets}"
                    if hang:
                        server._stop.wait()  # until the server closes: the generator's timeout ends the call
                        return
                    self._reply(200, {"episode_id": episode, "observation": ""})
                elif route == "/step":
                    with server._lock:
                        server.steps += 1
                    self._reply(200, {"observation": "", "reward": 0.0, "done": False})
                else:
                    self._reply(200, {})

        self.server = LoopbackServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def fail_for(self, seconds: float) -> None:
        self.fail_until = time.monotonic() + seconds

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


FAULTY_REWARD = '''"""Written by tools/chaos.py: exact match, but every {every}th call {what}."""
import itertools
import os
import threading

from asyncgrpo.tasks.arithmetic import EOS_TEXT

_calls = itertools.count(1)
_lock = threading.Lock()


def reward(prompt, completion, answer=None, **extra):
    with _lock:
        call = next(_calls)
    if call % {every} == 0:
{fault}
    text = completion.rstrip()
    while text.endswith(EOS_TEXT):
        text = text.removesuffix(EOS_TEXT).rstrip()
    return 1.0 if text == answer else 0.0
'''


def hanging_reward(every: int, log: Path) -> str:
    """A reward module whose every `every`-th call never returns (each such call noted in `log`)."""
    fault = (f"        with open({str(log)!r}, \"a\") as log:\n"
             "            log.write(f\"{os.getpid()} {call}\\n\")\n"
             "        threading.Event().wait()  # forever: only reward.timeout_s gets the generator past it")
    return FAULTY_REWARD.format(every=every, what="never returns", fault=fault)


def failing_reward(every: int) -> str:
    """A reward module whose every `every`-th call raises."""
    fault = '        raise RuntimeError(f"chaos: reward call {call} fails")'
    return FAULTY_REWARD.format(every=every, what="raises", fault=fault)


@contextlib.contextmanager
def small_disk(directory: Path) -> Iterator[bool]:
    """`directory` on a tmpfs of its own (64 MiB until `resize` shrinks it); True if mounted, False
    where mounting is not permitted. Unmounted on the way out, whatever happened."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs", str(directory)],
                             capture_output=True, check=False).returncode == 0
    try:
        yield mounted
    finally:
        # A process still holding a file there (one that outlived its run) must not keep it mounted.
        if mounted and subprocess.run(["umount", str(directory)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)


def resize(directory: Path, size_bytes: int) -> None:
    size_kib = -(-size_bytes // 4096) * 4  # whole pages
    subprocess.run(["mount", "-o", f"remount,size={size_kib}k", str(directory)], check=True, capture_output=True)


def tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def complete_steps(checkpoints: Path) -> list[int]:
    from asyncgrpo.learner.checkpoint import complete_checkpoints

    return [int(p.name.split("_")[1]) for p in complete_checkpoints(checkpoints)]


def verified(checkpoints: Path) -> bool:
    """Every complete checkpoint matches its manifest."""
    from asyncgrpo.learner.checkpoint import (
        CheckpointError,
        complete_checkpoints,
        verify,
    )

    try:
        for path in complete_checkpoints(checkpoints):
            verify(path)
    except CheckpointError:
        return False
    return True


# ------------------------------------------------------------------------------------- scenarios


def generator_kill(ctx: Context, row: Row) -> None:
    steps = 300
    train = ctx.train([f"train.max_steps={steps}"])
    ctx.wait_for_step(train, 60)
    ctx.signal(ctx.actors()["generator_pids"][0], signal.SIGKILL, "generator 0 at step 60")
    result = ctx.finish(train)
    restarted = result.summary.get("generators", [{}])[0].get("restarts")
    evaluate(ctx, row, steps, [
        (result.summary.get("generator_restarts") == 1 and restarted == 1, "generator_restarts=1"),
        ("[restart] generator 0 rejoined" in result.output, "the driver says generator 0 rejoined"),
    ])
    last = result.steps[-1] if result.steps else {}
    row.notes.append(f"{last.get('dispatch/down')} slots of the dead one not arrived granted again with their "
                     "prompts; what it queued kept its slots")


def generator_kill_at_end(ctx: Context, row: Row) -> None:
    steps = 120
    train = ctx.train([f"train.max_steps={steps}", "eval.at_end=true"])
    ctx.wait_for_step(train, steps)
    ctx.signal(ctx.actors()["generator_pids"][0], signal.SIGKILL, f"generator 0 once step {steps} was logged")
    result = ctx.finish(train)
    evaluate(ctx, row, steps, [
        # Before its run() returned (its report in summary.json says so) or during the evaluation.
        ("[finish] generator 0 died after the last step" in result.output, "the driver says it died after the last step"),
        ("[finish] no generator left: starting one on the final weights" in result.output,
         "a fresh engine on the final weights took over"),
        (result.summary.get("generator_restarts") == 0, "not restarted (nothing was left to generate)"),
        ("eval_accuracy_end" in result.summary, "the final evaluation ran (on a fresh engine)"),
        (not (ctx.run_dir / "evaluator_weights").exists(), "the fresh engine's weights were removed"),
    ])


def learner_kill(ctx: Context, row: Row) -> None:
    steps, every, kill_at = 300, 50, 120
    train = ctx.train([f"train.max_steps={steps}", f"train.save_every_steps={every}"])
    ctx.wait_for_step(train, kill_at)
    ctx.signal(ctx.actors()["learner_pids"][0], signal.SIGKILL, f"learner rank 0 at step {kill_at}")
    killed = time.monotonic()
    crashed = ctx.finish(train, timeout_s=STOP_WITHIN_S + 60)
    stop_s = time.monotonic() - killed
    row.notes.append(f"the run failed {stop_s:.0f} s after the kill")
    newest = complete_steps(ctx.run_dir / "checkpoints")
    resumed = ctx.finish(ctx.train([f"train.max_steps={steps}", f"train.save_every_steps={every}", "resume=auto"]))
    expected_from = (kill_at // every) * every
    evaluate(ctx, row, steps, [
        *one_line_error(crashed, "learner"),
        (stop_s <= STOP_WITHIN_S, f"the run stopped within {STOP_WITHIN_S} s of the kill (took {stop_s:.0f})"),
        (bool(newest) and newest[-1] >= expected_from, f"a complete checkpoint at >= {expected_from} (got {newest})"),
        (resumed.summary.get("resumed_at_step") == (newest[-1] if newest else None),
         f"resume=auto continued from the newest complete checkpoint (got {resumed.summary.get('resumed_at_step')})"),
    ])


def driver_kill(ctx: Context, row: Row) -> None:
    """SIGKILL of the driver: nothing of its own clean-up runs, so its shared-memory weight slots
    stay in /dev/shm (and its run's processes are killed as a scheduler would kill the job's process
    group). The next run's start removes the dead run's slots; resume=auto continues the run."""
    steps, every, kill_at = 300, 50, 120
    overrides = [f"train.max_steps={steps}", f"train.save_every_steps={every}"]
    train = ctx.train(overrides)
    ctx.wait_for_step(train, kill_at)
    ctx.track()
    slots = {d for d in ctx.private_dirs if "/asyncgrpo-weights-" in d}
    ctx.signal(train.proc.pid, signal.SIGKILL, f"the driver at step {kill_at}")
    train.proc.wait()
    with contextlib.suppress(ProcessLookupError):  # the job's process group, as a scheduler ends it
        os.killpg(train.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while ctx._alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    ctx.finish(train)  # its summary.json was never written: SIGKILL runs no clean-up
    left = {d for d in slots if os.path.isdir(d)}
    row.notes.append(f"{len(left)} of {len(slots)} weight slot directories left by the killed driver")
    ctx.private_dirs -= slots  # the next run must remove them, not the suite's clean-up
    newest = complete_steps(ctx.run_dir / "checkpoints")
    resumed = ctx.finish(ctx.train([*overrides, "resume=auto"]))
    evaluate(ctx, row, steps, [
        (bool(slots) and left == slots, f"the killed driver left its weight slots behind ({sorted(left)})"),
        (not any(os.path.isdir(d) for d in left), "the next run's start removed them"),
        (resumed.summary.get("resumed_at_step") == (newest[-1] if newest else None),
         f"resume=auto continued from the newest complete checkpoint {newest[-1:]} "
         f"(got {resumed.summary.get('resumed_at_step')})"),
    ])


def driver_sigterm_step(ctx: Context, row: Row) -> None:
    steps, at = 300, 120
    train = ctx.train([f"train.max_steps={steps}"])
    ctx.wait_for_step(train, at)
    signalled = time.monotonic()
    ctx.signal(train.proc.pid, signal.SIGTERM, f"the driver at step {at}")
    stopped = ctx.finish(train, timeout_s=STOP_WITHIN_S + 30)
    stop_s = time.monotonic() - signalled
    checkpoint = stopped.summary.get("interrupt_checkpoint") or ""
    resumed = ctx.finish(ctx.train([f"train.max_steps={steps}", "resume=auto"]))
    row.notes.append(f"stopped {stop_s:.0f} s after SIGTERM")
    evaluate(ctx, row, steps, [
        (stopped.returncode == 130 and stopped.summary.get("status") == "interrupted",
         f"the signalled run is interrupted, exit 130 (got {stopped.returncode}, {stopped.summary.get('status')})"),
        (stop_s <= STOP_WITHIN_S, f"it stopped within {STOP_WITHIN_S} s (took {stop_s:.0f})"),
        (bool(checkpoint) and (Path(checkpoint) / "COMPLETE").is_file()
         and int(Path(checkpoint).name.split("_")[1]) >= at,
         f"a complete interrupt checkpoint at >= {at} ({checkpoint})"),
        (resumed.summary.get("resumed_at_step") == (int(Path(checkpoint).name.split("_")[1]) if checkpoint else None),
         "resume=auto continued from the interrupt checkpoint"),
    ])


def driver_sigterm_checkpoint(ctx: Context, row: Row) -> None:
    steps, every, delay_s = 300, 100, 5
    overrides = [f"train.max_steps={steps}", f"train.save_every_steps={every}"]
    faults = {"checkpoint_save_delay_s": delay_s}
    train = ctx.train(overrides, faults=faults)
    checkpoints = ctx.run_dir / "checkpoints"
    ctx.wait(train, lambda: (checkpoints / f"step_{every}.tmp").is_dir(), f"the save of step_{every} to begin")
    signalled = time.monotonic()
    ctx.signal(train.proc.pid, signal.SIGTERM, f"the driver while step_{every}.tmp is written")
    stopped = ctx.finish(train, timeout_s=STOP_WITHIN_S + 30)
    stop_s = time.monotonic() - signalled
    complete = complete_steps(checkpoints)
    leftover_tmp = sorted(p.name for p in checkpoints.glob("*.tmp"))
    resumed = ctx.finish(ctx.train([*overrides, "resume=auto"], faults=faults))
    row.notes.append(f"stopped {stop_s:.0f} s after SIGTERM (saves slowed by {delay_s} s)")
    evaluate(ctx, row, steps, [
        (stopped.returncode == 130 and stopped.summary.get("status") == "interrupted",
         f"the signalled run is interrupted, exit 130 (got {stopped.returncode}, {stopped.summary.get('status')})"),
        (stop_s <= STOP_WITHIN_S, f"it stopped within {STOP_WITHIN_S} s (took {stop_s:.0f})"),
        (every in complete, f"the save under way completed (complete: {complete})"),
        (not leftover_tmp, f"no partial checkpoint left ({leftover_tmp})"),
        (bool(stopped.summary.get("interrupt_checkpoint")), "an interrupt checkpoint was saved"),
        (resumed.summary.get("resumed_at_step") == (complete[-1] if complete else None),
         "resume=auto continued from the newest complete checkpoint"),
        (verified(checkpoints), "every complete checkpoint matches its manifest"),
    ])


def wire_fault(name: str, every: int, reason: str | None) -> Callable[[Context, Row], None]:
    """Every `every`-th group lost (`wire_drop_every`) or corrupted (`wire_corrupt_every`, rejected
    under wire/rejected/`reason`) by the generator's sender."""

    def scenario(ctx: Context, row: Row) -> None:
        steps = 240
        result = ctx.finish(ctx.train([f"train.max_steps={steps}"], faults={name: every}))
        last = result.steps[-1] if result.steps else {}
        sent = sum(int(g.get("gen/groups_sent", 0)) for g in result.summary.get("generators", []) or [])
        rejected = int(last.get(f"wire/rejected/{reason}", 0)) if reason else 0
        checks = [(rejected >= 1, f"wire/rejected/{reason} counts the corrupted groups (got {rejected})")]
        evaluate(ctx, row, steps, checks if reason else [])
        gaps = row.details["accounting"]["seq_gaps"]
        # Each faulted group below the last one trained is a gap in the sequence numbers, and the
        # registry counts every gap (those after it too, announced by heartbeats).
        row.unmet += [what for ok, what in [
            (gaps >= 1, "some groups were lost"),
            (gaps <= int(last.get("queue/lost", 0)) <= sent // every,
             f"queue/lost counts every gap: {gaps} <= {last.get('queue/lost')} <= {sent // every} faulted"),
        ] if not ok]
        row.notes.append(f"{sent // every} of {sent} groups faulted; sequence gaps {gaps}, queue/lost "
                         f"{last.get('queue/lost')}, wire/rejected {last.get('wire/rejected')}")

    return scenario


def judge_outage(ctx: Context, row: Row) -> None:
    steps, outage_at, outage_s = 200, 40, 30.0
    judge = Judge()
    try:
        overrides = [f"train.max_steps={steps}", "reward.terms=[{name:judge,kind:judge,weight:1.0}]",
                     f"reward.judge.base_url={judge.base_url}", "reward.judge.model=chaos",
                     "reward.judge.prompt_template='{answer}|{completion}'", "reward.judge.concurrency=32",
                     "reward.judge.timeout_s=5", "reward.judge.retries=2", "reward.judge.backoff_s=0.5",
                     # The outage's share of the calls in the error window depends on how many steps
                     # the machine makes in 30 s: the stop on reward.max_error_rate is not what this
                     # scenario checks (a run that trips it fails loudly, as it should).
                     "reward.on_error=drop_group", "reward.max_error_rate=1"]
        train = ctx.train(overrides)
        ctx.wait_for_step(train, outage_at)
        judge.fail_for(outage_s)
        ctx.notes.append(f"judge answers 500 for {outage_s:.0f} s from step {outage_at}")
        result = ctx.finish(train)
    finally:
        judge.close()
    errors = sum(int(r.get("reward/errors", 0)) for r in result.steps)
    dropped = sum(int(r.get("reward/groups_dropped", 0)) for r in result.steps)
    evaluate(ctx, row, steps, [
        (judge.failed > 0, "the judge answered 500 during the outage"),
        (errors > 0 and dropped > 0, f"reward/errors and reward/groups_dropped count the outage ({errors}, {dropped})"),
    ])
    row.notes.append(f"judge: {judge.failed} x 500, {judge.answered} scores; reward/errors {errors}, "
                     f"groups dropped {dropped}")


def reward_hang(ctx: Context, row: Row) -> None:
    steps, every, timeout_s = 150, 2000, 2.0
    module_dir = ctx.directory / "reward_module"
    module_dir.mkdir(exist_ok=True)
    hangs = ctx.directory / "hangs.log"
    (module_dir / "chaos_reward.py").write_text(hanging_reward(every, hangs))
    python_path = os.pathsep.join(p for p in (str(module_dir), os.environ.get("PYTHONPATH", "")) if p)
    result = ctx.finish(ctx.train([f"train.max_steps={steps}", "reward.fn=chaos_reward:reward",
                                   f"reward.timeout_s={timeout_s}", "reward.threads=4"],
                                  env={"PYTHONPATH": python_path}))
    hung = len(_lines(hangs))
    errors = sum(int(r.get("reward/errors", 0)) for r in result.steps)
    evaluate(ctx, row, steps, [
        (hung > 0, "the reward function hung"),
        # Each hung call is one error, and nothing else is: the calls queued behind the hung ones
        # move to the new pool, and a call's timeout counts from when a thread takes it.
        (errors == hung, f"every hung call is a reward error and no other call is ({errors} errors, {hung} hangs)"),
    ])
    row.notes.append(f"{hung} calls hung (never returned), reward/errors {errors}")


def grant_drop(ctx: Context, row: Row) -> None:
    """Tickets with lost answers and failing rewards: a generator repeats its give-backs until a
    request carrying them is answered, so a repeated give-back may name a slot that the lost answer
    granted it again, with a new prompt; that prompt must be given again, not silently skipped."""
    steps, every, fail_every = 200, 5, 97
    module_dir = ctx.directory / "reward_module"
    module_dir.mkdir(exist_ok=True)
    (module_dir / "chaos_reward.py").write_text(failing_reward(fail_every))
    python_path = os.pathsep.join(p for p in (str(module_dir), os.environ.get("PYTHONPATH", "")) if p)
    result = ctx.finish(ctx.train([f"train.max_steps={steps}", "reward.fn=chaos_reward:reward",
                                   "reward.on_error=drop_group"],
                                  faults={"grant_drop_every": every}, env={"PYTHONPATH": python_path}))
    last = result.steps[-1] if result.steps else {}
    unreceived, released = int(last.get("dispatch/unreceived", 0)), int(last.get("dispatch/released", 0))
    dropped = sum(int(r.get("reward/groups_dropped", 0)) for r in result.steps)
    evaluate(ctx, row, steps, [
        (unreceived > 0, f"answers were lost: dispatch/unreceived counts their slots (got {unreceived})"),
        (dropped > 0 and released > 0,
         f"rewards failed: groups dropped and their slots given back ({dropped} dropped, {released} released)"),
    ])
    row.notes.append(f"every {every}th ticketed answer lost, every {fail_every}th reward call failed: "
                     f"dispatch/unreceived {unreceived}, dispatch/released {released}, reward/groups_dropped {dropped}")


def disk_full(ctx: Context, row: Row) -> None:
    steps, every = 300, 50
    checkpoints = ctx.run_dir / "checkpoints"
    overrides = [f"train.max_steps={steps}", f"train.save_every_steps={every}", "train.keep_checkpoints=0"]
    with small_disk(checkpoints) as mounted:
        faults = None if mounted else {"checkpoint_enospc": 3 * every}
        row.notes.append("a real full tmpfs" if mounted else
                         "mount not permitted: failpoint checkpoint_enospc (no real full disk)")
        train = ctx.train(overrides, faults=faults)
        if mounted:  # room for the first two checkpoints and half of a third
            ctx.wait(train, lambda: (checkpoints / f"step_{every}" / "COMPLETE").is_file(), f"step_{every}")
            size = tree_bytes(checkpoints / f"step_{every}")
            resize(checkpoints, tree_bytes(checkpoints) + int(1.5 * size))
            ctx.notes.append(f"checkpoints on a tmpfs with room for 2.5 checkpoints of {size / 1e6:.1f} MB")
        crashed = ctx.finish(train)
        complete = complete_steps(checkpoints)
        partial = sorted(p.name for p in checkpoints.glob("*.tmp"))
        manifests_ok = verified(checkpoints)
        if mounted:
            resize(checkpoints, 256 << 20)  # the operator makes room
        resumed = ctx.finish(ctx.train([*overrides, "resume=auto"]))
    evaluate(ctx, row, steps, [
        *one_line_error(crashed, "No space left on device"),
        (bool(complete) and complete == list(range(every, complete[-1] + 1, every)),
         f"the saves before the full disk are complete (got {complete})"),
        (bool(partial), f"the save that hit the full disk is left incomplete (.tmp: {partial})"),
        (manifests_ok, "every complete checkpoint matches its manifest"),
        (resumed.summary.get("resumed_at_step") == (complete[-1] if complete else None),
         f"resume=auto continued from the newest complete checkpoint {complete[-1:]}"),
    ])


def env_overrides(server: EnvServer, steps: int, *more: str) -> list[str]:
    """The default task with the chaos environment (EnvServer): no retries, so each hung or failed
    request is one failed call, and short timeouts."""
    return [f"train.max_steps={steps}", "env.name=http", f"env.http.base_url={server.base_url}",
            "env.http.retries=0", "env.http.timeout_s=3", "env.timeout_s=4", "rollout.max_new_tokens=8", *more]


def env_errors(result: RunResult) -> int:
    return sum(int(r.get("env/errors", 0)) for r in result.steps)


def env_hang(ctx: Context, row: Row) -> None:
    """Every 500th episode's environment never answers its reset: each is a timeout, counted, the
    episode scored 0 (env.on_error=zero), nothing else lost."""
    steps, every = 150, 500
    server = EnvServer(hang_every=every)
    try:
        result = ctx.finish(ctx.train(env_overrides(server, steps, "env.max_error_rate=1")))
    finally:
        server.close()
    errors = env_errors(result)
    evaluate(ctx, row, steps, [
        (server.steps > 0, f"turns ended at the stop text called the environment ({server.steps} steps)"),
        (server.hung > 0, f"resets hung ({server.hung})"),
        # A hang still pending when the run ended is never reported: at most one per generator.
        (server.hung - 1 <= errors <= server.hung,
         f"each hung reset is one environment error, and no other call is ({errors} errors, {server.hung} hangs)"),
    ])
    row.notes.append(f"{server.resets} resets ({server.hung} hung), {server.steps} steps; env/errors {errors}")


def env_outage(ctx: Context, row: Row) -> None:
    """The environment answers 500 for 20 s from step 40, env.on_error=drop_group, never stopping: the
    failed calls are counted and their groups dropped (counted as lost), the run finishes."""
    steps, outage_at, outage_s = 200, 40, 20.0
    server = EnvServer()
    try:
        train = ctx.train(env_overrides(server, steps, "env.on_error=drop_group", "env.max_error_rate=1"))
        ctx.wait_for_step(train, outage_at)
        server.fail_for(outage_s)
        ctx.notes.append(f"environment answers 500 for {outage_s:.0f} s from step {outage_at}")
        result = ctx.finish(train)
    finally:
        server.close()
    errors = env_errors(result)
    dropped = sum(int(r.get("reward/groups_dropped", 0)) for r in result.steps)
    evaluate(ctx, row, steps, [
        (server.failed > 0, "the environment answered 500 during the outage"),
        (errors > 0 and dropped > 0, f"env/errors and reward/groups_dropped count the outage ({errors}, {dropped})"),
    ])
    row.notes.append(f"environment: {server.failed} x 500; env/errors {errors}, groups dropped {dropped}")


def env_down(ctx: Context, row: Row) -> None:
    """The environment goes down for good at step 40: beyond env.max_error_rate (0.5) the run stops
    with one line naming the setting and the first error, instead of training on zeros."""
    outage_at = 40
    server = EnvServer()
    try:
        train = ctx.train(env_overrides(server, 400))
        ctx.wait_for_step(train, outage_at)
        server.fail_for(3600.0)
        result = ctx.finish(train)
    finally:
        server.close()
    evaluate(ctx, row, None, [*one_line_error(result, "env.max_error_rate", "first error")])
    row.notes.append(f"environment down from step {outage_at}: stopped at step {result.summary.get('steps')}")


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str
    expected: str
    run: Callable[[Context, Row], None]


SCENARIOS = [
    Scenario("generator_kill", "SIGKILL the generator at step 60 (mid-decode: it is in vLLM most of the time)",
             "finished; generator_restarts=1; 0 duplicates; no silent loss; staleness max <= 2", generator_kill),
    Scenario("generator_kill_at_end", "SIGKILL the generator once the last step (120) is logged: during the "
             "learner's finish or the final evaluation (eval.at_end=true)",
             "finished; not restarted; the final evaluation and the probe on a fresh engine from the final weights; "
             "0 duplicates", generator_kill_at_end),
    Scenario("learner_kill", "SIGKILL learner rank 0 at step 120 (checkpoints every 50), then resume=auto",
             "failed, exit 1, one-line error naming the learner; resumed from step_100; finished; 0 duplicates and "
             "no silent loss across the crash", learner_kill),
    Scenario("driver_kill", "SIGKILL the driver at step 120 (checkpoints every 50; its job's processes killed "
             "with it), then resume=auto",
             "the dead driver's shared-memory weight slots (and socket directories) are left, then removed by the "
             "next run's start; resumed "
             "from step_100; finished; 0 duplicates and no silent loss across the crash", driver_kill),
    Scenario("driver_sigterm_step", "SIGTERM the driver at step 120, then resume=auto",
             f"interrupted within {STOP_WITHIN_S} s, exit 130, complete interrupt checkpoint; resumed from it; "
             "finished; 0 duplicates, no silent loss", driver_sigterm_step),
    Scenario("driver_sigterm_checkpoint", "SIGTERM the driver while step_100.tmp is written (saves slowed 5 s by "
             "checkpoint_save_delay_s), then resume=auto",
             f"interrupted within {STOP_WITHIN_S} s; step_100 completes; no .tmp left; resumed; finished; "
             "0 duplicates", driver_sigterm_checkpoint),
    Scenario("wire_drop", "every 200th group numbered but never sent (failpoint wire_drop_every)",
             "finished; queue/lost counts them; 0 duplicates; no silent loss",
             wire_fault("wire_drop_every", 200, None)),
    Scenario("wire_corrupt", "every 150th group sent with its header's first byte flipped (wire_corrupt_every)",
             "finished; rejected under wire/rejected/bad_header and counted lost; 0 duplicates; no silent loss",
             wire_fault("wire_corrupt_every", 150, "bad_header")),
    Scenario("judge_outage", "the HTTP judge (reward.on_error=drop_group, reward.max_error_rate=1) answers 500 "
             "for 30 s from step 40",
             "finished; reward/errors and reward/groups_dropped count the outage; dropped prompts counted; "
             "0 duplicates", judge_outage),
    Scenario("reward_hang", "reward.fn never returns on every 2000th call (reward.timeout_s=2, reward.threads=4)",
             "finished; each hang a reward error; 0 duplicates", reward_hang),
    Scenario("grant_drop", "every 5th answer carrying tickets lost (grant_drop_every), "
             "every 97th reward call failing (reward.on_error=drop_group): give-backs repeated after lost answers",
             "finished; dispatch/unreceived and the give-backs count them; 0 duplicates; no silent loss",
             grant_drop),
    Scenario("env_hang", "the HTTP environment never answers every 500th reset (env.timeout_s=4, no retries)",
             "finished; each hang one environment error (timeout); 0 duplicates; no silent loss", env_hang),
    Scenario("env_outage", "the HTTP environment answers 500 for 20 s from step 40 (env.on_error=drop_group, "
             "env.max_error_rate=1)",
             "finished; env/errors and reward/groups_dropped count the outage; 0 duplicates; no silent loss",
             env_outage),
    Scenario("env_down", "the HTTP environment answers 500 from step 40 on (env.max_error_rate=0.5)",
             "failed, exit 1, one-line error naming env.max_error_rate and the first error", env_down),
    Scenario("disk_full", "run_dir/checkpoints on a tmpfs with room for 2.5 checkpoints (saves every 50), then "
             "resume=auto after making room",
             "failed, exit 1, one-line error naming 'No space left on device'; the failed save incomplete, the "
             "earlier ones verified; resumed from the newest; finished", disk_full),
]


def run_scenario(scenario: Scenario, out: Path, keep: bool) -> Row:
    row = Row(scenario.name)
    ctx = Context(out / scenario.name, SCENARIO_TIMEOUT_S)
    start = time.monotonic()
    print(f"[chaos] {scenario.name}: {scenario.fault}", flush=True)
    try:
        scenario.run(ctx, row)
    except ScenarioError as err:
        row.unmet.insert(0, str(err))
    except Exception as err:  # noqa: BLE001 - a bug here must not leave a run behind: the row says what broke
        row.unmet.insert(0, f"the scenario broke: {type(err).__name__}: {err}")
    finally:
        row.leftovers = ctx.stop_everything()
        row.details["private_dirs_seen"] = sorted(ctx.private_dirs)  # what the leftover check looked at
    row.notes = [*ctx.notes, *row.notes]
    row.wall_s = time.monotonic() - start
    if row.status == "":
        row.status = " -> ".join(str(r.summary.get("status", f"exit {r.returncode}")) for r in ctx.results)
    row.outcome = "PASS" if not row.unmet and not row.leftovers else "FAIL"
    if row.outcome == "PASS" and not keep:
        shutil.rmtree(ctx.directory, ignore_errors=True)
    print(f"[chaos] {scenario.name}: {row.outcome} in {row.wall_s:.0f} s"
          + (f"; unmet: {'; '.join(row.unmet[:3])}" if row.unmet else "")
          + (f"; leftovers: {'; '.join(row.leftovers)}" if row.leftovers else ""), flush=True)
    return row


def table(rows: Sequence[Row]) -> str:
    header = ("scenario", "outcome", "lost counted/actual", "duplicates", "staleness max", "final status", "time")
    lines = [header]
    for row in rows:
        lost = f"{row.lost_counted}/{row.lost_actual}" if row.lost_counted is not None else "-"
        lines.append((row.scenario, row.outcome, lost, "-" if row.duplicates is None else str(row.duplicates),
                      "-" if row.staleness_max is None else str(row.staleness_max), row.status or "-",
                      f"{row.wall_s:.0f} s"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    for row in rows:
        for what in [*row.unmet, *row.leftovers]:
            text.append(f"  {row.scenario}: {what}")
    return "\n".join(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="", help="comma-separated names (default: all; --list shows them)")
    parser.add_argument("--list", action="store_true", help="print the scenarios, their faults and expected outcomes")
    parser.add_argument("--keep", action="store_true",
                        help="keep every scenario's directory (failed ones are kept anyway)")
    parser.add_argument("--out", default="", help="directory for the scenarios' runs (default: runs/chaos/<date-time>)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every run (repeatable), before each scenario's own")
    args = parser.parse_args(argv)
    check_overrides(parser, args.set, RESERVED_KEYS, "chaos")
    if args.list:
        for scenario in SCENARIOS:
            print(f"{scenario.name}\n  fault:    {scenario.fault}\n  expected: {scenario.expected}")
        return 0
    by_name = {s.name: s for s in SCENARIOS}
    names = [n for n in args.scenarios.split(",") if n] or list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(by_name)}")
    load_config(parser, [*BASE_OVERRIDES, *args.set], what="--set")
    EXTRA_OVERRIDES[:] = args.set
    out = Path(args.out or REPO / "runs" / "chaos" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    rows = [run_scenario(by_name[name], out, args.keep) for name in names]
    total_s = time.monotonic() - start
    print(table(rows))
    print(f"{sum(r.outcome == 'PASS' for r in rows)} of {len(rows)} passed in {total_s / 60:.1f} min; runs in {out}")
    result = {"chaos": [asdict(row) for row in rows], "total_s": round(total_s, 1), "out": str(out)}
    (out / "chaos.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, default=str))
    return 0 if all(row.outcome == "PASS" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
