"""The learner's side of divergence-gated staleness (train.staleness_control=divergence; docs/ALGORITHMS.md,
Divergence-gated staleness): after every step, that step's divergence by token age (update()'s
divergence/* metrics, already added up over ranks) goes to the bound's control law
(asyncgrpo/queue/bound_control.py), and the bound it picks to rank 0's group source, whose dispatcher
grants new slots under it. It also counts the groups train.divergence_cap capped, for the summary.

Every rank runs the same controller on the same (reduced) measurement, so every rank's state, and
any rank's checkpoint of it, agree; only rank 0 has a source to set. Plain Python, no torch.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.queue.bound_control import BoundController, divergence_of, target_of
from asyncgrpo.queue.sources import GroupSource
from asyncgrpo.schema import Config

_PREFIX = "divergence/k3_age_"


def step_buckets(metrics: dict[str, float], metric: str) -> list[tuple[float, float, float]]:
    """(mean age, tokens, divergence under `metric`) per age bucket present in a step's metrics."""
    buckets = []
    for key in metrics:
        if key.startswith(_PREFIX):
            name = key[len(_PREFIX):]
            buckets.append((metrics[f"divergence/mean_age_{name}"], metrics[f"divergence/tokens_age_{name}"],
                            divergence_of(metric, metrics[key], metrics[f"divergence/ess_age_{name}"])))
    return buckets


class AdmissionControl:
    """The bound controller under divergence control (None under versions), and the capped-group count."""

    def __init__(self, cfg: Config, source: GroupSource | None) -> None:
        t = cfg.train
        self.metric, self.max_staleness, self.source = t.divergence_metric, t.max_staleness, source
        self.controller = BoundController(t.min_staleness, t.max_staleness, target_of(t.divergence_metric,
                                                                                       t.divergence_target)) \
            if t.staleness_control == "divergence" else None
        self.capped_groups = 0
        self._grant()  # the starting bound, before the generators' first requests are answered

    @property
    def bound(self) -> int:
        return self.controller.bound if self.controller is not None else self.max_staleness

    def after_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """A step's metrics in (update()'s divergence/*); `divergence/bound` (and `divergence/rate`) out."""
        self.capped_groups += int(metrics.get("divergence/capped_groups", 0))
        if self.controller is None:
            return {"divergence/bound": float(self.max_staleness)}
        self.controller.observe(step_buckets(metrics, self.metric))
        self._grant()
        return self.controller.metrics()

    def _grant(self) -> None:
        if self.controller is not None and self.source is not None:
            self.source.set_admission_bound(self.controller.bound)

    def summary(self) -> dict[str, Any]:
        """summary.json's learner keys: the bound at the end and the groups capped over the run."""
        return {"admission_bound": self.bound, "capped_groups": self.capped_groups}

    def state_dict(self) -> dict[str, Any]:
        return {"capped_groups": self.capped_groups,
                "controller": self.controller.state_dict() if self.controller is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` ({} from a checkpoint written before divergence control: from the start)."""
        self.capped_groups = int(state.get("capped_groups", 0))
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])
        self._grant()
