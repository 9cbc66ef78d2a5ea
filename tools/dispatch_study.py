"""Uneven generators: fixed shares (today's run) against tickets (asyncgrpo/dispatch.py), simulated.

    .venv/bin/python tools/dispatch_study.py runs/validate_simulator/g2_eta1
    .venv/bin/python tools/dispatch_study.py RUN_DIR --speeds 1,0.5 --etas 0,1,2,4 --calls 8,2 --seeds 5

Issue 16 asks that a generator half as fast get half the work: samples/s of two uneven generators
at least 90% of the sum of their speeds alone. This predicts it for both dispatches before the real
run moves onto tickets. From one finished run's phase times (`asyncgrpo simulate`'s calibration),
per max_staleness and call size (groups per vLLM call, the same alone and together):

- alone_i: generator i alone (its speed from --speeds), one step's groups from it only;
- quotas: all of them together, each with an even fixed share of every step (config.groups_per_generator);
- proportional: fixed shares proportional to the speeds (rollout.generator_shares, set by hand:
  what a user who knows the speeds can do today);
- tickets: together, each granted slots when it asks, within the staleness bound.

Ratios are against the sum of the alone figures (the issue's limit). No dispatch can pass the
learner either: `learner bound` is the same settings with generation taking no time, and
`of reachable` is tickets against the smaller of the two. Each figure is the median over --seeds
simulations with gamma noise on every call (--cv), with min-max beside the ratios. Simulated, not
measured: the model's assumptions are docs/SIMULATOR.md's. --train-scale multiplies the learner's
step time (below 1: a learner that keeps up with more generators). Last line: JSON with every row.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from typing import Any

from asyncgrpo.simulate import Calibration, Settings, SimulationError, simulate


def samples_per_s(calibration: Calibration, settings: Settings, seeds: int) -> list[float]:
    return [simulate(calibration, replace(settings, seed=seed)).samples_per_s for seed in range(seeds)]


def proportional_shares(speeds: list[float], groups_per_step: int) -> list[int]:
    """Shares of `groups_per_step` proportional to `speeds` (largest remainder), each at least 1."""
    if groups_per_step < len(speeds):
        raise ValueError(f"{groups_per_step} groups per step cannot give each of {len(speeds)} generators one")
    exact = [groups_per_step * v / sum(speeds) for v in speeds]
    shares = [max(1, int(x)) for x in exact]
    while sum(shares) < groups_per_step:  # the largest remainders get the rest
        i = max(range(len(shares)), key=lambda j: exact[j] - shares[j])
        shares[i] += 1
    while sum(shares) > groups_per_step:  # a 1 raised from below took one too many: the largest gives it back
        shares[shares.index(max(shares))] -= 1
    return shares


def study(calibration: Calibration, speeds: list[float], etas: list[int], calls: list[int], seeds: int, cv: float,
          steps: int, train_scale: float = 1.0) -> list[dict[str, Any]]:
    base = calibration.settings
    n, groups = len(speeds), base.groups_per_step
    rows = []
    for eta in etas:
        for call in calls:
            common = replace(base, max_staleness=eta, groups_per_call=call, generate_cv=cv, steps=steps,
                             capacity_groups=(eta + 1) * groups, stale_policy="both", push_every_steps=1,
                             train_scale=train_scale)
            alone = [statistics.median(samples_per_s(calibration, replace(
                common, num_generators=1, generator_speeds=str(speed)), seeds)) for speed in speeds]
            together = replace(common, num_generators=n, generator_speeds=",".join(map(str, speeds)))
            learner_bound = statistics.median(samples_per_s(calibration, replace(together, generate_scale=1e-9), seeds))
            row: dict[str, Any] = {"max_staleness": eta, "groups_per_call": call, "alone": alone, "limit": sum(alone),
                                   "learner_bound": learner_bound,
                                   "proportional_shares": proportional_shares(speeds, groups)}
            shares = ",".join(map(str, proportional_shares(speeds, groups)))
            for dispatch, settings in (("quotas", together), ("proportional", replace(together, generator_shares=shares)),
                                       ("tickets", replace(together, dispatch="tickets"))):
                values = samples_per_s(calibration, settings, seeds)
                ratios = [v / row["limit"] for v in values]
                row[dispatch] = {"samples_per_s": statistics.median(values), "ratio": statistics.median(ratios),
                                 "ratio_min": min(ratios), "ratio_max": max(ratios)}
            row["tickets_of_reachable"] = row["tickets"]["samples_per_s"] / min(row["limit"], learner_bound)
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], speeds: list[float]) -> str:
    lines = [f"speeds {speeds}; proportional shares {rows[0]['proportional_shares'] if rows else []}; "
             "ratio = together / sum alone (median [min, max] over seeds)",
             f"{'eta':>4}{'call':>6}{'sum alone':>11}{'learner bound':>15}{'quotas':>9}{'ratio':>22}"
             f"{'proport.':>9}{'ratio':>22}{'tickets':>9}{'ratio':>22}{'of reachable':>14}"]
    for r in rows:
        cells = [f"{r['max_staleness']:>4}{r['groups_per_call']:>6}{r['limit']:>11.1f}{r['learner_bound']:>15.1f}"]
        for dispatch in ("quotas", "proportional", "tickets"):
            d = r[dispatch]
            cells.append(f"{d['samples_per_s']:>9.1f}{d['ratio']:>8.3f} [{d['ratio_min']:.3f}, {d['ratio_max']:.3f}]")
        cells.append(f"{r['tickets_of_reachable']:>14.3f}")
        lines.append("".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a finished run to calibrate from (asyncgrpo simulate's RUN_DIR)")
    parser.add_argument("--speeds", default="1,0.5", help="relative speed of each generator (default 1,0.5)")
    parser.add_argument("--etas", default="0,1,2,4", help="train.max_staleness values")
    parser.add_argument("--calls", default="8,2", help="rollout.groups_per_call values (groups per vLLM call)")
    parser.add_argument("--seeds", type=int, default=3, help="simulations per figure, each with its own noise")
    parser.add_argument("--cv", type=float, default=0.3, help="coefficient of variation of each call's time")
    parser.add_argument("--steps", type=int, default=200, help="learner steps per simulation")
    parser.add_argument("--train-scale", type=float, default=1.0, help="x the learner's step time (default 1)")
    args = parser.parse_args()
    try:
        speeds = [float(s) for s in args.speeds.split(",")]
        etas = [int(e) for e in args.etas.split(",")]
        calls = [int(c) for c in args.calls.split(",")]
        calibration = Calibration.from_run(args.run_dir)
        calibration = replace(calibration, settings=replace(calibration.settings, replay=False, warmup_steps=1))
        rows = study(calibration, speeds, etas, calls, args.seeds, args.cv, args.steps, args.train_scale)
    except (ValueError, SimulationError) as err:
        raise SystemExit(f"dispatch_study: {err}") from None
    print(table(rows, speeds))
    print(json.dumps({"run_dir": args.run_dir, "speeds": speeds, "seeds": args.seeds, "cv": args.cv,
                      "steps": args.steps, "train_scale": args.train_scale, "rows": rows}))


if __name__ == "__main__":
    main()
