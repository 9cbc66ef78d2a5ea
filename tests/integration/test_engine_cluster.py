"""The study's own Ray cluster (asyncgrpo/engine_cluster.py): a driver with its environment joins it,
every process of it listens on loopback only, and it is gone, processes and temporary directory,
when the study leaves it."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
from process_tree import listening, loopback, tree

from asyncgrpo.engine_cluster import EngineCluster

pytestmark = pytest.mark.slow


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
