"""sim.cores (asyncgrpo/sim/events.py, asyncgrpo/sim/model.py): busy phases sharing a machine's processors, and a calibration
freed of the contention its own run had. Hand-computed answers with constant times."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_simulate import constant_run

from asyncgrpo.sim.calibration import Calibration, _machine_cores, _shared_cores, read_actors
from asyncgrpo.sim.events import Delay, EventLoop, Process, Work
from asyncgrpo.sim.model import Model, simulate, uncontended
from asyncgrpo.sim.settings import SimulationError, apply_overrides

# ------------------------------------------------------------------ the event loop


def ends(cores: int, jobs: list[tuple[float, Work | Delay]]) -> list[float]:
    """When each job (started at its time, then busy as given) ends, on `cores` processors."""
    loop = EventLoop(cores=cores)
    finished: list[float] = [0.0] * len(jobs)

    def job(index: int, start: float, request: Work | Delay) -> Process:
        yield Delay(start)
        yield request
        finished[index] = loop.now

    for i, (start, request) in enumerate(jobs):
        loop.start(job(i, start, request))
    loop.run(done=lambda: all(finished))
    return finished


def test_works_sharing_one_core_each_advance_at_half_speed_while_both_run():
    # A alone for 0.5 s (0.5 done), then A and B at half speed: A's last 0.5 takes 1 s (ends at
    # 1.5, B has done 0.5), then B alone: its last 0.5 ends at 2.0.
    assert ends(1, [(1e-9, Work(1.0)), (0.5, Work(1.0))]) == [pytest.approx(1.5), pytest.approx(2.0)]


def test_three_works_on_two_cores_take_one_and_a_half_times_as_long():
    assert ends(2, [(1e-9, Work(1.0))] * 3) == [pytest.approx(1.5 + 1e-9)] * 3


def test_works_within_the_cores_and_delays_never_slow_down():
    assert ends(2, [(1e-9, Work(1.0)), (1e-9, Work(1.0)), (1e-9, Delay(1.0))]) == [pytest.approx(1.0)] * 3


def test_a_work_on_two_processes_counts_twice():
    # On 2 cores a 2-process work and a 1-process work want 3: each runs at 2/3.
    assert ends(2, [(1e-9, Work(1.0, processes=2)), (1e-9, Work(1.0))]) == [pytest.approx(1.5)] * 2


def test_without_cores_a_work_is_a_delay():
    assert ends(0, [(1e-9, Work(1.0))] * 5) == [pytest.approx(1.0)] * 5


# ------------------------------------------------------------------ the model


def test_a_generator_and_learner_overlapping_on_one_core_train_at_half_the_speed_of_two_cores():
    # Generation and training take 1 s each and overlap (max_staleness 1): on two cores (or none
    # modelled) a step a second; sharing one core, each runs at half speed: a step every 2 s.
    cal, s = constant_run(generate_s=1.0, train_s=1.0, max_staleness=1, steps=100, warmup_steps=2)
    cal = replace(cal, shared_cores=0)
    own = simulate(cal, s).steady_samples_per_s
    assert own == pytest.approx(s.samples_per_step / 1.0, rel=0.01)
    assert simulate(cal, replace(s, cores=2)).steady_samples_per_s == pytest.approx(own)
    assert simulate(cal, replace(s, cores=1)).steady_samples_per_s == pytest.approx(own / 2, rel=0.01)


def test_a_synchronous_run_never_overlaps_so_one_core_costs_nothing():
    cal, s = constant_run(generate_s=1.0, score_s=0.25, train_s=2.0, push_s=0.5, max_staleness=0)
    cal = replace(cal, shared_cores=0)
    assert simulate(cal, replace(s, cores=1)).samples_per_s == pytest.approx(simulate(cal, s).samples_per_s)


def test_a_reward_wait_uses_no_processor():
    cal, s = constant_run(generate_s=1.0, train_s=1.0, max_staleness=0, steps=10)
    cal = replace(cal, shared_cores=0, generators=[replace(cal.generators[0], score_wait_s=5.0)])
    # Were the wait processor work, the learner's 1 s step would share the core with it.
    busy = simulate(cal, replace(s, cores=1))
    assert busy.samples_per_s == pytest.approx(simulate(cal, s).samples_per_s)


# ------------------------------------------------------------------ uncontended calibration


def contended_measurement(true: Calibration, cores: int) -> Calibration:
    """What a run with `true`'s uncontended times would have measured on `cores` shared cores."""
    model = Model(true, replace(true.settings, cores=cores))
    model.run()
    stretch = [g.clock.work_wall_s / g.clock.work_s for g in model.generators]
    return replace(true.scaled(model.learner.work_wall_s / model.learner.work_s, stretch), shared_cores=cores)


