"""Predict what bounded staleness buys on GPU clusters no one here can run, with the simulator.

    .venv/bin/python -m tools.predict_cluster RUN_DIR
    .venv/bin/python -m tools.predict_cluster RUN_DIR --generators 8,64,256 --etas 0,2 --exponents 0.5

RUN_DIR is a finished run (`asyncgrpo train`) the simulator is calibrated from (asyncgrpo/sim/,
docs/SIMULATOR.md). What it contributes is the shape of the loop (the generator's and learner's
phases, the throttle, the queue, the push) and the spread of the learner's step times; the sizes of
the phases are replaced by a 7B step anatomy:

- Reference cluster (`--reference-generators`, default 8): 8 generators, each one GPU running vLLM,
  and one FSDP learner (its own GPUs, fixed whatever the number of generators), training
  `train.groups_per_step` = 512 groups (`--groups-per-step`) per step, so that each of up to 256
  generators has groups to call (2 groups at 256).
- At that size a synchronous step (`train.max_staleness=0`) is 77% generation (`--generation-frac`:
  the learner waiting for the generators; a share of the order reported for GRPO on 7B models,
  assumed here, not measured), 3% weight push
  (`--push-frac`: the learner busy sending the weights) and 20% the rest of the learner's step
  (prepare + train + its untimed work). The step's absolute length (`--step-s`, 100 s) only sets
  the scale: every figure is relative but for the seconds per step, and it makes the calibrating
  run's fixed per-call costs (scoring, sending, tokenizing: a millisecond) negligible.
- A generator's weight load after a push takes nothing beyond the push (`--weight-load-frac` 0):
  the push is the whole transfer (a broadcast into the engines, loaded in place). What generators
  lose by joining a broadcast while they would be generating is not modelled; `--weight-load-frac
  0.03` charges each generator the push's time per version as well (an upper bound).
- These are reached by setting sim.generate_scale, sim.train_scale and sim.push_latency_s (and
  sim.weight_load_s) so that the simulated synchronous step at the reference size has exactly
  this anatomy; the split achieved is printed.
- A generator's call asks for its part of the step (the step's groups over the generators); its
  time grows with that part by sim.call_size_exponent: 1.0 (ideal data parallel: half the groups,
  half the time) and 0.5
  (decode is memory-bound at small batches, so a smaller batch is less than proportionally
  faster). One table each, both anchored to the same reference step.
- Generation lengths are long-tailed: each call's time has a coefficient of variation of 0.3
  (`--generate-cv`, gamma noise), so a synchronous step waits for the slowest of N calls; the 77%
  at the reference size includes that wait for the slowest of 8.
- The learner's step times are drawn from the calibrating run's steps (scaled), the push is a
  constant, nothing contends for hardware (one GPU per generator, the learner's own GPUs), and the
  learner does not grow with the cluster: with enough generators it is the bottleneck.

Each (generators, max_staleness) is simulated for `--steps` learner steps and reported over those
after the first `--skip` (the same simulation stopped there is subtracted), so the pipeline's
fill at the start is left out. Columns: seconds per learner step; samples/s relative to the
synchronous run at the same size, and to the reference synchronous step (the anatomy's, as the
fit's 200-step simulation achieved it); the learner's idle fraction (waiting for generation); the
generators' mean idle fraction (waiting for tickets or rewards); the staleness (learner
version at the take minus the generating version) mean and max. Last, one JSON line with the
anatomy, the fitted knobs and every row.

Sampling error: a 40-step window with long-tailed calls moves a ratio by up to about 4% from one
`--seed` to another; the grid's own synchronous row at the reference size, which would be 1.00
exactly with no sampling error, shows its size. Takes about 20 s of one core (--steps trades
time for error).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from asyncgrpo.contract import admission_limit
from asyncgrpo.sim.calibration import Calibration
from asyncgrpo.sim.model import Result, rounded, simulate
from asyncgrpo.sim.settings import Settings, SimulationError
from tools import (comma_list, finite_float, nonnegative_float, nonnegative_int, positive_float,
                             positive_int)


@dataclass(frozen=True)
class Anatomy:
    """The synchronous step at the reference size, as fractions of it."""

    reference_generators: int = 8
    step_s: float = 100.0
    generation_frac: float = 0.77  # the learner waiting for the generators
    push_frac: float = 0.03  # the learner sending weights
    weight_load_frac: float = 0.0  # a generator loading a version, per version (part of the wait)

    @property
    def learner_frac(self) -> float:
        """Prepare + train + the learner's untimed work: the rest of the step."""
        return 1.0 - self.generation_frac - self.push_frac

    def check(self) -> None:
        if not (0 < self.generation_frac < 1 and 0 <= self.push_frac < 1 and self.learner_frac > 0):
            raise SimulationError(f"generation {self.generation_frac} + push {self.push_frac} must leave the "
                                  f"learner's train a positive part of the step")
        if not 0 <= self.weight_load_frac < self.generation_frac:  # NaN too
            raise SimulationError(f"weight load {self.weight_load_frac} must be >= 0 and below the generation "
                                  f"part {self.generation_frac}")
        if not 0 < self.step_s < math.inf:
            raise SimulationError(f"step seconds must be > 0 and finite (got {self.step_s})")
        if self.reference_generators < 1:
            raise SimulationError(f"the reference size must be at least 1 generator (got {self.reference_generators})")


