"""The learner ranks' placement and start: one placement-group bundle per rank, packed onto as few
nodes as possible, and a `LearnerActor` in each; the ranks form their own torch.distributed group
through rank 0's address (`master_address`). The generators' side is in driver/actors.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from asyncgrpo.driver.remote import get, remote_class
from asyncgrpo.runtime.placement import node_resources
from asyncgrpo.schema import Config


def master_address(pg: Any) -> str:
    """Where rank 0's rendezvous listens: loopback when every rank is on the driver's node."""
    import ray
    from ray.util import placement_group_table

    bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
    if set(bundle_nodes.values()) == {ray.get_runtime_context().get_node_id()}:
        return "127.0.0.1"
    addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return addresses[bundle_nodes[0]]


def learner_bundle(cfg: Config, gpus: float) -> dict[str, float]:
    """One rank's Ray resources: its CPUs, its GPU share, the node resource that marks learner nodes."""
    return {"CPU": cfg.learner.num_cpus_per_rank, **({"GPU": gpus} if gpus else {}),
            **node_resources(cfg.learner.node_resource)}


def place_learners(cfg: Config, gpus: float) -> Any:
    """The placement group of `learner.world_size` bundles (not waited for: `start_learners` does)."""
    from ray.util.placement_group import placement_group

    bundle = learner_bundle(cfg, gpus)
    return placement_group([dict(bundle) for _ in range(cfg.learner.world_size)], strategy="PACK")


def start_learners(cfg: Config, model_dir: str, pg: Any, gpus: float, cores: list[list[int]], curve: Any) -> list[Any]:
    """Every rank's actor in its bundle of `pg`, once Ray has placed it; `cores`: each rank's,
    `curve`: rank 0's wire keys (it alone binds the sockets)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from asyncgrpo.learner.actor import LearnerActor

    world_size = cfg.learner.world_size
    get(pg.ready(), cfg.wire.startup_timeout_s,
        f"Ray placing {world_size} learner rank(s) of {learner_bundle(cfg, gpus)} (placement group)")
    # Several ranks meet at a port rank 0 binds first and then posts (learner/rendezvous.py); the board
    # lives as long as a handle to it: the ranks drop theirs once they have met.
    master_addr, board = master_address(pg), None
    if world_size > 1:
        from asyncgrpo.learner.rendezvous import PortBoard

        board = ray.remote(num_cpus=0)(PortBoard).remote()
    # Actors get absolute paths (checkpoints): their working directory need not be the driver's.
    actor_cfg = copy.deepcopy(cfg)
    actor_cfg.run_dir = str(Path(cfg.run_dir).resolve())
    return [
        remote_class(LearnerActor).options(
            num_cpus=cfg.learner.num_cpus_per_rank, num_gpus=gpus, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
        ).remote(actor_cfg, model_dir, rank, world_size, master_addr, board, cores[rank],
                 curve if rank == 0 else None)
        for rank in range(world_size)
    ]
