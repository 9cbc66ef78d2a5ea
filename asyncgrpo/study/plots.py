"""The study's figures, in study_dir/plots/: accuracy and reward against samples per cell (bands
over seeds), and the final accuracy against each factor's levels (docs/STUDIES.md, "What it
writes"). matplotlib is imported only when a figure is drawn."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncgrpo.study.results import RunResult, cell_estimates, runs_by_cell
from asyncgrpo.study.spec import Cell, Factor, Spec, safe_name
from asyncgrpo.study.stats import CONFIDENCE, is_number, mean_ci, pareto_front


ACCURACY_RANGE = (0.0, 1.0)  # a fraction of problems: its bands and bars are cut there
GAP_RANGE = (-1.0, 1.0)  # a difference of two accuracies

# More curves per cell, drawn as accuracy_vs_samples.png is, when some run has them: (RunResult.curves
# name, what it is, file, markers at the points: the eval curves have a point per evaluation, the
# range the value cannot leave or None).
CURVE_FIGURES = (
    ("greedy_accuracy", "held-out greedy accuracy", "greedy_accuracy_vs_samples.png", True, ACCURACY_RANGE),
    ("greedy_gap", "held-out greedy - sampled accuracy", "greedy_gap_vs_samples.png", True, GAP_RANGE),
    ("policy/entropy", "policy entropy (policy/entropy per step, nats/token)", "entropy_vs_samples.png", False, None),
    ("response/length_mean", "completion length (response/length_mean per step, tokens)",
     "length_vs_samples.png", False, None),
)


def write_plots(spec: Spec, results: list[RunResult], out: Path) -> list[Path]:
    """accuracy_vs_samples.png and reward_vs_samples.png (a panel per combination of all factors
    but the last, a line per level of the last, bands over seeds), the same for each of
    CURVE_FIGURES some run logged, final_accuracy_vs_<key>.png for each factor, and with two cells
    or more accuracy_auc_vs_samples_per_s.png. Nothing when no run has finished."""
    if not any(r.finished for r in results):
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only
    out.mkdir(parents=True, exist_ok=True)
    by_cell = runs_by_cell(spec, results)
    written = [
        _plot_curves(spec, by_cell, lambda r: r.eval_curve, "held-out sampled accuracy", out / "accuracy_vs_samples.png",
                     markers=True, limits=ACCURACY_RANGE),
        _plot_curves(spec, by_cell, lambda r: r.reward_curve, "training reward (reward/mean per step)",
                     out / "reward_vs_samples.png", markers=False),
    ]
    for name, what, file, markers, limits in CURVE_FIGURES:
        if any(r.curves.get(name) for _, runs in by_cell for r in runs):  # a run that logs none draws none
            written.append(_plot_curves(spec, by_cell, _curve(name), what, out / file, markers=markers,
                                        limits=limits))
    for factor in spec.factors:
        path = out / f"final_accuracy_vs_{safe_name(factor.key)}.png"
        written.append(_plot_factor(spec, by_cell, factor, path))
    if len(cell_estimates(by_cell, "samples_per_s", "accuracy_auc")) >= 2:
        written.append(_plot_front(spec, by_cell, out / "accuracy_auc_vs_samples_per_s.png"))
    return written


def _curve(name: str) -> Callable[[RunResult], list[tuple[float, float]]]:
    return lambda result: result.curves.get(name, [])


def _panels(spec: Spec, by_cell: list[tuple[Cell, list[RunResult]]]) -> dict[str, list[tuple[Cell, list[RunResult]]]]:
    """Cells grouped by every factor but the last (one group when there is one factor)."""
    panels: dict[str, list[tuple[Cell, list[RunResult]]]] = {}
    for cell, runs in by_cell:
        title = " ".join(f"{key}={level.label}" for key, level in cell.levels[:-1]) or spec.name
        panels.setdefault(title, []).append((cell, runs))
    return panels


def _band(curves: list[list[tuple[float, float]]],
          limits: tuple[float, float] | None = None) -> tuple[Any, Any, Any] | None:
    """Seeds' curves on a shared x grid: mean and the CI's low and high (the mean alone for one seed),
    the CI cut at `limits` (with 2 seeds t = 12.7 takes an accuracy's interval far below 0 and above 1,
    and the axis with it, flattening every curve)."""
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
    if limits is not None:
        low, high = np.clip(low, *limits), np.clip(high, *limits)
    return grid, mean, (low, high)


def _plot_curves(spec: Spec, by_cell: list[tuple[Cell, list[RunResult]]],
                 curve: Callable[[RunResult], list[tuple[float, float]]], what: str, path: Path,
                 markers: bool, limits: tuple[float, float] | None = None) -> Path:
    import matplotlib.pyplot as plt

    panels = _panels(spec, by_cell)
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    cut = f", cut at {limits[0]:g} and {limits[1]:g}" if limits is not None else ""
    # Two lines: one panel is 5.5 inches wide, and a long study name with the caption would not fit.
    fig.suptitle(f"{spec.name}: {what} vs samples\n(mean over seeds, band: {round(100 * CONFIDENCE)}% CI{cut})",
                 fontsize=10)
    palette = plt.get_cmap("tab10")
    for ax, (title, cells) in zip(axes.flat, panels.items()):
        drawn = False
        for i, (cell, runs) in enumerate(cells):
            band = _band([curve(r) for r in runs], limits)
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
    fig.suptitle(f"{spec.name}: final held-out accuracy vs {factor.key}\n(mean over seeds, bars: "
                 f"{round(100 * CONFIDENCE)}% CI, cut at 0 and 1)", fontsize=10)
    palette = plt.get_cmap("tab10")
    width = 0.6 / max(1, len(lines))
    for ax, (column, what) in zip(axes.flat, (("eval_accuracy_end", "sampled"), ("eval_greedy_accuracy_end", "greedy"))):
        for i, (name, per_level) in enumerate(lines.items()):
            xs, means, below, above = [], [], [], []
            for j, label in enumerate(labels):
                estimate = mean_ci([r.row[column] for r in per_level.get(label, [])])
                if estimate.mean is None:
                    continue
                xs.append(j + (i - (len(lines) - 1) / 2) * width)  # side by side, not on top of each other
                means.append(estimate.mean)
                half = estimate.half_width or 0.0  # cut at [0, 1], as the curves' bands are
                below.append(min(half, max(0.0, estimate.mean - ACCURACY_RANGE[0])))
                above.append(min(half, max(0.0, ACCURACY_RANGE[1] - estimate.mean)))
            if xs:
                ax.errorbar(xs, means, yerr=[below, above], fmt="-o", capsize=3, color=palette(i % 10), label=name,
                            markersize=4)
        ax.set_xticks(range(len(labels)), labels, rotation=20 if max(map(len, labels)) > 6 else 0, fontsize=8)
        ax.set_xlabel(factor.key)
        ax.set_ylabel(f"held-out {what} accuracy at the end")
        ax.grid(True, alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=7)
    return _save_figure(fig, path)


def _plot_front(spec: Spec, by_cell: list[tuple[Cell, list[RunResult]]], path: Path) -> Path:
    """Each cell at its mean samples/s and mean acc. AUC with both intervals as bars and each seed's
    run as a faint dot, the cells no other beats in both joined by a line (the Pareto front of the
    means). The axes span the runs, not the bars: with 2-3 seeds a t-interval is wider than the
    whole study and would squash every point into one corner."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    fig.suptitle(f"{spec.name}: accuracy AUC vs samples/s\n(means over seeds, dots: runs, bars: "
                 f"{round(100 * CONFIDENCE)}% CI, cut at the runs' range)", fontsize=10)
    palette = plt.get_cmap("tab10")
    cells = cell_estimates(by_cell, "samples_per_s", "accuracy_auc")
    runs_of = {cell.label: runs for cell, runs in by_cell}
    points = [(x.mean, y.mean) for _, _, x, y in cells]
    span_x, span_y = [x for x, _ in points], [y for _, y in points]
    for i, (cell, n, x, y) in enumerate(cells):
        color = palette(i % 10)
        seeds = [(r.row.get("samples_per_s"), r.row.get("accuracy_auc")) for r in runs_of[cell.label]]
        seeds = [(sx, sy) for sx, sy in seeds if is_number(sx) and is_number(sy)]
        ax.scatter([sx for sx, _ in seeds], [sy for _, sy in seeds], s=14, color=color, alpha=0.35, linewidths=0)
        span_x += [sx for sx, _ in seeds]
        span_y += [sy for _, sy in seeds]
        ax.errorbar([x.mean], [y.mean], xerr=[x.half_width or 0.0], yerr=[y.half_width or 0.0], fmt="o", capsize=3,
                    color=color, label=f"{cell.label} (n={n})")
    front = sorted(points[i] for i in pareto_front(points))
    if len(front) > 1:
        ax.plot([x for x, _ in front], [y for _, y in front], "--", color="gray", label="front of the means")
    ax.set_xlim(*_padded(span_x))
    ax.set_ylim(*_padded(span_y))
    ax.set_xlabel("samples/s (training loop)")
    ax.set_ylabel("held-out sampled accuracy AUC")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save_figure(fig, path)


def _padded(values: list[float], margin: float = 0.08) -> tuple[float, float]:
    """The range of values widened by margin of its span on each side (a fixed pad when all are equal)."""
    low, high = min(values), max(values)
    pad = (high - low) * margin or max(abs(high) * margin, 1e-3)
    return low - pad, high + pad


def _save_figure(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path
