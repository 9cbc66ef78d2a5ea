"""What the actors' placement decides for the wire and the weight backend, and whether the actors,
once placed, reach learner rank 0.

Whether a generator may run on another node than learner rank 0 must be known before rank 0 binds
its sockets, and alike in every process that builds a weight sender or receiver (the driver's
preflight, rank 0, each generator). So it is read from the config alone
(`asyncgrpo.runtime.placement.spans_nodes`, handed in as `spans_nodes`): joining an existing
cluster (`ray.address`) or placing actors by node resource makes `wire.transport=auto` tcp (with
CURVE, `composition.use_curve`), and so `weights.backend=auto` zmq (`weights.resolve_backend`, from the
transport). What the user forces is kept, and checked against where the actors landed once they
are up (`check_reach`, on the nodes each actor reports with `this_node`). `composition.wire_transport`
and `composition.weights_backend` resolve both from a whole config.

This sits in the wire, above asyncgrpo.runtime: resolving a transport asks ZeroMQ what it has.
"""

from __future__ import annotations

from asyncgrpo.schema import ConfigError, WireConfig
from asyncgrpo.wire.network import is_loopback
from asyncgrpo.wire.sockets import resolve_transport


def resolve_wire_transport(wire: WireConfig, spans_nodes: bool) -> str:
    """The transport learner rank 0 binds (ipc or tcp): `wire.transport` with auto decided, tcp
    when the actors may span nodes (a Unix socket reaches only its own machine)."""
    if wire.transport == "auto" and spans_nodes:
        return "tcp"
    return resolve_transport(wire.transport, wire.host)


def this_node() -> dict[str, str]:
    """The Ray node this process runs on: its id and its address as the cluster knows it (called
    inside an actor, where Ray is already loaded)."""
    import ray
    from ray.util import get_node_ip_address

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": get_node_ip_address()}


def check_reach(wire: WireConfig, transport: str, backend: str, learner: dict[str, str],
                generators: dict[int, dict[str, str]]) -> None:
    """Once the actors are up, before the weight rendezvous: every generator on another machine
    (another node address) than learner rank 0 can reach it. An ipc socket, shared-memory slots and
    a loopback address reach only their own machine; several Ray nodes on one machine share them.
    `transport` and `backend` are the run's resolved ones (`composition.wire_transport`,
    `composition.weights_backend`); `learner` and `generators` (by generator index) are `this_node()`'s answers."""
    for index, node in sorted(generators.items()):
        if node["node_ip"] == learner["node_ip"]:
            continue
        where = (f"generator {index} runs on node {node['node_ip']} and learner rank 0 on node {learner['node_ip']}, "
                 "another machine")
        if transport == "ipc":
            raise ConfigError(f"wire.transport={wire.transport} binds a Unix socket (ipc), but {where}: "
                              "use wire.transport=tcp")
        if is_loopback(wire.host):
            raise ConfigError(f"wire.host={wire.host} is loopback, but {where}: set wire.host to an address of the "
                              "learner's node that the other nodes reach, or 0.0.0.0")
        if backend == "shm":
            raise ConfigError(f"weights.backend=shm shares memory within one machine, but {where}: "
                              "use weights.backend=zmq")
