"""Async vs sync GRPO throughput: `asyncgrpo train` in several modes on one machine, each mode
repeated, the repeats interleaved, every figure a median with its spread.

    .venv/bin/python -m tools.bench_async                                     # 300 steps, etas 0,1,2,4, 3 repeats
    .venv/bin/python -m tools.bench_async --steps 30 --etas 0,2 --repeats 1   # a smoke run
    .venv/bin/python -m tools.bench_async --evals seed=1                      # held-out accuracy; overrides for every run

Modes. Same model, task, batch sizes, seed and number of learner steps in every run:
- async eta=k: train.max_staleness=k, for each k > 0 in --etas. The default max_staleness (the
  composed config's train.max_staleness, under the overrides given here) is always run: it is the
  headline.
- synchronous GRPO (eta 0) in each sensible pinning (--sync-configs). Generation and training
  alternate, so either stage may use the core the other leaves idle:
    sync                   the default pinning: the generator on its core, the learner on its own
    sync, learner 2 cores  the learner on both cores with 2 torch threads and 2 Ray CPUs
                           (learner.cpu_cores, learner.torch_threads, learner.num_cpus_per_rank);
                           vLLM on its core
    sync, vLLM 2 cores     the generator on both cores (rollout.cpu_cores) with 2 Ray CPUs
                           (rollout.num_cpus_per_generator); vLLM on CPU then runs 2 threads: its
                           count is the number of cores its process is pinned to
                           (resources.pin_to_cores sets torch's threads before the in-process engine
                           starts), and Ray sets the process's OMP_NUM_THREADS from its CPUs, which
                           must agree (with 1 Ray CPU, vLLM's CPU attention stopped: "thread_num (1
                           vs. 2)"; the config now refuses it); the learner on its core
    sync, both 2 cores     both of the above: each stage on both cores while the other waits
  The 2-core variants need the default pinning to give one generator and one learner rank one core
  each (a CPU run); otherwise they are skipped and `sync_skipped` says why. The synchronous
  baseline is the sync mode with the highest median samples/s.
- Interleaved: repeat r runs every mode once, in an order rotated by r, so the drift of a shared
  machine reaches every mode alike; repeat r of one mode is paired with repeat r of another.

Limits, from busy time inside each run (never from a stage timed in other conditions):
  T_gen    the generator's busy seconds per step: its run()'s wall time (gen/wall_s) minus its
           waits on the learner or on nothing (gen_time/throttle_s, gen_time/ask_s, gen/send_blocked_s,
           gen_time/rejoin_s), plus the weight loads done inside those
           waits (gen/weight_load_in_wait_s). Generation, scoring (a wait for rewards computed off
           its thread included: that is the generator stage's own latency, though gen/idle_s
           counts it as idle), sending and every weight load are busy. Per group sent, times
           train.groups_per_step; several generators' rates (groups per busy second) add up.
  T_learn  the learner's busy seconds per step: the mean over metrics.jsonl's steps of
           time/step_s - time/ack_wait_s - time/gen_wait_s (prepare, train with its optimizer
           step, push, ...), plus time/checkpoint_s.
  step_s   the run's measured seconds per step: train_s / steps (the driver's clock).
  pipeline limit  max(T_gen, T_learn): a perfect pipeline of the two stages as they ran here.
  sync limit      T_gen + T_learn: an ideal synchronous loop of the same stages.
  fraction_of_pipeline_limit = max(T_gen, T_learn) / step_s. At most 1 but for noise (costs
           that vary within a run): the learner's busy time lies inside the driver's clock, and so
           does the generator's for the groups trained (it starts with the clock; T_gen is its mean
           cost per group, the groups generated past the last step included, and besides them at
           most two weight loads reach past the clock: tests/unit/test_bench_async.py).
  overlap_limit = (T_gen + T_learn) / max(T_gen, T_learn): the most overlapping could gain here.
  overlap       = (T_gen + T_learn) / step_s: what overlapping gained here (at most overlap_limit;
           about 1 in a sync run, whose fraction_of_pipeline_limit is then about 1 / overlap_limit).
  Both limits include whatever the run's conditions cost (the learner's receiving thread, the
  acknowledgements, weight loads at the run's cadence, an engine's first-call warm-up).
Speed-up: speedup_vs_sync of a mode = its median samples/s / the baseline's median samples/s; min
and max are those of the per-repeat ratios (repeat r over the baseline's repeat r).

Prints a table (median [min-max] per mode), then, last, one JSON line:
  default_max_staleness  the composed config's train.max_staleness: the headline's eta
  headline          at that eta: mode, speedup_vs_sync, samples_per_s, fraction_of_pipeline_limit,
                    overlap_limit, overlap, learner_idle_frac, staleness_mean
  sync_baseline_mode  the sync mode with the highest median samples/s
  speedup_vs_sync   eta -> {median, min, max, per_repeat}, for every async eta
  modes             mode -> {eta, overrides, runs, speedup_vs_sync, and {median, min, max} of
                    samples_per_s, step_s, t_gen_s, t_learn_s, fraction_of_pipeline_limit,
                    overlap_limit, overlap, learner_idle_frac, generator_idle_frac,
                    staleness_mean, staleness_max, accuracy_end, greedy_accuracy_end (null
                    without --evals)}
  sync_skipped      sync mode -> why it was not run
  runs              each run's own figures, in the order run (run_figures() names them)
  steps, repeats, evals, run_dir
The same object goes to RUN_DIR/bench_async.json; each run's figures to RUN_DIR/runs.jsonl as it ends.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools import check_overrides, fresh_dir, load_config, repeated

# ------------------------------------------------------------------ limits from a run's own busy time

# What a generator waits on that is not its own work: tickets (asking, and granted none: gen_time/throttle_s),
# room in the learner's queue, its restart (rejoin). Weight loads inside them are added back.
GENERATOR_WAITS = ("gen_time/throttle_s", "gen_time/ask_s", "gen/send_blocked_s", "gen_time/rejoin_s")
# What a learner step waits on: the generators' acknowledgements, then a step's groups.
LEARNER_WAITS = ("time/ack_wait_s", "time/gen_wait_s")


def generator_busy_s(report: dict[str, Any]) -> float:
    """A generator's busy seconds: its run()'s wall time but for its waits, loads in them included."""
    waits = sum(float(report.get(key, 0.0)) for key in GENERATOR_WAITS)
    return max(0.0, float(report["gen/wall_s"]) - waits + float(report.get("gen/weight_load_in_wait_s", 0.0)))


def t_gen_s(generators: Sequence[dict[str, Any]], groups_per_step: int) -> float:
    """The generation stage's busy seconds per step (summary.json's generators)."""
    rate = 0.0  # groups per busy second, all generators together
    for report in generators:
        busy, sent = generator_busy_s(report), float(report.get("gen/groups_sent", 0))
        if busy > 0 and sent > 0:
            rate += sent / busy
    if rate <= 0:
        raise ValueError("no generator sent a group: no generation time to measure")
    return groups_per_step / rate


def learner_busy_s(record: dict[str, Any]) -> float:
    """One step's busy seconds (a metrics.jsonl step record)."""
    waits = sum(float(record.get(key, 0.0)) for key in LEARNER_WAITS)
    return max(0.0, float(record["time/step_s"]) - waits) + float(record.get("time/checkpoint_s", 0.0))


