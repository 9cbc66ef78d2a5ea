"""`asyncgrpo study SPEC.yaml [study_dir=DIR] [key=value ...]`: a grid of training runs x seeds, run one
after another (`--concurrent N`: N at a time), resumable, with a statistical report. docs/STUDIES.md
describes the spec and the output.

    Spec.load(path)              parse the spec and compose every cell's config before any run starts
    run_study(spec, study_dir)   every cell x seed not finished yet (finished runs with the planned
                                 overrides skipped, others refused), then aggregate()
    aggregate(study_dir)         results.csv, report.md and plots/ from the run directories

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

import csv
import fcntl
import io
import itertools
import json
import math
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

from asyncgrpo.study.cluster import (
    EngineCluster,
    cluster_overrides,
    signal_when_parent_dies,
)
from asyncgrpo.runtime.files import UnsafeDirectory, private_dir, write_atomic
from asyncgrpo.runtime.interrupts import interrupts_deferred
from asyncgrpo.schema import CONFIG_DIR

# ------------------------------------------------------------------------------------------ defaults
# The one place the study's own defaults live.

SPEC_KEYS = ("name", "base", "grid", "seeds", "baseline", "config_name")
REQUIRED_SPEC_KEYS = ("name", "grid", "seeds")
STUDY_DIR_ROOT = "studies"  # default study_dir: studies/<name>
STUDY_SPECS_DIR = CONFIG_DIR / "studies"  # `asyncgrpo study NAME` finds configs/studies/NAME.yaml
# Prepended to every run's overrides, so a spec's base (or the command line) can still change them:
# a study never resumes an interrupted run (it starts it again), so its checkpoint would be wasted
# time and disk; an export per run is disk for nothing; a progress bar is noise in train.log.
RUN_DEFAULTS = ("progress=false", "train.checkpoint_on_interrupt=false", "train.export_at_end=false")
# Keys the study sets itself for every run.
RESERVED_KEYS = ("seed", "run_dir", "resume")
CONFIDENCE = 0.95
FINISHED = "finished"
RUN_RECORD = "study_run.json"  # in each run_dir: the cell, the seed and the overrides it ran with
RUN_LOG = "train.log"  # in each run_dir: the run's stdout and stderr
EXIT_INTERRUPTED = 130


class SpecError(ValueError):
    """A spec that cannot run; the one-line message names the spec file and the key or cell."""


class StudyError(RuntimeError):
    """A study directory that cannot be used as asked (another study's runs, a study running in it)."""


# ------------------------------------------------------------------------------------------ the spec


@dataclass(frozen=True)
class Level:
    """One value of a factor: its label (in results.csv, the report and directory names) and the
    overrides it adds to a run."""

    label: str
    overrides: tuple[str, ...]
    value: Any  # as in the spec: a config-key factor's value, a named level's mapping of keys to values


@dataclass(frozen=True)
class Factor:
    """A grid entry: a config key with a list of values (`train.fixed_staleness: [0, 2]`), or a named
    factor whose levels are sets of overrides (`mode: {naive: {algo.mode: naive}, ...}`)."""

    key: str
    levels: tuple[Level, ...]
    named: bool = False  # levels given as a mapping of names to override sets

    def level(self, value: Any) -> Level | None:
        """The level a baseline value names: its label, or an equal value (2 names 2.0)."""
        for level in self.levels:
            if level.label == _label(value) or (not self.named and _same_value(level.value, value)):
                return level
        return None


@dataclass(frozen=True)
class Cell:
    """One combination of levels, in grid order."""

    levels: tuple[tuple[str, Level], ...]  # (factor key, level)

    @property
    def values(self) -> dict[str, str]:
        return {key: level.label for key, level in self.levels}

    @property
    def label(self) -> str:
        return " ".join(f"{key}={level.label}" for key, level in self.levels)

    @property
    def slug(self) -> str:
        return "__".join(f"{_safe(key)}-{_safe(level.label)}" for key, level in self.levels)

    @property
    def overrides(self) -> tuple[str, ...]:
        return tuple(o for _, level in self.levels for o in level.overrides)


@dataclass(frozen=True)
class RunPlan:
    """One run of the study: a cell at a seed, in its run directory."""

    cell: Cell
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]  # everything but run_dir, in order (later ones win)
    config_name: str

    def train_overrides(self) -> list[str]:
        return [*self.overrides, f"run_dir={override_value(str(self.run_dir))}"]

    @property
    def label(self) -> str:
        return f"{self.cell.label} seed={self.seed}"


@dataclass
class Spec:
    name: str
    base: list[str]
    factors: list[Factor]
    seeds: list[int]
    baseline: dict[str, str] | None = None  # factor key -> level label
    config_name: str = "default"
    source: str = "spec"  # the file it came from, for messages

    # -------------------------------------------------------------------------- loading

    @classmethod
    def load(cls, path: str | Path, extra_base: Sequence[str] = ()) -> Spec:
        """Parse and validate a spec file, then compose every cell's config (`config.load`), so a
        value the config refuses fails here, before any run, in one line naming the cell.
        `extra_base` overrides (from the command line) are added after the spec's base."""
        spec = cls.parse(read_spec_file(path), source=str(path), extra_base=extra_base)
        spec.check_configs()
        return spec

    @classmethod
    def parse(cls, data: Any, source: str = "spec", extra_base: Sequence[str] = ()) -> Spec:
        """The spec's structure only (no config composed): unknown or missing keys, empty grids,
        reserved keys, seeds, the baseline."""
        def fail(message: str) -> SpecError:
            return SpecError(f"{source}: {message}")

        if not isinstance(data, dict):
            raise fail(f"must be a mapping with keys {', '.join(SPEC_KEYS)}")
        unknown = [str(key) for key in data if key not in SPEC_KEYS]
        if unknown:
            raise fail(f"unknown key {', '.join(repr(k) for k in unknown)} (known: {', '.join(SPEC_KEYS)})")
        missing = [key for key in REQUIRED_SPEC_KEYS if data.get(key) is None]
        if missing:
            raise fail(f"missing key {', '.join(repr(k) for k in missing)}")
        name = data["name"]
        if not isinstance(name, str) or not name.strip() or _safe(name) != name:
            raise fail(f"name must be a non-empty string of letters, digits, '.', '_' or '-' (got {name!r})")
        base = list(data.get("base") or []) + list(extra_base)
        for override in base:
            if not isinstance(override, str) or "=" not in override:
                raise fail(f"base: each entry must be a key=value override (got {override!r})")
            _refuse_reserved(_override_key(override), "base", fail)
        factors = _parse_grid(data["grid"], fail)
        seeds = data["seeds"]
        if (not isinstance(seeds, list) or not seeds
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
            raise fail(f"seeds must be a non-empty list of integers >= 0 (got {seeds!r})")
        if len(set(seeds)) != len(seeds):
            raise fail(f"seeds must be distinct (got {seeds!r})")
        config_name = data.get("config_name") or "default"
        if not isinstance(config_name, str):
            raise fail(f"config_name must be the name of a preset in configs/ (got {config_name!r})")
        spec = cls(name=name, base=base, factors=factors, seeds=list(seeds), config_name=config_name, source=source)
        if data.get("baseline") is not None:
            spec.baseline = _parse_baseline(data["baseline"], factors, fail)
        return spec

    def check_configs(self, before: Sequence[str] = ()) -> list[Any]:
        """Compose each cell's config as its first seed's run would (`config.load`), with `before`
        ahead of the run's own overrides (the engine cluster's); the first one the config refuses
        raises SpecError naming the cell. Returns the configs."""
        from asyncgrpo.config import ConfigError, load

        configs = []
        for plan in self.runs(Path(STUDY_DIR_ROOT) / self.name, seeds=self.seeds[:1]):
            try:
                configs.append(load([*before, *plan.train_overrides()], config_name=self.config_name))
            except ConfigError as err:
                raise SpecError(f"{self.source}: cell {plan.cell.label}: {err}") from None
        return configs

    # -------------------------------------------------------------------------- the plan

    def cells(self) -> list[Cell]:
        """Every combination of the factors' levels, the first factor varying slowest."""
        return [Cell(tuple(zip((f.key for f in self.factors), levels)))
                for levels in itertools.product(*(f.levels for f in self.factors))]

    def runs(self, study_dir: str | Path, seeds: Sequence[int] | None = None) -> list[RunPlan]:
        """Every cell x seed, cell by cell (all seeds of a cell, then the next cell)."""
        root = Path(study_dir) / "runs"
        return [RunPlan(cell=cell, seed=seed, run_dir=root / cell.slug / f"seed_{seed}",
                        overrides=(*RUN_DEFAULTS, *self.base, *cell.overrides, f"seed={seed}"),
                        config_name=self.config_name)
                for cell in self.cells() for seed in (self.seeds if seeds is None else seeds)]

    def baseline_cell(self) -> Cell | None:
        if self.baseline is None:
            return None
        return next(cell for cell in self.cells() if cell.values == self.baseline)

    def grid_keys(self) -> list[str]:
        return [f.key for f in self.factors]

    def to_dict(self) -> dict[str, Any]:
        """The spec as YAML data: written to study_dir/spec.yaml, read back by `aggregate`."""
        grid: dict[str, Any] = {}
        for factor in self.factors:
            if factor.named:
                grid[factor.key] = {level.label: dict(level.value) for level in factor.levels}
            else:
                grid[factor.key] = [level.value for level in factor.levels]
        data: dict[str, Any] = {"name": self.name, "config_name": self.config_name, "base": list(self.base),
                                "grid": grid, "seeds": list(self.seeds)}
        if self.baseline is not None:
            data["baseline"] = dict(self.baseline)
        return data


def read_spec_file(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such spec file")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        first = str(err).strip().splitlines()
        raise SpecError(f"{path}: not valid YAML: {' '.join(line.strip() for line in first[:3])}") from None


def find_spec(name_or_path: str) -> Path:
    """A path as given, else configs/studies/<name>.yaml (so `asyncgrpo study quick` works)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    for candidate in (STUDY_SPECS_DIR / name_or_path, STUDY_SPECS_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    return path  # Spec.load names it as missing


def _parse_grid(grid: Any, fail: Callable[[str], SpecError]) -> list[Factor]:
    if not isinstance(grid, dict) or not grid:
        raise fail("grid must be a non-empty mapping: config keys each with a list of values, or named factors "
                   "each with a mapping of levels")
    factors = []
    for key, values in grid.items():
        key = str(key)
        where = f"grid.{key}"
        _refuse_reserved(key, where, fail)
        if isinstance(values, list):
            if not values:
                raise fail(f"{where}: empty list of values")
            levels = tuple(Level(_label(v), (f"{key}={override_value(v)}",), v) for v in values)
        elif isinstance(values, dict):
            if not values:
                raise fail(f"{where}: no levels")
            levels = []
            for label, overrides in values.items():
                label = str(label)
                if overrides is None:
                    overrides = {}
                if not isinstance(overrides, dict):
                    raise fail(f"{where}.{label}: a level must be a mapping of config keys to values (got {overrides!r})")
                for sub_key in overrides:
                    _refuse_reserved(str(sub_key), f"{where}.{label}", fail)
                overrides = {str(k): v for k, v in overrides.items()}
                levels.append(Level(label, tuple(f"{k}={override_value(v)}" for k, v in overrides.items()), overrides))
            levels = tuple(levels)
        else:
            raise fail(f"{where}: must be a list of values or a mapping of named levels (got {values!r})")
        labels = [level.label for level in levels]
        if len(set(labels)) != len(labels) or len({_safe(label) for label in labels}) != len(labels):
            raise fail(f"{where}: two levels have the same label (or the same directory name): {labels}")
        factors.append(Factor(key, levels, named=isinstance(values, dict)))
    if len({_safe(f.key) for f in factors}) != len(factors):
        raise fail(f"grid: two keys have the same directory name: {[f.key for f in factors]}")
    return factors


def _parse_baseline(baseline: Any, factors: list[Factor], fail: Callable[[str], SpecError]) -> dict[str, str]:
    keys = [f.key for f in factors]
    if not isinstance(baseline, dict):
        raise fail(f"baseline must be a mapping of grid keys to one of their values (grid keys: {', '.join(keys)})")
    extra = [str(k) for k in baseline if k not in keys]
    missing = [k for k in keys if k not in baseline]
    if extra or missing:
        raise fail(f"baseline must give one value for each grid key ({', '.join(keys)})"
                   + (f"; not grid keys: {', '.join(extra)}" if extra else "")
                   + (f"; missing: {', '.join(missing)}" if missing else ""))
    chosen = {}
    for factor in factors:
        level = factor.level(baseline[factor.key])
        if level is None:
            raise fail(f"baseline: {factor.key}={_label(baseline[factor.key])} is not one of the grid's values "
                       f"({', '.join(level.label for level in factor.levels)})")
        chosen[factor.key] = level.label
    return chosen


def _refuse_reserved(key: str, where: str, fail: Callable[[str], SpecError]) -> None:
    if key in RESERVED_KEYS:
        raise fail(f"{where}: {key} is set by the study for each run (seeds, study_dir), not by the spec")


def override_value(value: Any) -> str:
    """A YAML value as Hydra's override grammar reads it. Strings are quoted, so '0.5_2.0' or 'null'
    stay strings."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    raise SpecError(f"cannot write {value!r} as a config override")


def _label(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _safe(text: str) -> str:
    """For a directory name: letters, digits, '.', '_', '-' kept, anything else '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def _override_key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0].strip()


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
        return [sys.executable, "-m", "asyncgrpo.cli", "train", "--config-name", plan.config_name,
                *self.before, *plan.train_overrides()]

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


def default_study_dir(spec: Spec) -> Path:
    return Path(STUDY_DIR_ROOT) / spec.name


def engine_cluster_cpus(spec: Spec) -> int | None:
    """The CPUs of a study's own Ray cluster, whose generator engines its runs keep between them:
    the most any cell's run would give a local cluster. Checks every cell's config with the
    cluster's overrides. None when the runs join a cluster the spec names (ray.address in base):
    they start and stop their own engines."""
    from asyncgrpo.driver.prepare import local_cpus

    placeholder = "127.0.0.1:1"
    configs = spec.check_configs(before=cluster_overrides(placeholder, engine_pool_name(spec)))
    if any(cfg.ray.address != placeholder for cfg in configs):
        return None
    return max(local_cpus(cfg) for cfg in configs)


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
            cpus = engine_cluster_cpus(spec) if keep_engines else None
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
        recorded = [f"--config-name {record.get('config_name')}", *(record.get("overrides") or [])]
        planned = [f"--config-name {plan.config_name}", *plan.overrides]
        if recorded != planned:
            differing = sorted(set(recorded) ^ set(planned)) or ["their order"]
            raise StudyError(f"{plan.run_dir}: finished with other settings than the spec asks for now "
                             f"(differing: {', '.join(differing)}); use another study_dir, or remove that run")


def is_finished(run_dir: Path) -> bool:
    return read_summary(run_dir).get("status") == FINISHED


def read_summary(run_dir: Path) -> dict[str, Any]:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _run_record(plan: RunPlan) -> dict[str, Any]:
    return {"cell": plan.cell.values, "seed": plan.seed, "config_name": plan.config_name,
            "overrides": list(plan.overrides)}


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
    if summary.get("status") == FINISHED and _is_number(summary.get("eval_accuracy_end")):
        start = summary.get("eval_accuracy_start")
        return (f" (held-out accuracy {start:.3f} -> " if _is_number(start) else " (held-out accuracy ") + \
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


# ------------------------------------------------------------------------------------------ statistics


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t distribution with df degrees of freedom (scipy's t.ppf), by
    bisection on the CDF; scipy is not a dependency."""
    if not 0 < p < 1 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0 (got p={p}, df={df})")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= 1e-13 * max(1.0, high):
            break
    return (low + high) / 2


def t_cdf(t: float, df: float) -> float:
    """P(T <= t), T ~ Student's t(df): 1 - I_x(df/2, 1/2) / 2 for t >= 0, x = df / (df + t^2)."""
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t >= 0 else tail


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (modified Lentz;
    Numerical Recipes' betacf), on the side where it converges fast."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h / a


@dataclass(frozen=True)
class Estimate:
    """A mean over n values with its confidence interval (no interval for n < 2)."""

    n: int
    mean: float | None
    half_width: float | None

    @property
    def low(self) -> float | None:
        return None if self.mean is None or self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.mean is None or self.half_width is None else self.mean + self.half_width


def mean_ci(values: Sequence[float | None], confidence: float = CONFIDENCE) -> Estimate:
    """Mean and the t-interval mean +- t((1 + confidence) / 2, n - 1) * s / sqrt(n), s the sample
    standard deviation (n - 1 in the denominator). Missing values are left out."""
    xs = [float(v) for v in values if _is_number(v)]
    n = len(xs)
    if n == 0:
        return Estimate(0, None, None)
    mean = sum(xs) / n
    if n < 2:
        return Estimate(1, mean, None)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return Estimate(n, mean, t_quantile((1 + confidence) / 2, n - 1) * sd / math.sqrt(n))


def paired_difference(cell: dict[int, float | None], baseline: dict[int, float | None],
                      confidence: float = CONFIDENCE) -> Estimate:
    """Mean of cell - baseline over the seeds both have a value for, with its t-interval: pairing by
    seed removes what a seed does to both (its warm-started model, its prompts)."""
    seeds = [s for s in cell if _is_number(cell[s]) and _is_number(baseline.get(s))]
    return mean_ci([float(cell[s]) - float(baseline[s]) for s in seeds], confidence)  # type: ignore[arg-type]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------------------------------------ aggregation

# results.csv, after the grid keys and `seed`; `status` and `run_dir` last.
RESULT_COLUMNS = (
    "eval_accuracy_start", "eval_accuracy_end", "eval_greedy_accuracy_start", "eval_greedy_accuracy_end",
    "accuracy_auc", "steps", "samples", "samples_per_s", "staleness_mean", "staleness_max", "clipfrac", "ess",
    "wall_s", "train_s",
)
# The report's per-cell tables and the paired differences: (column, heading).
ACCURACY_METRICS = (
    ("eval_accuracy_start", "held-out acc. start"), ("eval_accuracy_end", "held-out acc. end"),
    ("eval_greedy_accuracy_end", "greedy end"), ("accuracy_auc", "acc. AUC"),
)
RUN_METRICS = (
    ("samples_per_s", "samples/s"), ("staleness_mean", "staleness mean"), ("staleness_max", "staleness max"),
    ("clipfrac", "clip fraction"), ("ess", "ESS"), ("wall_s", "wall s"),
)
DIFFERENCE_METRICS = (("eval_accuracy_end", "held-out acc. end"), ("eval_greedy_accuracy_end", "greedy end"),
                      ("accuracy_auc", "acc. AUC"))


@dataclass
class RunResult:
    plan: RunPlan
    row: dict[str, Any]  # results.csv
    eval_curve: list[tuple[float, float]]  # (samples, held-out sampled accuracy)
    reward_curve: list[tuple[float, float]]  # (samples, training reward/mean) per step
    # summary.json's engines_reused: generator indices that ran on an engine kept from an earlier run;
    # None when the run kept none in a pool (its own Ray cluster and engines: --fresh-engines).
    engines_reused: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.row["status"] == FINISHED


def load_study(study_dir: str | Path) -> tuple[Spec, list[RunResult]]:
    """The spec in study_dir/spec.yaml and every run of it that has started (has a summary.json)."""
    study_dir = Path(study_dir)
    spec = Spec.parse(read_spec_file(study_dir / "spec.yaml"), source=str(study_dir / "spec.yaml"))
    results = []
    for plan in spec.runs(study_dir):
        result = load_run_result(plan)
        if result is not None:
            results.append(result)
    return spec, results


def load_run_result(plan: RunPlan) -> RunResult | None:
    """results.csv's row of one run, from its summary.json and metrics.jsonl; None if it never started."""
    from asyncgrpo.plot import load_run

    if not (plan.run_dir / "summary.json").is_file():
        return None
    run = load_run(plan.run_dir)
    summary = run.summary
    steps = run.steps

    def step_mean(key: str) -> float | None:
        values = [r[key] for r in steps if _is_number(r.get(key))]
        return sum(values) / len(values) if values else None

    staleness_max = max((r["staleness/max"] for r in steps if _is_number(r.get("staleness/max"))),
                        default=summary.get("staleness_max"))
    eval_curve = eval_points(run.evals, steps, summary)
    row: dict[str, Any] = {**plan.cell.values, "seed": plan.seed}
    row.update({
        "eval_accuracy_start": summary.get("eval_accuracy_start"),
        "eval_accuracy_end": summary.get("eval_accuracy_end"),
        "eval_greedy_accuracy_start": summary.get("eval_greedy_accuracy_start"),
        "eval_greedy_accuracy_end": summary.get("eval_greedy_accuracy_end"),
        "accuracy_auc": accuracy_auc(eval_curve),
        "steps": summary.get("steps"),
        "samples": summary.get("samples"),
        "samples_per_s": summary.get("samples_per_s"),
        "staleness_mean": step_mean("staleness/mean"),
        "staleness_max": staleness_max,
        "clipfrac": step_mean("loss/clipfrac"),
        "ess": step_mean("is/ess"),  # logged only with algo.correction.is_level set
        "wall_s": summary.get("wall_s"),
        "train_s": summary.get("train_s"),
        "status": summary.get("status", "unknown"),
        "run_dir": str(plan.run_dir),
    })
    reward_curve = [(float(r["samples"]), float(r["reward/mean"])) for r in steps
                    if _is_number(r.get("samples")) and _is_number(r.get("reward/mean"))]
    return RunResult(plan, row, eval_curve, reward_curve, summary.get("engines_reused"))


def eval_points(evals: list[dict[str, Any]], steps: list[dict[str, Any]],
                summary: dict[str, Any]) -> list[tuple[float, float]]:
    """(samples consumed, held-out sampled accuracy) of each eval record, in order of samples. An eval
    record carries its learner step; the samples at that step come from the step record, 0 at step 0,
    or the summary's total at the summary's last step."""
    samples_at = {int(r["step"]): float(r["samples"]) for r in steps
                  if _is_number(r.get("step")) and _is_number(r.get("samples"))}
    samples_at.setdefault(0, 0.0)
    if _is_number(summary.get("steps")) and _is_number(summary.get("samples")):
        samples_at.setdefault(int(summary["steps"]), float(summary["samples"]))
    points = {}
    for record in evals:
        step, accuracy = record.get("step"), record.get("eval/accuracy")
        if _is_number(step) and _is_number(accuracy) and int(step) in samples_at:
            points[samples_at[int(step)]] = float(accuracy)  # a repeated step: the later record
    return sorted(points.items())


def accuracy_auc(points: list[tuple[float, float]]) -> float | None:
    """Area under held-out accuracy vs samples (trapezoids) divided by the samples spanned: the mean
    accuracy over training, in [0, 1]. With evaluations at the start and the end only, that is
    (start + end) / 2. None with fewer than two points."""
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


def aggregate(study_dir: str | Path) -> list[Path]:
    """results.csv, report.md and plots/*.png from the study's run directories; returns their paths."""
    study_dir = Path(study_dir)
    spec, results = load_study(study_dir)
    written = [write_results_csv(spec, results, study_dir / "results.csv"),
               write_report(spec, results, study_dir / "report.md")]
    written += write_plots(spec, results, study_dir / "plots")
    return written


def write_results_csv(spec: Spec, results: list[RunResult], path: Path) -> Path:
    columns = [*spec.grid_keys(), "seed", *RESULT_COLUMNS, "status", "run_dir"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for result in results:
        writer.writerow({k: "" if result.row.get(k) is None else result.row[k] for k in columns})
    write_atomic(path, buffer.getvalue())
    return path


def _by_cell(spec: Spec, results: list[RunResult]) -> list[tuple[Cell, list[RunResult]]]:
    """Each cell in grid order with its finished runs."""
    return [(cell, [r for r in results if r.finished and r.plan.cell == cell]) for cell in spec.cells()]


def _fmt(value: float | None) -> str:
    """Accuracies and fractions to 3 decimals; seconds and samples/s to what their noise allows."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def _fmt_estimate(estimate: Estimate, signed: bool = False) -> str:
    if estimate.mean is None:
        return "-"
    sign = "+" if signed and estimate.mean >= 0 else ""
    text = sign + _fmt(estimate.mean)
    if estimate.half_width is not None:
        text += f" [{_fmt(estimate.low)}, {_fmt(estimate.high)}]"
    return text


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def write_report(spec: Spec, results: list[RunResult], path: Path) -> Path:
    plans = spec.runs(path.parent)
    finished = [r for r in results if r.finished]
    unfinished = [r for r in results if not r.finished]
    percent = round(100 * CONFIDENCE)
    lines = [
        f"# Study {spec.name}",
        "",
        f"{len(spec.cells())} cells x {len(spec.seeds)} seed{'s' if len(spec.seeds) > 1 else ''} "
        f"({', '.join(map(str, spec.seeds))}) = {len(plans)} runs: "
        f"{len(finished)} finished, {len(unfinished)} failed or interrupted, {len(plans) - len(results)} not started. "
        f"Every run: preset `{spec.config_name}`, the study's defaults `{' '.join(RUN_DEFAULTS)}`, the spec's "
        f"base `{' '.join(spec.base) or '(none)'}`, its cell's values, then `seed`.",
        "",
        _engines_note(finished) + _overhead_note(finished) + ".",
        "",
        f"**Statistics**: per cell, the mean over seeds with a {percent}% confidence interval [low, high] = "
        f"mean +- t({(1 + CONFIDENCE) / 2:g}, n-1) s / sqrt(n) (Student's t, s the sample standard deviation); no "
        "interval with n < 2. Only finished runs count. `acc. AUC` is the area under held-out sampled accuracy vs "
        "samples consumed (trapezoids over the evaluations) divided by the samples spanned; with evaluations at the "
        "start and the end only it is (start + end) / 2. staleness, clip fraction (`loss/clipfrac`) and ESS "
        "(`is/ess`, logged only with `algo.correction.is_level` set) are means over a run's steps; staleness max is "
        "the run's maximum; samples/s is the training loop's (`summary.json`).",
        "",
    ]
    keys = spec.grid_keys()
    for title, metrics in (("Accuracy per cell", ACCURACY_METRICS), ("Training per cell", RUN_METRICS)):
        rows = []
        for cell, runs in _by_cell(spec, results):
            estimates = [mean_ci([r.row[column] for r in runs]) for column, _ in metrics]
            rows.append([*cell.values.values(), str(len(runs)), *(_fmt_estimate(e) for e in estimates)])
        lines += [f"## {title}", "", *_table([*keys, "n", *(heading for _, heading in metrics)], rows), ""]
    lines += ["## Paired differences against the baseline", ""]
    baseline = spec.baseline_cell()
    if baseline is None:
        lines.append("No `baseline` in the spec: give one (a value for each grid key) to compare cells with it.")
    else:
        base_runs = next(runs for cell, runs in _by_cell(spec, results) if cell == baseline)
        lines += [
            f"Baseline: {baseline.label}. For each seed both finished, the cell's value minus the baseline's on "
            f"that seed; the mean of those differences with its {percent}% t-interval over the n pairs. An "
            "interval that excludes 0 is a difference the seeds support.",
            "",
        ]
        rows = []
        for cell, runs in _by_cell(spec, results):
            if cell == baseline:
                continue
            diffs = []
            n_pairs = 0
            for column, _ in DIFFERENCE_METRICS:
                estimate = paired_difference({r.plan.seed: r.row[column] for r in runs},
                                             {r.plan.seed: r.row[column] for r in base_runs})
                n_pairs = max(n_pairs, estimate.n)
                diffs.append(_fmt_estimate(estimate, signed=True))
            rows.append([*cell.values.values(), str(n_pairs), *diffs])
        lines += _table([*keys, "n pairs", *(f"diff. {heading}" for _, heading in DIFFERENCE_METRICS)], rows)
    if unfinished:
        lines += ["", "## Runs not finished (left out of the statistics)", ""]
        for result in unfinished:
            summary = read_summary(result.plan.run_dir)
            error = f": {summary['error']}" if summary.get("error") else ""
            lines.append(f"- {result.plan.label}: {result.row['status']}{error} ({result.plan.run_dir})")
    lines += ["", "Per run: `results.csv`; figures: `plots/`.", ""]
    write_atomic(path, "\n".join(lines))
    return path


def _engines_note(finished: list[RunResult]) -> str:
    """Whether the runs kept their generator engines between them, and how many started on a kept one."""
    pooled = [r for r in finished if r.engines_reused is not None]
    if not pooled:
        return ("**Engines are not reused across runs**: each run is its own `asyncgrpo train` process, which "
                "starts a local Ray cluster and its vLLM engine(s) and stops them at its end")
    kept = sum(1 for r in pooled if r.engines_reused)
    return (f"**Engines are kept between runs**: each run is its own `asyncgrpo train` process on the study's Ray "
            f"cluster; {kept} of the {len(finished)} finished runs started on generator engines kept from the run "
            "before (the others started new ones: the first run of an invocation, one after a run that did not "
            "finish, or with other engine settings)")


def _overhead_note(finished: list[RunResult]) -> str:
    """What starting them per run costs: each run's wall clock outside its training loop."""
    overheads = [r.row["wall_s"] - r.row["train_s"] for r in finished
                 if _is_number(r.row.get("wall_s")) and _is_number(r.row.get("train_s"))]
    walls = [r.row["wall_s"] for r in finished if _is_number(r.row.get("wall_s"))]
    if not overheads or not walls:
        return ""
    return (f"; each run spent {sum(overheads) / len(overheads):.0f} s on average outside its training loop "
            f"(start-up, warm start, evaluations, shutdown: {100 * sum(overheads) / sum(walls):.0f}% of the "
            "runs' wall clock)")


# ------------------------------------------------------------------------------------------ plots


def write_plots(spec: Spec, results: list[RunResult], out: Path) -> list[Path]:
    """accuracy_vs_samples.png and reward_vs_samples.png (a panel per combination of all factors
    but the last, a line per level of the last, bands over seeds), and final_accuracy_vs_<key>.png
    for each factor. Nothing when no run has finished."""
    if not any(r.finished for r in results):
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only
    out.mkdir(parents=True, exist_ok=True)
    by_cell = _by_cell(spec, results)
    written = [
        _plot_curves(spec, by_cell, lambda r: r.eval_curve, "held-out sampled accuracy", out / "accuracy_vs_samples.png",
                     markers=True),
        _plot_curves(spec, by_cell, lambda r: r.reward_curve, "training reward (reward/mean per step)",
                     out / "reward_vs_samples.png", markers=False),
    ]
    for factor in spec.factors:
        written.append(_plot_factor(spec, by_cell, factor, out / f"final_accuracy_vs_{_safe(factor.key)}.png"))
    return written


def _panels(spec: Spec, by_cell: list[tuple[Cell, list[RunResult]]]) -> dict[str, list[tuple[Cell, list[RunResult]]]]:
    """Cells grouped by every factor but the last (one group when there is one factor)."""
    panels: dict[str, list[tuple[Cell, list[RunResult]]]] = {}
    for cell, runs in by_cell:
        title = " ".join(f"{key}={level.label}" for key, level in cell.levels[:-1]) or spec.name
        panels.setdefault(title, []).append((cell, runs))
    return panels


def _band(curves: list[list[tuple[float, float]]]) -> tuple[Any, Any, Any] | None:
    """Seeds' curves on a shared x grid: mean and the CI's low and high (the mean alone for one seed)."""
    import numpy as np

    curves = [c for c in curves if c]
    if not curves:
        return None
    grid = np.unique(np.concatenate([[x for x, _ in c] for c in curves]))
    stop = min(c[-1][0] for c in curves)  # only where every seed has data
    grid = grid[grid <= stop]
    ys = np.asarray([np.interp(grid, [x for x, _ in c], [y for _, y in c]) for c in curves])
    estimates = [mean_ci(list(ys[:, j])) for j in range(len(grid))]
    mean = np.asarray([e.mean for e in estimates])
    low = np.asarray([e.low if e.low is not None else e.mean for e in estimates])
    high = np.asarray([e.high if e.high is not None else e.mean for e in estimates])
    return grid, mean, (low, high)


def _plot_curves(spec: Spec, by_cell: list[tuple[Cell, list[RunResult]]],
                 curve: Callable[[RunResult], list[tuple[float, float]]], what: str, path: Path,
                 markers: bool) -> Path:
    import matplotlib.pyplot as plt

    panels = _panels(spec, by_cell)
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    fig.suptitle(f"{spec.name}: {what} vs samples (mean over seeds, band: {round(100 * CONFIDENCE)}% CI)")
    palette = plt.get_cmap("tab10")
    for ax, (title, cells) in zip(axes.flat, panels.items()):
        drawn = False
        for i, (cell, runs) in enumerate(cells):
            band = _band([curve(r) for r in runs])
            if band is None:
                continue
            x, mean, (low, high) = band
            label = f"{cell.levels[-1][0]}={cell.levels[-1][1].label} (n={len(runs)})"
            ax.plot(x, mean, "-o" if markers else "-", color=palette(i % 10), label=label, markersize=4)
            ax.fill_between(x, low, high, color=palette(i % 10), alpha=0.2)
            drawn = True
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("samples consumed")
        ax.set_ylabel(what.split(" (")[0])
        if drawn:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no finished run", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    return _save_figure(fig, path)


def _plot_factor(spec: Spec, by_cell: list[tuple[Cell, list[RunResult]]], factor: Factor, path: Path) -> Path:
    """Final held-out accuracy (sampled and greedy) against one factor's levels, a line per
    combination of the other factors, error bars the CI over seeds."""
    import matplotlib.pyplot as plt

    index = spec.factors.index(factor)
    lines: dict[str, dict[str, list[RunResult]]] = {}
    for cell, runs in by_cell:
        others = " ".join(f"{key}={level.label}" for j, (key, level) in enumerate(cell.levels) if j != index)
        lines.setdefault(others or spec.name, {})[cell.levels[index][1].label] = runs
    labels = [level.label for level in factor.levels]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), squeeze=False)
    fig.suptitle(f"{spec.name}: final held-out accuracy vs {factor.key} (mean over seeds, bars: "
                 f"{round(100 * CONFIDENCE)}% CI)")
    palette = plt.get_cmap("tab10")
    width = 0.6 / max(1, len(lines))
    for ax, (column, what) in zip(axes.flat, (("eval_accuracy_end", "sampled"), ("eval_greedy_accuracy_end", "greedy"))):
        for i, (name, per_level) in enumerate(lines.items()):
            xs, means, errors = [], [], []
            for j, label in enumerate(labels):
                estimate = mean_ci([r.row[column] for r in per_level.get(label, [])])
                if estimate.mean is None:
                    continue
                xs.append(j + (i - (len(lines) - 1) / 2) * width)  # side by side, not on top of each other
                means.append(estimate.mean)
                errors.append(estimate.half_width or 0.0)
            if xs:
                ax.errorbar(xs, means, yerr=errors, fmt="-o", capsize=3, color=palette(i % 10), label=name,
                            markersize=4)
        ax.set_xticks(range(len(labels)), labels, rotation=20 if max(map(len, labels)) > 6 else 0, fontsize=8)
        ax.set_xlabel(factor.key)
        ax.set_ylabel(f"held-out {what} accuracy at the end")
        ax.grid(True, alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=7)
    return _save_figure(fig, path)


def _save_figure(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


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
        directory = Path(study_dir) if study_dir else default_study_dir(spec)
        if dry_run:
            check_earlier_runs(spec.runs(directory))
            for plan in spec.runs(directory):
                state = FINISHED if is_finished(plan.run_dir) else "to run"
                log(f"{state:>8}  {plan.label}  ({plan.run_dir})")
            return 0
        outcome = run_study(spec, directory, log=log, keep_engines=keep_engines, concurrent=concurrent)
    except (SpecError, StudyError) as err:
        print(f"asyncgrpo: study: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before any run started (checking the spec) or after the results were written
        print("asyncgrpo: study: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return outcome.exit_code