# --------------------------------------------------------------------- steady-state figures


@dataclass(frozen=True)
class Steady:
    """A simulation's figures over its steps after the first `skip`."""

    steps: int
    seconds: float
    samples_per_s: float
    learner_seconds: dict[str, float]  # per phase, over the window
    learner_idle_frac: float  # (ack_wait + gen_wait) / the window
    generator_idle_frac: float  # mean over generators
    staleness_mean: float
    staleness_max: int

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps


@dataclass(frozen=True)
class Totals:
    """A simulation's figures as totals, which subtract (fractions do not)."""

    seconds: float = 0.0
    learner: dict[str, float] = field(default_factory=dict)  # seconds per phase
    generator_idle: list[float] = field(default_factory=list)  # idle seconds per generator
    staleness: dict[int, int] = field(default_factory=dict)  # groups per staleness

    @classmethod
    def of(cls, result: Result) -> Totals:
        return cls(seconds=result.sim_time_s, learner=result.learner_seconds,
                   generator_idle=[f * result.sim_time_s for f in result.generator_idle_fracs],
                   staleness=result.staleness_histogram)


def steady(calibration: Calibration, settings: Settings, skip: int) -> Steady:
    """Simulate `settings.steps` steps and subtract the same simulation stopped after `skip`.

    The model is deterministic for a seed and stopping it earlier changes nothing before the
    stop, so the difference is what the later steps did (the learner's exactly; a generator's idle
    time to within the reward wait of a call under way at the stop, which the model books when the
    call starts): the queue's fill at the start (every actor starts at version 0 with nothing
    queued) is left out."""
    if not 0 <= skip < settings.steps:
        raise SimulationError(f"skip {skip} must be below the simulated steps {settings.steps}")
    whole = Totals.of(simulate(calibration, settings))
    head = Totals.of(simulate(calibration, replace(settings, steps=skip))) if skip else Totals()
    seconds = whole.seconds - head.seconds
    learner = {phase: s - head.learner.get(phase, 0.0) for phase, s in whole.learner.items()}
    idle = [w - h for w, h in zip(whole.generator_idle, head.generator_idle or [0.0] * len(whole.generator_idle))]
    histogram = {k: n - head.staleness.get(k, 0) for k, n in whole.staleness.items() if n > head.staleness.get(k, 0)}
    groups = sum(histogram.values())
    steps = settings.steps - skip
    return Steady(
        steps=steps, seconds=seconds, samples_per_s=steps * settings.samples_per_step / seconds,
        learner_seconds=learner,
        learner_idle_frac=(learner.get("ack_wait", 0.0) + learner.get("gen_wait", 0.0)) / seconds,
        generator_idle_frac=statistics.fmean(idle) / seconds,
        staleness_mean=sum(k * n for k, n in histogram.items()) / groups if groups else 0.0,
        staleness_max=max(histogram, default=0))


# ---------------------------------------------------------------------- fitting the anatomy


@dataclass(frozen=True)
class Split:
    """The learner's seconds per step in each phase of a (synchronous) step."""

    wait_s: float  # ack_wait + gen_wait: generation, as the learner sees it
    train_s: float  # prepare + train
    push_s: float
    other_s: float  # the learner's untimed work (the calibrating run's)

    @property
    def step_s(self) -> float:
        return self.wait_s + self.train_s + self.push_s + self.other_s

    def fractions(self) -> dict[str, float]:
        step = self.step_s
        return {"generation": self.wait_s / step, "train": self.train_s / step, "push": self.push_s / step,
                "learner_other": self.other_s / step}


