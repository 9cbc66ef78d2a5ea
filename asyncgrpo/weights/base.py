"""Weight sync between learner rank 0 and the generators: one interface, one backend per transport.

    learner rank 0: WeightSender                              generators: WeightReceiver
      join_address()  --- the driver hands it to --->           join(address)
      wait_for_joins()   (both sides block until every generator has joined; no-op for zmq)
      push(version, named_tensors)  ------------------->        poll() / apply_newest(engine)
      shutdown(reason)  -------------------------------->       shutdown_reason
      announce(SaveNotice)  (a checkpoint save) -------->       saves (SaveWatch)
      republish()  (a restarted generator joined late) -->      poll() / apply_newest(engine)

Backends (`weights.backend`; auto = shm when every generator shares learner rank 0's node, else zmq):
- `shm` (one host): each version copied once into one of two shared-memory slots; generators load
  their running vLLM engine straight from it (asyncgrpo/weights/shm.py).
- `zmq` (any device): the full state dict in chunks over a ZeroMQ PUB socket; each generator keeps
  only the newest complete version and loads it into its running vLLM engine.
- `nccl` (GPU): names, shapes and dtypes are announced over the same PUB socket, the tensors are
  broadcast from learner rank 0 into the vLLM workers over an NCCL group (asyncgrpo/weights/nccl.py).

Tensors always travel under their Hugging Face names and shapes; the engine maps them.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from asyncgrpo.wire.messages import SaveNotice, Shutdown, WeightsChunk

BACKENDS = ("auto", "shm", "zmq", "nccl")
# A tensor of the policy's state dict: Hugging Face name, shape, dtype.
TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


def distinct_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict without the second name of a tied tensor (a tied LM head is the embedding:
    pushing it twice would double the largest tensor's bytes, and vLLM skips it anyway)."""
    distinct = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return ((name, tensor) for name, tensor in model.state_dict().items() if name in distinct)


def model_spec(model_dir: str) -> list[TensorSpec]:
    """Names, shapes and dtypes of what a push carries (`distinct_state`), in order, without
    allocating weights."""
    from asyncgrpo.models.shapes import meta_model_of

    return [(name, tuple(t.shape), t.dtype) for name, t in distinct_state(meta_model_of(model_dir))]


def fingerprint(spec: Iterable[TensorSpec]) -> np.ndarray:
    """A digest of names, shapes and dtypes (four int64): sender and receiver compare it in the
    announcement, so two different tensor lists fail loudly instead of scrambling weights."""
    text = ";".join(f"{name}:{list(shape)}:{dtype}" for name, shape, dtype in spec)
    return np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.int64).copy()


def largest_tensor(spec: list[TensorSpec]) -> TensorSpec:
    return max(spec, key=lambda entry: math.prod(entry[1]) * entry[2].itemsize)


