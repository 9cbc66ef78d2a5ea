"""Placement across nodes without Ray: how the config decides the wire and the weight backend,
the node-resource checks against a cluster's node list, the reach check once actors are up, and
the address a wildcard bind is advertised under."""

from __future__ import annotations

import socket
import sys
import types

import pytest

from asyncgrpo.config import load
from asyncgrpo.composition import use_curve

from asyncgrpo.composition import actors_span_nodes, node_resource_roles, weights_backend, wire_transport
from asyncgrpo.schema import ConfigError
from asyncgrpo.runtime.placement import (
    NODE_RESOURCE_SHARE,
    check_node_resources,
    custom_resources,
    node_resources,
)
from asyncgrpo.wire.network import advertised, advertised_host
from asyncgrpo.wire.reach import check_reach


@pytest.mark.parametrize(("overrides", "transport", "curve", "backend"), [
    ([], "ipc", False, "shm"),  # a local cluster: this machine only
    (["ray.address=auto"], "tcp", True, "zmq"),
    (["ray.address=10.0.0.1:6379"], "tcp", True, "zmq"),
    (["rollout.node_resource=gen"], "tcp", True, "zmq"),
    (["learner.node_resource=learn"], "tcp", True, "zmq"),
    (["ray.address=auto", "wire.host=0.0.0.0"], "tcp", True, "zmq"),
    # What the user forces is kept (checked against the actual placement by check_reach).
    (["ray.address=auto", "wire.transport=ipc"], "ipc", False, "shm"),
    (["ray.address=auto", "weights.backend=shm"], "tcp", True, "shm"),
    (["ray.address=auto", "weights.backend=nccl"], "tcp", True, "nccl"),
    (["ray.address=auto", "wire.curve=off", "wire.insecure=true"], "tcp", False, "zmq"),
])
def test_actors_that_may_span_nodes_get_tcp_with_curve_and_zmq_weights_unless_forced(overrides, transport, curve,
                                                                                    backend):
    cfg = load(overrides)
    assert actors_span_nodes(cfg) == any(o.startswith(("ray.", "rollout.node", "learner.node")) for o in overrides)
    assert (wire_transport(cfg), use_curve(cfg), weights_backend(cfg)) == (transport, curve, backend)


def test_curve_off_across_nodes_without_insecure_is_refused_in_one_line_saying_why_it_is_tcp():
    with pytest.raises(ConfigError) as err:
        load(["rollout.node_resource=gen", "wire.curve=off"])
    message = str(err.value)
    assert "\n" not in message and "wire.curve" in message and "span nodes" in message


@pytest.mark.parametrize("address", ["", "auto", "10.0.0.1:6379", "head.cluster:6379", "[::1]:6379"])
def test_ray_address_accepts_empty_auto_and_host_port(address):
    assert load([f"ray.address='{address}'"]).ray.address == address


@pytest.mark.parametrize("address", ["10.0.0.1", "head:", ":6379", "head:port", "head:70000", "local"])
def test_a_bad_ray_address_is_one_line_naming_the_key(address):
    with pytest.raises(ConfigError) as err:
        load([f"ray.address='{address}'"])
    assert "ray.address" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["CPU", "GPU", "memory", "object_store_memory", "node:10.0.0.1",
                                  "accelerator_type:A100"])
@pytest.mark.parametrize("key", ["rollout.node_resource", "learner.node_resource"])
def test_a_node_resource_naming_one_of_rays_own_is_refused(key, name):
    with pytest.raises(ConfigError) as err:
        load([f"{key}='{name}'"])
    assert key in str(err.value) and "\n" not in str(err.value)


def test_an_actor_asks_for_a_small_share_of_its_node_resource_and_nothing_without_one():
    assert node_resources("") == {}
    assert node_resources("gen_nodes") == {"gen_nodes": NODE_RESOURCE_SHARE}
    assert 1 / NODE_RESOURCE_SHARE >= 1000  # a node started with 1 unit takes a thousand actors


def node(resources: dict[str, float], alive: bool = True) -> dict:
    """One entry of `ray.nodes()`, as far as the checks read it."""
    base = {"CPU": 4.0, "memory": 1e9, "object_store_memory": 1e8, "node:10.0.0.1": 1.0}
    return {"Alive": alive, "NodeManagerAddress": "10.0.0.1", "Resources": {**base, **resources}}


CLUSTER = [node({"learn": 1.0, "node:__internal_head__": 1.0}), node({"gen": 1.0, "GPU": 8.0}),
           node({"gone": 1.0}, alive=False)]


