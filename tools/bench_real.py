"""Real model shapes end to end: the anatomy of a step on Qwen2.5-0.5B's shape (and its 2-layer cut).

    .venv/bin/python -m tools.bench_real                          # both shapes, 3 steps each
    .venv/bin/python -m tools.bench_real --shapes qwen2.5-0.5b-2l --steps 5 --new-tokens 256

For each shape: `asyncgrpo make-model` (random weights, a locally trained BPE tokenizer; cached under
--models), then `asyncgrpo train` on the GSM8K-format sample (tests/data) with chat-templated
prompts of about 100 tokens and completions of --new-tokens, synchronously (train.max_staleness=0),
so that a step's phases follow one another and add up:

    generation    the generator's vLLM calls (gen_time/generate_s)
    scoring       rewards, and waiting for them (gen_time/score_s + score_wait_s)
    transfer      the weight push: the learner's gather, copy and publish (time/push_s) and the
                  generator's assembly and load into vLLM (gen/weight_load_s)
    learner f/b   forward and backward over the step's micro-batches (time/train_s - time/optimizer_s)
    optimizer     gradient clipping, AdamW and the schedule (time/optimizer_s)
    idle          the learner waiting for groups (time/gen_wait_s + time/ack_wait_s), which in a
                  synchronous step is the generator's generation, scoring and load time seen from it

The first step is left out (compilation, allocation). Prints a table per shape (seconds per step and
share of the learner's step), tokens/s and peak memory per actor, then one JSON line.
Random weights: rewards are near zero and completions run to their budget; this measures machinery.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools import fresh_dir, list_type, positive_int

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "gsm8k_sample.jsonl"
TEMPLATE = ("{prompt}\\nSolve the problem step by step. Write the arithmetic of every step on its own line, "
            "check each intermediate result against the question, and explain briefly why each step is needed. "
            "Finish with the final answer as a number after ####.")


def make_model(shape: str, models: Path) -> Path:
    directory = models / shape
    if not (directory / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "make-model", shape, str(directory)], check=True)
    return directory


def run(shape: str, model_dir: Path, out: Path, args: argparse.Namespace) -> dict:
    run_dir = out / shape
    overrides = [
        f"run_dir={run_dir}", "progress=false", f"model.path={model_dir}", "task.name=gsm8k",
        f"data.train_files=[{DATA}]", "data.chat_template=true", f"data.prompt_template='{TEMPLATE}'",
        "task.eval_size=3", "eval.at_start=false", "eval.at_end=false", "train.export_at_end=false",
        f"model.max_positions={args.new_tokens + 192}", f"rollout.max_new_tokens={args.new_tokens}",
        f"rollout.samples_per_prompt={args.samples}", f"train.groups_per_step={args.groups}",
        f"train.max_steps={args.steps}", "train.steps_per_call=1", "train.max_staleness=0",
        f"learner.micro_batch_tokens={args.micro_batch_tokens}", "learner.warmup_steps=0",
        "rollout.kv_cache_gib=1", "log.samples_every_steps=0", "wire.timeout_s=1800",
        "reward.terms=[{name:letters,kind:format,pattern:'[a-z]'}]",
    ]
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "train", *overrides], check=True)
    wall = time.monotonic() - start
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss/pg" in r][1:]  # the first step compiles and allocates
    (gen,) = summary["generators"]
    num_steps = summary["steps"]

    def per_step(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in steps)

    step_s = per_step("time/step_s")
    phases = {
        # Generator totals over the run, per step (its first call included: a slight overestimate).
        "generation": gen["gen_time/generate_s"] / num_steps,
        "scoring": (gen.get("gen_time/score_s", 0.0) + gen.get("gen_time/score_wait_s", 0.0)) / num_steps,
        "transfer": per_step("time/push_s") + gen.get("gen/weight_load_s", 0.0) / num_steps,
        "learner f/b": per_step("time/train_s") - per_step("time/optimizer_s"),
        "optimizer": per_step("time/optimizer_s"),
        "idle": per_step("time/gen_wait_s") + per_step("time/ack_wait_s"),
    }
    return {
        "shape": shape,
        "parameters": summary["preflight"]["model"]["num_parameters"],
        "bytes_per_push": summary["preflight"]["push"]["bytes_per_push"],
        "chunks_per_push": summary["preflight"]["push"]["chunks_per_push"],
        "step_s": step_s,
        "phases_s": phases,
        "tokens_per_step": per_step("perf/tokens"),
        "tokens_per_s": per_step("perf/tokens") / step_s if step_s else 0.0,
        "learner_peak_rss_gib": summary["learner"]["peak_rss_mib"] / 1024,
        "generator_peak_rss_gib": gen["gen/peak_rss_mib"] / 1024,
        "estimated_gib": summary["preflight"]["memory_gib"],
        "probe_max_abs_diff": summary["probe"]["max_abs_diff_vs_learner"],
        "steps_measured": len(steps),
        "wall_s": wall,
    }


def print_table(row: dict) -> None:
    print(f"\n{row['shape']}: {row['parameters']:,} parameters, {row['bytes_per_push'] / 1e6:,.0f} MB per push in "
          f"{row['chunks_per_push']} chunks, {row['tokens_per_step']:,.0f} trained tokens per step")
    print(f"{'phase':<12} {'s/step':>8} {'share':>7}")
    for phase, seconds in row["phases_s"].items():
        print(f"{phase:<12} {seconds:>8.2f} {seconds / row['step_s']:>7.1%}")
    print(f"{'step':<12} {row['step_s']:>8.2f}")
    estimate = row["estimated_gib"]
    print(f"tokens/s {row['tokens_per_s']:,.0f}; peak RSS learner {row['learner_peak_rss_gib']:.1f} GiB "
          f"(estimated {estimate['learner_rank_gib']:.1f}), generator {row['generator_peak_rss_gib']:.1f} GiB "
          f"(estimated {estimate['generator_gib']:.1f}); vLLM vs learner log-probs {row['probe_max_abs_diff']:.1e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from asyncgrpo.models.shapes import SHAPES

    parser = argparse.ArgumentParser(prog="python -m tools.bench_real", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=list_type(choices=SHAPES), default="qwen2.5-0.5b-2l,qwen2.5-0.5b",
                        help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--steps", type=int, default=3,
                        help="learner steps per shape, at least 2 (the first is not measured)")
    parser.add_argument("--new-tokens", type=positive_int, default=256, help="rollout.max_new_tokens")
    parser.add_argument("--groups", type=positive_int, default=2, help="train.groups_per_step")
    parser.add_argument("--samples", type=positive_int, default=4, help="rollout.samples_per_prompt")
    parser.add_argument("--micro-batch-tokens", type=positive_int, default=1024)
    parser.add_argument("--models", default="runs/bench_real/models")
    parser.add_argument("--out", default="runs/bench_real", help="the runs go to a new OUT/<date-time> folder")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is not measured")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models, out = Path(args.models).resolve(), fresh_dir(Path(args.out).resolve())
    rows = [run(shape, make_model(shape, models), out, args) for shape in args.shapes]
    for row in rows:
        print_table(row)
    print(json.dumps({"shapes": rows, "settings": vars(args), "run_dir": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
