"""Does `asyncgrpo simulate` predict runs it was not calibrated from?

    .venv/bin/python -m tools.validate_simulator                                # etas 0,1,2,4 x 1 and 2 generators
    .venv/bin/python -m tools.validate_simulator --etas 0,2 --generators 1 --steps 30
    .venv/bin/python -m tools.validate_simulator --reuse --out /tmp/simval      # simulate finished runs again
    .venv/bin/python -m tools.validate_simulator --steps 200 --repeats 3        # every setting 3 times, medians
    .venv/bin/python -m tools.validate_simulator --bench-env runs/bench_env/DATE  # tool latency: no training
    .venv/bin/python -m tools.validate_simulator --bench-tail runs/bench_tail/DATE  # long completions: no training

For each (generators, max_staleness): a short real `asyncgrpo train` (the embedded tiny model on
the default task, no evaluation, no export) into OUT/g<generators>_eta<max_staleness>. Then each
run's samples/s is predicted three ways and compared with what the run measured:

- cross (the prediction): the simulator calibrated from ONE reference run (`--reference`, default
  1 generator at max_staleness 2, the defaults; or any finished run, `--reference-dir`), simulating
  this run's settings (generators, max_staleness, queue capacity) for its number of steps. Beside
  it the learner's and generators' idle fractions and the mean staleness, predicted / measured.
- same generators: calibrated from the run with as many generators at the reference's
  max_staleness (for that run itself, the nearest other max_staleness): another eta, the same
  contention. On this 2-core machine one generator and the learner are pinned to a core each;
  with 2 generators nothing is pinned (runtime.resources.plan_cores) and three processes share two cores,
  which changes every phase's time: a 1-generator reference cannot know that, so the cross column
  is off for 2 generators by however much contention costs, and this column shows what is left.
- own: calibrated from the run itself at its own settings: the model's bookkeeping, not a
  prediction (the table before cross-setting validation existed).

`--repeats R` runs the whole grid R times (round r into OUT/r<r>, each in an order rotated by r,
so that a shared machine's drift reaches every setting alike); each round's predictions are
calibrated from that round's reference, and a setting's figure is the median over rounds of its
ratios (and of its measured samples/s), printed with their [min-max].

`--bench-tail DIR` trains nothing either: it predicts the runs of a finished tools/bench_tail.py
benchmark, each from the run of `--tail-reference` (default: the bench's synchronous baseline) of
the same repeat, and from itself (own): what the simulator says the call-batched and continuous
generators give, from a synchronous run alone. Runs that recorded their engine's step cost and
group lengths are simulated step by step (`sim.engine=auto`, docs/SIMULATOR.md).

`--bench-env DIR` trains nothing: it predicts the runs of a finished tools/bench_env.py benchmark
(DIR/runs.jsonl), each from the run of its kind (sync, async) and repeat at `--env-reference-ms`
(default 0: no injected latency), simulating the target's env.latency_s and settings; beside it
the run from itself (own). Per mode the median ratio over repeats [min-max].

Last, one JSON line: every row, and per column the worst ratio (farthest from 1) with its run and
whether every ratio is within 15%. The reference run's own row is not a prediction and is left out
of the cross column's worst. Runs measured one after another on a shared machine also differ by
its load at the time, which no calibration can know. Each training costs about a minute of
start-up (Ray, vLLM) besides its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncgrpo.sim.calibration import Calibration, Measured
from asyncgrpo.sim.model import Result, simulate, uses_engine_steps
from asyncgrpo.sim.settings import SimulationError
from tools import list_type, load_config, nonnegative_int, positive_int

TOLERANCE = 0.15  # the issue's bar: predicted samples/s within 15% of measured
COLUMNS = ("cross", "same_generators", "own")


def train_overrides(generators: int, eta: int, steps: int, extra: list[str]) -> list[str]:
    """A grid run's overrides but its run_dir."""
    groups_per_step = 16  # the default's; the queue must hold (eta + 1) steps with several generators
    return [f"train.max_steps={steps}", f"train.max_staleness={eta}",
            f"rollout.num_generators={generators}", f"train.groups_per_step={groups_per_step}",
            f"queue.capacity_groups={max(64, (eta + 1) * groups_per_step)}",
            "model.warmstart_max_seconds=5", "progress=false", "eval.at_start=false", "eval.at_end=false",
            "train.export_at_end=false", *extra]


