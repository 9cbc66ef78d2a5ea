"""`asyncgrpo plot RUN_DIR [RUN_DIR ...]`: PNG figures from metrics.jsonl and summary.json.

One run: its curves. Several runs: the same figures with one colour per run, for comparison.
Every panel copes with missing keys (old runs, runs with other options) by saying "no data".
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from asyncgrpo.metrics.runs import Run, is_number, load_run


def run_labels(paths: list[Path]) -> list[str]:
    """Run directory names; parent/name where two runs share a name."""
    names = [p.resolve().name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [f"{p.resolve().parent.name}/{p.resolve().name}" for p in paths]


# --------------------------------------------------------------------------------------- drawing


def _smooth(y: np.ndarray) -> np.ndarray:
    """Trailing moving average over ~2% of the points: per-step values are noisy."""
    window = max(1, len(y) // 50)
    if window == 1:
        return y
    cumulative = np.cumsum(np.insert(y, 0, 0.0))
    out = np.empty_like(y)
    out[window - 1:] = (cumulative[window:] - cumulative[:-window]) / window
    out[: window - 1] = cumulative[1:window] / np.arange(1, window)
    return out


def _no_data(ax: Any, what: str = "") -> None:
    ax.text(0.5, 0.5, f"no data{': ' + what if what else ''}", ha="center", va="center",
            transform=ax.transAxes, color="gray")


def _line(ax: Any, x: np.ndarray, y: np.ndarray, color: str, label: str | None, smooth: bool = True,
          **kwargs: Any) -> None:
    if smooth and len(y) > 50:
        ax.plot(x, y, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(x, _smooth(y), color=color, label=label, **kwargs)
    else:
        ax.plot(x, y, color=color, label=label, **kwargs)


def _curves(ax: Any, runs: list[Run], colors: list[str], key: str, x: str, title: str, xlabel: str,
            ylabel: str = "", smooth: bool = True) -> None:
    drawn = False
    for run, color in zip(runs, colors):
        xs, ys = run.series(key, x)
        if len(xs):
            _line(ax, xs, ys, color, run.name, smooth)
            drawn = True
    _finish(ax, drawn, title, xlabel, ylabel or key, key)


def _finish(ax: Any, drawn: bool, title: str, xlabel: str, ylabel: str, missing: str = "") -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if drawn:
        ax.grid(True, alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=8)
    else:
        _no_data(ax, missing)


def _figure(rows: int, cols: int, title: str) -> tuple[Any, np.ndarray]:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    fig.suptitle(title)
    return fig, axes


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reward(runs: list[Run], colors: list[str], out: Path) -> Path:
    fig, axes = _figure(1, 2, "training reward (mean over each step's samples)")
    _curves(axes[0, 0], runs, colors, "reward/mean", "samples", "reward over samples", "samples consumed", "reward/mean")
    _curves(axes[0, 1], runs, colors, "reward/mean", "time/wall_s", "reward over wall-clock", "training wall-clock (s)",
            "reward/mean")
    return _save(fig, out / "reward.png")


def plot_eval(runs: list[Run], colors: list[str], out: Path) -> Path:
    fig, axes = _figure(1, 2, "held-out accuracy (solid: sampled, dashed: greedy)")
    for col, (x_key, xlabel) in enumerate((("samples", "samples consumed"), ("time/wall_s", "training wall-clock (s)"))):
        ax, drawn = axes[0, col], False
        for run, color in zip(runs, colors):
            for key, style in (("eval/accuracy", "-o"), ("eval/greedy_accuracy", "--s")):
                points = []
                for record in run.evals:
                    x = record.get(x_key)
                    if not is_number(x):
                        x = run.at_step(int(record.get("step", 0)), x_key)
                    if is_number(record.get(key)) and x is not None:
                        points.append((x, record[key]))
                if points:
                    xs, ys = zip(*sorted(points))
                    ax.plot(xs, ys, style, color=color, label=run.name if key == "eval/accuracy" else None)
                    drawn = True
        _finish(ax, drawn, f"held-out accuracy over {xlabel.split(' (')[0]}", xlabel, "accuracy", "eval/accuracy")
    return _save(fig, out / "eval_accuracy.png")


def plot_staleness(runs: list[Run], colors: list[str], out: Path) -> Path:
    fig, axes = _figure(1, 3, "staleness (policy versions between sampling and training)")
    _curves(axes[0, 0], runs, colors, "staleness/mean", "step", "mean staleness per step", "learner step",
            "staleness/mean")
    ax, drawn = axes[0, 1], False
    for run, color in zip(runs, colors):
        xs, ys = run.series("staleness/max", "step")
        if len(xs):
            ax.step(xs, ys, where="post", color=color, label=run.name)
            drawn = True
    _finish(ax, drawn, "max staleness per step", "learner step", "staleness/max", "staleness/max")

    ax, drawn = axes[0, 2], False
    histograms = [(run, color, (run.summary.get("learner") or {}).get("staleness_histogram") or {})
                  for run, color in zip(runs, colors)]
    histograms = [(run, color, h) for run, color, h in histograms if h]
    if histograms:
        values = sorted({int(k) for _, _, h in histograms for k in h})
        width = 0.8 / len(histograms)
        for i, (run, color, histogram) in enumerate(histograms):
            total = sum(histogram.values()) or 1
            heights = [histogram.get(str(v), 0) / total for v in values]
            ax.bar(np.arange(len(values)) + (i - (len(histograms) - 1) / 2) * width, heights, width=width,
                   color=color, label=run.name)
        ax.set_xticks(np.arange(len(values)), [str(v) for v in values])
        drawn = True
    _finish(ax, drawn, "staleness of consumed groups (summary.json)", "staleness", "fraction of groups",
            "learner.staleness_histogram")
    return _save(fig, out / "staleness.png")


def plot_correction(runs: list[Run], colors: list[str], out: Path) -> Path:
    """Every is/* and mismatch/* key, one panel each: rollout IS weights and train/rollout mismatch."""
    keys: dict[str, None] = {}
    for run in runs:
        for key in run.keys("is/") + run.keys("mismatch/"):
            keys[key] = None
    names = list(keys) or ["is/*, mismatch/*"]
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = _figure(rows, cols, "rollout importance weights (is/*) and rollout/training mismatch (mismatch/*)")
    for index, ax in enumerate(axes.flat):
        if index >= len(names):
            ax.axis("off")
            continue
        if not keys:
            _finish(ax, False, names[index], "learner step", "", "no is/ or mismatch/ keys")
            continue
        _curves(ax, runs, colors, names[index], "step", names[index], "learner step", names[index])
    return _save(fig, out / "is_mismatch.png")


def plot_throughput(runs: list[Run], colors: list[str], out: Path) -> Path:
    fig, axes = _figure(1, 3, "throughput and idle time")
    _curves(axes[0, 0], runs, colors, "perf/samples_per_s", "time/wall_s", "learner samples/s (per step)",
            "training wall-clock (s)", "samples/s")

    # Learner idle: the share of each step spent waiting for groups (and for lagging generators).
    ax, drawn = axes[0, 1], False
    for run, color in zip(runs, colors):
        points = []
        for record in run.steps:
            step_s = record.get("time/step_s")
            waits = [record[k] for k in ("time/gen_wait_s", "time/ack_wait_s") if is_number(record.get(k))]
            if is_number(step_s) and step_s > 0 and waits:
                points.append((record.get("samples", 0), min(1.0, sum(waits) / step_s)))
        if points:
            xs, ys = map(np.asarray, zip(*points))
            _line(ax, xs, ys, color, f"{run.name} learner")
            drawn = True
        # Generator idle: waits for tickets, weight loads and full-queue waits reported per step.
        points = []
        for record in run.steps:
            step_s, idle = record.get("time/step_s"), record.get("time/gen_idle_s")
            if is_number(step_s) and step_s > 0 and is_number(idle):
                points.append((record.get("samples", 0), min(1.0, idle / (step_s * run.num_generators))))
        if points:
            xs, ys = map(np.asarray, zip(*points))
            _line(ax, xs, ys, color, f"{run.name} generators", linestyle="--")
            drawn = True
    if drawn:
        ax.set_ylim(-0.02, 1.02)
    _finish(ax, drawn, "idle fraction (solid: learner, dashed: generators)", "samples consumed", "fraction of time",
            "time/gen_wait_s, time/step_s")

    # Where generator time went over the whole run (summary.json: generators' gen_time/*).
    ax, drawn = axes[0, 2], False
    bars: list[tuple[str, str, dict[str, float]]] = []
    for run, color in zip(runs, colors):
        for i, generator in enumerate(run.summary.get("generators") or []):
            phases = {k.removeprefix("gen_time/").removesuffix("_s"): float(v)
                      for k, v in generator.items() if k.startswith("gen_time/") and is_number(v)}
            if phases:
                label = run.name if len(run.summary["generators"]) == 1 else f"{run.name} g{i}"
                bars.append((label, color, phases))
    if bars:
        phases_all = list(dict.fromkeys(p for _, _, phases in bars for p in phases))
        import matplotlib.pyplot as plt

        palette = plt.get_cmap("tab10")
        bottoms = np.zeros(len(bars))
        for j, phase in enumerate(phases_all):
            fractions = np.asarray([phases.get(phase, 0.0) / (sum(phases.values()) or 1.0) for _, _, phases in bars])
            ax.bar(np.arange(len(bars)), fractions, bottom=bottoms, color=palette(j % 10), label=phase)
            bottoms += fractions
        ax.set_xticks(np.arange(len(bars)), [label for label, _, _ in bars], rotation=20, fontsize=8)
        drawn = True
    _finish(ax, drawn, "generator time by phase (summary.json)", "", "fraction of generator time",
            "summary generators gen_time/*")
    return _save(fig, out / "throughput.png")


AUDIT_REASONS = ("dropped_stale", "unheld", "filtered", "rejected", "lost", "given_back")  # asyncgrpo/queue/audit.py


def _audit_max_ks(run: Run) -> float | None:
    """log.audit_max_ks of the run's config.yaml (None without one, or from before the audit)."""
    try:
        from omegaconf import OmegaConf

        return float(OmegaConf.load(run.path / "config.yaml").log.audit_max_ks)
    except Exception:  # noqa: BLE001 - no threshold line is all it costs
        return None


def _sampled_against_trained(ax: Any, runs: list[Run], colors: list[str], keys: list[str], title: str,
                             ylabel: str) -> None:
    """Each of `keys` (an audit/sampled_* key) over steps, dashed, beside its audit/trained_* twin, solid."""
    drawn = False
    for run, color in zip(runs, colors):
        for key in keys:
            for side, style in (("sampled", "--"), ("trained", "-")):
                xs, ys = run.series(key.replace("sampled", side), "step")
                if len(xs):
                    label = f"{run.name} {side}" if key == keys[0] else None
                    ax.plot(xs, ys, style, color=color, label=label)
                    drawn = True
    _finish(ax, drawn, title, "learner step", ylabel, keys[0])


def plot_audit(runs: list[Run], colors: list[str], out: Path) -> Path:
    """The trained-vs-sampled audit (audit/*, over the run so far at each step): completion-length
    quantiles and mean reward, sampled (dashed) against trained (solid); the KS distances against
    log.audit_max_ks; the groups not trained, by reason."""
    fig, axes = _figure(1, 4, "trained against sampled groups (audit/*: over the run so far)")
    _sampled_against_trained(axes[0, 0], runs, colors, [f"audit/sampled_length_p{q}" for q in (50, 10, 90)],
                             "group mean completion length p10/p50/p90", "tokens")
    _sampled_against_trained(axes[0, 1], runs, colors, ["audit/sampled_reward_mean"],
                             "group mean reward (prompt difficulty)", "mean of group mean rewards")
    ax, drawn = axes[0, 2], False
    for run, color in zip(runs, colors):
        for key, style in (("audit/ks_length", "-"), ("audit/ks_reward", ":")):
            xs, ys = run.series(key, "step")
            if len(xs):
                ax.plot(xs, ys, style, color=color, label=f"{run.name} {key.split('_')[-1]}")
                drawn = True
        threshold = _audit_max_ks(run) if drawn else None
        if threshold is not None:
            ax.axhline(threshold, color=color, alpha=0.4, linestyle="--")
    _finish(ax, drawn, "KS distance, sampled vs trained (dashed: log.audit_max_ks)", "learner step", "KS distance",
            "audit/ks_length")
    ax, drawn = axes[0, 3], False
    import matplotlib.pyplot as plt

    palette = plt.get_cmap("tab10")
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        for j, reason in enumerate(AUDIT_REASONS):
            xs, ys = run.series(f"audit/not_trained/{reason}", "step")
            if len(xs) and ys.max() > 0:
                ax.plot(xs, ys, styles[i % len(styles)], color=palette(j), label=f"{run.name} {reason}")
                drawn = True
    _finish(ax, drawn, "groups not trained, by reason (cumulative)", "learner step", "groups",
            "audit/not_trained/<reason> (all 0, or absent)")
    return _save(fig, out / "audit.png")


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> list[Path]:
    """Write the figures for one run (or an overlay of several); returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training machine
    import matplotlib.pyplot as plt

    paths = [Path(d) for d in run_dirs]
    if not paths:
        raise ValueError("no run directory given")
    runs = [load_run(path, label) for path, label in zip(paths, run_labels(paths))]
    for run in runs:
        if run.skipped_lines:
            lines = f"{run.skipped_lines} line{'s' if run.skipped_lines != 1 else ''}"
            print(f"[plot] {run.path / 'metrics.jsonl'}: {lines} that are not step records skipped", file=sys.stderr)
    out = Path(out_dir) if out_dir else (paths[0] / "plots" if len(paths) == 1 else Path("plots_compare"))
    out.mkdir(parents=True, exist_ok=True)
    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color") or ["C0"]
    colors = [cycle[i % len(cycle)] for i in range(len(runs))]
    with plt.rc_context({"font.size": 9}):
        return [plot(runs, colors, out) for plot in
                (plot_reward, plot_eval, plot_staleness, plot_correction, plot_throughput, plot_audit)]
