"""The simulator's engine step by step (`sim.engine=steps`, asyncgrpo/sim/engine.py): hand-checkable
step counts, the tail the call-batched baseline waits for and the continuous engine does not, the
room rollout.max_running_seqs leaves, the staleness bound over random settings, and calibration
from a run's gen/engine_step_fit and gen/group_lengths with its one-line errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from one_line import raises_one_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncgrpo.sim.calibration import Calibration, GeneratorTimes, _engine_step_times, _group_lengths
from asyncgrpo.sim.engine import RunningEngine
from asyncgrpo.sim.model import simulate, uses_engine_steps
from asyncgrpo.sim.settings import Settings, SimulationError, apply_overrides
from test_simulate import NO_MEASUREMENT


def engine_run(*, lengths: list[tuple[int, ...]] | None = None, turns: list[tuple[tuple[int, ...], ...]] | None = None,
               fixed_s: float = 0.01, per_sequence_s: float = 0.0, train_s: float = 0.01, groups_per_step: int = 4,
               max_staleness: int = 0, steps: int = 10, continuous: bool = True, max_running_seqs: int = 256,
               inflight: bool = True, groups_per_call: int = 0, env_latency_s: float = 0.0) -> tuple[Calibration, Settings]:
    """One generator whose engine step takes fixed_s + per_sequence_s x running and whose groups
    decode `lengths` (one turn per sample) or `turns` (per sample, tokens per turn), a group's drawn
    at random; an environment answering in `env_latency_s`; a learner that trains `train_s`;
    nothing else costs time."""
    groups = turns if turns is not None else [tuple((n,) for n in group) for group in lengths]
    samples = len(groups[0])
    s = Settings(num_generators=1, groups_per_step=groups_per_step, samples_per_prompt=samples,
                 max_staleness=max_staleness, stale_policy="both", groups_per_call=groups_per_call, world_size=1,
                 capacity_groups=(max_staleness + 1) * groups_per_step, push_every_steps=1, steps=steps,
                 warmup_steps=0, continuous=continuous, max_running_seqs=max_running_seqs,
                 inflight_updates=inflight, engine="steps", env_latency_s=env_latency_s)
    times = GeneratorTimes(generate_s=1.0, call_groups=groups_per_call or groups_per_step, score_s_per_group=0.0,
                           score_wait_s=0.0, send_s_per_group=0.0, weight_load_s=0.0, other_s=0.0,
                           step_fixed_s=fixed_s, step_s_per_sequence=per_sequence_s)
    cal = Calibration(run_dir="engine", settings=s, generators=[times], train_s=[train_s], push_s=[0.0],
                      learner_other_s=0.0, measured=NO_MEASUREMENT, group_lengths=tuple(groups))
    return cal, s


def test_a_group_ends_with_its_longest_sample_and_each_sample_frees_its_sequence_when_it_ends():
    engine = RunningEngine()
    engine.admit("a", 0, ((1,), (3,)))
    engine.admit("b", 0, ((2,), (2,)))
    assert engine.sequences == 4
    assert engine.step() == ([], []) and engine.sequences == 3  # a's first sample ended
    assert engine.step() == ([("b", 0)], []) and engine.sequences == 1
    assert engine.step() == ([("a", 0)], []) and engine.sequences == 0


def test_a_sample_between_turns_leaves_the_engine_and_its_group_ends_after_its_last_turn():
    engine = RunningEngine()
    engine.admit("a", 3, ((1, 2), (1,)))  # sample 0: a turn of 1 token, its environment, a turn of 2
    assert engine.step() == ([], [(0, 0)]) and engine.sequences == 0 and engine.away == 1
    engine.resume(0, 0)
    assert engine.sequences == 1 and engine.away == 0
    assert engine.step() == ([], [])
    assert engine.step() == ([("a", 3)], []) and engine.sequences == 0


def test_episodes_waiting_on_their_environment_leave_the_engine_to_others():
    # Two turns of 5 tokens around a tool call; a step costs per sequence only, so what the engine
    # decodes while episodes wait is what asynchrony buys.
    common = dict(turns=[((5, 5), (5, 5))], fixed_s=0.0, per_sequence_s=0.001, train_s=0.001, groups_per_step=4,
                  steps=20)
    fast = simulate(*engine_run(**common, max_staleness=2, env_latency_s=0.0))
    sync_slow = simulate(*engine_run(**common, max_staleness=0, env_latency_s=0.2))
    async_slow = simulate(*engine_run(**common, max_staleness=2, env_latency_s=0.2))
    # Synchronous: every step waits the tool once (its episodes' calls overlap each other): 20 x 0.2 s at least.
    assert sync_slow.sim_time_s >= 20 * 0.2
    # Asynchronous: three steps' episodes wait at once, so about a third of that.
    assert async_slow.sim_time_s < 0.5 * sync_slow.sim_time_s
    assert fast.sim_time_s < async_slow.sim_time_s
    assert async_slow.staleness_max <= 2


def test_applying_each_answer_costs_the_generator_its_measured_time():
    cal, s = engine_run(turns=[((5, 5), (5, 5))], fixed_s=0.0, per_sequence_s=0.001, train_s=0.001, steps=10,
                        env_latency_s=0.1)
    free = simulate(cal, s)
    charged = simulate(replace(cal, generators=[replace(cal.generators[0], env_answer_s=0.001)]), s)
    # 10 steps x 4 groups x 2 samples come back once each, synchronously: 80 answers x 1 ms on the critical path.
    assert charged.sim_time_s - free.sim_time_s == pytest.approx(80 * 0.001)


def test_synchronous_steps_each_decode_as_long_as_the_steps_longest_group():
    # 4 groups of 2 samples, every group 5 tokens: 5 engine steps of 0.01 s, then 0.01 s of training.
    cal, s = engine_run(lengths=[(5, 5)], fixed_s=0.01, train_s=0.01, steps=10)
    result = simulate(cal, s)
    assert result.sim_time_s == pytest.approx(10 * (5 * 0.01 + 0.01))
    assert result.staleness_histogram == {0: 40}


def test_the_continuous_engine_passes_the_tail_that_holds_the_call_batched_one():
    # One group in eight decodes 100 tokens, the rest 10; a fast learner and room to run ahead.
    lengths = [(10, 10)] * 7 + [(100, 100)]
    common = dict(lengths=lengths, fixed_s=0.01, per_sequence_s=0.0, train_s=0.001, groups_per_step=8,
                  max_staleness=2, steps=40, groups_per_call=8)
    continuous = simulate(*engine_run(**common, continuous=True))
    batched = simulate(*engine_run(**common, continuous=False))
    # A call waits for its slowest group: nearly every call of 8 holds a 100-token group.
    assert continuous.samples_per_s > 1.5 * batched.samples_per_s
    assert continuous.staleness_max <= 2 and batched.staleness_max <= 2


def test_with_every_group_alike_and_no_fixed_step_cost_continuous_and_call_batched_run_alike():
    # Nothing to gain from a fuller engine: no tail to pass, and a step costs per sequence only.
    common = dict(lengths=[(8, 8)], fixed_s=0.0, per_sequence_s=0.001, train_s=0.001, groups_per_step=4,
                  max_staleness=1, steps=20)
    continuous = simulate(*engine_run(**common, continuous=True))
    batched = simulate(*engine_run(**common, continuous=False))
    assert continuous.samples_per_s == pytest.approx(batched.samples_per_s, rel=0.15)


def test_the_engine_never_runs_more_sequences_than_max_running_seqs():
    # 16 groups of 4 samples per step but room for 8 sequences: two groups at a time, 8 rounds of 10 steps.
    cal, s = engine_run(lengths=[(10, 10, 10, 10)], fixed_s=0.01, train_s=0.0, groups_per_step=16, steps=3,
                        max_running_seqs=8)
    result = simulate(cal, s)
    assert result.sim_time_s == pytest.approx(3 * 8 * 10 * 0.01)


def test_a_step_costs_more_with_more_sequences_running():
    lengths = [(10, 10)]
    cheap = simulate(*engine_run(lengths=lengths, fixed_s=0.01, per_sequence_s=0.0))
    dear = simulate(*engine_run(lengths=lengths, fixed_s=0.01, per_sequence_s=0.001))
    # 8 sequences run in every step: 0.018 s a step instead of 0.01.
    assert dear.sim_time_s - cheap.sim_time_s == pytest.approx(10 * 10 * 8 * 0.001)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_staleness=st.integers(0, 4), continuous=st.booleans(), inflight=st.booleans(),
       groups_per_step=st.integers(1, 8), room_groups=st.integers(1, 12),
       turns=st.lists(st.tuples(*[st.lists(st.integers(0, 60), min_size=0, max_size=3)] * 2).map(
           lambda group: tuple(tuple(sample) for sample in group)), min_size=1, max_size=6),
       train_s=st.sampled_from([0.0, 0.001, 0.05]), env_latency_s=st.sampled_from([0.0, 0.01, 0.3]))
def test_no_group_is_trained_more_than_max_staleness_versions_old(max_staleness, continuous, inflight, groups_per_step,
                                                                  room_groups, turns, train_s, env_latency_s):
    cal, s = engine_run(turns=turns, max_staleness=max_staleness, continuous=continuous, inflight=inflight,
                        groups_per_step=groups_per_step, max_running_seqs=2 * room_groups, train_s=train_s, steps=12,
                        env_latency_s=env_latency_s)
    result = simulate(cal, s)
    assert result.steps == 12 and result.staleness_max <= max_staleness
    assert sum(result.staleness_histogram.values()) == 12 * groups_per_step


def test_calibration_reads_the_step_fit_and_charges_the_rest_of_generation_to_the_first_step():
    report = {"gen/engine_step_fit": {"fixed_s": 0.002, "per_sequence_s": 0.0001, "steps": 980},
              "gen/engine_steps": 1000, "gen/mean_running_sequences": 50.0, "gen_time/generate_s": 10.0,
              "gen_time/ask_s": 0.5, "gen/ticket_requests": 100}
    times = _engine_step_times(report, untimed_s=2.0)
    assert times["step_fixed_s"] == 0.002 and times["step_s_per_sequence"] == 0.0001
    assert times["step_warmup_s"] == pytest.approx(10.0 - (1000 * 0.002 + 50_000 * 0.0001))
    assert times["ask_s"] == pytest.approx(0.005) and times["other_s_per_step"] == pytest.approx(0.002)
    with_answers = _engine_step_times({**report, "gen/env_answers": 400, "gen/env_answers_s": 0.8}, untimed_s=2.0)
    assert with_answers["env_answer_s"] == pytest.approx(0.002)
    assert with_answers["step_warmup_s"] == pytest.approx(times["step_warmup_s"] - 0.8)
    assert _engine_step_times({"gen/engine_steps": 1000}, 2.0) == {}  # a run from before the fit
    with pytest.raises(SimulationError, match="engine_step_fit"):
        _engine_step_times({**report, "gen/engine_step_fit": {"fixed_s": -1.0, "per_sequence_s": 0.0}}, 0.0)
    pooled = _group_lengths([{"gen/group_lengths": [[[3], [4, 2]]]}, {"gen/group_lengths": [[5, 6]]}])
    assert pooled == (((3,), (4, 2)), ((5,), (6,)))  # the first runs recorded a count per sample: one turn
    with pytest.raises(SimulationError, match="not token counts per turn"):
        _group_lengths([{"gen/group_lengths": [["x"]]}])
    with pytest.raises(SimulationError, match="not a group's samples"):
        _group_lengths([{"gen/group_lengths": [[]]}])


def test_auto_runs_steps_only_where_the_run_recorded_them_and_steps_without_them_is_one_line():
    cal, s = engine_run(lengths=[(5, 5)])
    assert uses_engine_steps(cal, replace(s, engine="auto"))
    assert not uses_engine_steps(cal, replace(s, engine="calls"))
    bare = replace(cal, group_lengths=())
    assert not uses_engine_steps(bare, replace(s, engine="auto"))
    with_env = replace(cal, env_max_calls=3)  # auto leaves runs with an environment call by call
    assert not uses_engine_steps(with_env, replace(s, engine="auto")) and uses_engine_steps(with_env, s)
    with raises_one_line(SimulationError, match="sim.engine=steps needs"):
        uses_engine_steps(bare, s)
    with pytest.raises(SimulationError, match="sim.engine must be one of"):
        apply_overrides(s, ["sim.engine=tokens"])
    with pytest.raises(SimulationError, match="rollout.max_running_seqs"):
        apply_overrides(s, ["rollout.max_running_seqs=1"])
