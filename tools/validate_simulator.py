"""Does `asyncgrpo simulate` reproduce the runs it is calibrated from?

    .venv/bin/python tools/validate_simulator.py                        # etas 0,1,2,4 x 1 and 2 generators
    .venv/bin/python tools/validate_simulator.py --etas 0,2 --generators 1 --steps 40

For each (generators, max_staleness): a short real `asyncgrpo train` (the embedded tiny model on
the default task, no evaluation, no export), then the simulator calibrated from that run's own
directory and simulating its own settings and number of steps. Prints predicted vs measured
samples/s (summary.json's, the whole run), their ratio, and the idle fractions and mean staleness
beside each other; last, one JSON line with every row and the worst ratio.

This checks the model's bookkeeping, not its extrapolation: a simulation of other settings than
the run's (more generators than cores, other learner ranks) also assumes the phase times do not
change with them (docs/SIMULATOR.md). On a 2-core machine one generator and the learner are
pinned to a core each; with 2 generators nothing is pinned (resources.plan_cores) and all three
contend for the cores, which the calibrating run measures, so its own simulation includes it.
Each training costs about a minute of start-up (Ray, vLLM) besides its steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncgrpo.simulate import Calibration, SimulationError, simulate


def train(run_dir: Path, generators: int, eta: int, steps: int, extra: list[str]) -> float:
    """A real run into `run_dir`; returns its wall seconds."""
    groups_per_step = 16  # the default's; the queue must hold (eta + 1) steps with several generators
    overrides = [f"run_dir={run_dir}", f"train.max_steps={steps}", f"train.max_staleness={eta}",
                 f"rollout.num_generators={generators}", f"train.groups_per_step={groups_per_step}",
                 f"queue.capacity_groups={max(64, (eta + 1) * groups_per_step)}",
                 "model.warmstart_max_seconds=5", "progress=false", "eval.at_start=false", "eval.at_end=false",
                 "train.export_at_end=false", *extra]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "train", *overrides], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"training {run_dir} failed (exit {done.returncode}): {tail[0]}")
    return time.monotonic() - start


def finished(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") == "finished"
    except (OSError, json.JSONDecodeError):
        return False


def compare(run_dir: Path, generators: int, eta: int) -> dict[str, Any]:
    calibration = Calibration.from_run(run_dir)
    result = simulate(calibration, calibration.settings)
    m = calibration.measured
    return {
        "generators": generators, "max_staleness": eta, "steps": calibration.settings.steps, "run_dir": str(run_dir),
        "measured_samples_per_s": round(m.samples_per_s, 2),
        "predicted_samples_per_s": round(result.samples_per_s, 2),
        "ratio": round(result.samples_per_s / m.samples_per_s, 4) if m.samples_per_s else None,
        "measured_learner_idle_frac": round(m.learner_idle_frac, 4),
        "predicted_learner_idle_frac": round(result.learner_idle_frac, 4),
        "measured_generator_idle_frac": round(m.generator_idle_frac, 4),
        "predicted_generator_idle_frac": round(result.generator_idle_frac, 4),
        "measured_staleness_mean": round(m.staleness_mean, 3),
        "predicted_staleness_mean": round(result.staleness_mean, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--etas", default="0,1,2,4", help="train.max_staleness values (default: 0,1,2,4)")
    parser.add_argument("--generators", default="1,2", help="rollout.num_generators values (default: 1,2)")
    parser.add_argument("--steps", type=int, default=40, help="learner steps per run (default: 40)")
    parser.add_argument("--out", default="runs/validate_simulator", help="parent of the run directories")
    parser.add_argument("--cache-dir", default="", help="model.cache_dir (default: the config's)")
    parser.add_argument("--reuse", action="store_true", help="simulate a finished run directory instead of "
                                                             "training it again")
    parser.add_argument("overrides", nargs="*", help="further `asyncgrpo train` overrides for every run")
    args = parser.parse_args()
    extra = [*([f"model.cache_dir={args.cache_dir}"] if args.cache_dir else []), *args.overrides]
    rows = []
    print(f"{'gens':>4} {'eta':>3} {'measured/s':>11} {'predicted/s':>12} {'ratio':>6}  "
          f"{'learner idle m/p':>17}  {'gen idle m/p':>13}  {'staleness m/p':>13}", flush=True)
    for generators in (int(g) for g in args.generators.split(",")):
        for eta in (int(e) for e in args.etas.split(",")):
            run_dir = Path(args.out) / f"g{generators}_eta{eta}"
            if not (args.reuse and finished(run_dir)):
                train(run_dir, generators, eta, args.steps, extra)
            try:
                row = compare(run_dir, generators, eta)
            except SimulationError as err:
                print(f"{generators:>4} {eta:>3}  {err}", flush=True)
                continue
            rows.append(row)
            print(f"{generators:>4} {eta:>3} {row['measured_samples_per_s']:>11.1f} "
                  f"{row['predicted_samples_per_s']:>12.1f} {row['ratio']:>6.3f}  "
                  f"{row['measured_learner_idle_frac']:>8.3f}/{row['predicted_learner_idle_frac']:<8.3f}  "
                  f"{row['measured_generator_idle_frac']:>6.3f}/{row['predicted_generator_idle_frac']:<6.3f}  "
                  f"{row['measured_staleness_mean']:>6.2f}/{row['predicted_staleness_mean']:<6.2f}", flush=True)
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    print(json.dumps({"runs": rows, "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
                      "worst_abs_error": max((abs(r - 1) for r in ratios), default=None)}))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
