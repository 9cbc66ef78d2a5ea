"""`asyncgrpo study SPEC.yaml [study_dir=DIR] [key=value ...]`: a grid of training runs x seeds, run one
after another (`--concurrent N`: N at a time), resumable, with a statistical report. docs/STUDIES.md
describes the spec and the output.

    run_study(spec, study_dir)   every cell x seed not finished yet (finished runs with the planned
                                 overrides skipped, others refused), then aggregate()
    command(...)                 the `asyncgrpo study` command line

The spec and its plan are asyncgrpo/study/spec.py; results.csv, report.md and plots/ are written by
report.py (`aggregate`) from what results.py reads back, with stats.py's intervals and plots.py's figures.

Each run is its own `asyncgrpo train` process (`SubprocessRunner`), which keeps one run's Python state
(or crash) out of the next. By default the study starts one local Ray cluster of its own
(asyncgrpo/study/cluster.py) before the first run, and the runs keep their generator engines in it
between them (`rollout.engine_pool`): each run resets them to its own starting weights, seed and
prompt streams instead of starting vLLM again. With `--fresh-engines`, or with `ray.address` in the
spec's base, every run starts and stops its own Ray cluster (or joins that one) and its own engines.

Study directory (private, 0700; one study process at a time holds its .lock):

    spec.yaml                          the spec as run (command-line overrides added to its base)
    runs/<cell-slug>/seed_<s>/         one `asyncgrpo train` run_dir, plus train.log and study_run.json;
                                       an unfinished one is kept as seed_<s>.incomplete-<k> and run again
    results.csv, report.md, plots/     written after the runs, also after Ctrl-C (from what finished)
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.metrics.runs import RunReadError
from asyncgrpo.runtime.files import UnsafeDirectory, private_dir, write_atomic
from asyncgrpo.runtime.interrupts import interrupts_deferred
from asyncgrpo.study.cluster import (
    EngineCluster,
    cluster_overrides,
    signal_when_parent_dies,
)
from asyncgrpo.study.report import aggregate
from asyncgrpo.study.results import FINISHED, is_finished, read_summary
from asyncgrpo.study.spec import RunPlan, Spec, SpecError, default_study_dir, find_spec, read_spec_file
from asyncgrpo.study.stats import is_number

RUN_RECORD = "study_run.json"  # in each run_dir: the cell, the seed and the overrides it ran with
RUN_LOG = "train.log"  # in each run_dir: the run's stdout and stderr
EXIT_INTERRUPTED = 130


class StudyError(RuntimeError):
    """A study directory that cannot be used as asked (another study's runs, a study running in it)."""


# ------------------------------------------------------------------------------------------ running

Runner = Callable[[RunPlan], int]
"""Runs one training run to its end in plan.run_dir; returns its exit code. Its outcome is read from
the run's summary.json. On Ctrl-C it stops the run (which writes its own summary) and re-raises."""


class SubprocessRunner:
    """Each run as `python -m asyncgrpo.cli train ...`, output to run_dir/train.log; `before`:
    overrides ahead of the run's own (the engine cluster's, which the run's own may override),
    `env`: the run's environment (None: the study's).

    The child gets its own session, so a Ctrl-C at the terminal reaches only the study, which passes
    exactly one SIGINT on: the run finishes its step, writes summary.json (status interrupted) and
    stops its Ray cluster and engines. A second Ctrl-C passes another SIGINT; a third kills the
    child's process group."""

    def __init__(self, log: Callable[[str], None] = print, before: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.log, self.before, self.env = log, list(before), env
        self._running: set[subprocess.Popen] = set()  # runs in progress (several with --concurrent)
        self._lock = threading.Lock()

    def command(self, plan: RunPlan) -> list[str]:
        return run_command(plan, self.before)

    def __call__(self, plan: RunPlan) -> int:
        plan.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(plan.run_dir / RUN_LOG, "ab") as out:
            process = subprocess.Popen(self.command(plan), stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True, env=self.env,
                                       preexec_fn=_interrupt_when_parent_dies)
            with self._lock:
                self._running.add(process)
            try:
                return process.wait()
            except KeyboardInterrupt:  # in the main thread: one run at a time
                self._stop(process)
                raise
            finally:
                with self._lock:
                    self._running.discard(process)

    def interrupt(self, presses: int) -> None:
        """Ctrl-C number `presses` (1, 2, ...) while runs go on in other threads (--concurrent):
        a SIGINT to each for the first two, then their process groups killed."""
        with self._lock:
            running = list(self._running)
        for process in running:
            try:
                if presses <= 2:
                    process.send_signal(signal.SIGINT)
                else:
                    os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _stop(self, process: subprocess.Popen) -> None:
        self.log(f"[study] interrupt: stopping the current run (pid {process.pid}); Ctrl-C again to hurry it, "
                 "twice to kill it")
        presses = 0
        while True:
            try:
                if presses < 2:
                    process.send_signal(signal.SIGINT)
                else:
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return
            except KeyboardInterrupt:
                presses += 1
            except ProcessLookupError:
                process.wait()
                return


def run_command(plan: RunPlan, before: Sequence[str] = ()) -> list[str]:
    """The run's command line: `asyncgrpo train --config-name ...`, or for a replay study's run
    `asyncgrpo replay RECORDING` (no engine cluster: a replay starts no generator, so no `before`)."""
    if plan.recording is not None:
        return [sys.executable, "-m", "asyncgrpo.cli", "replay", str(plan.recording), *plan.train_overrides()]
    return [sys.executable, "-m", "asyncgrpo.cli", "train", "--config-name", plan.config_name, *before,
            *plan.train_overrides()]


def _interrupt_when_parent_dies() -> None:
    """In the child, before exec (Linux): if the study dies without passing Ctrl-C on (killed, its
    terminal closed), the run gets a SIGINT and stops as it would on Ctrl-C, instead of running on
    unwatched into a directory the next study invocation reuses."""
    signal_when_parent_dies(signal.SIGINT)


@dataclass
class StudyOutcome:
    ran: list[RunPlan] = field(default_factory=list)
    skipped: list[RunPlan] = field(default_factory=list)
    not_finished: list[RunPlan] = field(default_factory=list)  # ran, but failed or interrupted
    interrupted: bool = False
    written: list[Path] = field(default_factory=list)  # results.csv, report.md, plots

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return 1 if self.not_finished else 0


def engine_cluster_cpus(spec: Spec) -> int | None:
    """The CPUs of a study's own Ray cluster, whose generator engines its runs keep between them:
    the most any cell's run would give a local cluster. Checks every cell's config with the
    cluster's overrides. None when the runs join a cluster the spec names (ray.address in base):
    they start and stop their own engines."""
    from asyncgrpo.composition import local_cluster_cpus

    placeholder = "127.0.0.1:1"
    configs = spec.check_configs(before=cluster_overrides(placeholder, engine_pool_name(spec)))
    cpus = [local_cluster_cpus(cfg, placeholder) for cfg in configs]  # None: a cell names its own ray.address
    return None if None in cpus else max(n for n in cpus if n is not None)


def engine_pool_name(spec: Spec) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", spec.name)


def run_study(spec: Spec, study_dir: str | Path | None = None, runner: Runner | None = None,
              log: Callable[[str], None] = print, keep_engines: bool = True, concurrent: int = 1) -> StudyOutcome:
    """Every run of the spec not finished yet, `concurrent` at a time (in plan order), then
    `aggregate`. Ctrl-C stops the runs in progress (each writes its own interrupted summary),
    starts no other, and still writes the results of what finished; the outcome then says
    interrupted. `keep_engines` (without a `runner`): the runs share a Ray cluster the study starts,
    and the generator engines in it (a pool per concurrent slot)."""
    if concurrent < 1:
        raise StudyError(f"--concurrent must be >= 1, got {concurrent}")
    study_dir = Path(study_dir or default_study_dir(spec))
    try:
        private_dir(study_dir)  # its runs' directories and checkpoints are below it
    except UnsafeDirectory as err:
        raise StudyError(str(err)) from None
    with ExitStack() as stack:
        if runner is None:
            # Replays start no generators: no engines to keep.
            cpus = engine_cluster_cpus(spec) if keep_engines and spec.recordings is None else None
            if cpus is None:
                runner = SubprocessRunner(log)
            else:
                runner = _LazyClusterRunner(stack, cpus * concurrent, engine_pool_name(spec), log)
        return _run_all(spec, study_dir, runner, log, concurrent)


class _LazyClusterRunner:
    """A `SubprocessRunner` on the study's engine cluster, started before the first run (a study
    with nothing left to run starts none)."""

    def __init__(self, stack: ExitStack, cpus: int, pool: str, log: Callable[[str], None]) -> None:
        self.stack, self.cpus, self.pool, self.log = stack, cpus, pool, log
        self.cluster: EngineCluster | None = None  # once the first run needs it
        self.runners: dict[int, SubprocessRunner] = {}  # per concurrent slot: its own engine pool
        self._lock = threading.Lock()

    def __call__(self, plan: RunPlan) -> int:
        slot = getattr(_SLOT, "index", 0)
        with self._lock:
            if self.cluster is None:
                try:
                    self.cluster = self.stack.enter_context(EngineCluster(self.cpus, self.pool, self.log))
                except RuntimeError as err:
                    raise StudyError(str(err)) from None
            if slot not in self.runners:
                pool = self.pool if slot == 0 else f"{self.pool}-{slot}"
                self.runners[slot] = SubprocessRunner(self.log, before=self.cluster.overrides(pool),
                                                      env=self.cluster.env)
        try:
            self.cluster.check_alive()
        except RuntimeError as err:
            raise StudyError(str(err)) from None
        return self.runners[slot](plan)

    def interrupt(self, presses: int) -> None:
        with self._lock:
            runners = list(self.runners.values())
        for runner in runners:
            runner.interrupt(presses)


# The concurrent slot the current thread runs plans for (`_run_concurrently`); 0 in the main thread.
_SLOT = threading.local()


def _run_all(spec: Spec, study_dir: Path, runner: Runner, log: Callable[[str], None],
             concurrent: int = 1) -> StudyOutcome:
    outcome = StudyOutcome()
    with _study_lock(study_dir):
        plans = spec.runs(study_dir)
        check_earlier_runs(plans)
        write_atomic(study_dir / "spec.yaml", yaml.safe_dump(spec.to_dict(), sort_keys=False))
        todo = [plan for plan in plans if not is_finished(plan.run_dir)]
        outcome.skipped = [plan for plan in plans if is_finished(plan.run_dir)]
        log(f"[study] {spec.name}: {len(spec.cells())} cells x {len(spec.seeds)} seeds = {len(plans)} runs; "
            f"{len(outcome.skipped)} finished before, {len(todo)} to run; in {study_dir}"
            + (f"; {concurrent} at a time" if concurrent > 1 else ""))
        if concurrent > 1:
            _run_concurrently(todo, runner, log, outcome, concurrent)
        else:
            _run_in_turn(todo, runner, log, outcome)
        if outcome.interrupted:
            log("[study] interrupted: no further runs; writing the results of the finished ones "
                "(run the same command again to continue)")
        # A torn results.csv or report.md would be worse than a late exit.
        with interrupts_deferred("[study] {signal} ignored: writing the results"):
            outcome.written = aggregate(study_dir)
    log(f"[study] results: {study_dir / 'results.csv'}, report: {study_dir / 'report.md'}")
    return outcome


def _start_run(plan: RunPlan, index: int, total: int, log: Callable[[str], None]) -> float:
    _set_aside(plan.run_dir, log)
    plan.run_dir.mkdir(mode=0o700, parents=True)
    write_atomic(plan.run_dir / RUN_RECORD, json.dumps(_run_record(plan), indent=2) + "\n")
    log(f"[study] {index}/{total} {plan.label}: started ({plan.run_dir / RUN_LOG})")
    return time.monotonic()


def _end_run(plan: RunPlan, index: int, total: int, code: int, started: float, log: Callable[[str], None],
             outcome: StudyOutcome) -> bool:
    """Record a run that ended; True if it was interrupted from outside the study (then stop too)."""
    outcome.ran.append(plan)
    summary = read_summary(plan.run_dir)
    status = summary.get("status", "no summary")
    log(f"[study] {index}/{total} {plan.label}: {status} in {time.monotonic() - started:.0f} s"
        + _result_note(summary))
    if status != FINISHED:
        outcome.not_finished.append(plan)
    return code == EXIT_INTERRUPTED or status == "interrupted"


def _run_in_turn(todo: list[RunPlan], runner: Runner, log: Callable[[str], None], outcome: StudyOutcome) -> None:
    running: RunPlan | None = None
    try:
        for index, plan in enumerate(todo, 1):
            started = _start_run(plan, index, len(todo), log)
            running = plan
            code = runner(plan)
            running = None
            if _end_run(plan, index, len(todo), code, started, log, outcome):
                outcome.interrupted = True  # stopped from outside the study (a signal to the run itself)
                break
    except KeyboardInterrupt:
        outcome.interrupted = True
        if running is not None:  # the run in progress: the runner stopped it, it wrote its summary
            outcome.ran.append(running)
            outcome.not_finished.append(running)


def _run_concurrently(todo: list[RunPlan], runner: Runner, log: Callable[[str], None], outcome: StudyOutcome,
                      slots: int) -> None:
    """`slots` worker threads take the plans in order, each running one at a time. Ctrl-C arrives in
    this (the main) thread: no further run starts, and each press goes to every run in progress
    (`runner.interrupt`: SIGINT, SIGINT, then kill), as with one run at a time."""
    queue = list(enumerate(todo, 1))
    lock, stop = threading.Lock(), threading.Event()
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        try:
            run_plans(slot)
        finally:
            done[slot].set()

    def run_plans(slot: int) -> None:
        _SLOT.index = slot
        while not stop.is_set():
            with lock:
                if not queue:
                    return
                index, plan = queue.pop(0)
                started = _start_run(plan, index, len(todo), log)
            try:
                code = runner(plan)
            except BaseException as err:  # noqa: BLE001 - a runner's failure stops the study, reported below
                with lock:
                    outcome.ran.append(plan)
                    outcome.not_finished.append(plan)
                    errors.append(err)
                stop.set()
                return
            with lock:
                if _end_run(plan, index, len(todo), code, started, log, outcome):
                    outcome.interrupted = True
                    stop.set()

    # Each worker says it is done by its own event: Thread.join interrupted by Ctrl-C can mark a live
    # thread as stopped (CPython 3.11's _wait_for_tstate_lock releases the lock the thread holds),
    # and the study would then report while a run still goes on.
    done = [threading.Event() for _ in range(slots)]
    for slot in range(slots):
        threading.Thread(target=work, args=(slot,), name=f"study-slot-{slot}", daemon=True).start()
    presses = 0
    while True:
        try:
            if all(event.is_set() for event in done):
                break
            time.sleep(0.1)
        except KeyboardInterrupt:
            presses += 1
            outcome.interrupted = True
            stop.set()
            if presses == 1:
                log("[study] interrupt: stopping the runs in progress; Ctrl-C again to hurry them, twice to kill them")
            interrupt = getattr(runner, "interrupt", None)
            if interrupt is not None:
                interrupt(presses)
    if errors:
        raise errors[0]


def check_earlier_runs(plans: list[RunPlan]) -> None:
    """A finished run is reused only if it ran with the overrides planned now; anything else (the
    spec's base changed, another study's directory) is refused before any run starts."""
    for plan in plans:
        if not is_finished(plan.run_dir):
            continue
        record_path = plan.run_dir / RUN_RECORD
        try:
            record = json.loads(record_path.read_text())
        except (OSError, json.JSONDecodeError):
            raise StudyError(f"{plan.run_dir}: a finished run without a readable {RUN_RECORD}: not a run of this "
                             "study; use another study_dir") from None
        recorded = (f"--config-name {record.get('config_name')}", f"recording {record.get('recording')}",
                    override_settings(record.get("overrides") or []))
        planned = (f"--config-name {plan.config_name}", f"recording {_recording(plan)}",
                   override_settings(plan.overrides))
        if recorded != planned:
            differing = sorted(set(_setting_texts(recorded)) ^ set(_setting_texts(planned))) or ["their order"]
            raise StudyError(f"{plan.run_dir}: finished with other settings than the spec asks for now "
                             f"(differing: {', '.join(differing)}); use another study_dir, or remove that run")


def override_settings(overrides: Sequence[str]) -> dict[str, str] | tuple[str, ...]:
    """What a list of Hydra overrides sets, for comparing two lists: {key: the override that sets it}
    (the last of a repeated key wins, as in Hydra) where their order cannot matter otherwise, so
    moving a key within a spec's base is no change; the list itself where it can (a key and one
    inside it, `learner.lora={...}` and `learner.lora.alpha=32`, or a deletion `~key`)."""
    keys = [override.partition("=")[0].strip().lstrip("+~") for override in overrides]
    nested = any(inner.startswith((outer + ".", outer + "[")) for outer in keys for inner in keys)
    if nested or any(override.lstrip().startswith("~") for override in overrides):
        return tuple(overrides)
    return dict(zip(keys, overrides))


def _setting_texts(settings: tuple[Any, ...]) -> list[str]:
    *header, overrides = settings
    return [*header, *(overrides.values() if isinstance(overrides, dict) else overrides)]


def _run_record(plan: RunPlan) -> dict[str, Any]:
    return {"cell": plan.cell.values, "seed": plan.seed, "config_name": plan.config_name,
            "recording": _recording(plan), "overrides": list(plan.overrides)}


def _recording(plan: RunPlan) -> str | None:
    return None if plan.recording is None else str(plan.recording)


def _set_aside(run_dir: Path, log: Callable[[str], None]) -> None:
    """An unfinished run (failed, interrupted, killed) starts again from scratch in a fresh run_dir:
    resuming would give it a second warm-up (fixed staleness) and a metrics.jsonl with repeated
    steps. The old directory is kept beside it as seed_<s>.incomplete-<k>."""
    if not run_dir.exists():
        return
    k = 1
    while run_dir.with_name(f"{run_dir.name}.incomplete-{k}").exists():
        k += 1
    target = run_dir.with_name(f"{run_dir.name}.incomplete-{k}")
    run_dir.rename(target)
    log(f"[study] {run_dir} had not finished: kept as {target.name}, the run starts again")


def _result_note(summary: dict[str, Any]) -> str:
    if summary.get("status") == FINISHED and is_number(summary.get("eval_accuracy_end")):
        start = summary.get("eval_accuracy_start")
        return (f" (held-out accuracy {start:.3f} -> " if is_number(start) else " (held-out accuracy ") + \
            f"{summary['eval_accuracy_end']:.3f})"
    if summary.get("error"):
        return f": {summary['error']}"
    return ""


@contextmanager
def _study_lock(study_dir: Path) -> Iterator[None]:
    """One study process per study_dir: two would run the same runs into the same directories."""
    with open(study_dir / ".lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StudyError(f"{study_dir}: another asyncgrpo study is running in this directory") from None
        yield


# ------------------------------------------------------------------------------------------ command


def command(spec_path: str, arguments: Sequence[str], dry_run: bool = False, report_only: bool = False,
            keep_engines: bool = True, concurrent: int = 1, log: Callable[[str], None] = print) -> int:
    """`asyncgrpo study`: arguments are `study_dir=DIR` and key=value overrides added to the spec's base;
    `keep_engines`: False for --fresh-engines; `concurrent`: --concurrent.
    Exit codes: 0 every run finished, 1 some run failed, 2 the spec or study_dir cannot be used,
    130 interrupted."""
    study_dir: str | None = None
    extra_base = []
    for argument in arguments:
        if argument.startswith("study_dir="):
            study_dir = argument.partition("=")[2]
        else:
            extra_base.append(argument)
    try:
        if report_only:
            directory = Path(study_dir) if study_dir else default_study_dir(
                Spec.parse(read_spec_file(find_spec(spec_path)), source=spec_path))
            for path in aggregate(directory):
                log(str(path))
            return 0
        spec = Spec.load(find_spec(spec_path), extra_base=extra_base)
        for line in spec.unread:
            log(f"[study] warning: {line}")
        directory = Path(study_dir) if study_dir else default_study_dir(spec)
        if dry_run:
            check_earlier_runs(spec.runs(directory))
            for plan in spec.runs(directory):
                state = FINISHED if is_finished(plan.run_dir) else "to run"
                replays = f", replays {plan.recording}" if plan.recording is not None else ""
                log(f"{state:>8}  {plan.label}  ({plan.run_dir}{replays})")
            return 0
        outcome = run_study(spec, directory, log=log, keep_engines=keep_engines, concurrent=concurrent)
    except (SpecError, StudyError, RunReadError) as err:  # RunReadError: a run's files, read for the report
        print(f"asyncgrpo: study: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before any run started (checking the spec) or after the results were written
        print("asyncgrpo: study: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return outcome.exit_code
