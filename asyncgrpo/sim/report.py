"""What `asyncgrpo simulate` prints: the run as measured beside the simulation, as a small table
and then one JSON line."""

from __future__ import annotations

import json

from asyncgrpo.sim.calibration import Calibration
from asyncgrpo.sim.model import Result, simulate, uses_engine_steps
from asyncgrpo.sim.settings import Settings, apply_overrides, changed_keys


def report(calibration: Calibration, settings: Settings, result: Result) -> str:
    """A small table (the run as measured beside the simulation), then the JSON line last."""
    m = calibration.measured
    changed = changed_keys(calibration.settings, settings)
    rows = [("samples/s", m.samples_per_s, result.samples_per_s),
            ("steady samples/s", m.steady_samples_per_s, result.steady_samples_per_s),
            ("learner idle frac", m.learner_idle_frac, result.learner_idle_frac),
            ("generator idle frac", m.generator_idle_frac, result.generator_idle_frac),
            ("staleness mean", m.staleness_mean, result.staleness_mean)]
    lines = [f"run: {calibration.run_dir} ({calibration.settings.steps} steps)",
             "changed: " + (", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()) or "nothing (the run's own "
                                                                                              "settings)")]
    if calibration.recorded_dispatch != "tickets":
        lines.append(f"note: the run was recorded under the removed {calibration.recorded_dispatch} dispatch: its "
                     f"times calibrate the simulation of tickets, and its measured figures are of the old dispatch")
    actors = settings.num_generators + settings.world_size
    if not settings.cores and calibration.device == "cpu" and (calibration.machine_cores or actors) < actors:
        lines.append(f"note: {actors} actors, each simulated on a core of its own, where the run had "
                     f"{calibration.machine_cores} CPU cores; sim.cores={calibration.machine_cores} makes them share them")
    if settings.cores:
        lines.append(f"processors: simulated on {settings.cores} shared cores (sim.cores); the run's actors "
                     + (f"shared {calibration.shared_cores} cores, taken out of its times first"
                        if calibration.shared_cores else "had cores of their own"))
    engine = "steps" if uses_engine_steps(calibration, settings) else "calls"
    lines.append("generation: " + ("the engine step by step (sim.engine=steps: the run's step cost and group lengths)"
                                   if engine == "steps" else "call by call (sim.engine=calls: the run's mean call time)"))
    lines.append(f"{'':<22}{'run (measured)':>16}{'simulated':>12}")
    lines += [f"{name:<22}{run:>16.3f}{sim:>12.3f}" for name, run, sim in rows]
    lines.append(f"{'staleness histogram':<22}{json.dumps(m.staleness_histogram):>16}  "
                 f"{json.dumps(result.staleness_histogram)}")
    payload = {**result.as_dict(), "staleness_histogram": {str(k): v for k, v in result.staleness_histogram.items()},
               "measured_samples_per_s": round(m.samples_per_s, 6),
               "ratio_to_measured": round(result.samples_per_s / m.samples_per_s, 4) if m.samples_per_s else None,
               "changed": {k: b for k, (_, b) in changed.items()},
               "recorded_dispatch": calibration.recorded_dispatch, "engine": engine}
    lines.append(json.dumps(payload))
    return "\n".join(lines)


def run_command(run_dir: str, overrides: list[str]) -> str:
    """What `asyncgrpo simulate` prints; raises SimulationError (one line) on bad input."""
    calibration = Calibration.from_run(run_dir)
    settings = apply_overrides(calibration.settings, overrides)
    return report(calibration, settings, simulate(calibration, settings))
