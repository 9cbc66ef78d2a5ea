"""Uneven generators under tickets, measured: two together against the sum of each alone.

    .venv/bin/python -m tools.bench_dispatch                          # slowdown 2, 40 steps, 3 repeats
    .venv/bin/python -m tools.bench_dispatch --slowdown 3 --steps 30 --repeats 1 --out /tmp/bd
    .venv/bin/python -m tools.bench_dispatch --base-slowdown 4    # generators that hardly share cores
    .venv/bin/python -m tools.bench_dispatch --pace-s 0.02        # generators on devices of their own

Two generators, generator 1 made `--slowdown` times slower by the failpoint generator_slowdown
(it sleeps (f - 1) x each vLLM call's time after the call: a slower device, where this machine
cannot give one generator a smaller share of its cores). `--base-slowdown B` slows every generator
B times more (generator 1: B x slowdown): a generator then spends most of its time asleep, as one
waiting on its own device would, and two of them hardly compete for this machine's cores, so their
speeds alone can add up. But the sleep is proportional to the call: when the other generator or
the learner slows a call by 10%, the generator runs 10% slower. `--pace-s P` instead makes each
vLLM call last P seconds per group (generator 1: P x slowdown; failpoint generator_pace_s): a
generator on a device of its own, whose speed the other processes do not change as long as the
call's own work on this machine fits in its pace. Every run is a real `asyncgrpo train`
(the embedded tiny model, default task, no evaluation, no export) with the same seed and steps,
its groups dispatched by tickets (asyncgrpo/queue/dispatch.py: slots to whichever generator asks):

    fast alone      one generator, not slowed
    slow alone      one generator, slowed
    tickets         two generators, generator 1 slowed
    tickets, equal  two generators, neither slowed (the dropped-groups baseline)

Repeat r runs every mode once, in an order rotated by r (a shared machine's drift reaches all alike).
Per run: samples/s (the run's own: samples over its training seconds), groups each generator sent,
and groups dropped (stale, full queue, unheld). Two figures of merit:
  of_sum_alone     samples/s over the sum of the two "alone" runs' samples/s of the same repeat (the
                   issue's bar: at least 0.9 for tickets; for "tickets, equal" twice fast alone).
                   Every run makes calls of --groups-per-call groups, alone or not. Only meaningful
                   where the generators do not compete for the same cores: alone, a generator has
                   the cores the other would use; on a small machine two generators and the
                   learner share them (--pace-s keeps that from changing their speeds).
  of_capacity      samples/s over the generators' capacity measured inside the same run: the sum
                   over generators of groups sent per busy second (tools/bench_async.py's
                   generator_busy_s: wall time but for its waits on tickets, weights, room or
                   data), times samples per group. 1 means no generator ever waited for work. The
                   learner can also be what waits on (`learner_idle_frac` near 0).
And the dropped groups against "tickets, equal".

Prints a table (median [min-max] per mode), then, last, one JSON line: {slowdown, base_slowdown, pace_s, steps, repeats,
modes: mode -> {samples_per_s, of_sum_alone, of_capacity, dropped, sent_slow_frac (the slowed
generator's fraction of the groups sent), learner_idle_frac}, each {median, min, max}, runs: every
run's figures, run_dir: the new <--out>/<date-time> folder the runs went to}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tools import check_overrides, finite_float, fresh_dir, load_config
from tools.bench_async import generator_busy_s, read_jsonl, spread

MODES: dict[str, tuple[list[str], bool]] = {  # label -> (overrides, generator slowed)
    "fast alone": (["rollout.num_generators=1"], False),
    "slow alone": (["rollout.num_generators=1"], True),
    "tickets": (["rollout.num_generators=2"], True),
    "tickets, equal": (["rollout.num_generators=2"], False),
}
# What the tool sets in every run: an override of one would replace it (the user's come last).
RESERVED_KEYS = ("run_dir", "train.max_steps", "rollout.groups_per_call", "rollout.num_generators")
DROP_KEYS = ("queue/dropped_stale", "queue/dropped_full", "queue/dropped_unheld")


def slowdowns(label: str, slowdown: float, base: float) -> dict[str, float]:
    """The failpoint's factor per generator id for `label`: `base` for each, times `slowdown` for the
    slowed one (generator 0 alone, generator 1 together); factors of 1 left out."""
    overrides, slowed = MODES[label]
    together = not overrides[0].endswith("=1")
    factors = {"0": base, **({"1": base} if together else {})}
    if slowed:
        factors["1" if together else "0"] = base * slowdown
    return {g: f for g, f in factors.items() if f != 1}


def failpoints(label: str, slowdown: float, base: float, pace_s: float) -> dict[str, Any]:
    """ASYNCGRPO_FAULTS for `label`: generator_slowdown factors, or with `pace_s` > 0 each generator's
    generator_pace_s (`pace_s`, times `slowdown` for the slowed one)."""
    if pace_s <= 0:
        factors = slowdowns(label, slowdown, base)
        return {"generator_slowdown": factors} if factors else {}
    ids = ["0"] if MODES[label][0][0].endswith("=1") else ["0", "1"]
    factors = slowdowns(label, slowdown, 1.0)
    return {"generator_pace_s": {g: pace_s * factors.get(g, 1.0) for g in ids}}


def train_overrides(label: str, steps: int, groups_per_call: int, extra: list[str]) -> list[str]:
    """A run's overrides but its run_dir: what the tool sets (RESERVED_KEYS among them), then `extra`."""
    # One call size everywhere: alone, a generator's call would otherwise be a whole step.
    return [f"train.max_steps={steps}", f"rollout.groups_per_call={groups_per_call}",
            "model.warmstart_max_seconds=5", "progress=false", "eval.at_start=false", "eval.at_end=false",
            "train.export_at_end=false", *MODES[label][0], *extra]