def split_of(window: Steady) -> Split:
    per_step = {k: v / window.steps for k, v in window.learner_seconds.items()}
    return Split(wait_s=per_step.get("ack_wait", 0.0) + per_step.get("gen_wait", 0.0),
                 train_s=per_step.get("train", 0.0), push_s=per_step.get("push", 0.0),
                 other_s=per_step.get("other", 0.0))


def cluster_settings(calibration: Calibration, num_generators: int, max_staleness: int, groups_per_step: int,
                     steps: int, exponent: float, generate_cv: float, seed: int) -> Settings:
    """The cluster's settings (the default policies), everything else the calibrating run's."""
    return replace(
        calibration.settings, num_generators=num_generators, groups_per_step=groups_per_step,
        max_staleness=max_staleness, stale_policy="both", groups_per_call=0,
        push_every_steps=1,
        # Under the throttle several generators need room for every step they may run ahead.
        capacity_groups=admission_limit(0, max_staleness, groups_per_step),
        steps=steps, seed=seed,
        # Step times drawn from all of the run's steps, none replayed in order: the calibrating
        # run's own sequence (its slow episodes on a shared machine) means nothing on a cluster.
        replay=False, warmup_steps=0,
        generate_cv=generate_cv, call_size_exponent=exponent)


def fit_anatomy(calibration: Calibration, anatomy: Anatomy, base: Settings, skip: int,
                tolerance: float = 1e-4, max_rounds: int = 40) -> tuple[Settings, Split]:
    """sim.* knobs on `base` (a synchronous run at the reference size) that give its step
    `anatomy`; returns them and the split the simulation achieves.

    The push is a constant, so its knob is exact. Training time is proportional to train_scale
    and the wait to generate_scale up to small fixed costs (weight loads, scoring, sending), but the
    two knobs share the simulation's random draws, so both are corrected together until every
    fraction is within `tolerance` of its target."""
    anatomy.check()
    target_wait = anatomy.generation_frac * anatomy.step_s
    target_learner = anatomy.learner_frac * anatomy.step_s  # train + the learner's other time
    part = base.groups_per_step / base.num_generators  # groups per call (rollout.groups_per_call=0)
    run = calibration.settings
    # First guesses from the calibration's means; the rounds below correct for the rest (the wait
    # for the slowest call, the fixed costs, the draws).
    mean_train = statistics.fmean(calibration.train_s) * base.groups_per_step / run.groups_per_step
    mean_call = statistics.fmean(g.generate_s * (part / g.call_groups) ** base.call_size_exponent
                                 for g in calibration.generators)
    settings = replace(base, train_scale=target_learner / mean_train, generate_scale=target_wait / mean_call,
                       push_latency_s=anatomy.push_frac * anatomy.step_s,
                       weight_load_s=anatomy.weight_load_frac * anatomy.step_s)
    for _ in range(max_rounds):
        split = split_of(steady(calibration, settings, skip))
        fractions = split.fractions()
        learner_frac = fractions["train"] + fractions["learner_other"]
        if (abs(fractions["generation"] - anatomy.generation_frac) <= tolerance
                and abs(learner_frac - anatomy.learner_frac) <= tolerance
                and abs(fractions["push"] - anatomy.push_frac) <= tolerance):
            return settings, split
        settings = replace(
            settings,
            train_scale=settings.train_scale * max(target_learner - split.other_s, 1e-9) / split.train_s,
            generate_scale=settings.generate_scale * target_wait / split.wait_s)
    raise SimulationError(f"the anatomy was not reached in {max_rounds} rounds (last split {fractions}); the "
                          f"calibrating run's fixed costs may be too large a part of the step: raise --step-s")


# ------------------------------------------------------------------------------ predictions


@dataclass(frozen=True)
class Row:
    call_size_exponent: float
    generators: int
    max_staleness: int
    step_s: float
    samples_per_s: float
    vs_sync_same_n: float  # samples/s over the synchronous run's with as many generators
    # over the synchronous run's at the reference size: the anatomy's step, as the fit's long
    # simulation achieved it (the same samples per step, so a ratio of step times)
    vs_sync_reference: float
    learner_idle_frac: float
    generator_idle_frac: float
    staleness_mean: float
    staleness_max: int


