"""The simulator's event loop checks a blocked condition again only after something it reads has
changed (EventLoop(track_changes=True), Until.reads): the same outcome as checking every condition
after every event, which is what these tests compare, over random settings and at the cluster
sizes tools/predict_cluster.py simulates."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from test_simulate import constant_run, random_run

from asyncgrpo.sim.events import EventLoop, SimulationStuck
from asyncgrpo.sim.model import Model, Result


def run_both(calibration, s) -> tuple[Result | str, Result | str]:
    """The model as it runs (changes tracked) and with every condition checked after every event."""
    outcomes = []
    for track in (True, False):
        model = Model(calibration, s)
        model.loop = EventLoop(track_changes=track)  # before run(): no process has started yet
        try:
            outcomes.append(model.run())
        except SimulationStuck as err:
            outcomes.append(f"stuck: {err}")
    return outcomes[0], outcomes[1]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_run())
def test_tracking_changes_gives_the_same_run_as_checking_every_condition_after_every_event(run):
    calibration, s = run
    tracked, untracked = run_both(calibration, s)
    assert tracked == untracked


def test_the_same_at_a_hundred_generators_with_noisy_calls():
    cal, s = constant_run(generate_s=8.0, score_s=0.1, train_s=[1.0, 0.8, 1.3], push_s=0.2, weight_load_s=0.05,
                          groups_per_step=200, max_staleness=2, steps=12, num_generators=1)
    for eta, policy in [(0, "both"), (2, "throttle"), (2, "drop")]:
        big = replace(s, num_generators=100, max_staleness=eta, stale_policy=policy, generate_cv=0.3,
                      capacity_groups=(eta + 1) * 200, push_every_steps=1, call_size_exponent=0.5, replay=False)
        tracked, untracked = run_both(cal, big)
        assert tracked == untracked, (eta, policy)