def train(run_dir: Path, generators: int, eta: int, steps: int, extra: list[str]) -> float:
    """A real run into `run_dir`; returns its wall seconds."""
    overrides = [f"run_dir={run_dir}", *train_overrides(generators, eta, steps, extra)]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "train", *overrides], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"training {run_dir} failed (exit {done.returncode}): {tail[0]}")
    return time.monotonic() - start


def finished(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") == "finished"
    except (OSError, json.JSONDecodeError):
        return False


# ------------------------------------------------------------------ comparing (pure, tested)


def prediction(measured: Measured, result: Result, calibrated_from: str) -> dict[str, Any]:
    """One column of a row: what a simulation predicted beside what the run measured."""
    return {
        "calibrated_from": calibrated_from,
        "samples_per_s": round(result.samples_per_s, 2),
        "ratio": round(result.samples_per_s / measured.samples_per_s, 4) if measured.samples_per_s else None,
        "learner_idle_frac": round(result.learner_idle_frac, 4),
        "generator_idle_frac": round(result.generator_idle_frac, 4),
        "staleness_mean": round(result.staleness_mean, 3),
    }


def measured_fields(measured: Measured) -> dict[str, Any]:
    return {"samples_per_s": round(measured.samples_per_s, 2),
            "learner_idle_frac": round(measured.learner_idle_frac, 4),
            "generator_idle_frac": round(measured.generator_idle_frac, 4),
            "staleness_mean": round(measured.staleness_mean, 3)}


def phase_times(calibration: Calibration) -> dict[str, Any]:
    """The calibrated times a prediction carries from one run to another: when they differ between
    runs of the same code, so does what the runs measured, and no other run's calibration knows."""
    steady = calibration.train_s[calibration.settings.warmup_steps:] or calibration.train_s
    return {"call_s": round(statistics.fmean(g.generate_s for g in calibration.generators), 4),
            "call_groups": calibration.generators[0].call_groups,
            "train_s": round(statistics.median(steady), 4),
            "push_s": round(statistics.median(calibration.push_s), 4) if calibration.push_s else 0.0}


def same_generators_source(available: list[tuple[int, int]], generators: int, eta: int,
                           reference_eta: int) -> tuple[int, int] | None:
    """The run to calibrate (generators, eta) from with the same contention but another eta: the
    one at the reference's eta, else the nearest other eta (the lower on a tie); None if the
    number of generators was run at no other eta."""
    others = [e for g, e in available if g == generators and e != eta]
    if not others:
        return None
    if reference_eta in others:
        return generators, reference_eta
    return generators, min(others, key=lambda e: (abs(e - eta), e))


def worst(rows: list[dict[str, Any]], column: str,
          names: tuple[str, ...] = ("generators", "max_staleness")) -> dict[str, Any] | None:
    """The ratio farthest from 1 in `column` (rows marked as that column's source left out), with
    its run (the row's `names`), and whether every ratio is within TOLERANCE."""
    scored = [(row[column]["ratio"], row) for row in rows
              if row.get(column) and row[column]["ratio"] is not None and not row[column].get("is_source")]
    if not scored:
        return None
    ratio, row = max(scored, key=lambda item: abs(item[0] - 1))
    return {"ratio": ratio, **{name: row[name] for name in names}, "runs": len(scored), "within_15pct": all(abs(r - 1) <= TOLERANCE for r, _ in scored)}


def combine(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (generators, max_staleness) from the rows of every round: per column the median
    of the rounds' ratios with their min and max, and the measured samples/s likewise."""
    by_key: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for rows in rounds:
        for row in rows:
            by_key.setdefault((row["generators"], row["max_staleness"]), []).append(row)
    combined = []
    for (generators, eta), rows in by_key.items():
        measured = [r["measured"]["samples_per_s"] for r in rows]
        entry: dict[str, Any] = {"generators": generators, "max_staleness": eta, "rounds": len(rows),
                                 "measured": {"samples_per_s": statistics.median(measured), "min": min(measured),
                                              "max": max(measured)}}
        for column in COLUMNS:
            ratios = [r[column]["ratio"] for r in rows if r.get(column) and r[column]["ratio"] is not None]
            entry[column] = ({"ratio": round(statistics.median(ratios), 4), "min": min(ratios), "max": max(ratios),
                              **({"is_source": True} if any(r[column].get("is_source") for r in rows) else {})}
                             if ratios else None)
        combined.append(entry)
    return combined


def format_combined(rows: list[dict[str, Any]]) -> str:
    """The medians over rounds, [min-max]; * marks the reference's cross cell."""
    def cell(column: dict[str, Any] | None) -> str:
        if not column:
            return "-"
        return (f"{column['ratio']:.3f} [{column['min']:.3f}-{column['max']:.3f}]"
                + ("*" if column.get("is_source") else ""))

    lines = ["| generators | max_staleness | rounds | measured samples/s | ratio cross | ratio same generators | "
             "ratio own |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["measured"]
        lines.append(f"| {r['generators']} | {r['max_staleness']} | {r['rounds']} | {m['samples_per_s']:.1f} "
                     f"[{m['min']:.1f}-{m['max']:.1f}] | {cell(r['cross'])} | {cell(r['same_generators'])} | "
                     f"{cell(r['own'])} |")
    return "\n".join(lines)


def _ratio_cell(column: dict[str, Any] | None) -> str:
    if not column or column["ratio"] is None:
        return "-"
    return f"{column['ratio']:.3f}" + ("*" if column.get("is_source") else "")


def format_table(rows: list[dict[str, Any]]) -> str:
    """Predicted (cross) against measured, then the other columns' ratios; * marks the reference
    run's cross cell (simulated from itself)."""
    lines = [("| generators | max_staleness | measured samples/s | predicted (cross) | ratio cross | "
              "ratio same generators | ratio own | learner idle measured / cross | "
              "generator idle measured / cross | staleness mean measured / cross |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, c = r["measured"], r["cross"]
        lines.append(f"| {r['generators']} | {r['max_staleness']} | {m['samples_per_s']:.1f} | "
                     f"{c['samples_per_s']:.1f} | {_ratio_cell(c)} | {_ratio_cell(r.get('same_generators'))} | "
                     f"{r['own']['ratio']:.3f} | {m['learner_idle_frac']:.3f} / {c['learner_idle_frac']:.3f} | "
                     f"{m['generator_idle_frac']:.3f} / {c['generator_idle_frac']:.3f} | "
                     f"{m['staleness_mean']:.2f} / {c['staleness_mean']:.2f} |")
    return "\n".join(lines)


def format_phases(rows: list[dict[str, Any]]) -> str:
    lines = ["| generators | max_staleness | vLLM call s (groups) | train s (median) | push s (median) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['generators']} | {r['max_staleness']} | {r['phases']['call_s']:.4f} ({r['phases']['call_groups']}) "
              f"| {r['phases']['train_s']:.4f} | {r['phases']['push_s']:.4f} |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the command


def target_cores(target: Calibration, cores: str) -> int:
    """sim.cores for a prediction of `target`: `auto`, the cores its actors were planned on (its
    machine's; 0 when its actors.json does not say); else the number given."""
    return (target.machine_cores or 0) if cores == "auto" else int(cores)


def predict(source: Calibration, target: Calibration, cores: int) -> dict[str, Any]:
    """Simulate `target`'s settings and number of steps from `source`'s phase times, on `cores`
    shared cores (0: every actor its own)."""
    return prediction(target.measured, simulate(source, replace(target.settings, cores=cores)), source.run_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.validate_simulator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--etas", type=list_type(nonnegative_int), default="0,1,2,4",
                        help="train.max_staleness values (default: 0,1,2,4)")
    parser.add_argument("--generators", type=list_type(positive_int), default="1,2",
                        help="rollout.num_generators values (default: 1,2)")
    parser.add_argument("--steps", type=positive_int, default=40, help="learner steps per run (default: 40)")
    parser.add_argument("--reference", default="1,2", help="GENERATORS,ETA of the run every cross prediction "
                                                           "is calibrated from; trained too if not in the grid "
                                                           "(default: 1,2)")
    parser.add_argument("--reference-dir", default="", help="calibrate the cross predictions from this finished "
                                                            "run instead")
    parser.add_argument("--out", default="runs/validate_simulator", help="parent of the run directories")
    parser.add_argument("--cache-dir", default="", help="model.cache_dir (default: the config's)")
    parser.add_argument("--reuse", action="store_true", help="simulate a finished run directory instead of "
                                                             "training it again")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the whole grid (default 1); medians "
                                                                   "over rounds")
    parser.add_argument("--cores", default="auto", help="sim.cores of every prediction: auto (default), the cores "
                                                        "the predicted run's actors were planned on; 0, no model "
                                                        "of actors sharing cores; or a number")
    parser.add_argument("--bench-env", default="", help="predict this finished tools/bench_env.py benchmark's "
                                                        "runs (its runs.jsonl) instead of training a grid")
    parser.add_argument("--env-reference-ms", type=int, default=0, help="with --bench-env: calibrate each kind from "
                                                                        "its run at this latency (default 0)")
    parser.add_argument("--bench-tail", default="", help="predict this finished tools/bench_tail.py benchmark's "
                                                         "runs (its runs.jsonl) instead of training a grid")
    parser.add_argument("--tail-reference", default="", help="with --bench-tail: the mode each repeat's runs are "
                                                             "predicted from (default: the bench's sync baseline)")
    parser.add_argument("overrides", nargs="*", help="further `asyncgrpo train` overrides for every run")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.cores != "auto" and not (args.cores.isdigit()):
        parser.error(f"--cores is auto or a number >= 0 (got {args.cores!r})")
    if args.bench_env:
        return validate_bench_env(Path(args.bench_env), args.env_reference_ms, args.cores)
    if args.bench_tail:
        return validate_bench_tail(Path(args.bench_tail), args.tail_reference, args.cores)
    extra = [*([f"model.cache_dir={args.cache_dir}"] if args.cache_dir else []), *args.overrides]
    try:
        reference_generators, reference_run_eta = (int(x) for x in args.reference.split(","))
    except ValueError:
        parser.error(f"--reference is GENERATORS,ETA (got {args.reference!r})")
    reference_key = (reference_generators, reference_run_eta)
    grid = [(g, e) for g in args.generators for e in args.etas]
    needed = grid + ([reference_key] if not args.reference_dir and reference_key not in grid else [])
    check_grid(parser, args, needed, extra)

    rounds = []
    for repeat in range(args.repeats):
        out = round_dir(args.out, repeat, args.repeats)
        order = needed[repeat % len(needed):] + needed[:repeat % len(needed)]
        outcome = one_round(args, out, order, grid, reference_key, extra)
        if outcome is None:
            return 1
        reference, rows = outcome
        rounds.append(rows)
        print(format_table(rows))
        print(f"\nphase times each run measured (the reference: {json.dumps(phase_times(reference))})")
        print(format_phases(rows), flush=True)
    if args.repeats == 1:
        print(json.dumps({"reference": reference.run_dir, "runs": rounds[0],
                          "worst": {column: worst(rounds[0], column) for column in COLUMNS}}))
        return 0 if rounds[0] else 1
    combined = combine(rounds)
    print(f"\nmedians over {args.repeats} rounds [min-max]")
    print(format_combined(combined))
    print(json.dumps({"repeats": args.repeats, "runs": combined, "rounds": rounds,
                      "worst": {column: worst(combined, column) for column in COLUMNS}}))
    return 0 if combined else 1


def check_grid(parser: argparse.ArgumentParser, args: argparse.Namespace, needed: list[tuple[int, int]],
               extra: list[str]) -> None:
    """Before anything trains: every run's overrides compose, and no run would train into a folder an
    earlier one left that `asyncgrpo train` refuses (train.refuse_used_run_dir, which resume= and
    run_dir_reuse=true let through; --reuse simulates finished runs instead of training them)."""
    from asyncgrpo.schema import ConfigError
    from asyncgrpo.train import refuse_used_run_dir

    configs = {(g, e): load_config(parser, train_overrides(g, e, args.steps, extra), what=f"g{g}_eta{e}")
               for g, e in needed}
    held = []
    for repeat in range(args.repeats):
        for (g, e), cfg in configs.items():
            run_dir = round_dir(args.out, repeat, args.repeats) / f"g{g}_eta{e}"
            if args.reuse and finished(run_dir):
                continue
            try:
                refuse_used_run_dir(cfg, run_dir)
            except ConfigError:
                held.append(str(run_dir))
    if held:
        what = "an unfinished run" if args.reuse else "a run (--reuse simulates a finished one)"
        parser.error(f"{held[0]} already holds {what}"
                     f"{f', and {len(held) - 1} more run folder(s) too' if len(held) > 1 else ''}: pass another --out")


def round_dir(out: str, repeat: int, repeats: int) -> Path:
    """Where round `repeat`'s runs go."""
    return Path(out) / f"r{repeat}" if repeats > 1 else Path(out)


def one_round(args: argparse.Namespace, out: Path, order: list[tuple[int, int]], grid: list[tuple[int, int]],
              reference_key: tuple[int, int], extra: list[str]) -> tuple[Calibration, list[dict[str, Any]]] | None:
    """Train (or reuse) every run of `order` under `out`; (the reference, a row per run of `grid`),
    or None without a reference."""
    calibrations: dict[tuple[int, int], Calibration] = {}
    # The machine's load average as each run ended: on a shared machine the phase times follow it,
    # which no calibration from another run can know.
    load_after: dict[tuple[int, int], float] = {}
    for generators, eta in order:
        run_dir = out / f"g{generators}_eta{eta}"
        if not (args.reuse and finished(run_dir)):
            print(f"training {run_dir} ...", file=sys.stderr, flush=True)
            train(run_dir, generators, eta, args.steps, extra)
            load_after[generators, eta] = round(os.getloadavg()[0], 2)
        try:
            calibrations[generators, eta] = Calibration.from_run(run_dir)
        except SimulationError as err:
            print(f"{run_dir}: {err}", file=sys.stderr, flush=True)
    try:
        reference = (Calibration.from_run(args.reference_dir) if args.reference_dir
                     else calibrations[reference_key])
    except (SimulationError, KeyError) as err:
        print(f"no reference run to calibrate from: {err}", file=sys.stderr)
        return None
    reference_eta = reference.settings.max_staleness
    print(f"cross: calibrated from {reference.run_dir} ({reference.settings.num_generators} generator(s), "
          f"max_staleness {reference_eta}, {reference.settings.steps} steps); same generators: from the run with "
          f"as many generators at max_staleness {reference_eta} (or the nearest other); own: from the run itself",
          flush=True)

    rows = []
    for key in grid:
        if key not in calibrations:
            continue
        target = calibrations[key]
        source = same_generators_source(list(calibrations), key[0], key[1], reference_eta)
        cores = target_cores(target, args.cores)
        cross = predict(reference, target, cores)
        if Path(reference.run_dir).resolve() == Path(target.run_dir).resolve():
            cross["is_source"] = True  # the reference itself: bookkeeping, not a prediction
        rows.append({
            "generators": key[0], "max_staleness": key[1], "steps": target.settings.steps,
            "run_dir": target.run_dir, "load_avg_1m_after": load_after.get(key),
            "measured": measured_fields(target.measured), "phases": phase_times(target), "cross": cross,
            "same_generators": predict(calibrations[source], target, cores) if source else None,
            "own": predict(target, target, cores), "sim_cores": cores,
        })
    return reference, rows


# ------------------------------------------------ environment latency (tools/bench_env.py's runs)


def env_references(runs: list[dict[str, Any]], reference_ms: int) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each bench_env run with the run it is predicted from: the same kind (sync, async) at
    `reference_ms`, of the same repeat where there is one, else of the lowest repeat; None when the
    kind has no run at that latency."""
    references: dict[tuple[str, int], dict[str, Any]] = {}
    for run in sorted(runs, key=lambda r: -r["repeat"]):  # the lowest repeat last: kept as the fallback
        if run["latency_ms"] == reference_ms:
            references[run["kind"], run["repeat"]] = references[run["kind"], -1] = run
    return [(run, references.get((run["kind"], run["repeat"]), references.get((run["kind"], -1)))) for run in runs]


def combine_env(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per bench_env mode: the median over repeats of the measured samples/s and of each
    column's ratio, with their min and max; the reference runs' own cross cells marked."""
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_mode.setdefault(row["mode"], []).append(row)
    combined = []
    for mode, group in by_mode.items():
        measured = [r["measured"]["samples_per_s"] for r in group]
        entry: dict[str, Any] = {"mode": mode, "kind": group[0]["kind"], "latency_ms": group[0]["latency_ms"],
                                 "repeats": len(group), "measured": {"samples_per_s": statistics.median(measured),
                                                                     "min": min(measured), "max": max(measured)}}
        for column in ("cross", "own"):
            cells = [r[column] for r in group if r.get(column) and r[column]["ratio"] is not None]
            ratios = [c["ratio"] for c in cells]
            entry[column] = ({"ratio": round(statistics.median(ratios), 4), "min": min(ratios), "max": max(ratios),
                              "samples_per_s": round(statistics.median(c["samples_per_s"] for c in cells), 2),
                              **({"is_source": True} if any(c.get("is_source") for c in cells) else {})}
                             if ratios else None)
        combined.append(entry)
    return sorted(combined, key=lambda e: (e["kind"], e["latency_ms"]))


def format_env_table(rows: list[dict[str, Any]]) -> str:
    """Per mode: measured and predicted samples/s (medians over repeats) and the ratios [min-max];
    * marks the reference runs (predicted from themselves)."""
    def cell(column: dict[str, Any] | None) -> str:
        if not column:
            return "-"
        return (f"{column['ratio']:.3f} [{column['min']:.3f}-{column['max']:.3f}]"
                + ("*" if column.get("is_source") else ""))

    lines = ["| mode | repeats | measured samples/s | predicted samples/s | ratio predicted | ratio own |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        m, c = r["measured"], r["cross"]
        predicted = f"{c['samples_per_s']:.1f}" if c else "-"
        lines.append(f"| {r['mode']} | {r['repeats']} | {m['samples_per_s']:.1f} [{m['min']:.1f}-{m['max']:.1f}] | "
                     f"{predicted} | {cell(c)} | {cell(r['own'])} |")
    return "\n".join(lines)


def predict_bench_runs(pairs: list[tuple[dict[str, Any], dict[str, Any] | None]], cores: str,
                       describe: Callable[[dict[str, Any], Calibration], dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per (run, reference) of a finished benchmark: `describe`'s fields, the run predicted from
    its reference (cross; None without one, marked where the reference is the run itself) and from
    itself (own). A run that cannot be calibrated is said on stderr and left out."""
    calibrations: dict[str, Calibration] = {}

    def calibration(run: dict[str, Any]) -> Calibration:
        if run["run_dir"] not in calibrations:
            calibrations[run["run_dir"]] = Calibration.from_run(run["run_dir"])
        return calibrations[run["run_dir"]]

    rows = []
    for run, reference in pairs:
        try:
            target = calibration(run)
            cross = predict(calibration(reference), target, target_cores(target, cores)) if reference else None
        except SimulationError as err:
            print(f"{run['run_dir']}: {err}", file=sys.stderr, flush=True)
            continue
        if cross and reference is run:
            cross["is_source"] = True
        rows.append({**describe(run, target), "repeat": run["repeat"], "run_dir": run["run_dir"],
                     "measured": measured_fields(target.measured), "cross": cross,
                     "own": predict(target, target, target_cores(target, cores))})
    return rows


def print_bench_predictions(rows: list[dict[str, Any]], header: str, about: dict[str, Any]) -> int:
    """The table per mode (medians over repeats) under `header`, then the JSON line: `about`, the modes,
    every run and the worst median per column; exit status 1 when no run could be predicted."""
    combined = combine_env(rows)
    print(header)
    print(format_env_table(combined))
    print(json.dumps({**about, "modes": combined, "runs": rows,
                      "worst": {column: worst(combined, column, ("mode",)) for column in ("cross", "own")}}))
    return 0 if rows else 1


def validate_bench_env(bench_dir: Path, reference_ms: int, cores: str) -> int:
    """Predict every run of a finished tools/bench_env.py benchmark from its kind's run at
    `reference_ms`; print the table per mode, then the JSON line."""
    runs = read_bench_runs(bench_dir, "bench_env")
    if runs is None:
        return 1
    if not any(run["latency_ms"] == reference_ms for run in runs):
        print(f"{bench_dir}: no run at --env-reference-ms {reference_ms} to predict from (latencies: "
              f"{', '.join(map(str, sorted({run['latency_ms'] for run in runs})))} ms)", file=sys.stderr)
        return 2
    rows = predict_bench_runs(env_references(runs, reference_ms), cores, lambda run, target: {
        "mode": run["mode"], "kind": run["kind"], "latency_ms": run["latency_ms"],
        "env_latency_s": target.settings.env_latency_s})
    return print_bench_predictions(rows, f"predicted: each kind's run at {reference_ms} ms of the same repeat; own: "
                                         f"each run from itself", {"bench_env": str(bench_dir), "reference_ms": reference_ms})


# ------------------------------------------------ long completions (tools/bench_tail.py's runs)


def read_bench_runs(bench_dir: Path, tool: str) -> list[dict[str, Any]] | None:
    """A finished benchmark's runs.jsonl (one run per line); None, said on stderr, when there is none."""
    try:
        return [json.loads(line) for line in (bench_dir / "runs.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        print(f"{bench_dir}: no {tool} runs.jsonl to predict ({err})", file=sys.stderr)
        return None


def tail_reference_mode(bench_dir: Path, given: str) -> str:
    """The mode every bench_tail run is predicted from: `given`, else the bench's synchronous
    baseline (bench_tail.json), else "sync"."""
    if given:
        return given
    try:
        return str(json.loads((bench_dir / "bench_tail.json").read_text())["sync_baseline_mode"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return "sync"


def tail_references(runs: list[dict[str, Any]], reference_mode: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each bench_tail run with the run it is predicted from: `reference_mode`'s of the same repeat,
    else of the lowest repeat; [] when no run has that mode."""
    references = {run["repeat"]: run for run in runs if run["mode"] == reference_mode}
    if not references:
        return []
    return [(run, references.get(run["repeat"], references[min(references)])) for run in runs]


def validate_bench_tail(bench_dir: Path, reference_mode: str, cores: str) -> int:
    """Predict every run of a finished tools/bench_tail.py benchmark from the run of `reference_mode`
    of the same repeat (the synchronous baseline by default: what the simulator says asynchrony
    would give, from a synchronous run alone) and from itself; print the table per mode, then the
    JSON line. Under sim.engine=auto the engine is simulated step by step where the runs recorded
    its step cost and group lengths."""
    runs = read_bench_runs(bench_dir, "bench_tail")
    if runs is None:
        return 1
    reference_mode = tail_reference_mode(bench_dir, reference_mode)
    pairs = tail_references(runs, reference_mode)
    if not pairs:
        print(f"{bench_dir}: no run of mode {reference_mode!r} to predict from (modes: "
              f"{', '.join(sorted({run['mode'] for run in runs}))})", file=sys.stderr)
        return 2
    rows = predict_bench_runs(pairs, cores, lambda run, target: {
        "mode": run["mode"], "kind": run["mode"], "latency_ms": 0,
        "engine_steps": uses_engine_steps(target, target.settings)})
    return print_bench_predictions(rows, f"predicted: from the {reference_mode!r} run of the same repeat; own: each "
                                         f"run from itself", {"bench_tail": str(bench_dir), "reference_mode": reference_mode})


if __name__ == "__main__":
    sys.exit(main())
