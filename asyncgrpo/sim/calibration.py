"""Reading a finished run directory into the times a simulation replays: config.yaml (the run's
settings), metrics.jsonl (each learner step's phases), summary.json (each generator's totals, what
the run measured) and actors.json (whether its actors shared cores). docs/SIMULATOR.md says how
each time is derived."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.contract import even_split
from asyncgrpo.sim.envwaits import expected_rounds
from asyncgrpo.sim.settings import MAX_STEPS, Settings, SimulationError


@dataclass(frozen=True)
class GeneratorTimes:
    """One measured generator's costs, from its totals in summary.json (docs/SIMULATOR.md)."""

    generate_s: float  # one vLLM call of `call_groups` groups: gen_time/generate_s / calls
    call_groups: int  # groups per call in the run: rollout.groups_per_call, or its part of a step (call_sizes)
    score_s_per_group: float  # gen_time/score_s / groups scored
    score_wait_s: float  # per call: gen_time/score_wait_s / calls (rewards not ready; idle)
    send_s_per_group: float  # (gen_time/send_s - gen/send_blocked_s) / groups sent
    weight_load_s: float  # per version loaded: gen/weight_load_s / gen/weight_loads
    other_s: float  # per call: gen/wall_s minus every timed phase, over calls (tokenizing, ...)
    first_call_extra_s: float = 0.0  # the engine's warm-up, added to its first call (_split_first_call)
    # Environment step calls per episode: (gen/env_calls - episodes) / episodes (every episode's reset
    # is a call too); 0 without an environment. With env.max_turns it sets a call's rounds of waits
    # (asyncgrpo/sim/envwaits.py).
    env_calls_per_episode: float = 0.0
    # Per round of calls, what an environment wait took beyond env.latency_s (the calls' threads, the
    # answers' trip back): gen_time/env_wait_s / calls / rounds - the run's env.latency_s, at least 0.
    env_overhead_s: float = 0.0
    # The engine step by step (asyncgrpo/sim/engine.py), from gen/engine_step_fit: a step's seconds
    # are step_fixed_s + step_s_per_sequence x the sequences it runs; both 0 where the run did not
    # record the fit. step_warmup_s: gen_time/generate_s beyond what the fit gives for the run's
    # steps (the first steps' compilation), paid by the first step.
    step_fixed_s: float = 0.0
    step_s_per_sequence: float = 0.0
    step_warmup_s: float = 0.0
    ask_s: float = 0.0  # per ticket request: gen_time/ask_s / gen/ticket_requests
    env_answer_s: float = 0.0  # applying one environment answer: gen/env_answers_s / gen/env_answers
    other_s_per_step: float = 0.0  # the untimed rest of gen/wall_s (other_s's), per engine step

    @property
    def has_step_fit(self) -> bool:
        return self.step_fixed_s + self.step_s_per_sequence > 0


# GeneratorTimes' fields that are work on the generator's processor (what contention stretches);
# the reward wait and the environment's overhead are not.
PROCESSOR_TIMES = ("generate_s", "score_s_per_group", "send_s_per_group", "weight_load_s", "other_s",
                   "first_call_extra_s", "step_fixed_s", "step_s_per_sequence", "step_warmup_s", "ask_s",
                   "env_answer_s", "other_s_per_step")


@dataclass(frozen=True)
class Measured:
    """What the run itself reported, to compare a simulation of its own settings with."""

    samples_per_s: float  # summary.json: samples / train_s
    steady_samples_per_s: float  # metrics.jsonl, steps after the warm-up: perf/samples / time/step_s
    learner_idle_frac: float  # summary.json: learner.idle_frac
    generator_idle_frac: float  # mean over generators of gen/idle_frac
    staleness_mean: float  # from learner.staleness_histogram
    staleness_histogram: dict[int, int]


