"""The driver's pure parts: GPU shares, fitting steps to finite data, local CPUs, the probe report."""

import numpy as np
import pytest

from asyncgrpo.driver import TrainingFailed
from asyncgrpo.driver.actors import check_gpu_share, gpus_per_actor
from asyncgrpo.driver.evaluation import probe_report
from asyncgrpo.driver.prepare import fit_steps_to_data, steps_in_data
from asyncgrpo.composition import local_cluster_cpus


def config(*overrides, device="cpu"):
    from asyncgrpo.config import load

    cfg = load(list(overrides))
    cfg.device = device
    return cfg


def test_gpus_per_actor_is_a_whole_gpu_when_there_are_enough_else_an_equal_share():
    assert gpus_per_actor(config("rollout.num_generators=1"), 0.0) == 0.0  # cpu: no GPU asked for
    assert gpus_per_actor(config("rollout.num_generators=1", device="cuda"), 4.0) == 1.0
    assert gpus_per_actor(config("rollout.num_generators=3", device="cuda"), 2.0) == pytest.approx(0.5)
    with pytest.raises(TrainingFailed, match="no GPU"):
        gpus_per_actor(config(device="cuda"), 0.0)


def test_nccl_needs_a_whole_gpu_per_actor():
    check_gpu_share(config("weights.backend=nccl", device="cuda"), 1.0)
    check_gpu_share(config("weights.backend=zmq", device="cuda"), 0.5)
    with pytest.raises(TrainingFailed, match="weights.backend=nccl needs a GPU per actor"):
        check_gpu_share(config("weights.backend=nccl", device="cuda"), 0.5)
    with pytest.raises(TrainingFailed, match="learner.world_size=2 needs a whole GPU"):
        check_gpu_share(config("learner.world_size=2", device="cuda"), 0.5)


def test_finite_data_fits_max_steps_to_every_full_step_of_the_one_stream(capsys):
    cfg = config("rollout.num_generators=2", "train.groups_per_step=5", "train.max_steps=100", "data.epochs=2")
    # One stream of 101 prompts x 2 epochs = 202, whatever the generators: 40 full steps of 5.
    assert steps_in_data(cfg, 101) == 40
    fit_steps_to_data(cfg, 101)
    assert cfg.train.max_steps == 40 and "train.max_steps 100 -> 40" in capsys.readouterr().out
    fit_steps_to_data(cfg, 1000)  # more data than steps: max_steps stays
    assert cfg.train.max_steps == 40
    with pytest.raises(TrainingFailed, match="less than one step"):
        fit_steps_to_data(cfg, 2)  # 2 prompts, 2 epochs: less than a step of 5


def test_endless_data_leaves_max_steps_alone():
    cfg = config("data.epochs=0", "train.max_steps=7")
    assert steps_in_data(cfg, 3) is None
    fit_steps_to_data(cfg, 3)
    assert cfg.train.max_steps == 7


def test_a_local_ray_cluster_has_at_least_the_cpus_the_actors_ask_for():
    cfg = config("rollout.num_generators=3", "rollout.num_cpus_per_generator=2", "learner.num_cpus_per_rank=1.5",
                 "ray.num_cpus=1")
    assert local_cluster_cpus(cfg, "") == 8  # ceil(3 * 2 + 1 * 1.5)
    assert local_cluster_cpus(cfg, "127.0.0.1:1") is None  # its own cluster, not one at that address


def test_probe_report_is_the_largest_per_token_gap():
    start = [np.array([-1.0, -2.0]), np.array([-0.5])]
    generator = [np.array([-1.1, -2.0]), np.array([-0.2])]
    learner = [np.array([-1.1, -2.05]), np.array([-0.2])]
    report = probe_report(generator, learner, start, generator_version=4, learner_version=4)
    assert report["generator_version"] == report["learner_version"] == 4
    assert report["max_abs_diff_vs_learner"] == pytest.approx(0.05)
    assert report["max_abs_change_since_start"] == pytest.approx(0.3)


RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _start_ray_seeing_auth(monkeypatch, cfg, runs=1):
    """prepare.start_ray with ray.init faked: the auth variables each ray.init call saw."""
    import os

    import ray

    from asyncgrpo.driver import prepare

    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **_: seen.append({key: os.environ.get(key) for key in RAY_AUTH_VARS}))
    monkeypatch.setattr(prepare, "interrupt_on_sigterm", lambda: None)  # the test process keeps its handlers
    for _ in range(runs):
        prepare.start_ray(cfg)
    return seen


def test_a_local_ray_cluster_gets_a_fresh_token_of_its_own_per_run_held_in_no_file(monkeypatch, tmp_path):
    from asyncgrpo.driver import prepare

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # whatever the user's environment says
    monkeypatch.setenv("RAY_AUTH_TOKEN", "shared")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "shared_token"))
    reloads = []
    monkeypatch.setattr(prepare, "reload_ray_auth", lambda: reloads.append(1))
    first, second = _start_ray_seeing_auth(monkeypatch, config(), runs=2)
    for seen in (first, second):
        assert seen["RAY_AUTH_MODE"] == "token"
        assert seen["RAY_AUTH_TOKEN"] != "shared" and len(seen["RAY_AUTH_TOKEN"]) >= 64
        assert seen["RAY_AUTH_TOKEN_PATH"] is None  # the environment, not a file, holds it
    assert first["RAY_AUTH_TOKEN"] != second["RAY_AUTH_TOKEN"]
    assert len(reloads) == 2  # Ray in this process reads the new mode and token, not what it cached
    assert list(tmp_path.iterdir()) == []  # no token file written (Ray's ~/.ray/auth_token included)


def test_joining_ray_address_uses_the_token_of_the_users_cluster(monkeypatch):
    from asyncgrpo.driver import prepare

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-clusters")
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setattr(prepare, "reload_ray_auth", lambda: pytest.fail("the user's token replaced"))
    (seen,) = _start_ray_seeing_auth(monkeypatch, config("ray.address=127.0.0.1:6379"))
    assert seen == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "the-clusters", "RAY_AUTH_TOKEN_PATH": None}


def _interrupted_start(monkeypatch, init=None):
    """prepare.start_ray, with ray.init replaced by `init` if given, must raise KeyboardInterrupt."""
    import ray

    from asyncgrpo.driver import prepare

    for key in (*RAY_AUTH_VARS, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        monkeypatch.delenv(key, raising=False)  # restored afterwards: start_ray sets them
    if init is not None:
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.setattr(ray, "init", init)
        monkeypatch.setattr(prepare, "reload_ray_auth", lambda: None)
    monkeypatch.setattr(prepare, "interrupt_on_sigterm", lambda: None)  # the test process keeps its handlers
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        prepare.start_ray(config())


def test_a_sigterm_inside_the_nodes_start_stops_the_processes_it_had_started(monkeypatch):
    # As Ray does when SIGTERM lands in Node.__init__: the GCS is running, its handler raises
    # SystemExit(SIGTERM), and ray.shutdown() never learns of the node, so it stops nothing.
    import signal
    import subprocess

    import psutil
    import ray

    started = []

    def init(**_):
        started.append(subprocess.Popen(["sleep", "600"]))  # a GCS only Ray's half-built node knew
        raise SystemExit(signal.SIGTERM)

    monkeypatch.setattr(ray, "shutdown", lambda: None)
    try:
        _interrupted_start(monkeypatch, init)
        (gcs,) = started
        assert gcs.poll() is not None or not psutil.pid_exists(gcs.pid)
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_real_ray_start_interrupted_before_the_raylet_leaves_no_process(monkeypatch):
    # The real thing: SIGTERM (Ray's own handler: SystemExit(15)) once the GCS is up, before the raylet.
    import signal

    import psutil
    from ray._private import node

    before = {child.pid for child in psutil.Process().children(recursive=True)}

    def interrupted(*args, **kwargs):
        raise SystemExit(signal.SIGTERM)

    monkeypatch.setattr(node.Node, "start_raylet", interrupted)
    _interrupted_start(monkeypatch)
    left = [p.name() for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == []
