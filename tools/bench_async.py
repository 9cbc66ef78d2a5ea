"""Async vs sync GRPO throughput, side by side in one run on one machine.

    .venv/bin/python tools/bench_async.py                      # 300 learner steps per mode
    .venv/bin/python tools/bench_async.py --steps 100 --etas 0,2

Same model, task, batch sizes and number of learner steps for every mode:
1. the limits, measured alone with the same actors and core pinning as a run:
   - generation alone: a generator generates and scores groups with no learner;
   - training alone: the learner trains (and pushes weights) on those cached groups, no waiting.
   With T_gen and T_train the seconds per sample of each, a perfect pipeline runs at
   1 / max(T_gen, T_train) samples/s, and the best possible speed-up over an ideal synchronous
   loop is overlap_limit = (T_gen + T_train) / max(T_gen, T_train).
2. `asyncgrpo train` with train.max_staleness in --etas. Synchronous GRPO (eta 0) runs in two
   configurations and the faster counts as the baseline: the default pinning (generator core 0,
   learner core 1) and "learner on both cores" (the learner gets 2 threads on both cores, since
   vLLM idles while the learner trains).

Prints a table, then, last, one JSON line:
  speedup_vs_sync    best async samples/s / best sync samples/s
  overlap_limit      (T_gen + T_train) / max(T_gen, T_train)
  fraction_of_limit  speedup_vs_sync / overlap_limit
  fraction_of_ideal_async  best async samples/s / (1 / max(T_gen, T_train)): how close async comes
                     to a perfect pipeline of the two measured stages
  learner_idle_frac  at eta 2 (or the largest async eta run)
  accuracy_by_staleness  eta -> final held-out sampled accuracy (greedy in accuracy_greedy_by_staleness)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from asyncgrpo.config import load
from asyncgrpo.learner.actor import LearnerActor
from asyncgrpo.rollout.generator import GeneratorActor
from asyncgrpo.schema import Config
from asyncgrpo.wire import Message, ScoredGroup, decode_group, encode_group


class FrameSink:
    """A generator's sink with no learner behind it: keeps each group's encoded frames (what the
    learner would have received), drops acknowledgements and heartbeats, never blocks."""

    def __init__(self) -> None:
        self.frames: list[list[bytes]] = []
        self.tokens = 0

    def try_send(self, message: Message, timeout_s: float) -> bool:
        if isinstance(message, ScoredGroup):
            self.frames.append([bytes(frame) for frame in encode_group(message)])
            self.tokens += int(message.tokens.size)
        return True

    def close(self) -> None:
        pass


class BenchGenerator(GeneratorActor):
    """Generation alone: the run's generator (same engine, scorer and cores), with no throttle and
    its groups kept as frames instead of sent; the learner can then train on them alone."""

    def __init__(self, cfg: Config, model_dir: str, endpoints: dict[str, str], quota_per_step: int,
                 cores: list[int]) -> None:
        super().__init__(cfg, 0, model_dir, endpoints["groups"], endpoints["weights"], quota_per_step, cores)
        self.sink.close()  # nothing goes to the learner
        self.sink = FrameSink()

    def generate_alone(self, num_groups: int) -> dict[str, Any]:
        """Generate and score `num_groups` groups, one vLLM call's worth at a time; the timing and the frames."""
        sink = self.sink
        assert isinstance(sink, FrameSink)
        sink.frames, sink.tokens = [], 0
        start = time.perf_counter()
        while len(sink.frames) < num_groups:
            # No throttle: the only limit is the groups still wanted (a dropped group is replaced).
            problems = self._take_problems(num_groups - len(sink.frames))
            if not problems:
                raise RuntimeError(f"the training data ran out after {len(sink.frames)} of {num_groups} groups")
            prompts = self._tokenize(problems)
            completions = self._generate(prompts)
            self._send_scored(self._submit(problems, prompts, completions))
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "groups": num_groups, "samples": num_groups * self.cfg.rollout.samples_per_prompt,
                "tokens": sink.tokens, "frames": sink.frames}


class BenchLearner(LearnerActor):
    """Training alone: the run's learner rank, fed cached groups instead of its queue."""

    def train_alone(self, frames: list[list[bytes]], num_steps: int) -> dict[str, float]:
        """`num_steps` steps on cached groups (no queue, no waiting), pushes included.

        Each group is relabelled with the current version, so staleness is 0 as in a sync run.
        """
        groups = [decode_group(f) for f in frames]
        per_step = self.cfg.train.groups_per_step
        seconds = 0.0
        samples = tokens = 0
        for step in range(num_steps):
            batch = [groups[(step * per_step + i) % len(groups)] for i in range(per_step)]
            for group in batch:
                group.versions = np.full_like(group.versions, self.version)
            start = time.perf_counter()
            metrics = self.train_on(batch)
            seconds += time.perf_counter() - start
            samples += int(metrics["perf/samples"])
            tokens += int(metrics["perf/tokens"])
        return {"seconds": seconds, "steps": num_steps, "samples": samples, "tokens": tokens}


