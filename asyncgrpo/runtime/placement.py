"""Which node each actor runs on: the Ray node resources that place learner ranks and generators.

Nodes are chosen by Ray custom resource: `learner.node_resource` and `rollout.node_resource` name a
resource the chosen nodes were started with (`ray start --resources='{"NAME": 1}'`). Each learner
rank's placement-group bundle and each generator actor asks for `NODE_RESOURCE_SHARE` of it: the
resource marks nodes, it does not count actors (their CPUs and GPUs do), so a node started with 1
takes up to 1,000 of them.

`spans_nodes` says, from the config alone (`composition.actors_span_nodes` hands it the keys), whether
generators may run on another node than learner rank 0; what that decides for the wire and the
weight backend, and the check of where the actors landed, are asyncgrpo.wire.reach's.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from typing import Any

from asyncgrpo.schema import ConfigError

# The share of a node resource each actor (generator, learner rank's bundle) asks for: small
# enough that one unit holds any realistic number of actors, and above Ray's resource precision
# (1e-4).
NODE_RESOURCE_SHARE = 0.001
# Ray's own resources, and the prefixes of those it adds per node: not names a user marks nodes with.
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
RAY_RESOURCE_PREFIXES = ("node:", "accelerator_type:")
# Machines (platform.machine()) whose memory ordering the shm weight slots' seqlock relies on (x86-64's
# total store order: weights/shm.py); weights.backend=auto is zmq elsewhere.
ORDERED_MACHINES = ("x86_64", "AMD64", "amd64")


def spans_nodes(ray_address: str, learner_node_resource: str, rollout_node_resource: str) -> bool:
    """Whether generators may run on another node than learner rank 0: a local cluster is this one
    machine; a joined cluster (ray.address) or placement by node resource may put them anywhere."""
    return bool(ray_address or rollout_node_resource or learner_node_resource)


def ordered_memory_platform(machine: str | None = None) -> bool:
    """Whether `machine` (this one's by default) keeps the store and load order shm's seqlock needs."""
    return (machine if machine is not None else platform.machine()) in ORDERED_MACHINES


def node_resources(name: str) -> dict[str, float]:
    """The Ray resources an actor asks for to run on a node marked `name` ({} for "": any node)."""
    return {name: NODE_RESOURCE_SHARE} if name else {}


def is_custom_resource(name: str) -> bool:
    return name not in RAY_RESOURCES and not name.startswith(RAY_RESOURCE_PREFIXES)


def custom_resources(nodes: list[dict[str, Any]]) -> list[str]:
    """The custom resources of the alive nodes in `nodes` (as `ray.nodes()` lists them), sorted."""
    return sorted({name for node in nodes if node.get("Alive") for name in node.get("Resources", {})
                   if is_custom_resource(name)})


def check_node_resources(roles: Iterable[tuple[str, str, str, float]], nodes: list[dict[str, Any]]) -> None:
    """After Ray is up, before any actor starts: each named node resource is on an alive node with
    room for one such actor. Otherwise the actor would wait for a node that never comes. `roles`:
    per kind of actor, the key of its node resource, that resource ("": any node), the key of its
    CPUs and the CPUs (`composition.node_resource_roles`)."""
    alive = [node for node in nodes if node.get("Alive")]
    available = custom_resources(alive)
    for key, name, cpus_key, cpus in roles:
        if not name:
            continue
        marked = [node for node in alive if node.get("Resources", {}).get(name, 0) > 0]
        if not marked:
            raise ConfigError(f"{key}={name!r} but no node of the Ray cluster has that resource (its custom resources: "
                              f"{', '.join(available) or 'none'}): start the chosen nodes with "
                              f"ray start --resources='{{\"{name}\": 1}}'")
        most = max(node["Resources"].get("CPU", 0.0) for node in marked)
        if most < cpus:
            raise ConfigError(f"{key}={name!r}: the nodes with that resource have at most {most:g} CPUs, but "
                              f"{cpus_key}={cpus:g}: start them with more --num-cpus or lower {cpus_key}")