def run(label: str, repeat: int, slowdown: float, base: float, pace_s: float, steps: int, groups_per_call: int,
        out: Path, extra: list[str]) -> dict[str, Any]:
    run_dir = out / f"r{repeat}_{''.join(c if c.isalnum() else '_' for c in label)}"
    faults = failpoints(label, slowdown, base, pace_s)
    env = {**os.environ, "ASYNCGRPO_FAULTS": json.dumps(faults)} if faults else dict(os.environ)
    args = [sys.executable, "-m", "asyncgrpo.cli", "train", f"run_dir={run_dir}",
            *train_overrides(label, steps, groups_per_call, extra)]
    print(f"[bench_dispatch] repeat {repeat}, {label}", file=sys.stderr, flush=True)
    done = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{label} (repeat {repeat}) failed, exit {done.returncode}: {tail[0]}")
    return figures(label, repeat, run_dir)


def figures(label: str, repeat: int, run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_jsonl(run_dir / "metrics.jsonl")
    last = [r for r in records if "queue/consumed" in r][-1]
    sent = [int(g["gen/groups_sent"]) for g in summary["generators"]]
    slow_index = 0 if len(sent) == 1 else 1
    samples_per_group = int(_yaml(run_dir / "config.yaml")["rollout"]["samples_per_prompt"])
    capacity = samples_per_group * sum(int(g["gen/groups_sent"]) / busy for g in summary["generators"]
                                       if (busy := generator_busy_s(g)) > 0)
    return {"mode": label, "repeat": repeat, "samples_per_s": float(summary["samples_per_s"]),
            "capacity_samples_per_s": capacity,
            "of_capacity": float(summary["samples_per_s"]) / capacity if capacity > 0 else None,
            "dropped": int(sum(last.get(key, 0) for key in DROP_KEYS)), "sent": sent,
            "sent_slow_frac": sent[slow_index] / sum(sent) if sum(sent) else 0.0,
            "learner_idle_frac": summary.get("learner", {}).get("idle_frac"), "run_dir": str(run_dir)}


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def of_sum_alone(runs: list[dict[str, Any]]) -> None:
    """Each run's samples/s over the sum of its generators' runs alone in its repeat (in place, when
    they ran): fast alone + slow alone; twice fast alone for "tickets, equal"; itself alone."""
    by_repeat: dict[int, dict[str, float]] = {}
    for r in runs:
        by_repeat.setdefault(r["repeat"], {})[r["mode"]] = r["samples_per_s"]
    for r in runs:
        alone = by_repeat[r["repeat"]]
        parts = {"fast alone": ["fast alone"], "slow alone": ["slow alone"],
                 "tickets, equal": ["fast alone", "fast alone"]}.get(r["mode"], ["fast alone", "slow alone"])
        if all(p in alone for p in parts):
            r["of_sum_alone"] = r["samples_per_s"] / sum(alone[p] for p in parts)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    modes = {}
    for label in MODES:
        mine = [r for r in runs if r["mode"] == label]
        if mine:
            modes[label] = {key: spread([r.get(key) for r in mine])
                            for key in ("samples_per_s", "of_sum_alone", "of_capacity", "dropped",
                                        "sent_slow_frac", "learner_idle_frac")}
    return modes


def cell(s: dict[str, float] | None, fmt: str) -> str:
    return "-" if s is None else f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_dispatch", description=__doc__.splitlines()[0])
    parser.add_argument("--slowdown", type=finite_float, default=2.0, help="generator 1's slowdown factor (>= 1)")
    parser.add_argument("--base-slowdown", type=finite_float, default=1.0,
                        help="every generator's slowdown factor (>= 1), generator 1's on top of --slowdown")
    parser.add_argument("--pace-s", type=finite_float, default=0.0,
                        help="seconds per group of generator 0's vLLM calls (generator 1: times --slowdown); "
                             "replaces the proportional slowdown (default 0: off)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--groups-per-call", type=int, default=8,
                        help="rollout.groups_per_call in every run (default 8: half the default step, "
                             "what each of two generators would ask for), so that alone and together make "
                             "calls of one size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_dispatch"),
                        help="the runs go to a new OUT/<date-time> folder (default: /tmp/bench_dispatch)")
    parser.add_argument("overrides", nargs="*",
                        help=f"config overrides for every run (not {', '.join(RESERVED_KEYS)}: set here)")
    args = parser.parse_args(argv)
    if args.slowdown < 1 or args.base_slowdown < 1 or min(args.steps, args.repeats, args.groups_per_call) < 1:
        parser.error("--slowdown and --base-slowdown must be >= 1, --steps, --repeats and --groups-per-call >= 1")
    if args.pace_s < 0 or (args.pace_s > 0 and args.base_slowdown != 1):
        parser.error("--pace-s must be >= 0, and is not combined with --base-slowdown")
    check_overrides(parser, args.overrides, RESERVED_KEYS, "bench_dispatch")
    for label in MODES:  # as each run's `asyncgrpo train` will compose them
        load_config(parser, train_overrides(label, args.steps, args.groups_per_call, args.overrides), what=label)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = fresh_dir(args.out)
    print(f"[bench_dispatch] runs in {out}", file=sys.stderr, flush=True)
    labels = list(MODES)
    runs = []
    for repeat in range(args.repeats):
        for label in labels[repeat % len(labels):] + labels[:repeat % len(labels)]:
            runs.append(run(label, repeat, args.slowdown, args.base_slowdown, args.pace_s, args.steps,
                            args.groups_per_call, out, args.overrides))
    of_sum_alone(runs)
    modes = summarize(runs)
    print(f"{'mode':<16} {'samples/s':>22} {'of sum alone':>20} {'of capacity':>20} {'dropped':>12} "
          f"{'slow gen frac':>20} {'learner idle':>20}")
    for label, m in modes.items():
        print(f"{label:<16} {cell(m['samples_per_s'], '.0f'):>22} {cell(m['of_sum_alone'], '.2f'):>20} "
              f"{cell(m['of_capacity'], '.2f'):>20} {cell(m['dropped'], '.0f'):>12} "
              f"{cell(m['sent_slow_frac'], '.2f'):>20} {cell(m['learner_idle_frac'], '.2f'):>20}")
    print(json.dumps({"slowdown": args.slowdown, "base_slowdown": args.base_slowdown, "pace_s": args.pace_s,
                      "steps": args.steps,
                      "groups_per_call": args.groups_per_call, "repeats": args.repeats, "modes": modes,
                      "runs": runs, "run_dir": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