def predict(calibration: Calibration, anatomy: Anatomy, *, generators: list[int], etas: list[int],
            exponent: float, groups_per_step: int, steps: int, skip: int, fit_steps: int, generate_cv: float,
            seed: int) -> tuple[Settings, Split, list[Row]]:
    """Fit the anatomy for `exponent`, then simulate every (generators, max_staleness).

    The fit simulates `fit_steps` steps (cheap at the reference size): the knobs then rest on the
    mean of many slowest-of-N calls rather than a short window's, and "vs sync at the reference
    size" divides by that step, so the grid's own synchronous row at the reference size shows its
    window's sampling error (a few %) as its departure from 1.00."""
    def settings_for(n: int, eta: int, steps: int = steps) -> Settings:
        return cluster_settings(calibration, n, eta, groups_per_step, steps, exponent, generate_cv, seed)

    fitted, split = fit_anatomy(calibration, anatomy, settings_for(anatomy.reference_generators, 0, fit_steps), skip)
    knobs = {name: getattr(fitted, name)
             for name in ("generate_scale", "train_scale", "push_latency_s", "weight_load_s")}

    done: dict[tuple[int, int], Steady] = {}

    def run(n: int, eta: int) -> Steady:
        if (n, eta) not in done:
            done[n, eta] = steady(calibration, replace(settings_for(n, eta), **knobs), skip)
        return done[n, eta]

    rows = []
    for n in generators:
        results = {eta: run(n, eta) for eta in sorted({0, *etas})}  # sync at this size: the baseline
        for eta in etas:
            r = results[eta]
            rows.append(Row(call_size_exponent=exponent, generators=n, max_staleness=eta, step_s=r.step_s,
                            samples_per_s=r.samples_per_s, vs_sync_same_n=r.samples_per_s / results[0].samples_per_s,
                            vs_sync_reference=split.step_s / r.step_s, learner_idle_frac=r.learner_idle_frac,
                            generator_idle_frac=r.generator_idle_frac, staleness_mean=r.staleness_mean,
                            staleness_max=r.staleness_max))
    return fitted, split, rows


def describe_fit(anatomy: Anatomy, exponent: float, fitted: Settings, split: Split) -> str:
    f = split.fractions()
    part = fitted.groups_per_step // fitted.num_generators
    return (f"call_size_exponent {exponent:g}: sim.generate_scale={fitted.generate_scale:.6g} "
            f"sim.train_scale={fitted.train_scale:.6g} sim.push_latency_s={fitted.push_latency_s:g} "
            f"sim.weight_load_s={fitted.weight_load_s:g}\n"
            f"  synchronous step at {anatomy.reference_generators} generators ({part} groups each): "
            f"{split.step_s:.2f} s = generation {f['generation']:.4f} + train {f['train']:.4f} + push "
            f"{f['push']:.4f} + learner other {f['learner_other']:.4f} "
            f"(target {anatomy.generation_frac:g} / {anatomy.learner_frac:g} with other / {anatomy.push_frac:g})")


def format_table(rows: list[Row], reference_generators: int) -> str:
    """One markdown table (the README's format)."""
    lines = [(f"| generators | max_staleness | s per step | vs sync, same N | vs sync at {reference_generators} | "
              f"learner idle | generator idle | staleness mean / max |"),
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.generators} | {r.max_staleness} | {r.step_s:.1f} | {r.vs_sync_same_n:.2f} | "
              f"{r.vs_sync_reference:.2f} | {r.learner_idle_frac:.3f} | {r.generator_idle_frac:.3f} | "
              f"{r.staleness_mean:.2f} / {r.staleness_max} |" for r in rows]
    return "\n".join(lines)