class WeightSender(Protocol):
    """Learner side (rank 0 only)."""

    bytes_pushed: int
    endpoint: str  # the ZeroMQ endpoint generators subscribe to (announcements, chunks, shutdown)

    def join_address(self) -> dict[str, Any]:
        """Where receivers join the weight transport ({}: nothing to join)."""

    def wait_for_joins(self) -> None:
        """Block until every receiver has joined (returns at once when there is nothing to join)."""

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Make `version` available to every generator; returns the payload bytes sent."""

    def shutdown(self, reason: str) -> None:
        """Tell every generator to stop after loading what it has."""

    def announce(self, notice: SaveNotice) -> None:
        """Tell every generator that a checkpoint save starts or ended (`SaveWatch` on their side)."""

    def republish(self) -> None:
        """Make the newest version pushed available again, for a generator that joined after it was
        pushed (a restarted one): a subscriber receives nothing published before it connected.
        Nothing to do before the first push (generators start from that version's weights)."""

    def close(self) -> None: ...


class WeightTarget(Protocol):
    """What a receiver loads weights into (a `VLLMEngine`)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class WeightReceiver(Protocol):
    """Generator side."""

    shutdown_reason: str | None
    newest_version: int
    saves: SaveWatch  # the checkpoint saves announced on the weight stream
    delta_mismatches: int  # weights.delta: deltas it could not apply (not its base); 0 for other pushes

    def rejections(self) -> tuple[int, str]:
        """Weight messages that could not be used, and the first reason (reported to the learner)."""

    def join(self, address: dict[str, Any]) -> None:
        """Join the sender's transport at `address` (from `WeightSender.join_address`); blocks until all joined."""

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Read what has arrived, waiting up to `timeout_s` for the first message; True if a new
        version or a shutdown arrived."""

    def apply_newest(self, target: WeightTarget) -> int | None:
        """Load the newest complete version into `target` (a safe point: no request in flight);
        returns that version, or None if nothing new arrived."""

    def close(self) -> None: ...


class StreamReceiver:
    """What every generator-side receiver shares: the subscription to learner rank 0's PUB socket,
    whose `Shutdown` and `SaveNotice` mean the same whatever the backend, and the count of messages
    it could not use. Each backend says what a `WeightsChunk` means (`_on_chunk`: a piece of a
    version, or the announcement of one)."""

    delta_mismatches = 0  # only zmq applies deltas (weights.delta)

    def __init__(self, subscriber: Any) -> None:
        """`subscriber`: an `asyncgrpo.wire.Subscriber` (or a test's stand-in with `recv` and `rejected`)."""
        self.subscriber = subscriber
        self.newest_version = -1
        self.shutdown_reason: str | None = None
        self.saves = SaveWatch()

    def rejections(self) -> tuple[int, str]:
        """Weight messages that could not be used (malformed, too large, inconsistent), and the first reason."""
        rejected = self.subscriber.rejected
        return sum(rejected.counts().values()), rejected.first_error

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Read what has arrived (waiting up to `timeout_s` for the first message); True if a new
        version (complete, or announced) or a shutdown arrived."""
        changed = False
        wait = timeout_s
        while (message := self.subscriber.recv(wait)) is not None:
            wait = 0.0
            if isinstance(message, Shutdown):
                self.shutdown_reason = message.reason
                changed = True
            elif isinstance(message, SaveNotice):
                self.saves.note(message)
            elif isinstance(message, WeightsChunk):
                changed |= self._on_chunk(message)
        return changed

    def _on_chunk(self, chunk: WeightsChunk) -> bool:
        """A weights message arrived: True if it completes or announces a newer version."""
        raise NotImplementedError


class SaveWatch:
    """A generator's view of learner rank 0's checkpoint saves, from the `SaveNotice`s that arrive
    with the weights. A save stops weight pushes and the queue's takes for as long as it takes
    (minutes for a 7B model's shards), longer than `wire.timeout_s`; so while one is announced and
    not over, a generator's waits may last until the save's bound (`deadline`), and once it is over,
    `wire.timeout_s` from its end. It is over at its end notice or at a newer version's weights (the
    learner went on: an end notice lost on the way does not keep the bound). A generator that missed
    the announcement (it subscribed after it) waits `wire.timeout_s` as before."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.notice: SaveNotice | None = None  # the save in progress, if one was announced
        self.announced_at = 0.0
        self.ended: SaveNotice | None = None  # the last save that ended
        self.ended_at = -math.inf

    @property
    def until(self) -> float:
        """When the save in progress must be over (-inf: none in progress)."""
        return self.announced_at + self.notice.timeout_s if self.notice is not None else -math.inf

    def note(self, notice: SaveNotice) -> None:
        """A notice arrived: a save starts (the newest replaces an older one), or one ends."""
        now = self.clock()
        if notice.saving:
            if self.notice is None or notice.version >= self.notice.version:
                self.notice, self.announced_at = notice, now
        elif self.notice is not None and notice.version >= self.notice.version:
            self._end(now)

    def weights_loaded(self, version: int) -> None:
        """Weights newer than the save's version: the learner is past the save."""
        if self.notice is not None and version > self.notice.version:
            self._end(self.clock())

    def _end(self, now: float) -> None:
        self.ended, self.ended_at, self.notice = self.notice, now, None

    def deadline(self, started: float, timeout_s: float) -> float:
        """Until when a wait that began at `started` (this clock) may last: `timeout_s`, or the bound
        of the save in progress, or `timeout_s` after the last save ended, whichever is latest."""
        return max(started + timeout_s, self.until, self.ended_at + timeout_s)

    def describe(self) -> str:
        """The save behind an extended wait, for its timeout's message."""
        now = self.clock()
        if self.notice is not None:
            return (f"learner rank 0 announced a checkpoint save of version {self.notice.version} "
                    f"{now - self.announced_at:.0f} s ago, to take at most {self.notice.timeout_s:.0f} s "
                    "(train.checkpoint_timeout_s), and it has not ended")
        if self.ended is not None:
            return (f"learner rank 0's checkpoint save of version {self.ended.version} ended "
                    f"{now - self.ended_at:.0f} s ago")
        return ""
