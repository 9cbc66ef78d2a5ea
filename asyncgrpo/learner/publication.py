"""What the generators can load (`VersionPublisher`): the learner pushes each new version, every
weights.push_every_steps; under `train.fixed_staleness=k` >= 1 publication is delayed (`VersionRing`):
once the learner at version v has taken step v's groups, and before it trains them, it publishes
the weights of version v + 1 - k, labelled v + 1 - k, instead of its newest.

Why this fixes staleness at k (docs/ALGORITHMS.md, Fixed staleness): the dispatcher
(asyncgrpo/queue/dispatch.py) grants a generator holding w > the starting version only slots of
step w + k. Version v + 1 - k fills step v + 1, the learner's next; step v's groups are all in hand
when it is published, so no slot of step v or earlier is left for the older weights it replaces
(the rule tests/unit/test_dispatch.py's interleavings check: nothing newer than u - k is loadable
while step u is not taken). The first k steps (and the first k after a resume: the checkpoint holds
only its own version) are sampled by the starting weights, staleness u.

Why before training: the generators sample step v + 1 while the learner trains step v, so a
fixed-staleness run overlaps generation and training by one step, as a version-bounded one does.
Publishing after the update (v + 1 - k at version v + 1) would give the same versions to the same
steps one phase later, and make every step wait for the update before its generation.

Rank 0 keeps CPU copies of the versions made but not yet published, at most k, in the dtype the
weights travel in (`learner.parts.held_dtype`, which builds the ring): casting before the sender
casts again changes nothing, and costs k pushes of memory (preflight's `memory_gib`). A version's
copy is released once published.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from asyncgrpo import contract
from asyncgrpo.weights import Publication

if TYPE_CHECKING:
    from asyncgrpo.learner.policy import Policy
    from asyncgrpo.weights.base import WeightSender

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
    """The versions a learner with publication delay `delay` (>= 1) has made but not yet published:
    `hold` after each update, `publish` after each take."""

    def __init__(self, delay: int, dtype: torch.dtype) -> None:
        if delay < 1:
            raise ValueError(f"delay must be >= 1 (0 publishes the newest weights directly), got {delay}")
        self.delay, self.dtype = delay, dtype
        self._held: dict[int, NamedTensors] = {}  # version -> its tensors, oldest version first

    @property
    def versions(self) -> list[int]:
        return list(self._held)

    def hold(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep a copy of version `version`'s weights `named` (the update just made it)."""
        if self._held and version != max(self._held) + 1:
            # A skipped version would leave a hole that is published as nothing, k steps later.
            raise RuntimeError(f"delayed publication needs a push every step: version {version} after "
                               f"{max(self._held)} (weights.push_every_steps must be 1)")
        self._held[version] = [(name, self._copy(tensor)) for name, tensor in named]

    def publish(self, taken_step: int, send: Callable[[int, NamedTensors], int]) -> tuple[int | None, int]:
        """Step `taken_step`'s groups are all taken: `send` the weights of version
        taken_step + 1 - delay, which fill the next step, if held (None during the warm-up: the
        generators keep the starting weights). Returns (the version sent or None, the bytes `send`
        reported)."""
        due = contract.published_at_take(taken_step, self.delay)
        tensors = self._held.pop(due, None)
        return (due, send(due, tensors)) if tensors is not None else (None, 0)

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to("cpu", dtype=dtype, copy=True)


class VersionPublisher:
    """What the generators can load, published by the learner: each new version as it is made
    (every `publication.every_steps`), or under train.fixed_staleness=k >= 1 (`ring`) held, and
    the version that fills the next step published after each take. Every rank calls `after_update`
    and `push` (the gather is a collective); rank 0 alone has a `sender` (None elsewhere: nothing
    is sent)."""

    def __init__(self, policy: Policy, sender: WeightSender | None, publication: Publication,
                 ring: VersionRing | None) -> None:
        self.policy, self.sender, self.publication, self.ring = policy, sender, publication, ring
        # The newest version the generators can load: pushed, or the one they start from.
        self.pushed_version = 0
        self._sent_after_take = 0

    def after_take(self, taken_step: int) -> None:
        """Rank 0, once step `taken_step`'s groups are taken and before they train: under a ring,
        publish the held version that fills the next step."""
        if self.ring is None or self.sender is None:
            return
        published, self._sent_after_take = self.ring.publish(taken_step, self.sender.push)
        self.pushed_version = self.pushed_version if published is None else published

    def after_update(self, version: int) -> dict[str, float]:
        """At the new `version` (every rank): push it, or under a ring keep a copy. The push's
        metrics; under a ring, those of the publication after this step's take."""
        if version % self.publication.every_steps != 0:
            return {}
        if self.ring is None:
            sent = self.push(version)
        else:
            sent, self._sent_after_take = self._sent_after_take, 0
            named = pushed_tensors(self.policy, self.publication.adapters_only)
            if self.sender is None:
                _exhaust(named)
            else:
                self.ring.hold(version, named)
        metrics = {"perf/push_bytes": sent}
        if self.sender is not None and self.publication.delta and (sent or self.ring is None):
            metrics["perf/push_changed_frac"] = self.sender.changed_fraction
        return metrics

    def push(self, version: int) -> int:
        """Push the policy's weights now, as `version` (every rank); returns the bytes sent."""
        named = pushed_tensors(self.policy, self.publication.adapters_only)  # gathered lazily, as the sender takes each tensor
        if self.sender is None:
            _exhaust(named)
            return 0
        sent = self.sender.push(version, named)
        self.pushed_version = version
        return sent

    def push_final(self, version: int) -> None:
        """At the end of the run (every rank): make sure the generators can load `version`, the
        newest (under a ring they hold an older one; the final evaluation and the probe need it)."""
        if self.ring is not None or version % self.publication.every_steps != 0:
            self.push(version)


def _exhaust(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Take every tensor of a gather this rank does not send: every rank takes part in each."""
    for _ in named:
        pass
