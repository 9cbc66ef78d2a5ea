"""Weight sync through shared memory, for generators on learner rank 0's host (`weights.backend=shm`).

    learner rank 0                                    generator
    --------------                                    ---------
    slot = version % 2; header: writing = version
    copy every tensor into the slot (in wire dtype)
    header: complete = version
    PUB: WeightsChunk(version, "__shm__", [slot, fingerprint])  ->  poll(): newest (version, slot)
                                                      apply_newest(): load the engine straight from
                                                      the slot, then check it was not rewritten

Two files in a private directory under `weights.shm_dir` (RAM-backed /dev/shm by default) hold
one version each; both sides lay the tensors out identically from the model directory's tensor list
and the wire dtype, and the announcement carries a fingerprint of that layout, so a mismatch fails
loudly instead of scrambling weights.

Why: over ZeroMQ a push is copied five times (the learner's private copy, the socket's two kernel
copies, the generator's assembly, the engine load); here twice (into the slot, into the engine), and
nothing is buffered per generator. The learner is blocked exactly for its gather and copy.

Versions alternate between the slots, so the learner writes version v + 2 over v. A generator still
loading v from that slot would read a torn mix: it checks the slot's `writing` counter after the load
(a seqlock) and, if it moved, loads the newest announced version again before generating anything.

The seqlock is plain loads and stores on the mapped memory, with no fences: Python gives no
ordering guarantee between processes, and the seqlock is correct only where the hardware keeps
stores in order as others see them and loads in order (x86-64's total store order). Elsewhere (Arm,
POWER) a generator could see the new counter before the tensor bytes: both sides refuse to start
there (`require_ordered_platform`), and `weights.backend=auto` picks zmq.

A slot directory is named after the process that created it (`asyncgrpo-weights-<pid>-<start>-`,
start: the process's start time from /proc): the driver removes this user's directories whose
creator is gone before a run starts (`remove_stale_slots`), what a SIGKILLed run left in RAM.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncgrpo.runtime.files import owned_private_dir, remove_stale_owned_dirs
from asyncgrpo.runtime.placement import ORDERED_MACHINES, ordered_memory_platform
from asyncgrpo.weights.base import StreamReceiver, TensorSpec, WeightTarget, fingerprint
from asyncgrpo.wire import Publisher, SaveNotice, Shutdown, Subscriber, WeightsChunk

ANNOUNCEMENT_NAME = "__shm__"
NUM_SLOTS = 2
# Header: int64 [writing version, complete version]; a page so every tensor starts aligned.
HEADER_BYTES = 4096
_ALIGN = 64
_WRITING, _COMPLETE = 0, 1
# How often a generator whose load was torn re-reads the newest version before giving up.
MAX_TORN_LOADS = 8
SLOT_DIR_PREFIX = "asyncgrpo-weights-"
# <pid>-<start time>-<mkdtemp's random part> (files.owned_private_dir); older runs' names have no pid
# and are left alone.


def require_ordered_platform(machine: str | None = None) -> None:
    """Refuse, in one line, a machine whose memory ordering the slots' seqlock does not hold on."""
    if not ordered_memory_platform(machine):
        import platform

        raise ValueError(f"weights.backend=shm relies on x86-64 memory ordering for its slots' seqlock; this machine "
                         f"is {machine or platform.machine()} (supported: {', '.join(ORDERED_MACHINES)}): "
                         "use weights.backend=zmq")


def remove_stale_slots(directory: str) -> list[str]:
    """Remove the slot directories in `directory` that this user's dead runs left (a learner killed
    with SIGKILL, or its driver); the ones removed. Never another user's, a live process's, or a
    name that records no process."""
    return remove_stale_owned_dirs(directory, SLOT_DIR_PREFIX)