def test_a_clusters_custom_resources_are_those_of_its_alive_nodes_less_rays_own():
    assert custom_resources(CLUSTER) == ["gen", "learn"]


def test_named_node_resources_the_cluster_has_pass():
    check_node_resources(node_resource_roles(load(["learner.node_resource=learn", "rollout.node_resource=gen"])), CLUSTER)
    check_node_resources(node_resource_roles(load([])), [])  # nothing named: nothing to check


@pytest.mark.parametrize(("key", "name"), [("learner.node_resource", "lern"), ("rollout.node_resource", "gone")])
def test_a_node_resource_no_alive_node_has_is_one_line_naming_the_key_and_what_the_cluster_has(key, name):
    with pytest.raises(ConfigError) as err:
        check_node_resources(node_resource_roles(load([f"{key}={name}"])), CLUSTER)
    message = str(err.value)
    assert "\n" not in message
    assert key in message and repr(name) in message and "gen, learn" in message


def test_a_node_resource_whose_nodes_cannot_hold_one_actor_is_refused_naming_the_cpu_key():
    with pytest.raises(ConfigError) as err:
        check_node_resources(node_resource_roles(load(["rollout.node_resource=gen", "rollout.num_cpus_per_generator=6"])),
                             CLUSTER)
    assert "rollout.num_cpus_per_generator=6" in str(err.value) and "\n" not in str(err.value)


def reach(cfg, learner, generators):
    """`check_reach` as the driver calls it, with the run's resolved transport and backend."""
    check_reach(cfg.wire, wire_transport(cfg), weights_backend(cfg), learner, generators)


A, B = {"node_id": "aa", "node_ip": "10.0.0.1"}, {"node_id": "bb", "node_ip": "10.0.0.2"}
A2 = {"node_id": "cc", "node_ip": "10.0.0.1"}  # another Ray node on A's machine


@pytest.mark.parametrize("overrides", [[], ["wire.transport=ipc"], ["weights.backend=shm"]])
def test_generators_on_the_learners_machine_pass_whatever_the_transport(overrides):
    reach(load(overrides), A, {0: A, 1: A2})


def test_a_generator_on_another_machine_over_tcp_to_a_reachable_host_passes():
    reach(load(["ray.address=auto", "wire.host=0.0.0.0"]), A, {0: A, 1: B})


@pytest.mark.parametrize(("overrides", "named"), [
    (["ray.address=auto", "wire.transport=ipc"], "wire.transport=ipc"),
    (["ray.address=auto"], "wire.host=127.0.0.1"),  # tcp, but on loopback
    (["ray.address=auto", "wire.host=0.0.0.0", "weights.backend=shm"], "weights.backend=shm"),
])
def test_a_generator_on_another_machine_that_cannot_reach_the_learner_is_one_line_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as err:
        reach(load(overrides), A, {0: A, 3: B})
    message = str(err.value)
    assert "\n" not in message
    assert named in message and "generator 3" in message and "10.0.0.2" in message


def test_a_wildcard_bind_is_advertised_under_rays_node_address_in_a_ray_process(monkeypatch):
    fake_ray = types.ModuleType("ray")
    fake_ray.is_initialized = lambda: True
    fake_util = types.ModuleType("ray.util")
    fake_util.get_node_ip_address = lambda: "10.1.2.3"
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setitem(sys.modules, "ray.util", fake_util)
    assert advertised("tcp://0.0.0.0:5555") == "tcp://10.1.2.3:5555"
    assert advertised("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"  # an explicit host stays
    assert advertised("ipc:///tmp/x/s") == "ipc:///tmp/x/s"


def test_a_wildcard_bind_is_never_advertised_as_the_hostnames_127_0_1_1(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's /etc/hosts
    host = advertised_host("0.0.0.0")
    assert host != "127.0.1.1" and host not in ("0.0.0.0", "*")

    def no_route(self, address):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(socket.socket, "connect", no_route)
    assert advertised_host("*") == "127.0.0.1"  # no other machine to reach: loopback reaches the local peers


def test_a_placement_error_found_once_ray_is_up_exits_2_with_one_line(monkeypatch, capsys, tmp_path):
    import asyncgrpo.train
    from asyncgrpo import cli

    def no_such_node(cfg):  # as Actors.start raises it (check_node_resources, check_reach)
        raise ConfigError("rollout.node_resource='gpu_nodes' but no node of the Ray cluster has that resource")

    monkeypatch.setattr(asyncgrpo.train, "train", no_such_node)
    assert cli.main(["train", f"run_dir={tmp_path}", "rollout.node_resource=gpu_nodes"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("asyncgrpo: config error: rollout.node_resource=")
