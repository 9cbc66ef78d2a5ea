"""What a study's runs left behind, read back from their run directories: each run's summary.json
and metrics.jsonl as one row of results.csv (`RunResult`) with its curves for the figures."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.runtime.provenance import short_commit
from asyncgrpo.study.spec import Cell, RunPlan, Spec, read_spec_file
from asyncgrpo.study.stats import Estimate, is_number, mean_ci

FINISHED = "finished"  # summary.json's status of a run that reached its end
# Curves kept per run, for the figures and the report's differences over training. Eval curves are
# over the eval records (start, periodic with eval.every_steps, end), x = samples consumed; the key is
# the eval record's, without its "eval/" prefix. `greedy_gap` is derived per record: greedy minus
# sampled accuracy of the same weights on the same problems.
EVAL_CURVES = ("accuracy", "greedy_accuracy", "greedy_gap")
# Step curves: these step-record metrics over the run's steps, x = samples consumed.
STEP_CURVES = ("reward/mean", "policy/entropy", "response/length_mean")
# A training metric "at the end" is its mean over the run's last tenth of steps (at least one):
# one step's value of the entropy or the length is a batch of 128 samples, noisy on its own.
END_FRACTION = 0.1


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

    # EVAL_CURVES and STEP_CURVES by name: (samples, value) in order of samples; empty when the run
    # logged none of it.
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # EVAL_CURVES again with the learner step as x, for pairing runs at the same step of training.
    eval_by_step: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

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
    curves = {name: eval_points(run.evals, steps, summary, name) for name in EVAL_CURVES}
    curves.update({key: step_points(steps, key) for key in STEP_CURVES})
    eval_curve = curves["accuracy"]
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
        **policy_columns(summary, curves),
        "wall_s": summary.get("wall_s"),
        "train_s": summary.get("train_s"),
        "status": summary.get("status", "unknown"),
        "commit": short_commit(summary.get("code")),
        "run_dir": str(plan.run_dir),
    })
    by_step = {name: eval_points(run.evals, [], {}, name, x="step") for name in EVAL_CURVES}
    return RunResult(plan, row, eval_curve, curves["reward/mean"], summary.get("engines_reused"), curves, by_step)


def policy_columns(summary: dict[str, Any], curves: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """results.csv's columns on what the policy became, beside its accuracy: the greedy - sampled gap at
    the end, the area under the greedy accuracy and under the gap (as `accuracy_auc`), and the policy's
    entropy and completion length at the end (mean over the last END_FRACTION of steps)."""
    sampled, greedy = summary.get("eval_accuracy_end"), summary.get("eval_greedy_accuracy_end")
    return {
        "greedy_gap_end": greedy - sampled if is_number(sampled) and is_number(greedy) else None,
        "greedy_accuracy_auc": accuracy_auc(curves["greedy_accuracy"]),
        "greedy_gap_auc": accuracy_auc(curves["greedy_gap"]),
        "entropy_end": tail_mean(curves["policy/entropy"]),
        "length_end": tail_mean(curves["response/length_mean"]),
    }


def step_points(steps: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(samples consumed, value of `key`) of each step record that has both."""
    return [(float(r["samples"]), float(r[key])) for r in steps if is_number(r.get("samples")) and is_number(r.get(key))]


def tail_mean(points: list[tuple[float, float]], fraction: float = END_FRACTION) -> float | None:
    """The mean of the last `fraction` of the points (at least one); None without points."""
    if not points:
        return None
    tail = points[-max(1, round(fraction * len(points))):]
    return sum(y for _, y in tail) / len(tail)


def eval_points(evals: list[dict[str, Any]], steps: list[dict[str, Any]],
                summary: dict[str, Any], name: str = "accuracy", x: str = "samples") -> list[tuple[float, float]]:
    """(samples consumed, `name`) of each eval record, in order of samples: `accuracy` (held-out
    sampled), `greedy_accuracy`, or `greedy_gap` (greedy minus sampled of the same record). An eval
    record carries its learner step; the samples at that step come from the step record, 0 at step 0,
    or the summary's total at the summary's last step. With x="step", (learner step, `name`)."""
    samples_at = {int(r["step"]): float(r["samples"]) for r in steps
                  if is_number(r.get("step")) and is_number(r.get("samples"))}
    samples_at.setdefault(0, 0.0)
    if is_number(summary.get("steps")) and is_number(summary.get("samples")):
        samples_at.setdefault(int(summary["steps"]), float(summary["samples"]))
    points = {}
    for record in evals:
        step, value = record.get("step"), eval_value(record, name)
        if x == "step" and is_number(step) and value is not None:
            points[float(step)] = value
        elif is_number(step) and value is not None and int(step) in samples_at:
            points[samples_at[int(step)]] = value  # a repeated step: the later record
    return sorted(points.items())


def value_at(points: list[tuple[float, float]], x: float) -> float | None:
    """A curve's value at x, linear between its two nearest points; None outside the points' span
    (a run whose evaluations at a version lag a multiple of eval.every_steps is still paired there)."""
    if not points or not points[0][0] <= x <= points[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]  # a single point, at x


def eval_value(record: dict[str, Any], name: str) -> float | None:
    """One of EVAL_CURVES from an eval record; None when the record lacks what it needs."""
    if name == "greedy_gap":
        sampled, greedy = record.get("eval/accuracy"), record.get("eval/greedy_accuracy")
        return float(greedy) - float(sampled) if is_number(sampled) and is_number(greedy) else None
    value = record.get(f"eval/{name}")
    return float(value) if is_number(value) else None


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


def cell_estimates(by_cell: list[tuple[Cell, list[RunResult]]], x: str,
                   y: str) -> list[tuple[Cell, int, Estimate, Estimate]]:
    """Each cell whose finished runs logged both columns: how many runs logged both, and the estimate
    of each column over seeds."""
    estimates = []
    for cell, runs in by_cell:
        ex, ey = mean_ci([r.row.get(x) for r in runs]), mean_ci([r.row.get(y) for r in runs])
        if ex.mean is not None and ey.mean is not None:
            both = sum(1 for r in runs if is_number(r.row.get(x)) and is_number(r.row.get(y)))
            estimates.append((cell, both, ex, ey))
    return estimates