def t_learn_s(records: Sequence[dict[str, Any]]) -> float:
    """The learner's mean busy seconds per step, over the step records (others, e.g. evals, are skipped)."""
    steps = [r for r in records if "time/step_s" in r]
    if not steps:
        raise ValueError("metrics.jsonl holds no step record")
    return sum(learner_busy_s(r) for r in steps) / len(steps)


def run_figures(summary: dict[str, Any], records: Sequence[dict[str, Any]], groups_per_step: int) -> dict[str, Any]:
    """One run's figures, from its summary.json and metrics.jsonl (module docstring: definitions)."""
    steps = int(summary["steps"])
    if steps <= 0 or float(summary["train_s"]) <= 0:
        raise ValueError(f"the run trained no step (steps={steps}, train_s={summary['train_s']})")
    step_s = float(summary["train_s"]) / steps
    generators, learner = summary["generators"], summary["learner"]
    t_gen, t_learn = t_gen_s(generators, groups_per_step), t_learn_s(records)
    pipeline_s, serial_s = max(t_gen, t_learn), t_gen + t_learn
    histogram = {int(k): int(v) for k, v in learner["staleness_histogram"].items()}
    groups = sum(histogram.values()) or 1
    return {
        "steps": steps,
        "train_s": float(summary["train_s"]),
        "samples_per_s": float(summary["samples_per_s"]),
        "step_s": step_s,
        "t_gen_s": t_gen,
        "t_learn_s": t_learn,
        "pipeline_limit_s": pipeline_s,
        "sync_limit_s": serial_s,
        "fraction_of_pipeline_limit": pipeline_s / step_s,
        "overlap_limit": serial_s / pipeline_s,
        "overlap": serial_s / step_s,
        "gen_tokens_per_s": sum(float(g.get("gen/tokens_generated", 0)) for g in generators) / float(summary["train_s"]),
        "learner_idle_frac": float(learner["idle_frac"]),
        "generator_idle_frac": sum(float(g["gen/idle_frac"]) for g in generators) / len(generators),
        "staleness_mean": sum(k * v for k, v in histogram.items()) / groups,
        "staleness_max": max(histogram, default=0),
        "dropped_stale": int(summary.get("groups_dropped_stale", 0)),
        "accuracy_start": summary.get("eval_accuracy_start"),
        "accuracy_end": summary.get("eval_accuracy_end"),
        "greedy_accuracy_end": summary.get("eval_greedy_accuracy_end"),
    }


