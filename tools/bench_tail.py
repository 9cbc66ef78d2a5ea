"""Long completions: the continuous generator against the call-batched one and synchronous GRPO, on
the long-tail task, every mode repeated, the repeats interleaved, every figure a median with its
spread.

    .venv/bin/python -m tools.bench_tail                                  # 30 steps, 3 repeats
    .venv/bin/python -m tools.bench_tail --steps 8 --repeats 1 --sync-configs default   # a smoke run

Modes. The long-tail preset (configs/longtail.yaml: completions of 20 to 200 tokens), the same model,
seed and number of learner steps in every run:
- sync: train.max_staleness=0 in each pinning of tools/bench_async.py (--sync-configs); the
  synchronous baseline is the one with the highest median samples/s.
- call-batched: train.max_staleness=--eta, rollout.continuous=false (a call's prompts go into an
  empty engine, so each call waits for its slowest sample), in-flight loads on.
- continuous: train.max_staleness=--eta, rollout.continuous=true (the engine is refilled as
  sequences finish, each group sent as it completes), in-flight loads on.
Interleaved as tools/bench_async.py does: repeat r runs every mode once, rotated by r.

Per mode: samples/s and completion tokens/s; engine occupancy (gen/engine_occupancy: mean running
sequences per engine step over rollout.max_running_seqs, i.e. while generating); the learner's idle
share; the staleness mean and the per-token age histogram (staleness/tokens_age_*, means over the
run's steps); held-out sampled accuracy at the end. x sync and x batched are median samples/s over
the baseline's, with the per-repeat ratios' range.

Prints a table, then, last, one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from tools.bench_async import (
    SYNC_CONFIGS,
    Mode,
    add_run_arguments,
    best_sync_mode,
    check_modes,
    check_run_arguments,
    fmt_spread,
    parse_sync_configs,
    planned_cores,
    run_benchmark,
    run_figures,
    speedup,
    spread,
    sync_modes,
    train_run,
)
from tools import load_config

BATCHED, CONTINUOUS = "call-batched", "continuous"
TOKEN_AGES = ("0", "1", "2", "3", "4plus")
KEYS = ("samples_per_s", "tokens_per_s", "engine_occupancy", "learner_idle_frac", "staleness_mean",
        "accuracy_end", *(f"tokens_age_{age}" for age in TOKEN_AGES))


def async_modes(eta: int) -> list[Mode]:
    inflight = "rollout.inflight_updates=true"
    return [Mode(BATCHED, eta, (f"train.max_staleness={eta}", "rollout.continuous=false", inflight)),
            Mode(CONTINUOUS, eta, (f"train.max_staleness={eta}", "rollout.continuous=true", inflight))]


def tail_figures(summary: dict[str, Any], records: list[dict[str, Any]], groups_per_step: int) -> dict[str, Any]:
    """bench_async's figures of a run, and what the long tail adds: tokens/s, engine occupancy, the
    token age histogram."""
    records = [r for r in records if "perf/tokens" in r]  # the steps (the file also holds evaluations)
    figures = run_figures(summary, records, groups_per_step)
    train_s = summary["train_s"]
    tokens = sum(r["perf/tokens"] for r in records)
    occupancy = [g["gen/engine_occupancy"] for g in summary["generators"] if "gen/engine_occupancy" in g]
    ages = {f"tokens_age_{age}": statistics.fmean(r.get(f"staleness/tokens_age_{age}", 0.0) for r in records)
            for age in TOKEN_AGES} if records else {}
    return {**figures, "tokens_per_s": tokens / train_s if train_s > 0 else None,
            "engine_occupancy": statistics.fmean(occupancy) if occupancy else None, **ages}


def run_once(mode: Mode, repeat: int, common: list[str], out_dir: Path) -> dict[str, Any]:
    """One `asyncgrpo train --config-name longtail` run of `mode`."""
    summary, records, cfg, run_dir = train_run(mode, repeat, common, out_dir, "bench_tail", config_name="longtail")
    figures = tail_figures(summary, records, cfg.train.groups_per_step)
    return {"mode": mode.label, "eta": cfg.train.max_staleness, "repeat": repeat, **figures, "run_dir": str(run_dir)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-mode spreads and the speed-ups against the best sync mode and the call-batched generator."""
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_mode.setdefault(run["mode"], []).append(run)
    modes = {label: {"eta": group[0]["eta"], "runs": len(group), **{k: spread(r.get(k) for r in group) for k in KEYS}}
             for label, group in by_mode.items()}
    baseline = best_sync_mode(modes)
    for label, mode in modes.items():
        mode["speedup_vs_sync"] = speedup(by_mode[label], by_mode[baseline]) if baseline else None
        mode["speedup_vs_batched"] = speedup(by_mode[label], by_mode[BATCHED]) if BATCHED in by_mode else None
    return {"sync_baseline_mode": baseline, "modes": modes}


def print_table(result: dict[str, Any]) -> None:
    columns = [("mode", 22), ("samples/s", 19), ("tokens/s", 22), ("x sync", 17), ("x batched", 17),
               ("occupancy", 16), ("learner idle", 16), ("stale mean", 16), ("acc end", 19)]
    header = " ".join(f"{name:<{width}}" for name, width in columns)
    print(f"\n{header}\n{'-' * len(header)}")
    for label, m in result["modes"].items():
        cells = [label, fmt_spread(m["samples_per_s"], ",.0f"), fmt_spread(m["tokens_per_s"], ",.0f"),
                 fmt_spread(m["speedup_vs_sync"], ".2f"), fmt_spread(m["speedup_vs_batched"], ".2f"),
                 fmt_spread(m["engine_occupancy"], ".0%"), fmt_spread(m["learner_idle_frac"], ".1%"),
                 fmt_spread(m["staleness_mean"], ".2f"), fmt_spread(m["accuracy_end"], ".3f")]
        print(" ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, columns)))
    print("\ntoken ages (share of trained tokens sampled k versions before their step, median over repeats):")
    for label, m in result["modes"].items():
        ages = ", ".join(f"{age}: {fmt_spread(m[f'tokens_age_{age}'], '.0%')}" for age in TOKEN_AGES)
        print(f"  {label}: {ages}")
    print(f"median [min-max] over repeats; sync baseline: {result['sync_baseline_mode']}")
    for label, why in result["sync_skipped"].items():
        print(f"not run: {label}: {why}")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_tail", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, steps=30, out="runs/bench_tail")
    parser.add_argument("--sync-configs", type=parse_sync_configs, default=list(SYNC_CONFIGS),
                        help=f"which sync pinnings to run (default: all of {','.join(SYNC_CONFIGS)})")
    args = parser.parse_args(argv)
    common = check_run_arguments(parser, args)

    from asyncgrpo.driver.prepare import resolve_device

    base = load_config(parser, common, "longtail")
    generator_cores, learner_cores = planned_cores(parser, base)
    sync, skipped = sync_modes(args.sync_configs, resolve_device(base.device), generator_cores, learner_cores)
    modes = [*sync, *async_modes(args.eta)]
    check_modes(parser, modes, common, "longtail")
    return run_benchmark("bench_tail", modes, args.repeats, args.out,
                         lambda mode, repeat, out_dir: run_once(mode, repeat, common, out_dir),
                         lambda runs: {**summarize(runs), "sync_skipped": skipped}, print_table,
                         {"steps": args.steps, "eta": args.eta, "repeats": args.repeats})


if __name__ == "__main__":
    sys.exit(main())
