"""A study's written results, from its run directories: results.csv (a row per run), report.md
(per-cell means with intervals, paired differences against the baseline, the runs that did not
finish) and the figures (`aggregate`). docs/STUDIES.md, "What it writes", describes them."""

from __future__ import annotations

import csv
import io
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from asyncgrpo.runtime.files import write_atomic
from asyncgrpo.study.pairing import markdown_table, pairing_section
from asyncgrpo.study.plots import write_plots
from asyncgrpo.study.results import (
    RunResult,
    cell_estimates,
    load_study,
    read_summary,
    runs_by_cell,
    value_at,
)
from asyncgrpo.study.spec import RUN_DEFAULTS, Cell, Spec
from asyncgrpo.study.stats import (
    CONFIDENCE,
    Estimate,
    is_number,
    mean_ci,
    paired_difference,
    paired_ratio,
    pareto_front,
)

# results.csv, after the grid keys and `seed`; `status`, `commit` and `run_dir` last.
RESULT_COLUMNS = (
    "eval_accuracy_start", "eval_accuracy_end", "eval_greedy_accuracy_start", "eval_greedy_accuracy_end",
    "accuracy_auc", "greedy_accuracy_auc", "greedy_gap_end", "greedy_gap_auc", "steps", "samples", "samples_per_s",
    "staleness_mean", "staleness_max", "clipfrac", "ess", "entropy_end", "length_end", "wall_s", "train_s",
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
# Paired against the baseline as ratios, not differences: throughput on a shared machine.
# The training loop's seconds, not the run's wall clock: a study's first run pays for the Ray cluster
# and the engines' start, which seed-major order gives to the first cell at every resume.
RATIO_METRICS = (("samples_per_s", "samples/s"), ("train_s", "train s"))
# What the policy became beside its accuracy: per cell, and paired against the baseline.
POLICY_METRICS = (
    ("greedy_accuracy_auc", "greedy AUC"), ("greedy_gap_end", "greedy - sampled end"),
    ("greedy_gap_auc", "greedy - sampled AUC"), ("entropy_end", "entropy end"), ("length_end", "length end"),
)
ROUNDING = 1e-9  # a difference this small is 0 (float rounding), never bold
# The eval curves whose paired differences the report gives at every evaluated step: (curve, heading).
OVER_TRAINING = (("accuracy", "held-out sampled accuracy"), ("greedy_accuracy", "held-out greedy accuracy"),
                 ("greedy_gap", "greedy - sampled accuracy"))


def aggregate(study_dir: str | Path) -> list[Path]:
    """results.csv, report.md and plots/*.png from the study's run directories; returns their paths."""
    study_dir = Path(study_dir)
    spec, results = load_study(study_dir)
    written = [write_results_csv(spec, results, study_dir / "results.csv"),
               write_report(spec, results, study_dir / "report.md")]
    written += write_plots(spec, results, study_dir / "plots")
    return written


def write_results_csv(spec: Spec, results: list[RunResult], path: Path) -> Path:
    """A row per started run: the grid's values, the seed, `RESULT_COLUMNS`, status, commit and run_dir."""
    columns = [*spec.grid_keys(), "seed", *RESULT_COLUMNS, "status", "commit", "run_dir"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for result in results:
        writer.writerow({k: "" if result.row.get(k) is None else result.row[k] for k in columns})
    write_atomic(path, buffer.getvalue())
    return path


def _fmt(value: float | None) -> str:
    """Accuracies and fractions to 3 decimals; seconds and samples/s to what their noise allows."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def _fmt_estimate(estimate: Estimate, signed: bool = False, bold: bool = False) -> str:
    """mean [low, high]; with `bold`, in bold when the interval excludes 0."""
    if estimate.mean is None:
        return "-"
    sign = "+" if signed and estimate.mean >= 0 else ""
    text = sign + _fmt(estimate.mean)
    if estimate.low is not None and estimate.high is not None:
        text += f" [{_fmt(estimate.low)}, {_fmt(estimate.high)}]"
        # A margin for float rounding: two equal accuracies differenced as sums are not exactly 0.
        if bold and (estimate.low > ROUNDING or estimate.high < -ROUNDING):
            text = f"**{text}**"
    return text


def write_report(spec: Spec, results: list[RunResult], path: Path) -> Path:
    """report.md: how the runs ran, per-cell estimates, paired differences, the runs not finished."""
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
        + _how_runs_ran(spec),
        "",
        (_replay_note() if spec.recordings is not None else _engines_note(finished)) + _overhead_note(finished) + ".",
        "",
        _code_note(finished),
        "",
        f"**Statistics**: per cell, the mean over seeds with a {percent}% confidence interval [low, high] = "
        f"mean +- t({(1 + CONFIDENCE) / 2:g}, n-1) s / sqrt(n) (Student's t, s the sample standard deviation); no "
        "interval with n < 2. Only finished runs count. `acc. AUC` is the area under held-out sampled accuracy vs "
        "samples consumed (trapezoids over the evaluations) divided by the samples spanned; with evaluations at the "
        "start and the end only it is (start + end) / 2. staleness, clip fraction (`loss/clipfrac`) and ESS "
        "(`is/ess`, logged only with `algo.correction.is_level` set) are means over a run's steps; staleness max is "
        "the run's maximum; samples/s is the training loop's (`summary.json`). greedy - sampled is the held-out "
        "greedy accuracy minus the sampled one of the same weights; entropy (`policy/entropy`) and length "
        "(`response/length_mean`) at the end are means over a run's last tenth of steps.",
        "",
    ]
    keys = spec.grid_keys()
    for title, metrics in (("Accuracy per cell", ACCURACY_METRICS), ("Training per cell", RUN_METRICS),
                           ("Greedy accuracy and the policy per cell", POLICY_METRICS)):
        rows = []
        for cell, runs in runs_by_cell(spec, results):
            estimates = [mean_ci([r.row[column] for r in runs]) for column, _ in metrics]
            rows.append([*cell.values.values(), str(len(runs)), *(_fmt_estimate(e) for e in estimates)])
        lines += [f"## {title}", "", *markdown_table([*keys, "n", *(heading for _, heading in metrics)], rows), ""]
    lines += _front_section(spec, results)
    lines += _differences_section(spec, results)
    if pairing := pairing_section(spec, results, _fmt_estimate):  # replay studies only
        lines += ["", *pairing]
    if unfinished:
        lines += ["", "## Runs not finished (left out of the statistics)", ""]
        for result in unfinished:
            summary = read_summary(result.plan.run_dir)
            error = f": {summary['error']}" if summary.get("error") else ""
            lines.append(f"- {result.plan.label}: {result.row['status']}{error} ({result.plan.run_dir})")
    lines += ["", "Per run: `results.csv`; figures: `plots/`.", ""]
    write_atomic(path, "\n".join(lines))
    return path


def _differences_section(spec: Spec, results: list[RunResult]) -> list[str]:
    """Paired differences against the baseline cell: at the end and as AUC (accuracy, then greedy
    accuracy and the policy), then at every evaluated step of training."""
    lines = ["## Paired differences against the baseline", ""]
    baseline = spec.baseline_cell()
    if baseline is None:
        return lines + ["No `baseline` in the spec: give one (a value for each grid key) to compare cells with it."]
    by_cell = runs_by_cell(spec, results)
    base_runs = next(runs for cell, runs in by_cell if cell == baseline)
    lines += [
        f"Baseline: {baseline.label}. For each seed both finished, the cell's value minus the baseline's on "
        f"that seed; the mean of those differences with its {round(100 * CONFIDENCE)}% t-interval over the n "
        "pairs. An interval that excludes 0 is a difference the seeds support. samples/s and the training "
        "loop's seconds are compared as ratios (the cell's over the baseline's on the same seed; their "
        "geometric mean, and the t-interval of their logarithms exponentiated): an interval that excludes 1 "
        "is a difference the seeds support.",
        "",
    ]
    keys = spec.grid_keys()
    for metrics in (DIFFERENCE_METRICS, POLICY_METRICS):
        getters = [_row_value(column) for column, _ in metrics]
        rows = _difference_rows(by_cell, baseline, base_runs, getters)
        lines += [*markdown_table([*keys, "n pairs", *(f"diff. {heading}" for _, heading in metrics)], rows), ""]
    getters = [_row_value(column) for column, _ in RATIO_METRICS]
    rows = _difference_rows(by_cell, baseline, base_runs, getters, compare=paired_ratio)
    lines += [*markdown_table([*keys, "n pairs", *(f"ratio {heading}" for _, heading in RATIO_METRICS)], rows), ""]
    return lines + _over_training(by_cell, baseline, base_runs, keys)


def _front_section(spec: Spec, results: list[RunResult]) -> list[str]:
    """The cells on the front of mean samples/s and mean acc. AUC (plots/accuracy_auc_vs_samples_per_s.png)."""
    cells = cell_estimates(runs_by_cell(spec, results), "samples_per_s", "accuracy_auc")
    if len(cells) < 2:
        return []
    front = sorted(pareto_front([(x.mean, y.mean) for _, _, x, y in cells]), key=lambda i: cells[i][2].mean)
    named = ", ".join(f"{cells[i][0].label} ({_fmt(cells[i][2].mean)} samples/s, acc. AUC {_fmt(cells[i][3].mean)})"
                      for i in front)
    return ["## Throughput and accuracy together", "",
            "The cells no other cell beats in both mean samples/s and mean acc. AUC (the Pareto front of the "
            f"means; their intervals are in the tables above), slowest first: {named}. "
            "Figure: plots/accuracy_auc_vs_samples_per_s.png.", ""]


def _row_value(column: str) -> Callable[[RunResult], float | None]:
    return lambda result: result.row.get(column)


def _curve_value(name: str, step: float) -> Callable[[RunResult], float | None]:
    return lambda result: value_at(result.eval_by_step.get(name, []), step)


def _difference_rows(by_cell: list[tuple[Cell, list[RunResult]]], baseline: Cell, base_runs: list[RunResult],
                     getters: list[Callable[[RunResult], float | None]], bold: bool = False,
                     compare: Callable[..., Estimate] = paired_difference) -> list[list[str]]:
    """A row per cell but the baseline: its levels, the most pairs any value had, and per getter the
    paired comparison against the baseline (`compare`: difference or ratio) with its interval."""
    rows = []
    for cell, runs in by_cell:
        if cell == baseline:
            continue
        diffs, n_pairs = [], 0
        for get in getters:
            estimate = compare({r.plan.seed: get(r) for r in runs}, {r.plan.seed: get(r) for r in base_runs})
            n_pairs = max(n_pairs, estimate.n)
            diffs.append(_fmt_estimate(estimate, signed=compare is paired_difference, bold=bold))
        rows.append([*cell.values.values(), str(n_pairs), *diffs])
    return rows


def _over_training(by_cell: list[tuple[Cell, list[RunResult]]], baseline: Cell, base_runs: list[RunResult],
                   keys: list[str]) -> list[str]:
    """The paired differences of each OVER_TRAINING curve at every step most runs evaluated (a run
    whose evaluation came a version late is read between its neighbours); nothing without periodic
    evaluation, where the end differences above say it all."""
    steps = common_eval_steps([r for _, runs in by_cell for r in runs])
    if len(steps) <= 2:
        return []
    lines = ["## Paired differences over training", "",
             "The same paired differences at each learner step the runs evaluated at (`eval.every_steps`); "
             "**bold**: the interval excludes 0, so the first bold step of a row is where the seeds first "
             "support a difference.", ""]
    for name, heading in OVER_TRAINING:
        rows = _difference_rows(by_cell, baseline, base_runs, [_curve_value(name, step) for step in steps], bold=True)
        lines += [f"### {heading}", "", *markdown_table([*keys, "n pairs", *(f"step {step:g}" for step in steps)], rows), ""]
    return lines


def common_eval_steps(results: list[RunResult]) -> list[float]:
    """The learner steps at which at least half of the runs have an evaluation, in order."""
    counts: dict[float, int] = {}
    for result in results:
        for step, _ in result.eval_by_step.get("accuracy", []):
            counts[step] = counts.get(step, 0) + 1
    return sorted(step for step, count in counts.items() if 2 * count >= len(results))


def _how_runs_ran(spec: Spec) -> str:
    """What every run was given: a train run's preset and overrides, or a replay's recording and overrides."""
    if spec.recordings is not None:
        return (f"Every run: `asyncgrpo replay` of one recording with the study's defaults `{' '.join(RUN_DEFAULTS)}`, "
                f"the spec's base `{' '.join(spec.base) or '(none)'}`, its cell's values, then `seed` (the "
                "recording's index in `recordings`, which pairs the runs).")
    return (f"Every run: preset `{spec.config_name}`, the study's defaults `{' '.join(RUN_DEFAULTS)}`, the spec's "
            f"base `{' '.join(spec.base) or '(none)'}`, its cell's values, then `seed`.")


def _replay_note() -> str:
    return ("**Replays**: each run is its own `asyncgrpo replay` process: one learner on a recorded stream, no "
            "generators, Ray or sockets; a vLLM engine in the same process only for its evaluations")


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
                 if is_number(r.row.get("wall_s")) and is_number(r.row.get("train_s"))]
    walls = [r.row["wall_s"] for r in finished if is_number(r.row.get("wall_s"))]
    if not overheads or not walls:
        return ""
    return (f"; each run spent {sum(overheads) / len(overheads):.0f} s on average outside its training loop "
            f"(start-up, warm start, evaluations, shutdown: {100 * sum(overheads) / sum(walls):.0f}% of the "
            "runs' wall clock)")


def _code_note(finished: list[RunResult]) -> str:
    """Which commits the finished runs ran (results.csv's `commit`, from each summary.json's `code`):
    a study resumed across commits says so."""
    counts = Counter(result.row.get("commit") or "not recorded" for result in finished)
    if not counts:
        return "**Code**: no finished run."
    listed = ", ".join(f"{commit} ({n} run{'s' if n > 1 else ''})" for commit, n in counts.items())
    return (f"**Code** (summary.json's `code`; not recorded: a run from an installed package, without git, or "
            f"from before the field existed): {listed}.")