# ---------------------------------------------------------------------------- across repeats

# The per-run figures summarized per mode as median, min and max.
SPREAD_KEYS = ("samples_per_s", "step_s", "t_gen_s", "t_learn_s", "fraction_of_pipeline_limit", "overlap_limit",
               "overlap", "learner_idle_frac", "generator_idle_frac", "staleness_mean", "staleness_max",
               "accuracy_end", "greedy_accuracy_end")


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    """{median, min, max} of the values given (None and NaN left out); None if there are none."""
    present = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def speedup(runs: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Median samples/s of `runs` over the baseline's; min/max of the ratios of runs paired by repeat."""
    ours, theirs = spread(r["samples_per_s"] for r in runs), spread(r["samples_per_s"] for r in baseline)
    if ours is None or theirs is None:
        return None
    by_repeat = {r["repeat"]: r["samples_per_s"] for r in baseline}
    ratios = [r["samples_per_s"] / by_repeat[r["repeat"]]
              for r in sorted(runs, key=lambda r: r["repeat"]) if r["repeat"] in by_repeat]
    return {"median": ours["median"] / theirs["median"], "min": min(ratios, default=None),
            "max": max(ratios, default=None), "per_repeat": ratios}


def best_sync_mode(modes: dict[str, dict[str, Any]]) -> str | None:
    """The sync mode (eta 0) with the highest median samples/s; the first listed on a tie."""
    sync = [label for label, mode in modes.items() if mode["eta"] == 0 and mode["samples_per_s"] is not None]
    return max(sync, key=lambda label: modes[label]["samples_per_s"]["median"], default=None)


def summarize(runs: Sequence[dict[str, Any]], default_eta: int,
              overrides: dict[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """Per-mode spreads, the baseline, the speed-ups and the headline, from every run's figures
    (each with its `mode`, `eta` and `repeat`). `overrides`: each mode's, to report beside it."""
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_mode.setdefault(run["mode"], []).append(run)
    modes = {label: {"eta": group[0]["eta"], "overrides": list((overrides or {}).get(label, [])),
                     "runs": len(group), **{key: spread(r.get(key) for r in group) for key in SPREAD_KEYS}}
             for label, group in by_mode.items()}
    baseline = best_sync_mode(modes)
    for label, mode in modes.items():
        mode["speedup_vs_sync"] = speedup(by_mode[label], by_mode[baseline]) if baseline else None
    async_modes = {mode["eta"]: label for label, mode in modes.items() if mode["eta"] > 0}
    headline = None
    if default_eta in async_modes:
        label = async_modes[default_eta]
        mode = modes[label]
        headline = {"eta": default_eta, "mode": label,
                    **{key: mode[key] for key in ("speedup_vs_sync", "samples_per_s", "fraction_of_pipeline_limit",
                                                  "overlap_limit", "overlap", "learner_idle_frac", "staleness_mean")}}
    return {
        "default_max_staleness": default_eta,
        "headline": headline,
        "sync_baseline_mode": baseline,
        "speedup_vs_sync": {str(eta): modes[label]["speedup_vs_sync"] for eta, label in sorted(async_modes.items())},
        "modes": modes,
    }


# ------------------------------------------------------------------------------------------ modes


@dataclass(frozen=True)
class Mode:
    label: str
    eta: int
    overrides: tuple[str, ...]


# --sync-configs names -> mode labels.
SYNC_CONFIGS = {"default": "sync", "learner2": "sync, learner 2 cores", "vllm2": "sync, vLLM 2 cores",
                "both2": "sync, both 2 cores"}


def core_spec(cores: Sequence[int]) -> str:
    """[0, 1, 3] -> '0-1,3', quoted for Hydra when it holds a comma (else a list to Hydra)."""
    parts: list[str] = []
    ordered = sorted(cores)
    start = prev = ordered[0]
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    spec = ",".join(parts)
    return f"'{spec}'" if "," in spec else spec


def two_core_obstacle(device: str, generator_cores: list[list[int]], learner_cores: list[list[int]]) -> str | None:
    """Why the 2-core sync variants cannot be expressed from the default pinning (None: they can)."""
    if device != "cpu":
        return f"device={device}: the stages run on accelerators, not on the pinned cores"
    if len(generator_cores) != 1 or len(learner_cores) != 1:
        return (f"the 2-core variants need one generator and one learner rank ({len(generator_cores)} and "
                f"{len(learner_cores)} here)")
    gen, learn = generator_cores[0], learner_cores[0]
    if len(gen) != 1 or len(learn) != 1 or gen == learn:
        return f"the default pinning gives the generator cores {gen} and the learner {learn}, not one core each"
    return None


def sync_modes(wanted: Sequence[str], device: str, generator_cores: list[list[int]],
               learner_cores: list[list[int]]) -> tuple[list[Mode], dict[str, str]]:
    """The sync modes asked for (SYNC_CONFIGS keys) and, for those that cannot run here, why."""
    modes: list[Mode] = []
    skipped: dict[str, str] = {}
    obstacle = two_core_obstacle(device, generator_cores, learner_cores)
    variants: dict[str, tuple[str, ...]] = {}
    if obstacle is None:
        both = core_spec([*generator_cores[0], *learner_cores[0]])
        gen_core, learner_core = core_spec(generator_cores[0]), core_spec(learner_cores[0])
        threads = len(generator_cores[0]) + len(learner_cores[0])
        # The Ray CPUs too: Ray sets each actor process's OMP_NUM_THREADS from them before torch or
        # vLLM load, and vLLM's CPU attention fails when a thread's OpenMP count (Ray's 1) differs
        # from the engine's (2, from the pinning): "cpu_attn_impl ... thread_num (1 vs. 2)".
        learner = (f"learner.cpu_cores={both}", f"learner.torch_threads={threads}", f"learner.num_cpus_per_rank={threads}")
        generator = (f"rollout.cpu_cores={both}", f"rollout.num_cpus_per_generator={threads}")
        variants = {
            "learner2": (f"rollout.cpu_cores={gen_core}", *learner),
            "vllm2": (*generator, f"learner.cpu_cores={learner_core}"),
            "both2": (*generator, *learner),
        }
    for key in wanted:
        label = SYNC_CONFIGS[key]
        if key == "default":
            modes.append(Mode(label, 0, ("train.max_staleness=0",)))
        elif obstacle is not None:
            skipped[label] = obstacle
        else:
            modes.append(Mode(label, 0, ("train.max_staleness=0", *variants[key])))
    return modes, skipped


def async_modes(etas: Iterable[int], default_eta: int) -> list[Mode]:
    """One mode per eta > 0, the default max_staleness always among them (the headline)."""
    wanted = sorted({e for e in etas if e > 0} | ({default_eta} if default_eta > 0 else set()))
    return [Mode(f"async eta={eta}", eta, (f"train.max_staleness={eta}",)) for eta in wanted]


def interleaved(modes: Sequence[Mode], repeats: int) -> list[tuple[int, Mode]]:
    """(repeat, mode) in running order: each repeat runs every mode once, rotated by one per repeat."""
    order: list[tuple[int, Mode]] = []
    for repeat in range(repeats):
        shift = repeat % len(modes)
        order.extend((repeat, mode) for mode in [*modes[shift:], *modes[:shift]])
    return order


def parse_etas(text: str) -> list[int]:
    try:
        etas = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--etas wants comma-separated integers, got {text!r}") from None
    if any(e < 0 for e in etas):
        raise argparse.ArgumentTypeError(f"--etas: max_staleness is never negative, got {text!r}")
    return etas


def parse_sync_configs(text: str) -> list[str]:
    keys = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [k for k in keys if k not in SYNC_CONFIGS]
    if unknown:
        raise argparse.ArgumentTypeError(f"--sync-configs: unknown {unknown}; choose from {', '.join(SYNC_CONFIGS)}")
    if twice := repeated(keys):  # two modes of one label would share one run folder (r<repeat>_<label>)
        raise argparse.ArgumentTypeError(f"--sync-configs: {', '.join(twice)} given twice")
    return keys


# ------------------------------------------------------------------------------------------ running


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_run(mode: Mode, repeat: int, common: list[str], out_dir: Path, tool: str,
              config_name: str = "default") -> tuple[dict[str, Any], list[dict[str, Any]], Any, Path]:
    """One `asyncgrpo train --config-name config_name` run of `mode` under `out_dir` (announced as
    `tool`'s); its summary, its metrics.jsonl records, its config and its run directory."""
    from asyncgrpo.config import load
    from asyncgrpo.train import train

    slug = "".join(c if c.isalnum() else "_" for c in mode.label)
    run_dir = out_dir / f"r{repeat}_{slug}"
    overrides = [*common, *mode.overrides]
    cfg = load([*overrides, f"run_dir={run_dir}", "progress=false"], config_name=config_name)
    print(f"[{tool}] repeat {repeat}, {mode.label}: asyncgrpo train --config-name {config_name} {' '.join(overrides)}",
          file=sys.stderr, flush=True)
    summary = train(cfg)
    return summary, read_jsonl(run_dir / "metrics.jsonl"), cfg, run_dir


def run_once(mode: Mode, repeat: int, common: list[str], out_dir: Path) -> dict[str, Any]:
    """One `asyncgrpo train` run of `mode`; its figures (run_figures) with mode, eta, repeat, run_dir."""
    summary, records, cfg, run_dir = train_run(mode, repeat, common, out_dir, "bench_async")
    figures = run_figures(summary, records, cfg.train.groups_per_step)
    return {"mode": mode.label, "eta": cfg.train.max_staleness, "repeat": repeat, **figures, "run_dir": str(run_dir)}


def run_all(modes: Sequence[Mode], repeats: int, out_dir: Path, tool: str,
            run_one: Callable[[Mode, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """Every mode `repeats` times, interleaved (`interleaved`); each run's figures (`run_one(mode,
    repeat)`) appended to out_dir/runs.jsonl as it ends, so a failure later loses nothing."""
    order = interleaved(modes, repeats)
    runs: list[dict[str, Any]] = []
    for index, (repeat, mode) in enumerate(order, 1):
        print(f"[{tool}] run {index}/{len(order)}", file=sys.stderr, flush=True)
        run = run_one(mode, repeat)
        runs.append(run)
        with (out_dir / "runs.jsonl").open("a") as f:
            f.write(json.dumps(run) + "\n")
    return runs


def run_benchmark(tool: str, modes: Sequence[Mode], repeats: int, out_root: str,
                  run_one: Callable[[Mode, int, Path], dict[str, Any]],
                  summarize: Callable[[list[dict[str, Any]]], dict[str, Any]],
                  print_table: Callable[[dict[str, Any]], None], header: dict[str, Any]) -> int:
    """What every benchmark here does after parsing its arguments: `modes` run `repeats` times
    (`run_all`, `run_one(mode, repeat, out_dir)`) into a new timestamped folder under `out_root`;
    the result (`header`, `summarize(runs)`, the runs) printed as a table, written to
    <out_dir>/<tool>.json and printed last as one JSON line."""
    out_dir = fresh_dir(out_root)
    runs = run_all(modes, repeats, out_dir, tool, lambda mode, repeat: run_one(mode, repeat, out_dir))
    result = {**header, **summarize(runs), "runs": runs, "run_dir": str(out_dir)}
    print_table(result)
    (out_dir / f"{tool}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


def add_run_arguments(parser: argparse.ArgumentParser, steps: int, out: str) -> None:
    """--steps, --eta, --repeats, --out and the Hydra overrides, as the single-preset benchmarks
    (bench_tail, bench_env) take them; `check_run_arguments` refuses what cannot run."""
    parser.add_argument("--steps", type=int, default=steps, help=f"learner steps per run (default: {steps})")
    parser.add_argument("--eta", type=int, default=2, help="max_staleness of the asynchronous modes (default: 2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved (default: 3)")
    parser.add_argument("--out", default=out)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run, e.g. seed=1")


def check_run_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The overrides every run of a single-preset benchmark takes (`add_run_arguments`)."""
    if args.repeats < 1 or args.steps < 1 or args.eta < 1:
        parser.error("--repeats, --steps and --eta must be at least 1")
    check_overrides(parser, args.overrides)
    # Held-out accuracy at the end is a figure here; the export is not, and costs time.
    return ["train.export_at_end=false", "eval.at_start=false", "train.max_train_minutes=0", *args.overrides,
            f"train.max_steps={args.steps}"]


def planned_cores(parser: argparse.ArgumentParser, base: Any) -> tuple[list[list[int]], list[list[int]]]:
    """The cores the base config pins its generators and learner ranks to (the sync modes re-pin
    them), or parser.error for a core spec that does not plan (rollout.cpu_cores, learner.cpu_cores)."""
    from asyncgrpo.runtime.resources import plan_cores

    try:
        return plan_cores(base.rollout.num_generators, base.learner.world_size, base.rollout.cpu_cores,
                          base.learner.cpu_cores)
    except ValueError as err:
        parser.error(f"rollout.cpu_cores={base.rollout.cpu_cores!r} / learner.cpu_cores={base.learner.cpu_cores!r}: "
                     f"{err}")


def check_modes(parser: argparse.ArgumentParser, modes: Sequence[Mode], common: Sequence[str],
                config_name: str = "default") -> None:
    """Before anything runs: there is a mode, and every mode's overrides compose as its run will
    compose them (`train_run`), or parser.error naming the first mode that cannot run (the
    user's overrides against a mode's own, e.g. train.fixed_staleness against its max_staleness)."""
    if not modes:
        parser.error("no modes to run (every mode asked for was left out or cannot run here)")
    for mode in modes:
        load_config(parser, [*common, *mode.overrides, "progress=false"], config_name, what=f"mode {mode.label!r}")


def fmt_spread(s: dict[str, float] | None, fmt: str, scale: float = 1.0) -> str:
    """'median [min-max]' (a lone value when min = max); '-' for nothing."""
    if s is None:
        return "-"
    median = format(s["median"] * scale, fmt)
    if s["min"] is None or s["max"] is None:  # a speed-up with no repeat paired
        return median
    low, high = format(s["min"] * scale, fmt), format(s["max"] * scale, fmt)
    return median if low == high else f"{median} [{low}-{high}]"


def print_table(result: dict[str, Any]) -> None:
    columns = [("mode", 22), ("eta", 3), ("samples/s", 19), ("x sync", 17), ("T_gen ms", 14), ("T_learn ms", 14),
               ("of pipeline limit", 17), ("overlap", 16), ("overlap limit", 16), ("learner idle", 16),
               ("stale mean", 16), ("acc end", 19)]
    header = " ".join(f"{name:<{width}}" for name, width in columns)
    print()
    print(header)
    print("-" * len(header))
    for label, m in result["modes"].items():
        speed = m["speedup_vs_sync"]
        cells = [label, str(m["eta"]), fmt_spread(m["samples_per_s"], ",.0f"),
                 fmt_spread(speed, ".2f"),
                 fmt_spread(m["t_gen_s"], ".1f", 1e3), fmt_spread(m["t_learn_s"], ".1f", 1e3),
                 fmt_spread(m["fraction_of_pipeline_limit"], ".0%"), fmt_spread(m["overlap"], ".2f"),
                 fmt_spread(m["overlap_limit"], ".2f"), fmt_spread(m["learner_idle_frac"], ".1%"),
                 fmt_spread(m["staleness_mean"], ".2f"), fmt_spread(m["accuracy_end"], ".3f")]
        print(" ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, columns)))
    print()
    print("median [min-max] over repeats; x sync: median samples/s / the baseline's [per-repeat ratios]; limits from")
    print("each run's own busy time: T_gen, T_learn per step; of pipeline limit = max(T_gen, T_learn) / measured step;")
    print("overlap = (T_gen + T_learn) / measured step; overlap limit = (T_gen + T_learn) / max(T_gen, T_learn)")
    print(f"sync baseline: {result['sync_baseline_mode']} (highest median samples/s of the sync modes)")
    for label, why in result["sync_skipped"].items():
        print(f"not run: {label}: {why}")
    head = result["headline"]
    if head is not None:
        print(f"headline (default max_staleness={head['eta']}): {fmt_spread(head['speedup_vs_sync'], '.2f')}x the "
              f"sync baseline, {fmt_spread(head['fraction_of_pipeline_limit'], '.0%')} of its pipeline limit, "
              f"learner idle {fmt_spread(head['learner_idle_frac'], '.1%')}")
    else:
        print(f"no headline: the default max_staleness={result['default_max_staleness']} was not run asynchronously")
    print()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_async", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="learner steps per run")
    parser.add_argument("--etas", type=parse_etas, default=parse_etas("0,1,2,4"),
                        help="max_staleness values; 0 = the sync modes (default: 0,1,2,4; the default "
                             "max_staleness is always added)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved (default: 3)")
    parser.add_argument("--sync-configs", type=parse_sync_configs, default=list(SYNC_CONFIGS),
                        help=f"which sync modes to run with eta 0 (default: all of {','.join(SYNC_CONFIGS)})")
    parser.add_argument("--evals", action="store_true",
                        help="held-out accuracy at the start and end of each run (off by default: time)")
    parser.add_argument("--out", default="runs/bench_async")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run, e.g. seed=1")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    check_overrides(parser, args.overrides)

    from asyncgrpo.driver.prepare import resolve_device

    # Not on the clock either way, but they cost minutes over many runs: the final export always,
    # the evaluations unless asked for. The caller's overrides come after and win.
    bench = ["train.export_at_end=false", *([] if args.evals else ["eval.at_start=false", "eval.at_end=false"])]
    common = [*bench, *args.overrides, f"train.max_steps={args.steps}"]
    base = load_config(parser, common)
    default_eta = base.train.max_staleness
    device = resolve_device(base.device)
    generator_cores, learner_cores = planned_cores(parser, base)
    sync, skipped = sync_modes(args.sync_configs if 0 in args.etas else [], device, generator_cores, learner_cores)
    modes = [*sync, *async_modes(args.etas, default_eta)]
    check_modes(parser, modes, common)

    def run_one(mode: Mode, repeat: int, out_dir: Path) -> dict[str, Any]:
        run = run_once(mode, repeat, common, out_dir)
        print(f"[bench_async] {mode.label}: {run['samples_per_s']:.0f} samples/s, T_gen {run['t_gen_s'] * 1e3:.1f} ms, "
              f"T_learn {run['t_learn_s'] * 1e3:.1f} ms, step {run['step_s'] * 1e3:.1f} ms "
              f"({run['fraction_of_pipeline_limit']:.0%} of its pipeline limit)", file=sys.stderr, flush=True)
        return run

    overrides = {m.label: m.overrides for m in modes}
    return run_benchmark("bench_async", modes, args.repeats, args.out, run_one,
                         lambda runs: {**summarize(runs, default_eta, overrides), "sync_skipped": skipped},
                         print_table, {"steps": args.steps, "repeats": args.repeats, "evals": args.evals})

if __name__ == "__main__":
    sys.exit(main())
