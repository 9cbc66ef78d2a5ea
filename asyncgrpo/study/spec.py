"""A study's spec file: parsing and validating it, and the plan it makes, every cell of the grid x
every seed with its run directory and overrides. docs/STUDIES.md describes the spec.

    Spec.load(path)     parse the spec and compose every cell's config before any run starts
    Spec.runs(dir)      the runs, seed by seed (`RunPlan`: a cell at a seed, in its run directory)
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.runtime.strict_yaml import load_yaml
from asyncgrpo.schema import CONFIG_DIR, SEED_LIMIT, ConfigError

# ------------------------------------------------------------------------------------------ defaults
# The spec's keys, and what the study itself sets for every run.

SPEC_KEYS = ("name", "base", "grid", "seeds", "baseline", "config_name", "command", "recordings")
REQUIRED_SPEC_KEYS = ("name", "grid")  # and seeds for `command: train`, recordings for `command: replay`
# What each run is: `asyncgrpo train` (a live run per cell x seed), or `asyncgrpo replay RECORDING`
# (a replay per cell x recording: every cell trains on the same recorded samples, so cells are
# compared paired by recording; the run's `seed` is the recording's index, which seeds its evaluations).
COMMANDS = ("train", "replay")
STUDY_DIR_ROOT = "studies"  # default study_dir: studies/<name>
STUDY_SPECS_DIR = CONFIG_DIR / "studies"  # `asyncgrpo study NAME` finds configs/studies/NAME.yaml
# Prepended to every run's overrides, so a spec's base (or the command line) can still change them:
# a study never resumes an interrupted run (it starts it again), so its checkpoint would be wasted
# time and disk; an export per run is disk for nothing; a progress bar is noise in train.log.
RUN_DEFAULTS = ("progress=false", "train.checkpoint_on_interrupt=false", "train.export_at_end=false")
# Keys the study sets itself for every run.
RESERVED_KEYS = ("seed", "run_dir", "resume")


class SpecError(ValueError):
    """A spec that cannot run; the one-line message names the spec file and the key or cell."""


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
        return "__".join(f"{safe_name(key)}-{safe_name(level.label)}" for key, level in self.levels)

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
    recording: Path | None = None  # a replay's recording directory (`command: replay`); None: a train run

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
    command: str = "train"  # COMMANDS
    recordings: list[str] | None = None  # `command: replay`: the recording directories, one per "seed"
    # Set by `load`: a line per cell that changes settings its runs do not read (asyncgrpo/inert_settings.py).
    unread: list[str] = field(default_factory=list)

    # -------------------------------------------------------------------------- loading

    @classmethod
    def load(cls, path: str | Path, extra_base: Sequence[str] = ()) -> Spec:
        """Parse and validate a spec file, then compose every cell's config (`config.load`), so a
        value the config refuses fails here, before any run, in one line naming the cell.
        `extra_base` overrides (from the command line) are added after the spec's base."""
        spec = cls.parse(read_spec_file(path), source=str(path), extra_base=extra_base)
        spec.unread = spec.inert_settings(spec.check_configs())
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
        command = data.get("command") or "train"
        if command not in COMMANDS:
            raise fail(f"command must be one of {', '.join(COMMANDS)} (got {command!r})")
        required = (*REQUIRED_SPEC_KEYS, "recordings" if command == "replay" else "seeds")
        missing = [key for key in required if data.get(key) is None]
        if missing:
            raise fail(f"missing key {', '.join(repr(k) for k in missing)}")
        name = data["name"]
        if not isinstance(name, str) or not name.strip() or safe_name(name) != name:
            raise fail(f"name must be a non-empty string of letters, digits, '.', '_' or '-' (got {name!r})")
        base = list(data.get("base") or []) + list(extra_base)
        for override in base:
            if not isinstance(override, str) or "=" not in override:
                raise fail(f"base: each entry must be a key=value override (got {override!r})")
            _refuse_reserved(_override_key(override), "base", fail)
        factors = _parse_grid(data["grid"], fail)
        recordings = _parse_recordings(data, command, fail)
        seeds = data.get("seeds") if recordings is None else list(range(len(recordings)))
        if (not isinstance(seeds, list) or not seeds
                or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < SEED_LIMIT for s in seeds)):
            # The config's own range (config._run_rules): checked for every seed, not only the first's cell.
            raise fail(f"seeds must be a non-empty list of integers in [0, 2**32) (got {seeds!r})")
        if len(set(seeds)) != len(seeds):
            raise fail(f"seeds must be distinct (got {seeds!r})")
        config_name = data.get("config_name") or "default"
        if not isinstance(config_name, str):
            raise fail(f"config_name must be the name of a preset in configs/ (got {config_name!r})")
        if recordings is not None and data.get("config_name") is not None:
            raise fail("config_name: a replay's config is its recording's config.yaml; drop config_name")
        spec = cls(name=name, base=base, factors=factors, seeds=list(seeds), config_name=config_name, source=source,
                   command=command, recordings=recordings)
        if data.get("baseline") is not None:
            spec.baseline = _parse_baseline(data["baseline"], factors, fail)
        return spec

    def check_configs(self, before: Sequence[str] = ()) -> list[Any]:
        """Compose each cell's config as its first seed's run would (`config.load`), with `before`
        ahead of the run's own overrides (the engine cluster's); the first one the config refuses
        raises SpecError naming the cell. Returns the configs."""
        from asyncgrpo.config import load

        if self.recordings is not None:
            return self._check_replays()
        configs = []
        for plan in self._plans_to_check():
            try:
                configs.append(load([*before, *plan.train_overrides()], config_name=self.config_name))
            except ConfigError as err:
                raise SpecError(f"{self.source}: cell {plan.cell.label}: {err}") from None
        return configs

    def _plans_to_check(self) -> list[RunPlan]:
        """A run of each cell (its first seed's), or of each cell and recording for a replay study."""
        return self.runs(Path(STUDY_DIR_ROOT) / self.name, seeds=None if self.recordings is not None else self.seeds[:1])

    def inert_settings(self, configs: Sequence[Any]) -> list[str]:
        """A line for each cell whose config (`configs`, from check_configs) changes settings its runs do
        not read (asyncgrpo/inert_settings.py): a spec that sets them most likely meant them to act."""
        from asyncgrpo.inert_settings import inert_settings

        if self.recordings is not None:
            return []  # a replay's config is its recording's: what it sets, the spec did not
        found = (f"cell {plan.cell.label}: set but not read by its runs: {'; '.join(inert)}"
                 for plan, cfg in zip(self._plans_to_check(), configs) if (inert := inert_settings(cfg)))
        return list(dict.fromkeys(found))

    def _check_replays(self) -> list[Any]:
        """Every recording opens, and every cell's overrides compose with every recording's config
        as `asyncgrpo replay` would compose them (a recording can refuse what another takes: its
        groups per step)."""
        from asyncgrpo.config import replay_config
        from asyncgrpo.recording.source import open_recording
        from asyncgrpo.recording.stream import RecordingError

        configs = []
        for plan in self._plans_to_check():
            try:
                configs.append(replay_config(open_recording(plan.recording), plan.train_overrides()))
            except RecordingError as err:
                raise SpecError(f"{self.source}: recordings: {err}") from None
            except ConfigError as err:
                raise SpecError(f"{self.source}: cell {plan.cell.label}, recording {plan.recording}: {err}") from None
        return configs

    # -------------------------------------------------------------------------- the plan

    def cells(self) -> list[Cell]:
        """Every combination of the factors' levels, the first factor varying slowest."""
        return [Cell(tuple(zip((f.key for f in self.factors), levels)))
                for levels in itertools.product(*(f.levels for f in self.factors))]

    def runs(self, study_dir: str | Path, seeds: Sequence[int] | None = None) -> list[RunPlan]:
        """Every cell x seed, seed by seed (every cell at the first seed, then at the next): a study
        stopped part-way has every cell at the same seeds, so its cells still compare paired."""
        root = Path(study_dir) / "runs"
        return [RunPlan(cell=cell, seed=seed, run_dir=root / cell.slug / f"seed_{seed}",
                        overrides=(*RUN_DEFAULTS, *self.base, *cell.overrides, f"seed={seed}"),
                        config_name=self.config_name, recording=self.recording(seed))
                for seed in (self.seeds if seeds is None else seeds) for cell in self.cells()]

    def recording(self, seed: int) -> Path | None:
        """The recording a replay study's run with this "seed" (the recording's index) replays."""
        return None if self.recordings is None else Path(self.recordings[seed]).expanduser()

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
        if self.recordings is not None:  # a replay study: its seeds are the recordings' indices
            data = {"name": self.name, "command": self.command, "recordings": list(self.recordings),
                    "base": list(self.base), "grid": grid}
        if self.baseline is not None:
            data["baseline"] = dict(self.baseline)
        return data