def test_uncontended_recovers_the_times_a_run_on_shared_cores_was_slowed_from():
    true, _ = constant_run(generate_s=0.5, score_s=0.1, train_s=1.0, push_s=0.1, groups_per_step=4, max_staleness=2,
                           num_generators=2, capacity_groups=12, steps=60)
    true = replace(true, generators=true.generators * 2, shared_cores=0)
    measured = contended_measurement(true, cores=2)
    assert measured.train_s[0] > 1.05 * true.train_s[0]  # the contention is there to take out
    recovered = uncontended(measured)
    assert recovered.train_s[0] == pytest.approx(true.train_s[0], rel=0.02)
    assert recovered.push_s[0] == pytest.approx(true.push_s[0], rel=0.02)
    for got, want in zip(recovered.generators, true.generators):
        assert got.generate_s == pytest.approx(want.generate_s, rel=0.02)
        assert got.score_s_per_group == pytest.approx(want.score_s_per_group, rel=0.02)
    assert recovered.shared_cores == 0 and uncontended(recovered) == recovered  # never taken out twice


def test_a_run_whose_actors_had_cores_of_their_own_is_its_own_uncontended_calibration():
    cal, _ = constant_run(num_generators=1)
    assert uncontended(replace(cal, shared_cores=0)) == replace(cal, shared_cores=0)


def test_sim_cores_refuses_a_run_that_does_not_say_whether_its_actors_shared_cores():
    cal, s = constant_run()
    with pytest.raises(SimulationError, match="sim.cores needs to know whether"):
        simulate(cal, replace(s, cores=2))


def test_sim_cores_refuses_a_shares_run_whose_actors_shared_cores_and_takes_one_whose_actors_did_not():
    # Taking a run's contention out replays the run, dispatch included: the removed one cannot be.
    cal, s = constant_run()
    with pytest.raises(SimulationError, match="shared 2 cores under the removed shares dispatch"):
        simulate(replace(cal, shared_cores=2, recorded_dispatch="shares"), replace(s, cores=2))
    own = replace(cal, shared_cores=0, recorded_dispatch="shares")
    assert simulate(own, replace(s, cores=2)) == simulate(replace(own, recorded_dispatch="tickets"), replace(s, cores=2))


def test_sim_cores_is_an_override_and_must_not_be_negative():
    cal, s = constant_run()
    assert apply_overrides(s, ["sim.cores=4"]).cores == 4
    with pytest.raises(SimulationError, match="sim.cores must be >= 0"):
        apply_overrides(s, ["sim.cores=-1"])


# ------------------------------------------------------------------ actors.json


def actors(generator_cores: list, learner_cores: list, driver_cores: list | None = None,
           nodes: tuple[str, str] = ("a", "a")) -> dict:
    record = {"generator_cores": generator_cores, "learner_cores": learner_cores,
              "learner_nodes": [{"node_id": nodes[0]}], "generator_nodes": [{"node_id": nodes[1]}] * len(generator_cores)}
    if driver_cores is not None:
        record["driver_cores"] = driver_cores
    return record


def test_actors_pinned_to_cores_of_their_own_shared_none():
    assert _shared_cores(actors([[0]], [[1]], [0, 1])) == 0
    assert _shared_cores(actors([[0]], [[1]])) == 0  # known without driver_cores


def test_unpinned_or_overlapping_actors_shared_the_drivers_cores():
    assert _shared_cores(actors([[], []], [[]], [0, 1])) == 2
    assert _shared_cores(actors([[0], [0]], [[1]], [0, 1, 2])) == 3
    assert _machine_cores(actors([[0], [0]], [[1]], [0, 1, 2])) == 3


def test_shared_cores_is_unknown_without_driver_cores_across_nodes_or_without_actors_json(tmp_path):
    assert _shared_cores(actors([[], []], [[]])) is None
    assert _shared_cores(actors([[]], [[]], [0, 1], nodes=("a", "b"))) is None
    assert read_actors(tmp_path / "missing.json") == {}
    (tmp_path / "bad.json").write_text("{")
    assert read_actors(tmp_path / "bad.json") == {}
    (tmp_path / "list.json").write_text("[]")
    assert read_actors(tmp_path / "list.json") == {}
    assert _shared_cores({}) is None and _machine_cores({}) is None


def test_every_simulate_key_is_documented_in_the_simulator_doc():
    from asyncgrpo.sim.settings import OVERRIDE_KEYS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "SIMULATOR.md").read_text()
    assert [key for key in OVERRIDE_KEYS if f"`{key}`" not in doc] == []


# ------------------------------------------------------------------ the report


def test_the_report_suggests_sim_cores_when_a_cpu_runs_actors_outnumber_its_cores():
    from asyncgrpo.sim.report import report

    cal, s = constant_run(num_generators=1)
    cal = replace(cal, device="cpu", machine_cores=2, shared_cores=0)
    more = replace(s, num_generators=2, capacity_groups=s.groups_per_step)
    assert "sim.cores=2 makes them share" in report(cal, more, simulate(cal, more))
    assert "sim.cores" not in report(cal, s, simulate(cal, s)).split("\n{")[0]  # 2 actors on 2 cores
    gpu = replace(cal, device="cuda")
    assert "note:" not in report(gpu, more, simulate(gpu, more))
    shared = replace(more, cores=2)
    assert "processors: simulated on 2 shared cores" in report(cal, shared, simulate(cal, shared))
