"""Delayed weight publication, for `train.fixed_staleness=k`: at version v the learner publishes
the weights of version v - k, labelled v - k, instead of its newest.

Why this fixes staleness at k (docs/ALGORITHMS.md, Fixed staleness): the dispatcher
(asyncgrpo/queue/dispatch.py) grants a slot of step u only to a generator holding w >= u - k. A group of
step u is started before the learner takes step u, i.e. at a learner version <= u, when the newest
published weights are at most u - k. So w = u - k exactly, for every step u >= k (the dispatcher's
lower bound makes it exact on its own). The first k steps (and the first k after a resume: the
checkpoint holds only its own version) are sampled by the starting weights, staleness u.

Rank 0 keeps CPU copies of the last k versions' state dicts in the dtype the weights travel in
(`learner.parts.held_dtype`, which builds the ring): casting before the sender casts again changes
nothing, and costs k pushes of memory (preflight's `memory_gib`). A version's copy is released once
published.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from asyncgrpo.schema import Config

if TYPE_CHECKING:
    from asyncgrpo.learner.policy import Policy

NamedTensors = list[tuple[str, torch.Tensor]]


def pushed_tensors(policy: Policy, adapters_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """What a push carries (every rank must exhaust it: each gather is a collective): the merged
    weights, or under LoRA with weights.lora_push=adapter the adapters alone, under their module
    paths in `weights.adapters.adapter_spec`'s order (the generators merge them)."""
    from asyncgrpo.weights.adapters import push_names

    if adapters_only:
        return iter(push_names(policy.adapter_state_dict()))
    return policy.full_state_dict()


class VersionRing:
    """The versions a learner with publication delay `delay` (>= 1) has made but not yet published."""

    def __init__(self, delay: int, dtype: torch.dtype) -> None:
        if delay < 1:
            raise ValueError(f"delay must be >= 1 (0 publishes the newest weights directly), got {delay}")
        self.delay, self.dtype = delay, dtype
        self._held: dict[int, NamedTensors] = {}  # version -> its tensors, oldest version first

    @property
    def versions(self) -> list[int]:
        return list(self._held)

    def publish(self, version: int, named: Iterable[tuple[str, torch.Tensor]],
                send: Callable[[int, NamedTensors], int]) -> tuple[int | None, int]:
        """At learner version `version` with its weights `named`: `send` version - delay's weights,
        if held (None during the warm-up), then keep a copy of `named`. Returns (the version sent
        or None, the bytes `send` reported)."""
        if self._held and version != max(self._held) + 1:
            # A skipped version would leave a hole that is published as nothing, k steps later.
            raise RuntimeError(f"delayed publication needs a push every step: version {version} after "
                               f"{max(self._held)} (weights.push_every_steps must be 1)")
        due = version - self.delay
        # Sent before this version is copied: at most `delay` copies are held at any time.
        tensors = self._held.pop(due, None)
        published, sent = (due, send(due, tensors)) if tensors is not None else (None, 0)
        del tensors
        self._held[version] = [(name, self._copy(tensor)) for name, tensor in named]
        return published, sent

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to("cpu", dtype=dtype, copy=True)
