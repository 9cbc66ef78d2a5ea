"""Environment latency hidden by asynchrony: the calculator tool with an injected delay per call,
synchronous GRPO against the continuous asynchronous generator, every mode repeated, the repeats
interleaved, every figure a median with its spread.

    .venv/bin/python -m tools.bench_env                                   # 0, 50, 200 ms; 3 repeats
    .venv/bin/python -m tools.bench_env --steps 6 --repeats 1 --latencies-ms 0,200   # a smoke run

Modes. The calculator preset (configs/calculator.yaml: the policy calls [a*b], the environment
answers =value, the policy writes the product), the same model, seed and number of learner steps in
every run, env.latency_s added to every environment call (reset and step):
- sync <L> ms: train.max_staleness=0 (a step's groups are generated, tool calls included, before it
  trains; the next step's wait for them all).
- async <L> ms: train.max_staleness=--eta, rollout.continuous=true (other episodes decode while one
  waits on its tool; the learner trains meanwhile).
Interleaved as tools/bench_async.py does: repeat r runs every mode once, rotated by r.

Per mode: samples/s, the generators' env_wait share (gen_time/env_wait_s over their wall time),
engine occupancy, mean policy turns per episode, held-out sampled accuracy at the end. "keeps" is a
mode's median samples/s over the same kind's at 0 ms; "x sync" its samples/s over sync's at the same
latency (per-repeat ratios' range).

Prints a table, then, last, one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from tools import repeated
from tools.bench_async import (
    Mode,
    add_run_arguments,
    check_modes,
    check_run_arguments,
    fmt_spread,
    run_benchmark,
    run_figures,
    speedup,
    spread,
    train_run,
)

SYNC, ASYNC = "sync", "async"
KEYS = ("samples_per_s", "env_wait_frac", "engine_occupancy", "mean_episode_turns", "accuracy_end")


def modes_for(latencies_ms: list[int], eta: int) -> list[Mode]:
    modes = []
    for latency in latencies_ms:
        delay = f"env.latency_s={latency / 1000:g}"
        modes.append(Mode(f"{SYNC} {latency} ms", 0, ("train.max_staleness=0", delay)))
        continuous = (f"train.max_staleness={eta}", "rollout.continuous=true", delay)
        modes.append(Mode(f"{ASYNC} {latency} ms", eta, continuous))
    return modes


def env_figures(summary: dict[str, Any], records: list[dict[str, Any]], groups_per_step: int) -> dict[str, Any]:
    """bench_async's figures of a run, and what the environment adds: its wait share, occupancy, turns."""
    records = [r for r in records if "perf/tokens" in r]  # the steps (the file also holds evaluations)
    figures = run_figures(summary, records, groups_per_step)
    generators = summary["generators"]

    def mean_of(key: str) -> float | None:
        values = [g[key] for g in generators if key in g]
        return statistics.fmean(values) if values else None

    waits = [g.get("gen_time/env_wait_s", 0.0) / g["gen/wall_s"] for g in generators if g.get("gen/wall_s")]
    return {**figures, "env_wait_frac": statistics.fmean(waits) if waits else None,
            "engine_occupancy": mean_of("gen/engine_occupancy"),
            "mean_episode_turns": mean_of("gen/mean_episode_turns")}


def run_once(mode: Mode, repeat: int, common: list[str], out_dir: Path) -> dict[str, Any]:
    """One `asyncgrpo train --config-name calculator` run of `mode`."""
    summary, records, cfg, run_dir = train_run(mode, repeat, common, out_dir, "bench_env", config_name="calculator")
    figures = env_figures(summary, records, cfg.train.groups_per_step)
    kind, latency = mode.label.split(" ")[0], int(mode.label.split(" ")[1])
    return {"mode": mode.label, "kind": kind, "latency_ms": latency, "eta": cfg.train.max_staleness,
            "repeat": repeat, **figures, "run_dir": str(run_dir)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-mode spreads; each mode against its kind at 0 ms ("keeps") and against sync at its latency."""
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_mode.setdefault(run["mode"], []).append(run)
    modes = {}
    for label, group in by_mode.items():
        kind, latency = group[0]["kind"], group[0]["latency_ms"]
        zero, sync = by_mode.get(f"{kind} 0 ms"), by_mode.get(f"{SYNC} {latency} ms")
        modes[label] = {"kind": kind, "latency_ms": latency, "runs": len(group),
                        **{k: spread(r.get(k) for r in group) for k in KEYS},
                        "keeps_vs_0ms": speedup(group, zero) if zero else None,
                        "speedup_vs_sync": speedup(group, sync) if sync and kind != SYNC else None}
    return {"modes": modes}


def print_table(result: dict[str, Any]) -> None:
    columns = [("mode", 16), ("samples/s", 19), ("keeps", 17), ("x sync", 17), ("env wait", 16),
               ("occupancy", 16), ("turns", 14), ("acc end", 19)]
    header = " ".join(f"{name:<{width}}" for name, width in columns)
    print(f"\n{header}\n{'-' * len(header)}")
    for label, m in result["modes"].items():
        cells = [label, fmt_spread(m["samples_per_s"], ",.0f"), fmt_spread(m["keeps_vs_0ms"], ".0%"),
                 fmt_spread(m["speedup_vs_sync"], ".2f"), fmt_spread(m["env_wait_frac"], ".0%"),
                 fmt_spread(m["engine_occupancy"], ".0%"), fmt_spread(m["mean_episode_turns"], ".2f"),
                 fmt_spread(m["accuracy_end"], ".3f")]
        print(" ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, columns)))
    print("median [min-max] over repeats; keeps: samples/s over the same kind at 0 ms; x sync: over sync at "
          "the same latency\n")


def parse_latencies(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"latencies must be milliseconds >= 0, comma-separated, got {text!r}")
    if twice := repeated(values):  # two modes of one label ("sync 50 ms") would share one run folder
        raise argparse.ArgumentTypeError(f"latency {', '.join(twice)} ms given twice in {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_env", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, steps=20, out="runs/bench_env")
    parser.add_argument("--latencies-ms", type=parse_latencies, default=[0, 50, 200],
                        help="injected delay per environment step call, comma-separated (default: 0,50,200)")
    args = parser.parse_args(argv)
    common = check_run_arguments(parser, args)
    modes = modes_for(args.latencies_ms, args.eta)
    check_modes(parser, modes, common, "calculator")
    return run_benchmark("bench_env", modes, args.repeats, args.out,
                         lambda mode, repeat, out_dir: run_once(mode, repeat, common, out_dir),
                         summarize, print_table, {"steps": args.steps, "eta": args.eta, "repeats": args.repeats, "latencies_ms": args.latencies_ms})


if __name__ == "__main__":
    sys.exit(main())
