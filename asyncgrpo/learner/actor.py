"""The learner rank as a Ray actor: builds its parts inside the actor's process."""

from __future__ import annotations

import os
from typing import Any

from asyncgrpo.learner.learner import Learner
from asyncgrpo.learner.parts import learner_parts
from asyncgrpo.schema import Config
from asyncgrpo.wire.reach import this_node
from asyncgrpo.wire.security import CurveServerKeys


class LearnerActor(Learner):
    def __init__(self, cfg: Config, model_dir: str, rank: int, world_size: int, master_addr: str,
                 port_board: Any | None, cores: list[int] | None, curve: CurveServerKeys | None) -> None:
        """`port_board`: where several ranks meet (learner/rendezvous.py); None for a single rank."""
        parts = learner_parts(cfg, model_dir, rank, world_size, master_addr, None, cores, curve, port_board)
        super().__init__(**parts.arguments)
        self._endpoints = parts.endpoints

    def endpoints(self) -> dict[str, str]:
        """Rank 0: where generators connect (groups: the queue's PULL socket; weights: the PUB socket)."""
        return self._endpoints

    def weight_join_address(self) -> dict[str, Any]:
        """Rank 0: where generators join the weight transport ({}: nothing to join)."""
        return self.weights.join_address() if self.weights is not None else {}

    def wait_for_weight_joins(self) -> None:
        """Rank 0: returns when every generator has joined (at once when there is nothing to join)."""
        if self.weights is not None:
            self.weights.wait_for_joins()

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> dict[str, str]:
        """The Ray node this rank runs on (node_id, node_ip): run_dir/actors.json, the reach check."""
        return this_node()
