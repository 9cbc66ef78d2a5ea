"""The study's own Ray cluster (asyncgrpo/study/cluster.py): a driver with its environment joins it,
every process of it listens on loopback only, and it is gone, processes and temporary directory,
when the study leaves it. Its helper lives as long as the study process, not as long as the
(worker) thread that happened to start it. A plain run's local cluster (driver/prepare.py) has a
token of its own as well."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from process_tree import listening, loopback, tree

from asyncgrpo.study.cluster import EngineCluster


@pytest.mark.slow
def test_the_study_cluster_is_joinable_listens_on_loopback_only_and_leaves_nothing():
    with EngineCluster(num_cpus=2, pool="p", log=lambda _: None) as cluster:
        helper = cluster._helper
        processes = tree(helper.pid)
        joined = subprocess.run(
            [sys.executable, "-c", "import os, ray; ray.init(address=os.environ['ADDR'], log_to_driver=False); "
                                   "print(int(ray.cluster_resources()['CPU'])); ray.shutdown()"],
            env={**cluster.env, "ADDR": cluster.address}, capture_output=True, text=True, timeout=180)
        assert joined.returncode == 0, joined.stderr[-2000:]
        assert joined.stdout.strip().splitlines()[-1] == "2"
        listeners = listening(processes)
        assert listeners, "no listener found: the cluster's processes were not seen"
        assert all(loopback(ip) for _, _, ip, _ in listeners), listeners
        tmp = cluster.env["RAY_TMPDIR"]
    gone, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, [p.pid for p in alive]
    assert not os.path.exists(tmp)


# A stand-in for Ray in the helper (first on its PYTHONPATH): the helper's own code runs, with a
# "cluster" that starts at once, or never when FAKE_RAY_HANGS is set (the helper still starting).
FAKE_RAY = """
import os, time, types
def init(**kwargs):
    if os.environ.get("FAKE_RAY_HANGS"):
        time.sleep(600)
    return types.SimpleNamespace(address_info={"gcs_address": "127.0.0.1:1"})
def shutdown():
    pass
"""

# The study's side: a slot's worker thread starts the cluster and exits, the process goes on.
OWNER = """
import sys, threading, time
from asyncgrpo.study.cluster import EngineCluster
clusters = []
def start():
    print("tmp", flush=True)
    clusters.append(EngineCluster(1, "p", log=lambda _: None).__enter__())
thread = threading.Thread(target=start)
thread.start()
thread.join()
print(clusters[0]._helper.pid, clusters[0]._tmp, flush=True)
time.sleep(600)
"""


def _owner(tmp_path: Path, **env: str) -> subprocess.Popen:
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text(FAKE_RAY)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-c", OWNER], env={**os.environ, "PYTHONPATH": path, **env},
                            stdout=subprocess.PIPE, text=True)


def _line(process: subprocess.Popen, timeout_s: float = 60.0) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    assert ready, "the owner process printed nothing"
    return process.stdout.readline().strip()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def _ray_tmp_dirs() -> set[str]:
    return {str(path) for path in Path("/tmp").glob("agec*")}


def test_the_cluster_helper_outlives_the_thread_that_started_it_and_dies_with_the_process(tmp_path):
    before = _ray_tmp_dirs()
    owner = _owner(tmp_path)
    try:
        assert _line(owner) == "tmp"
        pid, _ = _line(owner).split()
        helper = int(pid)
        # The starting thread has exited: the kernel's parent-death signal (which follows the
        # thread) would have come by now; other slots' runs still use the cluster.
        time.sleep(3)
        assert _alive(helper), "the helper died with the worker thread that started it"
        owner.kill()
        owner.wait()
        assert _gone_within(helper, 30), "the helper outlived the study process"
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
        for path in _ray_tmp_dirs() - before:  # the killed owner left its temporary directory
            shutil.rmtree(path, ignore_errors=True)


def test_a_helper_still_starting_its_cluster_dies_with_the_study_process(tmp_path):
    before = _ray_tmp_dirs()
    owner = _owner(tmp_path, FAKE_RAY_HANGS="1")
    try:
        assert _line(owner) == "tmp"
        deadline = time.monotonic() + 60
        while not (children := psutil.Process(owner.pid).children()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children, "the owner started no helper"
        helper = children[0].pid
        time.sleep(1)  # into its (hanging) start, where it reads nothing from the study
        owner.kill()
        owner.wait()
        assert _gone_within(helper, 30), "a helper still starting outlived the study process"
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
        for path in _ray_tmp_dirs() - before:
            shutil.rmtree(path, ignore_errors=True)


# A plain run's driver: Ray imported before the run sets its token (as a process may have done).
RUN = """
import json, os, sys
import ray
from asyncgrpo.config import load
from asyncgrpo.driver.prepare import start_ray
assert start_ray(load(["ray.num_cpus=1"]))
print(json.dumps({"address": ray.get_runtime_context().gcs_address, "token": os.environ["RAY_AUTH_TOKEN"],
                  "cpus": ray.cluster_resources()["CPU"]}), flush=True)
sys.stdin.read()
ray.shutdown()
"""

JOIN = ("import os, ray; ray.init(address=os.environ['ADDR'], log_to_driver=False); "
        "print(int(ray.cluster_resources()['CPU'])); ray.shutdown()")


@pytest.mark.slow
def test_a_plain_runs_local_cluster_takes_only_its_own_token_which_no_file_and_no_command_line_holds(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    env.update(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    run = subprocess.Popen([sys.executable, "-c", RUN], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    try:
        started = json.loads(_line(run, 180))
        assert started["cpus"] >= 1  # the driver itself got in with the run's token
        processes = tree(run.pid)
        for process in processes:
            try:
                assert started["token"] not in " ".join(process.cmdline()), process
            except psutil.NoSuchProcess:
                pass
        without = subprocess.run([sys.executable, "-c", JOIN], env={**env, "ADDR": started["address"]},
                                 capture_output=True, text=True, timeout=180)
        assert without.returncode != 0 and "Authentication" in without.stderr, without.stderr[-2000:]
        with_token = subprocess.run(
            [sys.executable, "-c", JOIN], capture_output=True, text=True, timeout=180,
            env={**env, "ADDR": started["address"], "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": started["token"]})
        assert with_token.returncode == 0, with_token.stderr[-2000:]
        assert list(home.iterdir()) == []  # no ~/.ray/auth_token, nor any other file
    finally:
        run.stdin.close()
        try:
            run.wait(120)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
        run.stdout.close()
