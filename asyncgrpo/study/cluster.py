"""A Ray cluster on this machine that outlives a study's runs, so that their generator engines can
be kept between them (`rollout.engine_pool`, asyncgrpo/driver/engine_pool.py).

It runs in a helper process of its own (`python -m asyncgrpo.study.cluster`), which starts a local
cluster with `ray.init` (every listener on 127.0.0.1, token authentication, a private temporary
directory so that no other driver on this machine finds it with `ray.address=auto`), prints its
address and waits until its stdin closes; then it shuts the cluster down, and the pooled engines
with it. The study process dying closes that pipe too, and the helper also watches that its parent
process is still there (so that one dying while the cluster is still starting, when the helper reads
nothing, is noticed as well). Not the kernel's parent-death signal: that follows the *thread* that
started the helper, and a study's slot thread that starts the cluster may end (its plans done)
while other slots' runs still use it.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, Self

from asyncgrpo.runtime.ray_cluster import private_token_env

# How long the helper may take to bring the cluster up.
START_TIMEOUT_S = 180.0
# How long it may take to shut it down before it is killed.
STOP_TIMEOUT_S = 60.0
# How often the helper looks whether the study process is still its parent.
PARENT_POLL_S = 0.5


class EngineCluster:
    """`with EngineCluster(num_cpus, pool) as cluster:` the runs get `cluster.env` as their
    environment and `cluster.overrides(pool)` before their own overrides (`pool`: the engine pool
    of the runs' slot; the cluster's own name for the first)."""

    def __init__(self, num_cpus: int, pool: str, log: Callable[[str], None] = print) -> None:
        self.num_cpus, self.pool, self.log = num_cpus, pool, log
        self.address = ""
        self.env: dict[str, str] = {}
        self._helper: subprocess.Popen | None = None
        self._tmp = ""

    def overrides(self, pool: str) -> list[str]:
        return cluster_overrides(self.address, pool)

    def __enter__(self) -> Self:
        # Ray's Unix sockets live under its temporary directory, whose path must stay short.
        self._tmp = tempfile.mkdtemp(prefix="agec", dir="/tmp")
        self.env = {**{key: value for key, value in os.environ.items() if key != "RAY_AUTH_TOKEN_PATH"},
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": self._tmp, **private_token_env(),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self._helper = subprocess.Popen(
            [sys.executable, "-m", "asyncgrpo.study.cluster",
             json.dumps({"num_cpus": self.num_cpus, "parent": os.getpid()})],
            env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True)
        try:
            ready, _, _ = select.select([self._helper.stdout], [], [], START_TIMEOUT_S)
            line = self._helper.stdout.readline() if ready else ""
            if not line:
                raise RuntimeError(f"the study's Ray cluster did not start within {START_TIMEOUT_S:.0f} s"
                                   + ("" if self._helper.poll() is None else f" (exit code {self._helper.returncode})"))
            self.address = json.loads(line)["address"]
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.log(f"[study] Ray cluster at {self.address} for every run; generator engines are kept between runs "
                 f"(engine pool {self.pool})")
        return self

    def check_alive(self) -> None:
        """Raise if the helper, and so the cluster, has stopped (every run would fail to join it)."""
        if self._helper is None or self._helper.poll() is not None:
            code = None if self._helper is None else self._helper.returncode
            raise RuntimeError(f"the study's Ray cluster at {self.address} has stopped (its helper exited with "
                               f"code {code}); run the same command again to continue the study")

    def __exit__(self, *exc: object) -> None:
        helper, self._helper = self._helper, None
        if helper is not None:
            try:
                helper.stdin.close()
                helper.wait(STOP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
            if helper.poll() is None:
                try:
                    os.killpg(helper.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                helper.wait()
            helper.stdout.close()
            _reap_session(helper.pid, STOP_TIMEOUT_S)
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _reap_session(session_id: int, timeout_s: float) -> None:
    """Wait until every process of the helper's session (raylet, workers, the engines and their
    EngineCore children) has exited, killing what is left after `timeout_s`: Ray's workers notice
    the raylet's end on their own, a moment later, and an engine holds its memory until then."""
    deadline = time.monotonic() + timeout_s
    while (left := session_processes(session_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def session_processes(session_id: int) -> list[int]:
    """The pids of the live (not zombie) processes in session `session_id` (Linux /proc; elsewhere none)."""
    pids = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] != "Z" and int(fields[3]) == session_id:
            pids.append(int(entry.name))
    return pids


def cluster_overrides(address: str, pool: str) -> list[str]:
    """A run's overrides on the cluster at `address`: join it, keep the engines in `pool`, and keep
    the wire on Unix sockets (and so the weights in shared memory) as on a run's own local cluster:
    joining an address would otherwise mean tcp with CURVE, for actors that could be on other
    machines. The run's own overrides come after these and may change them."""
    return [f"ray.address={address}", f"rollout.engine_pool={pool}", "wire.transport=ipc"]


def signal_when_parent_dies(signum: int) -> None:
    """In a child, before exec (Linux; elsewhere nothing): the kernel sends `signum` when the parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)


def terminate_when_parent_exits(parent: int, poll_s: float) -> None:
    """In a child: SIGTERM to itself once process `parent` is no longer its parent (it exited and
    the child was handed to init or a subreaper). getppid() names the parent *process*, which a
    thread of it ending does not change; `parent` is passed in, since it may be gone already."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve(spec: dict[str, Any]) -> None:
    """The helper: start the cluster, print its address, keep it until stdin closes or SIGTERM."""
    import ray

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # through the finally below
    terminate_when_parent_exits(int(spec["parent"]), PARENT_POLL_S)
    context = ray.init(num_cpus=int(spec["num_cpus"]), include_dashboard=False, _node_ip_address="127.0.0.1",
                       log_to_driver=False)
    print(json.dumps({"address": context.address_info["gcs_address"]}), flush=True)
    try:
        sys.stdin.read()
    except (OSError, ValueError):
        pass
    finally:
        ray.shutdown()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
