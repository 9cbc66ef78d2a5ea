"""Two Ray nodes on this machine, all on loopback: the learner placed on one by
`learner.node_resource`, the generator on the other by `rollout.node_resource`, and the real CLI
joining the cluster (`ray.address`) trains a few steps over the wire between them.

The cluster is Ray's `cluster_utils.Cluster` in a helper process of its own: `ray start` rewrites a
worker's 127.0.0.1 to the machine's address (and then listens on every interface), unless
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, with which it refuses to start a worker node at all.
`Cluster` starts both nodes at 127.0.0.1 under that setting, and every process of the cluster
listens on loopback only.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest
from process_tree import listening, loopback, tree
from shared_cache import warm_cache

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 3
LEARNER_RESOURCE, ROLLOUT_RESOURCE = "learner_node", "rollout_node"

# The helper: starts the two nodes, prints their address and ids, keeps them until its stdin closes.
CLUSTER = r"""
import json, sys
from ray.cluster_utils import Cluster

spec = json.loads(sys.argv[1])
cluster = Cluster(initialize_head=True, head_node_args={**spec["common"], **spec["head"]})
worker = cluster.add_node(**spec["common"], **spec["worker"])
cluster.wait_for_nodes()
print(json.dumps({"address": cluster.address, "head": cluster.head_node.node_id, "worker": worker.node_id}), flush=True)
sys.stdin.read()
cluster.shutdown()
"""


@contextmanager
def two_node_cluster(env: dict[str, str], seen: dict[int, psutil.Process]) -> Iterator[dict]:
    """The cluster's address and node ids; every process of it goes into `seen`. On the way out
    the helper shuts the nodes down, and whatever of `seen` still runs is killed."""
    spec = {"common": {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 100 << 20},
            "head": {"resources": {LEARNER_RESOURCE: 1}, "include_dashboard": False},
            "worker": {"resources": {ROLLOUT_RESOURCE: 1}}}
    helper = subprocess.Popen([sys.executable, "-c", CLUSTER, json.dumps(spec)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready, _, _ = select.select([helper.stdout], [], [], 180)
        line = helper.stdout.readline() if ready else ""
        assert line, "the two-node cluster did not start within 180 s"
        seen.update((p.pid, p) for p in tree(helper.pid))
        yield {**json.loads(line), "pid": helper.pid}
    finally:
        seen.update((p.pid, p) for p in tree(helper.pid))
        helper.stdin.close()
        try:
            helper.wait(60)
        except subprocess.TimeoutExpired:
            pass
        helper.stdout.close()
        for proc in seen.values():
            try:
                if proc.is_running():  # the same process (psutil compares start times), not a reused pid
                    proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(list(seen.values()), timeout=15)


def listening_until_exit(cluster_pid: int, cli: subprocess.Popen, seen: dict[int, psutil.Process],
                         timeout_s: float) -> set[tuple[int, str, str, int]]:
    """Every listening socket any process of the cluster or the driver held at any sample, sampled
    every 0.3 s until the run ends or `timeout_s` (all those processes go into `seen`). A union over
    the whole run, not one snapshot: a snapshot could fall before a socket was bound or after it closed."""
    deadline = time.monotonic() + timeout_s
    sockets: set[tuple[int, str, str, int]] = set()
    while cli.poll() is None and time.monotonic() < deadline:
        processes = [*tree(cluster_pid), *tree(cli.pid)]
        seen.update((p.pid, p) for p in processes)
        sockets.update(listening(processes))
        time.sleep(0.3)
    return sockets


def test_the_learner_and_the_generator_on_two_nodes_train_over_tcp_with_curve_all_on_loopback(tmp_path):
    # Ray's Unix sockets live under its temp dir, whose paths must stay short; private, so that
    # no other cluster on this machine (nor `ray.init(address="auto")` elsewhere) sees this one.
    ray_tmp = tempfile.mkdtemp(prefix="agmn", dir="/tmp")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": ray_tmp,
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    run_dir = tmp_path / "run"
    seen: dict[int, psutil.Process] = {}
    started = time.monotonic()
    try:
        with two_node_cluster(env, seen) as cluster:
            cluster_up_s = time.monotonic() - started
            command = [
                sys.executable, "-m", "asyncgrpo.cli", "train", f"run_dir={run_dir}",
                f"model.cache_dir={warm_cache(tmp_path)}", "model.warmstart_max_seconds=5", "progress=false",
                f"train.max_steps={STEPS}", "train.steps_per_call=1", "eval.at_start=false", "eval.at_end=false",
                "train.export_at_end=false", "wire.startup_timeout_s=300",
                f"ray.address={cluster['address']}",
                f"learner.node_resource={LEARNER_RESOURCE}", f"rollout.node_resource={ROLLOUT_RESOURCE}",
            ]
            with open(tmp_path / "cli.log", "w") as log:
                cli = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                sockets = listening_until_exit(cluster["pid"], cli, seen, timeout_s=600)
                returncode = cli.wait(300)
            finally:
                if cli.poll() is None:
                    os.killpg(cli.pid, signal.SIGKILL)
                    cli.wait(30)
        output = (tmp_path / "cli.log").read_text()
        assert returncode == 0, output[-4000:]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    wall_s = time.monotonic() - started
    print(f"[multinode] cluster up in {cluster_up_s:.0f} s, whole test {wall_s:.0f} s")

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == STEPS
    # The weights crossed the nodes: the generator's engine holds the learner's final version.
    assert summary["probe"]["generator_version"] == summary["probe"]["learner_version"] == STEPS

    actors = json.loads((run_dir / "actors.json").read_text())
    (learner,), (generator,) = actors["learner_nodes"], actors["generator_nodes"]
    assert learner["node_id"] == cluster["head"] and generator["node_id"] == cluster["worker"]
    assert learner["node_id"] != generator["node_id"]
    assert learner["node_ip"] == generator["node_ip"] == "127.0.0.1"
    wire = actors["wire"]
    assert (wire["transport"], wire["curve"], wire["weights_backend"]) == ("tcp", True, "zmq")
    assert "tickets" in wire["endpoints"]  # grants cross the nodes on a third socket
    ports = {int(endpoint.rpartition(":")[2]) for endpoint in wire["endpoints"].values()}
    assert all(endpoint.startswith("tcp://127.0.0.1:") for endpoint in wire["endpoints"].values()), wire

    # Every listening socket the cluster's processes and the driver's held during the run was on
    # loopback, the learner's ZeroMQ sockets among them.
    assert sockets and all(loopback(ip) for _, _, ip, _ in sockets), sockets
    learner_pid = actors["learner_pids"][0]
    assert ports <= {port for pid, _, _, port in sockets if pid == learner_pid}, (ports, sockets)

    # Nothing of the cluster, the driver or the actors is left.
    assert not [pid for pid, proc in seen.items() if running(proc)]


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
