"""What a local Ray cluster started on this machine is given, shared by the driver (a run's own
cluster, asyncgrpo/driver/prepare.py) and a study (one cluster for all its runs,
asyncgrpo/study/cluster.py): its authentication token and its CPU count. Light: Ray itself is
imported by the callers that start it, not here."""

from __future__ import annotations

import math
import os
import secrets


def private_token_env() -> dict[str, str]:
    """Ray's token authentication with a fresh random token, for a cluster this process starts: set
    in the environment its processes inherit, readable only by the user and root
    (/proc/<pid>/environ), and written to no file. Without it Ray 2.60 uses, or creates, the
    token in ~/.ray/auth_token: mode 0644, and the same for every cluster of the user."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def local_cpus(num_cpus: int, actor_cpus: float) -> int:
    """Logical CPUs of a local Ray cluster: `num_cpus` (ray.num_cpus; 0: all cores), but at least
    `actor_cpus`, what the actors ask for (Ray's CPU counts only admit actors; pinning to physical
    cores is runtime.resources.plan_cores' job)."""
    return max(num_cpus or os.cpu_count() or 1, math.ceil(actor_cpus))


# How long the processes of an interrupted Ray start get to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0


def child_pids() -> set[int]:
    """This process's descendants now (psutil: a dependency of Ray itself)."""
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def stop_children_started_since(before: set[int], grace_s: float = STOP_GRACE_S) -> list[str]:
    """Stop this process's descendants that are not in `before` (SIGTERM, then SIGKILL after
    `grace_s`); the names of those it found. A ray.init interrupted inside the node's start leaves
    the GCS, the raylet and the agents it had started unknown to ray.shutdown() (Ray records the
    node only once its start returns): without this they live on until this process exits."""
    import psutil

    started = []
    for pid in child_pids() - before:
        try:
            started.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    names = []
    for proc in started:
        try:
            names.append(proc.name())
            proc.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(started, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=grace_s)
    return sorted(names)