def read_spec_file(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such spec file")
    try:
        return load_yaml(path.read_text())
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not UTF-8 text") from None
    except OSError as err:
        raise SpecError(f"{path}: {err.strerror or err}") from None
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
        if len(set(labels)) != len(labels) or len({safe_name(label) for label in labels}) != len(labels):
            raise fail(f"{where}: two levels have the same label (or the same directory name): {labels}")
        factors.append(Factor(key, levels, named=isinstance(values, dict)))
    if len({safe_name(f.key) for f in factors}) != len(factors):
        raise fail(f"grid: two keys have the same directory name: {[f.key for f in factors]}")
    return factors


def _parse_recordings(data: dict, command: str, fail: Callable[[str], SpecError]) -> list[str] | None:
    """`command: replay`'s recording directories (paired runs: each cell replays each of them); None
    for `command: train`, which takes none."""
    recordings = data.get("recordings")
    if command == "train":
        if recordings is not None:
            raise fail("recordings: only with command: replay")
        return None
    if data.get("seeds") is not None:
        raise fail("seeds: a replay study runs each cell once per recording (the recording's index is its seed); "
                   "drop seeds")
    if (not isinstance(recordings, list) or not recordings
            or not all(isinstance(r, str) and r.strip() for r in recordings)):
        raise fail(f"recordings must be a non-empty list of recording directories with command: replay "
                   f"(got {recordings!r})")
    if len({str(Path(r).expanduser()) for r in recordings}) != len(recordings):
        raise fail(f"recordings must be distinct (got {recordings!r})")
    return list(recordings)


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


def safe_name(text: str) -> str:
    """For a directory name: letters, digits, '.', '_', '-' kept, anything else '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def _override_key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0].strip()


def default_study_dir(spec: Spec) -> Path:
    """studies/<name>, where a study runs when no study_dir is given."""
    return Path(STUDY_DIR_ROOT) / spec.name
