"""What a study's runs left behind, read back from their run directories: each run's summary.json
and metrics.jsonl as one row of results.csv (`RunResult`) with its curves for the figures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.study.spec import Cell, RunPlan, Spec, read_spec_file
from asyncgrpo.study.stats import is_number

FINISHED = "finished"  # summary.json's status of a run that reached its end


@dataclass
class RunResult:
    """One started run: its row of results.csv and its curves."""

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
    from asyncgrpo.metrics.runs import load_run

    if not (plan.run_dir / "summary.json").is_file():
        return None
    run = load_run(plan.run_dir)
    summary = run.summary
    steps = run.steps

    def step_mean(key: str) -> float | None:
        values = [r[key] for r in steps if is_number(r.get(key))]
        return sum(values) / len(values) if values else None

    staleness_max = max((r["staleness/max"] for r in steps if is_number(r.get("staleness/max"))),
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
                    if is_number(r.get("samples")) and is_number(r.get("reward/mean"))]
    return RunResult(plan, row, eval_curve, reward_curve, summary.get("engines_reused"))


def eval_points(evals: list[dict[str, Any]], steps: list[dict[str, Any]],
                summary: dict[str, Any]) -> list[tuple[float, float]]:
    """(samples consumed, held-out sampled accuracy) of each eval record, in order of samples. An eval
    record carries its learner step; the samples at that step come from the step record, 0 at step 0,
    or the summary's total at the summary's last step."""
    samples_at = {int(r["step"]): float(r["samples"]) for r in steps
                  if is_number(r.get("step")) and is_number(r.get("samples"))}
    samples_at.setdefault(0, 0.0)
    if is_number(summary.get("steps")) and is_number(summary.get("samples")):
        samples_at.setdefault(int(summary["steps"]), float(summary["samples"]))
    points = {}
    for record in evals:
        step, accuracy = record.get("step"), record.get("eval/accuracy")
        if is_number(step) and is_number(accuracy) and int(step) in samples_at:
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


def is_finished(run_dir: Path) -> bool:
    """A run whose summary.json says it reached its end (a study skips it when run again)."""
    return read_summary(run_dir).get("status") == FINISHED


def read_summary(run_dir: Path) -> dict[str, Any]:
    """A run's summary.json; empty when it has none yet or it cannot be read."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return summary if isinstance(summary, dict) else {}


def runs_by_cell(spec: Spec, results: list[RunResult]) -> list[tuple[Cell, list[RunResult]]]:
    """Each cell in grid order with its finished runs."""
    return [(cell, [r for r in results if r.finished and r.plan.cell == cell]) for cell in spec.cells()]