EXPONENT_MEANING = {1.0: "ideal data parallel: a call's time is proportional to its groups",
                    0.5: "decode memory-bound at small batches: half the groups take 0.71 of the time"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.predict_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a finished run to calibrate from")
    parser.add_argument("--generators", default="8,16,32,64,128,256", help="cluster sizes (default: 8,...,256)")
    parser.add_argument("--etas", default="0,1,2,4", help="train.max_staleness values (default: 0,1,2,4)")
    parser.add_argument("--exponents", default="1.0,0.5", help="sim.call_size_exponent values (default: 1.0,0.5)")
    parser.add_argument("--reference-generators", type=positive_int, default=8,
                        help="where the anatomy holds (default: 8)")
    parser.add_argument("--generation-frac", type=finite_float, default=0.77, help="of the reference synchronous step")
    parser.add_argument("--push-frac", type=finite_float, default=0.03, help="of the reference synchronous step")
    parser.add_argument("--weight-load-frac", type=finite_float, default=0.0, help="a generator's load per version")
    parser.add_argument("--step-s", type=positive_float, default=100.0, help="the reference synchronous step's seconds")
    parser.add_argument("--groups-per-step", type=positive_int, default=512,
                        help="train.groups_per_step (default: 512)")
    parser.add_argument("--generate-cv", type=nonnegative_float, default=0.3, help="sim.generate_cv (default: 0.3)")
    parser.add_argument("--steps", type=int, default=48, help="learner steps per simulation (default: 48)")
    parser.add_argument("--skip", type=int, default=8, help="first steps left out of the figures (default: 8)")
    parser.add_argument("--fit-steps", type=int, default=200, help="steps of the fit's simulations (default: 200)")
    parser.add_argument("--seed", type=int, default=0, help="sim.seed")
    args = parser.parse_args(argv)
    try:
        generators = comma_list(args.generators, positive_int, what="--generators")
        etas = comma_list(args.etas, nonnegative_int, what="--etas")
        exponents = comma_list(args.exponents, finite_float, what="--exponents")
    except argparse.ArgumentTypeError as err:
        parser.error(f"a comma-separated list of numbers was expected ({err})")
    anatomy = Anatomy(reference_generators=args.reference_generators, step_s=args.step_s,
                      generation_frac=args.generation_frac, push_frac=args.push_frac,
                      weight_load_frac=args.weight_load_frac)
    try:
        calibration = Calibration.from_run(args.run_dir)
        print(f"calibrated from {calibration.run_dir}: {calibration.settings.steps} steps, "
              f"{calibration.settings.num_generators} generator(s), max_staleness {calibration.settings.max_staleness}, "
              f"{calibration.measured.samples_per_s:.1f} samples/s measured")
        print(f"anatomy: a synchronous step at {anatomy.reference_generators} generators (one GPU each, vLLM) and one "
              f"FSDP learner is {anatomy.step_s:g} s: generation {anatomy.generation_frac:g}, train (+ learner other) "
              f"{anatomy.learner_frac:.2f}, push {anatomy.push_frac:g}; weight load {anatomy.weight_load_frac:g}; "
              f"{args.groups_per_step} groups per step; sim.generate_cv={args.generate_cv:g}; figures over steps "
              f"{args.skip + 1}..{args.steps}")
        payload: dict[str, Any] = {"run_dir": calibration.run_dir, "anatomy": asdict(anatomy),
                                   "groups_per_step": args.groups_per_step, "generate_cv": args.generate_cv,
                                   "steps": args.steps, "skip": args.skip,
                                   "fit_steps": args.fit_steps, "seed": args.seed, "fits": {}, "rows": []}
        for exponent in exponents:
            fitted, split, rows = predict(calibration, anatomy, generators=generators, etas=etas, exponent=exponent,
                                          groups_per_step=args.groups_per_step, steps=args.steps, skip=args.skip,
                                          fit_steps=args.fit_steps, generate_cv=args.generate_cv, seed=args.seed)
            meaning = EXPONENT_MEANING.get(exponent, "")
            print(f"\n{describe_fit(anatomy, exponent, fitted, split)}\n"
                  f"sim.call_size_exponent={exponent:g}{f' ({meaning})' if meaning else ''}:")
            print(format_table(rows, anatomy.reference_generators), flush=True)
            payload["fits"][f"{exponent:g}"] = {
                "generate_scale": fitted.generate_scale, "train_scale": fitted.train_scale,
                "push_latency_s": fitted.push_latency_s, "weight_load_s": fitted.weight_load_s,
                "reference_step_s": split.step_s, "split": split.fractions()}
            payload["rows"] += [asdict(r) for r in rows]
    except SimulationError as err:
        print(f"predict_cluster: {err}", file=sys.stderr)
        return 2
    print(json.dumps(rounded(payload)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