def measure_limits(cfg: Config, model_dir: str, steps: int) -> dict[str, float]:
    """Seconds per sample of generation alone and of training alone, on the run's actors and cores."""
    import ray

    from asyncgrpo.resources import plan_cores
    from asyncgrpo.train import ACTOR_ENV

    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": ACTOR_ENV})
    try:
        generator_cores, learner_cores = plan_cores(1, 1, cfg.rollout.cpu_cores, cfg.learner.cpu_cores)
        learner = ray.remote(BenchLearner).options(num_cpus=1).remote(
            cfg, model_dir, 0, 1, "127.0.0.1", None, learner_cores[0], None)
        # The generator connects to the learner's sockets as in a run (and hears its weight pushes),
        # but sends nothing.
        endpoints = ray.get(learner.endpoints.remote(), timeout=cfg.wire.startup_timeout_s)
        quota = cfg.train.groups_per_step
        generator = ray.remote(BenchGenerator).options(num_cpus=1).remote(
            cfg, model_dir, endpoints, quota, generator_cores[0])
        ray.get(generator.ready.remote(), timeout=cfg.wire.startup_timeout_s)
        ray.get(generator.generate_alone.remote(quota))  # warm-up: first calls compile and allocate
        gen = ray.get(generator.generate_alone.remote(steps * quota), timeout=cfg.wire.startup_timeout_s)
        frames = gen.pop("frames")
        ray.get(learner.train_alone.remote(frames, 3))  # warm-up
        learn = ray.get(learner.train_alone.remote(frames, steps), timeout=cfg.wire.startup_timeout_s)
        ray.kill(generator)
        ray.kill(learner)
    finally:
        ray.shutdown()
    t_gen = gen["seconds"] / gen["samples"]
    t_train = learn["seconds"] / learn["samples"]
    return {
        "gen_alone_samples_per_s": 1 / t_gen,
        "gen_alone_tokens_per_s": gen["tokens"] / gen["seconds"],
        "train_alone_samples_per_s": 1 / t_train,
        "gen_s_per_step": gen["seconds"] / steps,
        "train_s_per_step": learn["seconds"] / steps,
        "overlap_limit": (t_gen + t_train) / max(t_gen, t_train),
        "ideal_async_samples_per_s": 1 / max(t_gen, t_train),
        "ideal_sync_samples_per_s": 1 / (t_gen + t_train),
    }


