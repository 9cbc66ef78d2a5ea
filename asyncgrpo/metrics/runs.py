"""Reading a run directory: its metrics.jsonl (step and eval records) and summary.json, for
`asyncgrpo plot`, a study's results and the simulator's calibration. Plain Python: numpy is
imported only by `Run.series`, which the figures use."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


class RunReadError(ValueError):
    """A run directory's metrics.jsonl or summary.json cannot be read (one line naming the file)."""


@dataclass
class Run:
    """One run directory as read (`load_run`): `name` labels it in figures and tables."""

    name: str
    path: Path
    steps: list[dict[str, Any]] = field(default_factory=list)  # learner step records
    evals: list[dict[str, Any]] = field(default_factory=list)  # records with eval/accuracy
    summary: dict[str, Any] = field(default_factory=dict)
    num_generators: int = 1
    # metrics.jsonl lines that are not a record (not JSON, not an object, a step that is not a
    # number): skipped and counted. A run killed mid-write leaves one, its partial last line.
    skipped_lines: int = 0

    def series(self, key: str, x: str = "samples") -> tuple[np.ndarray, np.ndarray]:
        """(x, y) over the step records that have both keys."""
        import numpy as np  # only for figures: the study and the simulator read runs without it

        points = [(r[x], r[key]) for r in self.steps if is_number(r.get(key)) and is_number(r.get(x))]
        if not points:
            return np.zeros(0), np.zeros(0)
        xs, ys = zip(*points)
        return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)

    def keys(self, prefix: str) -> list[str]:
        found: dict[str, None] = {}
        for record in self.steps:
            for key, value in record.items():
                if key.startswith(prefix) and is_number(value):
                    found[key] = None
        return list(found)

    def at_step(self, step: int, key: str) -> float | None:
        """`key` of the step record of learner step `step`; step 0 (before training) is 0."""
        if step <= 0:
            return 0.0
        for record in self.steps:
            if record.get("step") == step and is_number(record.get(key)):
                return float(record[key])
        return None


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool): a value a curve or a mean can use."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a metrics.jsonl (objects whose step, if any, is a number) and how many lines
    were not one (see Run.skipped_lines); no records for no file, RunReadError for an unreadable one."""
    records: list[dict[str, Any]] = []
    skipped = 0
    if not path.exists():
        return records, skipped
    for raw in _read_bytes(path).splitlines():
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:  # not UTF-8 or not JSON
            skipped += 1
            continue
        if not isinstance(record, dict) or ("step" in record and not is_number(record["step"])):
            skipped += 1
            continue
        records.append(record)
    return records, skipped


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise RunReadError(f"{path}: {err.strerror or err}") from None


def _read_summary(path: Path) -> dict[str, Any]:
    """summary.json as a dict; {} if absent or cut short (written as the run ends)."""
    if not path.exists():
        return {}
    data = _read_bytes(path)
    try:
        summary = json.loads(data)
    except UnicodeDecodeError:
        raise RunReadError(f"{path}: not UTF-8 text") from None
    except ValueError:
        return {}
    if not isinstance(summary, dict):
        raise RunReadError(f"{path}: not a JSON object")
    return summary


def latest_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step records as the run finally took them. A run resumed in its own run_dir appends to
    metrics.jsonl from its checkpoint's step, so the steps the earlier run logged after that
    checkpoint come twice: a step at or below one already seen replaces every record from it on."""
    kept: list[dict[str, Any]] = []
    for record in records:
        step = record.get("step")
        if is_number(step):
            while kept and is_number(kept[-1].get("step")) and kept[-1]["step"] >= step:
                kept.pop()
        kept.append(record)
    return kept


def _num_generators(run_dir: Path) -> int:
    """rollout.num_generators of the run's config.yaml, 1 without one (the generators' idle
    fraction is divided by it)."""
    config = run_dir / "config.yaml"
    if config.exists():
        try:
            from omegaconf import OmegaConf

            return int(OmegaConf.load(config).rollout.num_generators)
        except Exception:  # noqa: BLE001 - a config from another version only costs the estimate
            pass
    return 1


def load_run(run_dir: str | Path, name: str | None = None) -> Run:
    """A run directory's step records (as the run finally took them), eval records and summary."""
    path = Path(run_dir)
    if not (path / "metrics.jsonl").exists() and not (path / "summary.json").exists():
        raise FileNotFoundError(f"{path}: neither metrics.jsonl nor summary.json found; is this a run directory?")
    records, skipped = read_records(path / "metrics.jsonl")
    summary = _read_summary(path / "summary.json")
    return Run(
        name=name or path.resolve().name,
        path=path,
        steps=latest_steps([r for r in records if "eval/accuracy" not in r and "eval/greedy_accuracy" not in r]),
        evals=[r for r in records if "eval/accuracy" in r or "eval/greedy_accuracy" in r],
        summary=summary,
        num_generators=_num_generators(path),
        skipped_lines=skipped,
    )
