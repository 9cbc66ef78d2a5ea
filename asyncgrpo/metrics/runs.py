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


@dataclass
class Run:
    """One run directory as read (`load_run`): `name` labels it in figures and tables."""

    name: str
    path: Path
    steps: list[dict[str, Any]] = field(default_factory=list)  # learner step records
    evals: list[dict[str, Any]] = field(default_factory=list)  # records with eval/accuracy
    summary: dict[str, Any] = field(default_factory=dict)
    num_generators: int = 1

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


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves a partial last line
    return records


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
    records = _read_jsonl(path / "metrics.jsonl")
    summary: dict[str, Any] = {}
    if (path / "summary.json").exists():
        try:
            summary = json.loads((path / "summary.json").read_text())
        except json.JSONDecodeError:
            summary = {}
    return Run(
        name=name or path.resolve().name,
        path=path,
        steps=latest_steps([r for r in records if "eval/accuracy" not in r and "eval/greedy_accuracy" not in r]),
        evals=[r for r in records if "eval/accuracy" in r or "eval/greedy_accuracy" in r],
        summary=summary,
        num_generators=_num_generators(path),
    )
