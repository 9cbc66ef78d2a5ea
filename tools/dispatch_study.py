"""Uneven generators under tickets (asyncgrpo/queue/dispatch.py), simulated: together against each alone.

    .venv/bin/python -m tools.dispatch_study runs/validate_simulator/g2_eta1
    .venv/bin/python -m tools.dispatch_study RUN_DIR --speeds 1,0.5 --etas 0,1,2,4 --calls 8,2 --seeds 5

Issue 16 asks that a generator half as fast get half the work: samples/s of two uneven generators
at least 90% of the sum of their speeds alone. Tickets grant slots to whichever generator asks,
within the staleness bound, so a faster one makes more. From one finished run's phase times
(`asyncgrpo simulate`'s calibration), per max_staleness and call size (groups per vLLM call, the
same alone and together):

- alone_i: generator i alone (its speed from --speeds), one step's groups from it only;
- tickets: all of them together.

The ratio is against the sum of the alone figures (the issue's limit). No dispatch can pass the
learner: `learner bound` is the same settings with generation taking no time, and `of reachable`
is tickets against the smaller of the two. Each figure is the median over --seeds simulations
with gamma noise on every call (--cv), with min-max beside the ratio. Simulated, not measured:
the model's assumptions are docs/SIMULATOR.md's. --train-scale multiplies the learner's step time
(below 1: a learner that keeps up with more generators). Last line: JSON with every row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from typing import Any

from asyncgrpo.sim.calibration import Calibration
from asyncgrpo.sim.model import simulate
from asyncgrpo.sim.settings import Settings, SimulationError
from tools import comma_list, nonnegative_int, positive_float, positive_int


def samples_per_s(calibration: Calibration, settings: Settings, seeds: int) -> list[float]:
    return [simulate(calibration, replace(settings, seed=seed)).samples_per_s for seed in range(seeds)]


def study(calibration: Calibration, speeds: list[float], etas: list[int], calls: list[int], seeds: int, cv: float,
          steps: int, train_scale: float = 1.0) -> list[dict[str, Any]]:
    base = calibration.settings
    rows = []
    for eta in etas:
        for call in calls:
            common = replace(base, max_staleness=eta, groups_per_call=call, generate_cv=cv, steps=steps,
                             capacity_groups=(eta + 1) * base.groups_per_step, stale_policy="both",
                             push_every_steps=1, train_scale=train_scale)
            alone = [statistics.median(samples_per_s(calibration, replace(
                common, num_generators=1, generator_speeds=str(speed)), seeds)) for speed in speeds]
            together = replace(common, num_generators=len(speeds), generator_speeds=",".join(map(str, speeds)))
            learner_bound = statistics.median(samples_per_s(calibration, replace(together, generate_scale=1e-9), seeds))
            values = samples_per_s(calibration, together, seeds)
            ratios = [v / sum(alone) for v in values]
            tickets = {"samples_per_s": statistics.median(values), "ratio": statistics.median(ratios),
                       "ratio_min": min(ratios), "ratio_max": max(ratios)}
            rows.append({"max_staleness": eta, "groups_per_call": call, "alone": alone, "limit": sum(alone),
                         "learner_bound": learner_bound, "tickets": tickets,
                         "tickets_of_reachable": tickets["samples_per_s"] / min(sum(alone), learner_bound)})
    return rows


def table(rows: list[dict[str, Any]], speeds: list[float]) -> str:
    lines = [f"speeds {speeds}; ratio = together / sum alone (median [min, max] over seeds)",
             f"{'eta':>4}{'call':>6}{'sum alone':>11}{'learner bound':>15}{'tickets':>9}{'ratio':>22}"
             f"{'of reachable':>14}"]
    for r in rows:
        t = r["tickets"]
        lines.append(f"{r['max_staleness']:>4}{r['groups_per_call']:>6}{r['limit']:>11.1f}{r['learner_bound']:>15.1f}"
                     f"{t['samples_per_s']:>9.1f}{t['ratio']:>8.3f} [{t['ratio_min']:.3f}, {t['ratio_max']:.3f}]"
                     f"{r['tickets_of_reachable']:>14.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.dispatch_study", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a finished run to calibrate from (asyncgrpo simulate's RUN_DIR)")
    parser.add_argument("--speeds", default="1,0.5", help="relative speed of each generator (default 1,0.5)")
    parser.add_argument("--etas", default="0,1,2,4", help="train.max_staleness values")
    parser.add_argument("--calls", default="8,2", help="rollout.groups_per_call values (groups per vLLM call)")
    parser.add_argument("--seeds", type=int, default=3, help="simulations per figure, each with its own noise")
    parser.add_argument("--cv", type=float, default=0.3, help="coefficient of variation of each call's time")
    parser.add_argument("--steps", type=int, default=200, help="learner steps per simulation")
    parser.add_argument("--train-scale", type=float, default=1.0, help="x the learner's step time (default 1)")
    args = parser.parse_args(argv)
    try:
        speeds = comma_list(args.speeds, positive_float, unique=False, what="--speeds")  # one per generator
        etas = comma_list(args.etas, nonnegative_int, what="--etas")
        calls = comma_list(args.calls, positive_int, what="--calls")
        if args.seeds < 1:
            raise ValueError(f"--seeds must be at least 1 (got {args.seeds})")
        calibration = Calibration.from_run(args.run_dir)
        calibration = replace(calibration, settings=replace(calibration.settings, replay=False, warmup_steps=1))
        rows = study(calibration, speeds, etas, calls, args.seeds, args.cv, args.steps, args.train_scale)
    except (argparse.ArgumentTypeError, ValueError, SimulationError) as err:
        print(f"dispatch_study: {err}", file=sys.stderr)
        return 2
    print(table(rows, speeds))
    print(json.dumps({"run_dir": args.run_dir, "speeds": speeds, "seeds": args.seeds, "cv": args.cv,
                      "steps": args.steps, "train_scale": args.train_scale, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
