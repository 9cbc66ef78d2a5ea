"""The replay study's section of report.md: what comparing corrections on identical samples buys.

In a replay study (`command: replay`) every cell trains on the same recordings, so a cell and the
baseline are paired by recording. For each cell against the baseline and each accuracy metric the
section gives the paired difference with its interval, the interval the same difference would have
had from independent runs (var(A) + var(B): each correction its own runs), and the ratio of the two
variances (`stats.pairing_gain`)."""

from __future__ import annotations

from collections.abc import Callable

from asyncgrpo.study.results import RunResult, runs_by_cell
from asyncgrpo.study.spec import Spec
from asyncgrpo.study.stats import CONFIDENCE, Estimate, pairing_gain

# The metrics compared: (results.csv column, heading).
PAIRING_METRICS = (("eval_accuracy_end", "held-out acc. end"), ("eval_greedy_accuracy_end", "greedy end"),
                   ("accuracy_auc", "acc. AUC"))


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: the header, its rule, a line per row (report.md's and tools/study_pairs.py's)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def pairing_section(spec: Spec, results: list[RunResult], fmt: Callable[[Estimate, bool], str]) -> list[str]:
    """report.md's lines for a replay study with a baseline; none for other studies. `fmt` writes an
    estimate as the rest of the report does (signed)."""
    baseline = spec.baseline_cell()
    if spec.recordings is None or baseline is None:
        return []
    by_cell = runs_by_cell(spec, results)
    base_runs = next(runs for cell, runs in by_cell if cell == baseline)
    percent = round(100 * CONFIDENCE)
    lines = [
        "## Paired on identical samples against independent runs", "",
        f"Every cell replays the same {len(spec.recordings)} recording(s), so cell and baseline ({baseline.label}) are "
        f"paired by recording. `paired`: the mean per-recording difference with its {percent}% t-interval "
        "(var(A - B) / n). `unpaired`: the same mean with the interval independent runs of each cell would give "
        "((var(A) + var(B)) / n, Welch's degrees of freedom). `ratio` = (var(A) + var(B)) / var(A - B): how many "
        "times the independent runs per cell it would take to match the paired precision (inf: every pair "
        "differs by the same amount).", "",
    ]
    rows = []
    for cell, runs in by_cell:
        if cell == baseline:
            continue
        for column, heading in PAIRING_METRICS:
            gain = pairing_gain({r.plan.seed: r.row[column] for r in runs},
                                {r.plan.seed: r.row[column] for r in base_runs})
            ratio = "-" if gain.variance_ratio is None else f"{gain.variance_ratio:.2f}"
            rows.append([*cell.values.values(), heading, str(gain.n), fmt(gain.paired, True),
                         fmt(gain.unpaired, True), ratio])
    lines += markdown_table([*spec.grid_keys(), "metric", "n pairs", "paired", "unpaired", "ratio"], rows)
    return [*lines, ""]
