"""Learner step time, tokens/s and peak memory per rank, at world size 1 and 2 (CPU, gloo, FSDP2).

Each world size runs as real processes (one per rank, one torch thread each) on the same cached
groups, so only the learner is timed: collate, broadcast to the ranks, forward/backward over
micro-batches, gradient reduce-scatter, AdamW step and the full-state-dict gather of the weight
push (published by rank 0; nobody subscribes). The tiny model of the embedded default; two
shapes: the default task's (16 groups x 8 samples, 6-token prompts, up to 5-token completions) and
longer completions (24 tokens, filling the model's 32-position context). Tokens are completion
tokens (the ones the loss is on); "train" is forward/backward/optimizer, the rest of a step is
collate + broadcast and the weight gather.

Prints a table, then, last, one JSON line. Run: `.venv/bin/python -m tools.bench_learner`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

from tools import check_overrides, list_type, load_config, nonnegative_int, positive_int

SHAPES = {"default": (6, 5), "long": (8, 24)}  # prompt tokens, max completion tokens
GROUPS_PER_STEP, SAMPLES = 16, 8


def make_groups(prompt_len: int, max_completion: int, seed: int, groups_per_step: int = GROUPS_PER_STEP) -> list:
    from asyncgrpo.wire import ScoredGroup

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(groups_per_step):
        lengths = rng.integers(max(1, max_completion // 2), max_completion + 1, size=SAMPLES).astype(np.int32)
        total = int(lengths.sum())
        groups.append(ScoredGroup(
            generator_id=0, seq=g, prompt_id=g, prompt_tokens=rng.integers(3, 60, size=prompt_len).astype(np.int32),
            tokens=rng.integers(1, 60, size=total).astype(np.int32),
            logprobs=-rng.uniform(0.5, 5.0, size=total).astype(np.float32),
            versions=np.zeros(total, dtype=np.int32), lengths=lengths,
            rewards=rng.integers(0, 2, size=SAMPLES).astype(np.float32),
        ))
    return groups


def rank_main(rank: int, world_size: int, port: int, model_dir: str, steps: int, warmup: int, out: str,
              overrides: list[str], shapes: list[str], groups_per_step: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    from asyncgrpo.config import load
    from asyncgrpo.learner.learner import Learner
    from asyncgrpo.learner.rendezvous import join_spawner_store
    from asyncgrpo.runtime.timing import PhaseTimer

    join_spawner_store(port, rank, world_size, timedelta(seconds=120))
    cfg = load(["learner.warmup_steps=0", *overrides])
    learner = Learner.from_config(cfg, model_dir, rank=rank, world_size=world_size)
    results = {}
    try:
        for shape in shapes:
            prompt_len, max_completion = SHAPES[shape]
            batches = [make_groups(prompt_len, max_completion, seed=s, groups_per_step=groups_per_step) for s in range(4)]
            times, train_times, tokens = [], [], 0
            for i in range(warmup + steps):
                timer = PhaseTimer()
                start = time.perf_counter()
                metrics = learner.train_on(batches[i % len(batches)], timer)
                if i >= warmup:
                    times.append(time.perf_counter() - start)
                    train_times.append(timer.seconds["train"])
                    tokens += int(metrics["perf/tokens"])
            results[shape] = {"step_s": statistics.median(times), "mean_step_s": statistics.fmean(times),
                              "train_s": statistics.median(train_times),
                              "tokens_per_step": tokens / steps, "tokens_per_s": tokens / sum(times)}
    finally:
        learner.close()
        dist.destroy_process_group()  # joined above, not by the learner
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def run(world_size: int, model_dir: str, steps: int, warmup: int, overrides: list[str], shapes: list[str],
        groups_per_step: int) -> dict:
    import torch.multiprocessing as mp

    from asyncgrpo.learner.rendezvous import spawner_store

    store = spawner_store(timedelta(seconds=120))  # held until the ranks are done
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(world_size, store.port, model_dir, steps, warmup, out, overrides, shapes, groups_per_step),
                           nprocs=world_size, join=True, start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]
    return {"world_size": world_size, **{shape: ranks[0][shape] for shape in shapes},
            "peak_rss_mib_per_rank": [round(r["peak_rss_mib"], 1) for r in ranks]}


def build_model_dir(size: str, model_dir: Path) -> None:
    """The model the ranks load: the embedded tiny one, or a random-weight shape of tools.bench_push."""
    if size != "tiny":
        import subprocess

        subprocess.run([sys.executable, "-c", f"from pathlib import Path; from tools.bench_push import build; "
                        f"build({size!r}, Path({str(model_dir)!r}))"], check=True)
        return
    from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
    from asyncgrpo.models.tokenizer import build_char_tokenizer
    from asyncgrpo.schema import ModelConfig

    tokenizer = build_char_tokenizer()
    save_model(build_model(TinyModelSpec.from_config(ModelConfig()), tokenizer, seed=0), tokenizer, model_dir)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tools.bench_push import model_sizes

    parser = argparse.ArgumentParser(prog="python -m tools.bench_learner", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=40, help="timed steps per shape")
    parser.add_argument("--warmup", type=nonnegative_int, default=5)
    parser.add_argument("--world-sizes", type=list_type(positive_int), default="1,2")
    parser.add_argument("--size", default="tiny", choices=model_sizes(),
                        help="tiny (the embedded default's model) or a random-weight shape of tools.bench_push "
                             "(100M, qwen2.5-0.5b), built in a child process so its memory is not counted")
    parser.add_argument("--shapes", type=list_type(choices=SHAPES), default=",".join(SHAPES),
                        help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--groups", type=positive_int, default=GROUPS_PER_STEP,
                        help=f"groups of {SAMPLES} samples per step")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. learner.micro_batch_tokens=256 "
                                                     "or learner.lora.rank=16")
    args = parser.parse_args(argv)
    check_overrides(parser, args.overrides)
    load_config(parser, ["learner.warmup_steps=0", *args.overrides])  # as each rank will (rank_main)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    with tempfile.TemporaryDirectory() as model_dir:
        build_model_dir(args.size, Path(model_dir))
        shapes = args.shapes
        results = [run(w, model_dir, args.steps, args.warmup, args.overrides, shapes, args.groups)
                   for w in args.world_sizes]

    print(f"{'world size':>10} {'shape':>8} {'tokens/step':>12} {'step ms (median)':>17} {'of which train ms':>18} "
          f"{'tokens/s':>9} {'peak RSS per rank (MiB)':>24}")
    for result in results:
        for shape in shapes:
            r = result[shape]
            print(f"{result['world_size']:>10} {shape:>8} {r['tokens_per_step']:>12.0f} {r['step_s'] * 1000:>17.1f} "
                  f"{r['train_s'] * 1000:>18.1f} {r['tokens_per_s']:>9.0f} {', '.join(f'{m:.0f}' for m in result['peak_rss_mib_per_rank']):>24}")
    print(json.dumps({"bench": "learner", "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
                      "results": results}))


if __name__ == "__main__":
    main()