def default_directory() -> str:
    """RAM-backed where the system has it; the temporary directory otherwise."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in a slot (bytes after the header)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def layout(spec: Sequence[TensorSpec], wire_dtype: torch.dtype) -> tuple[list[Entry], int]:
    """Each tensor's place in a slot, floating tensors in `wire_dtype`; and the payload bytes."""
    entries, offset = [], 0
    for name, shape, dtype in spec:
        dtype = wire_dtype if dtype.is_floating_point else dtype
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        entries.append(Entry(name, tuple(shape), dtype, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return entries, offset


def slot_bytes(spec: Sequence[TensorSpec], wire_dtype: torch.dtype) -> int:
    return HEADER_BYTES + layout(spec, wire_dtype)[1]


class _Slot:
    """One mapped slot file: its header counters and a typed view of each tensor."""

    def __init__(self, path: str, size: int, entries: list[Entry], writable: bool) -> None:
        flags = os.O_RDWR if writable else os.O_RDONLY
        fd = os.open(path, flags)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ValueError(f"weights.backend=shm: {path} holds {actual} bytes where this model needs {size}")
            self.map = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # A read-only map: torch warns that the tensor is not writable; nothing here writes it.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(self.map, dtype=torch.uint8)
        self.header = np.frombuffer(self.map, dtype=np.int64, count=2)
        self.tensors = [raw[HEADER_BYTES + e.offset:HEADER_BYTES + e.offset + e.nbytes].view(e.dtype).view(e.shape)
                        for e in entries]

    def close(self) -> None:
        del self.tensors, self.header
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view: the map is freed with it
            pass


class ShmWeightSender:
    """Learner side (rank 0). Creates the slots; `close()` removes them."""

    def __init__(self, publisher: Publisher, spec: Sequence[TensorSpec], wire_dtype: torch.dtype,
                 directory: str) -> None:
        self.publisher = publisher
        self.endpoint = publisher.endpoint
        self.spec = list(spec)
        self.entries, payload = layout(self.spec, wire_dtype)
        self.slot_size = HEADER_BYTES + payload
        self.fingerprint = fingerprint((e.name, e.shape, e.dtype) for e in self.entries)
        require_ordered_platform()
        free = shutil.disk_usage(directory).free
        if free < NUM_SLOTS * self.slot_size:
            raise ValueError(f"weights.backend=shm needs {NUM_SLOTS * self.slot_size / 2**30:.2f} GiB free in "
                             f"{directory} (weights.shm_dir), it has {free / 2**30:.2f} GiB: "
                             "set weights.shm_dir or weights.backend=zmq")
        self.directory = owned_private_dir(SLOT_DIR_PREFIX, parent=directory)
        # The slots live in RAM: removed by close(), or when this object is collected or the process
        # exits without it (a learner built and dropped by a test or a tool). A killed process's slots
        # are removed by the driver at stop, or when the driver was killed too, by the next run's.
        self._remove = weakref.finalize(self, remove_directory, self.directory)
        self.paths = [os.path.join(self.directory, f"slot{i}") for i in range(NUM_SLOTS)]
        for path in self.paths:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, self.slot_size)
            finally:
                os.close(fd)
        self.slots = [_Slot(path, self.slot_size, self.entries, writable=True) for path in self.paths]
        for slot in self.slots:
            slot.header[:] = -1
        self.newest: tuple[int, int] | None = None  # (version, slot) of the newest push
        self.bytes_pushed = 0

    @property
    def payload_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def join_address(self) -> dict[str, Any]:
        return {"shm_paths": self.paths, "shm_slot_bytes": self.slot_size}

    def wait_for_joins(self) -> None:
        pass  # receivers map the files whenever they join

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy every tensor into slot `version % 2` (consuming `named_tensors` lazily), then announce it."""
        index = version % NUM_SLOTS
        slot = self.slots[index]
        slot.header[_COMPLETE] = -1
        slot.header[_WRITING] = version  # before the first byte: a reader of the old version sees it moved
        count = 0
        for (name, tensor), entry, target in zip(named_tensors, self.entries, slot.tensors):
            if name != entry.name or tuple(tensor.shape) != entry.shape:
                raise ValueError(f"weight push: got {name} {tuple(tensor.shape)} where the model has "
                                 f"{entry.name} {entry.shape}")
            with torch.no_grad():
                target.copy_(tensor.detach())
            count += 1
        if count != len(self.entries):
            raise ValueError(f"weight push: {count} tensors where the model has {len(self.entries)}")
        slot.header[_COMPLETE] = version
        self._announce(version, index)
        self.newest = (version, index)
        self.bytes_pushed += self.payload_bytes
        return self.payload_bytes

    def _announce(self, version: int, index: int) -> None:
        announcement = np.concatenate([np.array([index], dtype=np.int64), self.fingerprint])
        self.publisher.publish(WeightsChunk(version=version, chunk_index=0, num_chunks=1, names=[ANNOUNCEMENT_NAME],
                                            tensors=[announcement], dtypes=["int64"], shapes=[[announcement.size]],
                                            offsets=[0]))

    def republish(self) -> None:
        """Announce the newest version again: it is still in its slot (a restarted generator also
        finds it there when it joins, `ShmWeightReceiver.join`)."""
        if self.newest is not None:
            self._announce(*self.newest)

    def shutdown(self, reason: str) -> None:
        self.publisher.publish(Shutdown(reason=reason))

    def announce(self, notice: SaveNotice) -> None:
        self.publisher.publish(notice)

    def close(self) -> None:
        self.publisher.close()
        for slot in self.slots:
            slot.close()
        self._remove()


def remove_directory(directory: str) -> None:
    """Remove a sender's slot directory (also for a driver cleaning up after a crashed learner)."""
    if Path(directory).name.startswith(SLOT_DIR_PREFIX):
        shutil.rmtree(directory, ignore_errors=True)


class ShmWeightReceiver(StreamReceiver):
    """Generator side: announcements over the subscription, tensors read from the mapped slots."""

    def __init__(self, subscriber: Subscriber, spec: Sequence[TensorSpec], wire_dtype: torch.dtype,
                 timeout_s: float) -> None:
        super().__init__(subscriber)
        require_ordered_platform()
        self.entries, payload = layout(list(spec), wire_dtype)
        self.slot_size = HEADER_BYTES + payload
        self.fingerprint = fingerprint((e.name, e.shape, e.dtype) for e in self.entries)
        self.timeout_s = timeout_s
        self.slots: list[_Slot] = []
        self.announced: tuple[int, int] | None = None  # newest (version, slot) not yet loaded
        self.torn_loads = 0

    def join(self, address: dict[str, Any]) -> None:
        if address.get("shm_slot_bytes") != self.slot_size:
            raise ValueError(f"weights.backend=shm: the learner's slots hold {address.get('shm_slot_bytes')} bytes, "
                             f"this generator's model and wire dtype need {self.slot_size}: different model directories?")
        self.slots = [_Slot(path, self.slot_size, self.entries, writable=False) for path in address["shm_paths"]]
        # A generator that joins late (a restart) missed the announcements so far: the slots say
        # which version is complete in each, and `apply_newest` checks the slot as it loads.
        complete = [(int(slot.header[_COMPLETE]), index) for index, slot in enumerate(self.slots)]
        version, index = max(complete)
        if version > max(self.newest_version, self.announced[0] if self.announced else -1):
            self.announced = (version, index)

    def _on_chunk(self, message: WeightsChunk) -> bool:
        body = message.tensors[0] if message.names == [ANNOUNCEMENT_NAME] and message.tensors else None
        if body is None or body.dtype != np.int64 or body.size != 1 + self.fingerprint.size \
                or not 0 <= int(body[0]) < NUM_SLOTS:
            self.subscriber.rejected.record_error("bad_announcement", "weights.backend=shm: not a slot announcement")
            return False
        if not np.array_equal(body[1:], self.fingerprint):
            self.subscriber.rejected.record_error(
                "inconsistent_weights", "weights.backend=shm: the learner announced a different tensor layout than "
                                        "this generator's model directory and wire dtype give")
            return False
        if message.version <= max(self.newest_version, self.announced[0] if self.announced else -1):
            return False
        self.announced = (message.version, int(body[0]))
        return True

    def apply_newest(self, target: WeightTarget) -> int | None:
        """Load the newest announced version straight from its slot; reload if the learner rewrote
        the slot meanwhile (then a newer version is announced, or about to be)."""
        if self.announced is None:
            return None
        if not self.slots:
            raise RuntimeError("weights.backend=shm: weights announced before this generator joined")
        deadline = time.monotonic() + self.timeout_s
        for _ in range(MAX_TORN_LOADS):
            version, index = self.announced
            slot = self.slots[index]
            if slot.header[_COMPLETE] == version and slot.header[_WRITING] == version:
                target.load_weights([(e.name, t) for e, t in zip(self.entries, slot.tensors)])
                if slot.header[_WRITING] == version:
                    self.announced = None
                    self.newest_version = version
                    return version
                self.torn_loads += 1
            # Rewritten under us: the learner announces each version after writing it; wait for it.
            while self.announced[0] == version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weights.backend=shm: slot {index} was rewritten while loading version "
                                       f"{version} and no newer version was announced within {self.timeout_s:.0f} s")
                self.poll(timeout_s=0.5)
        raise RuntimeError(f"weights.backend=shm: {MAX_TORN_LOADS} loads in a row were overwritten by the learner "
                           "mid-load (the engine loads slower than the learner steps): use weights.backend=zmq")

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        self.slots = []
        self.subscriber.close()
