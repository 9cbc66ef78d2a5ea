"""What a LoRA run's generators pay for applying adapter pushes: merged in place against vLLM's LoRA
path, beside full fine-tuning, on the real CLI, every mode repeated, the repeats interleaved.

    .venv/bin/python -m tools.bench_lora                                  # 200 steps, 3 repeats
    .venv/bin/python -m tools.bench_lora --steps 30 --repeats 1           # a smoke run

Modes, on the embedded default (or any preset's model through the overrides), the same seed and
learner steps in every run, the asynchronous generator at train.max_staleness=--eta:
- full FT: learner.lora.rank=0, every push the whole model;
- LoRA merge: learner.lora.rank=--rank (alpha 2 x rank), adapter pushes merged into the engine's
  weights in place (rollout.lora_apply=merge, the default);
- LoRA vllm: the same adapters served through vLLM's LoRA path (rollout.lora_apply=vllm).
Interleaved as tools/bench_async.py does: repeat r runs every mode once, rotated by r.

Per mode: samples/s, the generator's busy time per learner step (T_gen: decoding dominates it),
generated tokens/s, a push's load time in the generator (gen/weight_load_s over gen/weight_loads:
the merge and copy, or the adapter's replacement), held-out sampled accuracy at the end; "x merge"
is samples/s over LoRA merge's of the same repeat (median and range of the per-repeat ratios).

Prints a table, then, last, one JSON line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

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

FULL, MERGE, VLLM = "full FT", "LoRA merge", "LoRA vllm"
KEYS = ("samples_per_s", "t_gen_s", "gen_tokens_per_s", "weight_load_ms", "accuracy_end")


def modes_for(rank: int, eta: int) -> list[Mode]:
    """Full fine-tuning, and LoRA of `rank` applied each way, all at max_staleness `eta`."""
    bound = f"train.max_staleness={eta}"
    lora = (f"learner.lora.rank={rank}", f"learner.lora.alpha={2 * rank}")
    return [Mode(FULL, eta, (bound,)),
            Mode(MERGE, eta, (bound, *lora, "rollout.lora_apply=merge")),
            Mode(VLLM, eta, (bound, *lora, "rollout.lora_apply=vllm"))]


def weight_load_ms(generators: list[dict[str, Any]]) -> float | None:
    """A push's mean load time in the generators (ms), None when none loaded one."""
    loads = sum(int(g.get("gen/weight_loads", 0)) for g in generators)
    return 1e3 * sum(float(g.get("gen/weight_load_s", 0.0)) for g in generators) / loads if loads else None


def run_once(mode: Mode, repeat: int, common: list[str], out_dir: Path) -> dict[str, Any]:
    """One `asyncgrpo train` run of `mode`: bench_async's figures and a push's load time."""
    summary, records, cfg, run_dir = train_run(mode, repeat, common, out_dir, "bench_lora")
    records = [r for r in records if "perf/tokens" in r]  # the steps (the file also holds evaluations)
    figures = run_figures(summary, records, cfg.train.groups_per_step)
    return {"mode": mode.label, "eta": cfg.train.max_staleness, "repeat": repeat, **figures,
            "weight_load_ms": weight_load_ms(summary["generators"]), "run_dir": str(run_dir)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-mode spreads, and each mode's samples/s against LoRA merge's, repeat by repeat."""
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_mode.setdefault(run["mode"], []).append(run)
    merge = by_mode.get(MERGE)
    return {"modes": {label: {"runs": len(group), **{k: spread(r.get(k) for r in group) for k in KEYS},
                              "vs_merge": speedup(group, merge) if merge and label != MERGE else None}
                      for label, group in by_mode.items()}}


def print_table(result: dict[str, Any]) -> None:
    columns = [("mode", 11), ("samples/s", 19), ("x merge", 17), ("T_gen ms", 14), ("tokens/s", 19),
               ("push load ms", 18), ("acc end", 19)]
    header = " ".join(f"{name:<{width}}" for name, width in columns)
    print(f"\n{header}\n{'-' * len(header)}")
    for label, m in result["modes"].items():
        cells = [label, fmt_spread(m["samples_per_s"], ",.0f"), fmt_spread(m["vs_merge"], ".2f"),
                 fmt_spread(m["t_gen_s"], ".1f", 1e3), fmt_spread(m["gen_tokens_per_s"], ",.0f"),
                 fmt_spread(m["weight_load_ms"], ".2f"), fmt_spread(m["accuracy_end"], ".3f")]
        print(" ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, columns)))
    print("median [min-max] over repeats; x merge: samples/s over LoRA merge's in the same repeat\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, steps=200, out="runs/bench_lora")
    parser.add_argument("--rank", type=int, default=8, help="the LoRA modes' learner.lora.rank (default: 8)")
    args = parser.parse_args(argv)
    common = check_run_arguments(parser, args)
    if args.rank < 1:
        parser.error("--rank must be at least 1")
    modes = modes_for(args.rank, args.eta)
    check_modes(parser, modes, common)
    return run_benchmark("bench_lora", modes, args.repeats, args.out,
                         lambda mode, repeat, out_dir: run_once(mode, repeat, common, out_dir),
                         summarize, print_table, {"steps": args.steps, "eta": args.eta, "repeats": args.repeats, "rank": args.rank})


if __name__ == "__main__":
    raise SystemExit(main())