@dataclass(frozen=True)
class Calibration:
    run_dir: str
    settings: Settings  # the run's own (sim.steps = its number of steps)
    generators: list[GeneratorTimes]
    train_s: list[float]  # per step, in order: time/prepare_s + time/train_s
    push_s: list[float]  # per push, in order: time/push_s of the steps that pushed
    learner_other_s: float  # per step: the driver's train_s minus the learner's timed phases, over steps
    measured: Measured
    # The processors the run's actors shared (actors.json): 0, none (each pinned to cores of its
    # own); n, the n cores of their one machine (not pinned); None, not known (a run from before
    # driver_cores was recorded, or actors on several nodes).
    shared_cores: int | None = None
    machine_cores: int | None = None  # the cores the run's actors were planned on (actors.json driver_cores)
    device: str = ""  # the run's config.yaml device ("cpu", "cuda")
    # The dispatch the run was recorded under (recorded_dispatch): "tickets", or "shares", removed
    # since; such a run calibrates only what does not depend on it (docs/SIMULATOR.md).
    recorded_dispatch: str = "tickets"
    # Environment step calls one episode may make (the run's env.max_turns); 0: no environment.
    env_max_calls: int = 0
    # Completion lengths of groups the run sent (every generator's gen/group_lengths: per group, per
    # sample, tokens per turn): what a simulated engine draws a group's decoding from; empty where
    # the run did not record them.
    group_lengths: tuple[tuple[tuple[int, ...], ...], ...] = ()

    @classmethod
    def from_run(cls, run_dir: str | Path) -> Calibration:
        """Read config.yaml, metrics.jsonl and summary.json; a missing or unusable file is one line
        (SimulationError), and so is a value of the wrong type or shape in any of them."""
        try:
            return cls._from_run(Path(run_dir))
        except SimulationError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, OSError) as err:
            raise SimulationError(f"{run_dir}: a file of the run does not read as this version writes it "
                                  f"({type(err).__name__}: {' '.join(str(err).split())[:200]})") from None

    @classmethod
    def _from_run(cls, path: Path) -> Calibration:
        config = _read_config(path)
        actors = read_actors(path / "actors.json")
        summary = _read_json(path / "summary.json")
        steps = _step_records(path, summary)
        settings = _run_settings(config, steps=min(len(steps), MAX_STEPS))
        dispatch = recorded_dispatch(config, path / "config.yaml")
        reports = _generator_reports(path, summary, settings)
        first_step_wait = float(steps[0].get("time/ack_wait_s", 0.0)) + float(steps[0].get("time/gen_wait_s", 0.0))
        parts = even_split(settings.num_generators, settings.groups_per_step)
        env = _env_max_calls(config)
        generators = [_generator_times(i, report, call_groups, part, first_step_wait,
                                       EnvShape(env, settings.samples_per_prompt, settings.env_latency_s))
                      for i, (report, call_groups, part) in enumerate(zip(reports, settings.call_groups(), parts))]

        def phase(key: str) -> list[float]:
            return [float(r.get(f"time/{key}_s", 0.0)) for r in steps]

        timed = sum(sum(phase(key)) for key in ("ack_wait", "gen_wait", "prepare", "train", "push"))
        # The driver's clock (train_s) also covers what no learner phase times: metrics, the step
        # records' trip through Ray, checkpoints.
        wall = float(summary.get("train_s") or sum(phase("step")))
        pushed = [float(r.get("time/push_s", 0.0)) for r in steps if int(r["step"]) % settings.push_every_steps == 0]
        return cls(run_dir=str(path), settings=settings, generators=generators,
                   train_s=[p + t for p, t in zip(phase("prepare"), phase("train"))], push_s=pushed,
                   learner_other_s=max(0.0, (wall - timed) / len(steps)),
                   measured=_measured(summary, reports, steps[settings.warmup_steps:] or steps),
                   shared_cores=_shared_cores(actors), machine_cores=_machine_cores(actors),
                   device=str(config.get("device", "")), recorded_dispatch=dispatch, env_max_calls=env,
                   group_lengths=_group_lengths(reports))

    def scaled(self, learner: float, generators: list[float]) -> Calibration:
        """Every processor phase's time x a factor per actor (the learner's, each generator's); the
        reward wait, which uses no processor here, is kept."""
        def generator(times: GeneratorTimes, f: float) -> GeneratorTimes:
            return replace(times, **{name: getattr(times, name) * f for name in PROCESSOR_TIMES})

        return replace(self, generators=[generator(t, f) for t, f in zip(self.generators, generators)],
                       train_s=[t * learner for t in self.train_s], push_s=[t * learner for t in self.push_s],
                       learner_other_s=self.learner_other_s * learner)


def read_actors(path: Path) -> dict[str, Any]:
    """A run's actors.json ({} when missing or unreadable: what it would say is then unknown)."""
    try:
        actors = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return actors if isinstance(actors, dict) else {}


def _machine_cores(actors: dict[str, Any]) -> int | None:
    driver_cores = actors.get("driver_cores")
    return len(driver_cores) if isinstance(driver_cores, list) and driver_cores else None


def _shared_cores(actors: dict[str, Any]) -> int | None:
    """Calibration.shared_cores from a run's actors.json."""
    try:
        cores = [*actors["generator_cores"], *actors["learner_cores"]]
        nodes = {n["node_id"] for n in [*actors["learner_nodes"], *actors["generator_nodes"]]}
    except (KeyError, TypeError):
        return None
    pinned = [set(c) for c in cores if isinstance(c, list)]
    if len(pinned) == len(cores) and all(pinned) and sum(map(len, pinned)) == len(set().union(*pinned)):
        return 0  # every actor on cores of its own
    return _machine_cores(actors) if len(nodes) == 1 else None