def run_mode(label: str, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    from asyncgrpo.train import train

    slug = "".join(c if c.isalnum() else "_" for c in label)
    cfg = load([*overrides, f"run_dir={out_dir / slug}", "progress=false"])
    print(f"[bench_async] {label}: asyncgrpo train {' '.join(overrides)}", file=sys.stderr, flush=True)
    summary = train(cfg)
    learner, generators = summary["learner"], summary["generators"]
    histogram = {int(k): v for k, v in learner["staleness_histogram"].items()}
    groups = sum(histogram.values()) or 1
    generated_tokens = sum(g["gen/tokens_generated"] for g in generators)
    return {
        "mode": label,
        "eta": cfg.train.max_staleness,
        "steps": summary["steps"],
        "samples": summary["samples"],
        "train_s": summary["train_s"],
        "samples_per_s": summary["samples_per_s"],
        "gen_tokens_per_s": generated_tokens / summary["train_s"],
        "learner_idle_frac": learner["idle_frac"],
        "generator_idle_frac": sum(g["gen/idle_frac"] for g in generators) / len(generators),
        "staleness_mean": sum(k * v for k, v in histogram.items()) / groups,
        "staleness_max": max(histogram),
        "dropped_stale": summary.get("groups_dropped_stale", 0),
        "accuracy_start": summary.get("eval_accuracy_start"),
        "accuracy_end": summary.get("eval_accuracy_end"),
        "greedy_accuracy_end": summary.get("eval_greedy_accuracy_end"),
    }


def print_table(limits: dict[str, float], rows: list[dict[str, Any]], baseline: float) -> None:
    print()
    print(f"limits (measured alone, {limits['gen_s_per_step'] * 1e3:.0f} ms generating and "
          f"{limits['train_s_per_step'] * 1e3:.0f} ms training per step):")
    print(f"  generation alone  {limits['gen_alone_samples_per_s']:8.0f} samples/s")
    print(f"  training alone    {limits['train_alone_samples_per_s']:8.0f} samples/s")
    print(f"  ideal sync        {limits['ideal_sync_samples_per_s']:8.0f} samples/s   (1 / (T_gen + T_train))")
    print(f"  ideal async       {limits['ideal_async_samples_per_s']:8.0f} samples/s   (1 / max(T_gen, T_train)), "
          f"overlap limit {limits['overlap_limit']:.2f}x")
    print()
    header = (f"{'mode':<18} {'eta':>3} {'samples/s':>9} {'vs sync':>7} {'of ideal':>8} {'gen tok/s':>9} "
              f"{'learner idle':>12} {'gen idle':>8} {'stale mean':>10} {'max':>3} {'acc start':>9} {'acc end':>7} "
              f"{'greedy':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['mode']:<18} {r['eta']:>3} {r['samples_per_s']:>9.0f} {r['samples_per_s'] / baseline:>6.2f}x "
              f"{r['samples_per_s'] / limits['ideal_async_samples_per_s']:>7.0%} {r['gen_tokens_per_s']:>9.0f} "
              f"{r['learner_idle_frac']:>12.1%} {r['generator_idle_frac']:>8.1%} {r['staleness_mean']:>10.2f} "
              f"{r['staleness_max']:>3} {r['accuracy_start'] or 0:>9.3f} {r['accuracy_end'] or 0:>7.3f} "
              f"{r['greedy_accuracy_end'] or 0:>6.3f}")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="learner steps per mode")
    parser.add_argument("--etas", default="0,1,2,4", help="max_staleness values (0 = synchronous)")
    parser.add_argument("--limit-steps", type=int, default=40, help="steps' worth of groups for the alone runs")
    parser.add_argument("--no-sync-both-cores", action="store_true", help="skip the sync run with the learner on both cores")
    parser.add_argument("--out", default="runs/bench_async")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every mode, e.g. seed=1")
    args = parser.parse_args()

    from asyncgrpo.train import prepare_model, resolve_device

    etas = [int(e) for e in args.etas.split(",")]
    common = [*args.overrides, f"train.max_steps={args.steps}"]
    out_dir = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    base = load([*common, f"run_dir={out_dir}/limits"])
    base.device = resolve_device(base.device)
    # The alone runs push over zmq whatever the modes use: the collective backend needs every
    # generator in its group, and training alone has none.
    base.weights.backend = "zmq"
    model_dir = prepare_model(base)
    limits = measure_limits(base, model_dir, args.limit_steps)
    print(f"[bench_async] limits: {json.dumps(limits)}", file=sys.stderr, flush=True)

    rows = []
    for eta in etas:
        rows.append(run_mode("sync" if eta == 0 else f"async eta={eta}", [*common, f"train.max_staleness={eta}"], out_dir))
        if eta == 0 and not args.no_sync_both_cores:
            rows.append(run_mode("sync, 2-core lrn", [*common, "train.max_staleness=0", "learner.cpu_cores=0-1",
                                                      "learner.torch_threads=2"], out_dir))
    sync_rows = [r for r in rows if r["eta"] == 0]
    async_rows = [r for r in rows if r["eta"] > 0]
    baseline = max((r["samples_per_s"] for r in sync_rows), default=float("nan"))
    print_table(limits, rows, baseline)
    best_async = max(async_rows, key=lambda r: r["samples_per_s"]) if async_rows else None
    at_eta2 = next((r for r in async_rows if r["eta"] == 2), async_rows[-1] if async_rows else None)
    result = {
        "steps": args.steps,
        "speedup_vs_sync": best_async["samples_per_s"] / baseline if best_async and sync_rows else None,
        "overlap_limit": limits["overlap_limit"],
        # The speed-up over sync as a fraction of the overlap limit, and the async samples/s as a
        # fraction of a perfect pipeline of the two stages measured alone.
        "fraction_of_limit": (best_async["samples_per_s"] / baseline / limits["overlap_limit"]
                              if best_async and sync_rows else None),
        "fraction_of_ideal_async": (best_async["samples_per_s"] / limits["ideal_async_samples_per_s"]
                                    if best_async else None),
        "learner_idle_frac": at_eta2["learner_idle_frac"] if at_eta2 else None,
        "accuracy_by_staleness": {str(r["eta"]): r["accuracy_end"] for r in rows if r["mode"] != "sync, 2-core lrn"},
        "accuracy_greedy_by_staleness": {str(r["eta"]): r["greedy_accuracy_end"] for r in rows
                                         if r["mode"] != "sync, 2-core lrn"},
        "sync_baseline_mode": max(sync_rows, key=lambda r: r["samples_per_s"])["mode"] if sync_rows else None,
        "best_async_eta": best_async["eta"] if best_async else None,
        "limits": limits,
        "modes": rows,
        "run_dir": str(out_dir),
    }
    (out_dir / "bench_async.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