def _measured(summary: dict[str, Any], reports: list[dict[str, Any]], steady: list[dict[str, Any]]) -> Measured:
    learner = summary.get("learner") or {}
    histogram = {int(k): int(v) for k, v in (learner.get("staleness_histogram") or {}).items()}
    steady_s = sum(float(r.get("time/step_s", 0.0)) for r in steady)
    return Measured(
        samples_per_s=float(summary.get("samples_per_s", 0.0)),
        steady_samples_per_s=sum(float(r.get("perf/samples", 0.0)) for r in steady) / steady_s if steady_s else 0.0,
        learner_idle_frac=float(learner.get("idle_frac", 0.0)),
        generator_idle_frac=sum(float(g.get("gen/idle_frac", 0.0)) for g in reports) / len(reports),
        staleness_mean=histogram_mean(histogram),
        staleness_histogram=histogram,
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SimulationError(f"{path} not found (summary.json is written when a run ends; is this a run directory?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SimulationError(f"{path}: not JSON ({err})") from None


def _read_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise SimulationError(f"{run_dir}: no such directory")
    if not path.is_file():
        raise SimulationError(f"{path} not found; is this a run directory?")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SimulationError(f"{path}: not YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise SimulationError(f"{path}: not a config mapping")
    return config


def _run_settings(config: dict[str, Any], steps: int) -> Settings:
    def get(key: str) -> Any:
        value: Any = config
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise SimulationError(f"config.yaml has no {key}")
            value = value[part]
        return value

    settings = Settings(
        num_generators=int(get("rollout.num_generators")), groups_per_step=int(get("train.groups_per_step")),
        samples_per_prompt=int(get("rollout.samples_per_prompt")), max_staleness=int(get("train.max_staleness")),
        stale_policy=str(get("train.stale_policy")), groups_per_call=int(get("rollout.groups_per_call")),
        world_size=int(get("learner.world_size")), capacity_groups=int(get("queue.capacity_groups")),
        push_every_steps=int(get("weights.push_every_steps")), steps=steps,
        env_latency_s=float((config.get("env") or {}).get("latency_s", 0.0)),  # absent in older runs: none
        max_backlog_versions=int((config.get("weights") or {}).get(  # absent in older runs: the default
            "max_backlog_versions", Settings.max_backlog_versions)),
        # Absent in runs from before the continuous engine: they called vLLM call by call.
        continuous=bool(get("rollout").get("continuous", False)),
        max_running_seqs=int(get("rollout").get("max_running_seqs", Settings.max_running_seqs)),
        inflight_updates=bool(get("rollout").get("inflight_updates", False)),
        fixed_staleness=int(get("train").get("fixed_staleness", -1)))  # absent in older runs: off
    settings.check()
    return settings


def _step_records(run_dir: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """This run's step records: a resumed run's metrics.jsonl also holds the earlier run's steps,
    which its summary's generator totals do not cover."""
    from asyncgrpo.metrics.runs import RunReadError, latest_steps, read_records

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SimulationError(f"{path} not found; is this a run directory?")
    try:  # a run killed mid-write leaves a partial last line: skipped, as plot skips it
        records, _ = read_records(path)
    except RunReadError as err:
        raise SimulationError(str(err)) from None
    resumed_at = int(summary.get("resumed_at_step") or 0)
    steps = [r for r in latest_steps([r for r in records if "time/train_s" in r]) if int(r["step"]) > resumed_at]
    if not steps:
        raise SimulationError(f"{path} has no learner step records")
    return steps


def _generator_reports(run_dir: Path, summary: dict[str, Any], settings: Settings) -> list[dict[str, Any]]:
    reports = summary.get("generators")
    if not isinstance(reports, list) or len(reports) != settings.num_generators:
        raise SimulationError(f"{run_dir / 'summary.json'} has no generator reports for rollout.num_generators="
                              f"{settings.num_generators} (status: {summary.get('status', 'unknown')})")
    return reports


def recorded_dispatch(config: dict[str, Any], path: Path) -> str:
    """The dispatch a run's config.yaml was recorded under: "tickets", or "shares" (removed).

    Runs before the shares dispatch was removed record rollout.dispatch, or (older still) default to
    shares without the key; runs since record neither it nor queue.full_policy, which every config
    had until then. Hand-set shares sized each generator's calls unevenly, which a calibration for
    tickets cannot take apart: refused in one line."""
    rollout = config.get("rollout") if isinstance(config.get("rollout"), dict) else {}
    queue = config.get("queue") if isinstance(config.get("queue"), dict) else {}
    dispatch = rollout.get("dispatch", "shares" if "full_policy" in queue else "tickets")
    if dispatch not in ("shares", "tickets"):
        raise SimulationError(f"{path}: rollout.dispatch must be tickets or shares (got {dispatch!r})")
    if dispatch == "shares" and rollout.get("generator_shares"):
        raise SimulationError(f"{path}: recorded under the removed shares dispatch with rollout.generator_shares="
                              f"{rollout['generator_shares']}, which sized each generator's calls: calibrate from a "
                              f"run under tickets")
    return str(dispatch)


@dataclass(frozen=True)
class EnvShape:
    """What a run's config says of its environment calls, for calibrating a generator's waits."""

    max_calls: int  # env.max_turns; 0 without an environment
    samples_per_prompt: int  # episodes per group
    latency_s: float  # env.latency_s


def _env_max_calls(config: dict[str, Any]) -> int:
    """Calibration.env_max_calls: env.max_turns where the run had an environment (env.name), else 0."""
    env = config.get("env") if isinstance(config.get("env"), dict) else {}
    return int(env.get("max_turns", 0)) if env.get("name") else 0


def _env_times(report: dict[str, Any], sent: int, calls: int, call_groups: int, env: EnvShape) -> tuple[float, float]:
    """(env_calls_per_episode, env_overhead_s) of a generator's totals; (0, 0) without environment calls."""
    episodes = sent * env.samples_per_prompt
    per_episode = max(0.0, float(report.get("gen/env_calls", 0)) - episodes) / episodes if env.max_calls else 0.0
    rounds = expected_rounds(per_episode, env.max_calls, call_groups * env.samples_per_prompt)
    if rounds <= 0:
        return 0.0, 0.0
    waited = float(report.get("gen_time/env_wait_s", 0.0)) / calls / rounds
    return per_episode, max(0.0, waited - env.latency_s)


def _generator_times(index: int, report: dict[str, Any], call_groups: int, first_step_groups: int,
                     first_step_wait_s: float, env: EnvShape) -> GeneratorTimes:
    def total(key: str) -> float:
        value = float(report.get(key, 0.0))
        if not math.isfinite(value):
            raise SimulationError(f"generator {index} reports {key}={value}: not a measurement")
        return value

    sent = int(total("gen/groups_sent"))
    if sent <= 0:
        raise SimulationError(f"generator {index} sent no groups: nothing to calibrate its calls from")
    if total("gen_time/generate_s") <= 0:
        # A call that takes no time would let an unthrottled generator loop forever at one instant.
        raise SimulationError(f"generator {index} reports no generation time (gen_time/generate_s)")
    # Calls are not counted in the summary: with inline rewards every call's groups are sent before
    # the next call, so groups sent / groups per call is exact but for a last call cut short by the
    # shutdown (one call at most, which only rounds up here).
    calls = math.ceil(sent / call_groups)
    timed = sum(total(f"gen_time/{phase}_s")
                for phase in ("weights", "ask", "generate", "score", "score_wait", "throttle", "exhausted", "send"))
    loads = total("gen/weight_loads")
    env_calls_per_episode, env_overhead_s = _env_times(report, sent, calls, call_groups, env)
    if env_calls_per_episode:  # modelled as waits of their own (model.Model.env_wait_s), not as other time
        timed += total("gen_time/env_wait_s")
    times = GeneratorTimes(
        generate_s=total("gen_time/generate_s") / calls,
        call_groups=call_groups,
        score_s_per_group=total("gen_time/score_s") / sent,
        score_wait_s=total("gen_time/score_wait_s") / calls,
        send_s_per_group=max(0.0, total("gen_time/send_s") - total("gen/send_blocked_s")) / sent,
        weight_load_s=total("gen/weight_load_s") / loads if loads else 0.0,
        other_s=max(0.0, total("gen/wall_s") - timed) / calls,
        env_calls_per_episode=env_calls_per_episode, env_overhead_s=env_overhead_s,
    )
    times = replace(times, **_engine_step_times(report, max(0.0, total("gen/wall_s") - timed)))
    env_wait_s = env_wait_per_call(times, call_groups * env.samples_per_prompt, env.max_calls, env.latency_s)
    return _split_first_call(times, calls, math.ceil(first_step_groups / call_groups), first_step_wait_s, env_wait_s)


def _engine_step_times(report: dict[str, Any], untimed_s: float) -> dict[str, float]:
    """GeneratorTimes' step_* fields, ask_s and other_s_per_step from a generator's totals; {} where it
    recorded no gen/engine_step_fit (a run from before it, or one whose steps all ran one batch size)."""
    fit, steps = report.get("gen/engine_step_fit"), int(report.get("gen/engine_steps") or 0)
    if not isinstance(fit, dict) or steps <= 0:
        return {}
    fixed_s, per_sequence_s = float(fit.get("fixed_s", 0.0)), float(fit.get("per_sequence_s", 0.0))
    if fixed_s < 0 or per_sequence_s < 0 or fixed_s + per_sequence_s <= 0:
        raise SimulationError(f"gen/engine_step_fit must have fixed_s, per_sequence_s >= 0, not both 0 (got {fit})")
    running = float(report.get("gen/mean_running_sequences") or 0.0) * steps
    fitted_s = fixed_s * steps + per_sequence_s * running
    requests = int(report.get("gen/ticket_requests") or 0)
    answers, answers_s = int(report.get("gen/env_answers") or 0), float(report.get("gen/env_answers_s", 0.0))
    return {"step_fixed_s": fixed_s, "step_s_per_sequence": per_sequence_s,
            # Answers applied between steps are in gen_time/generate_s but charged apart (env_answer_s).
            "step_warmup_s": max(0.0, float(report.get("gen_time/generate_s", 0.0)) - fitted_s - answers_s),
            "ask_s": float(report.get("gen_time/ask_s", 0.0)) / requests if requests else 0.0,
            "env_answer_s": answers_s / answers if answers else 0.0,
            "other_s_per_step": untimed_s / steps}


def _group_lengths(reports: list[dict[str, Any]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Every generator's gen/group_lengths, pooled: per group, per sample, its tokens per turn (a
    sample recorded as one count, as the first runs did, is one turn); a malformed entry is one line."""
    def turns(sample: Any) -> tuple[int, ...]:
        counts = [sample] if isinstance(sample, int) else sample
        if not (isinstance(counts, list) and all(isinstance(n, int) and n >= 0 for n in counts)):
            raise SimulationError(f"gen/group_lengths holds a sample {sample!r}, not token counts per turn")
        return tuple(counts)

    pooled = []
    for report in reports:
        for group in report.get("gen/group_lengths") or ():
            if not (isinstance(group, list) and group):
                raise SimulationError(f"gen/group_lengths holds {group!r}, not a group's samples")
            pooled.append(tuple(turns(sample) for sample in group))
    return tuple(pooled)


def env_wait_per_call(times: GeneratorTimes, episodes: int, max_calls: int, latency_s: float) -> float:
    """How long a call of `episodes` episodes waits on its environment: its expected rounds of calls
    (asyncgrpo/sim/envwaits.py) x (env.latency_s + the measured overhead per round); 0 without calls."""
    if not times.env_calls_per_episode:
        return 0.0
    return expected_rounds(times.env_calls_per_episode, max_calls, episodes) * (latency_s + times.env_overhead_s)


def _split_first_call(times: GeneratorTimes, calls: int, first_calls: int, first_step_wait_s: float,
                      env_wait_s: float) -> GeneratorTimes:
    """Take an engine's warm-up out of the mean call time.

    An engine's first call can take many times a later one (on CPU, vLLM compiles then), and a mean
    over a short run's calls spreads that over every call. The learner's first step waited
    (`first_step_wait_s`: its ack_wait + gen_wait) for the `first_calls` calls that make its part,
    generators and learner starting together; with G the total generation time over `calls` calls
    and c a call's other costs (its environment wait, `env_wait_s`, included), a later call's g and the first call's extra W solve
        W + calls x g = G    and    W + first_calls x (g + c) = first_step_wait_s.
    The slowest generator sets that wait, so a faster one's W comes out too large. No warm-up is
    taken out when the run is too short to tell (no later calls) or the solution is not positive.
    """
    if calls <= first_calls:
        return times
    total = times.generate_s * calls
    per_call_rest = (times.score_s_per_group + times.send_s_per_group) * times.call_groups \
        + times.score_wait_s + times.other_s + env_wait_s
    later = (total - first_step_wait_s + first_calls * per_call_rest) / (calls - first_calls)
    extra = total - calls * later
    if later <= 0 or extra <= 0:
        return times
    return replace(times, generate_s=later, first_call_extra_s=extra)


def histogram_mean(histogram: dict[int, int]) -> float:
    """The mean of a staleness histogram (staleness -> groups); 0 when it is empty."""
    count = sum(histogram.values())
    return sum(k * v for k, v in histogram.items()) / count if count else 0.0
