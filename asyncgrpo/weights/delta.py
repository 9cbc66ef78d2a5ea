"""Delta weight pushes (`weights.delta`, zmq backend): only the elements whose wire value changed.

A 16-bit wire value changes only when an update moves a weight by more than half its rounding step,
so after one optimizer step most bf16 elements keep their wire value: sending only the changed ones
saves most of a push's bytes over the network. Elements are compared as uint16 bit patterns (no
float comparison: -0 and +0 differ, a NaN equals itself), so a receiver that applies a delta onto
exactly its base version holds bit for bit what the sender holds.

Per piece of the chunk plan (asyncgrpo/weights/zmq.py, `chunk_plan`) the encoding is the smallest of
int32 positions + values (6 bytes per changed element), a bitmask of the piece + values (1/8 byte
per element + 2 per changed one) or all the piece's values (2 bytes per element): a delta piece is
never larger than the full one, so it fits the chunk it was planned in.

Sender (`DeltaEncoder`, learner rank 0): keeps the previous push's wire values, one copy of the
model in the wire dtype in its CPU memory; a full push every `weights.full_every` versions, when
asked (`request_full`) and on `republish` (a restarted generator, or a delta lost on the way).
Receiver (`DeltaBase`, each generator): keeps the newest complete version's wire values, one copy of
the model in the wire dtype; applies a delta only onto exactly its base version, else counts a
mismatch and waits for a full push (docs/WIRE.md, Delta pushes).
"""

from __future__ import annotations

import numpy as np

from asyncgrpo.wire.messages import DELTA_INDEX, DELTA_MASK, DELTA_VALUES

_NO_POSITIONS = np.empty(0, dtype=np.int32)


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def as_bits(array: np.ndarray) -> np.ndarray:
    """A wire array's bit patterns (bfloat16 already travels as uint16; float16 is viewed; an integer
    buffer, rare, compares as itself)."""
    return array.view(_UNSIGNED[array.dtype.itemsize])


def encode_piece(new: np.ndarray, old: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, int]:
    """The delta of one piece: `new` and `old` are 1-D 16-bit arrays of the same size. Returns
    (encoding, positions, values, changed count); values are `new`'s changed elements (all of
    `new` for DELTA_VALUES), positions are relative to the piece's first element."""
    changed = as_bits(new) != as_bits(old)
    count = int(np.count_nonzero(changed))
    span, itemsize = new.size, new.dtype.itemsize
    index_bytes, mask_bytes = 4 * count, -(-span // 8)
    if itemsize * count + min(index_bytes, mask_bytes) >= itemsize * span:
        return DELTA_VALUES, _NO_POSITIONS, new, count
    if index_bytes <= mask_bytes:
        return DELTA_INDEX, np.flatnonzero(changed).astype(np.int32), new[changed], count
    return DELTA_MASK, np.packbits(changed, bitorder="little"), new[changed], count


def apply_piece(flat: np.ndarray, offset: int, span: int, encoding: int, positions: np.ndarray,
                values: np.ndarray) -> None:
    """Write one delta piece into `flat` (writable, the base version's tensor) in place; raises
    ValueError when the piece does not fit it (a malformed push, not a lost one)."""
    if offset + span > flat.size or values.dtype.itemsize != flat.dtype.itemsize:
        raise ValueError(f"a delta piece of {span} elements at {offset} does not fit a tensor of {flat.size}")
    target = flat[offset:offset + span]
    if encoding == DELTA_VALUES:
        target[:] = values.view(flat.dtype)
        return
    if encoding == DELTA_MASK:
        positions = np.flatnonzero(np.unpackbits(positions, count=span, bitorder="little"))
    if positions.size != values.size or (positions.size and (positions[0] < 0 or positions[-1] >= span
                                                             or np.any(np.diff(positions) <= 0))):
        raise ValueError(f"a delta piece's positions ({positions.size}) do not match its {values.size} values "
                         f"or leave its span of {span} elements")
    target[positions] = values.view(flat.dtype)


class DeltaEncoder:
    """Sender side: the previous push's wire arrays (by tensor index) and when the next push must be full."""

    def __init__(self, full_every: int) -> None:
        """`full_every`: weights.full_every (a full push every this many versions)."""
        self.full_every = full_every
        self.previous: dict[int, tuple[np.ndarray, str]] = {}  # tensor index -> wire array, wire dtype name
        self.base_version = -1  # the version `previous` holds (-1: nothing pushed yet)
        self.deltas_since_full = 0
        self.full_requested = False
        self.changed = 0  # elements whose wire value changed, in the push being built
        self.elements = 0
        self.changed_fraction = 1.0  # of the last push (1.0 for the first)

    def next_is_full(self) -> bool:
        return (self.base_version < 0 or self.full_requested
                or self.deltas_since_full + 1 >= self.full_every)

    def request_full(self) -> None:
        """The next push is full (a generator could not apply a delta)."""
        self.full_requested = True

    def encode(self, index: int, start: int, part: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """The delta of tensor `index`'s elements [start, start + part.size) against the previous push."""
        encoding, positions, values, count = encode_piece(part, self.previous[index][0][start:start + part.size])
        self.changed += count
        self.elements += part.size
        return encoding, positions, values

    def keep(self, index: int, array: np.ndarray, wire_dtype: str, full: bool) -> None:
        """Tensor `index` of the push being built is all sent: it is the next delta's base. A full
        push counts what changed anyway, for the metric (every push reports its fraction)."""
        if full:
            old = self.previous.get(index)
            self.changed += array.size if old is None else int(np.count_nonzero(as_bits(array) != as_bits(old[0])))
            self.elements += array.size
        self.previous[index] = (array, wire_dtype)

    def pushed(self, version: int, full: bool) -> None:
        """`version` went out (`previous` now holds it): a delta or a full push."""
        self.base_version = version
        self.deltas_since_full = 0 if full else self.deltas_since_full + 1
        self.full_requested = self.full_requested and not full
        self.changed_fraction = self.changed / max(1, self.elements)
        self.changed = self.elements = 0


class DeltaBase:
    """Receiver side: the newest complete version's wire arrays (by tensor name, writable), onto
    which a delta of exactly that base version applies; and the deltas that could not apply."""

    def __init__(self) -> None:
        self.version = -1
        self.tensors: dict[str, tuple[np.ndarray, str, list[int]]] = {}  # name -> flat, dtype, shape
        self.mismatches = 0  # delta versions whose base this receiver did not hold
        self._mismatched = -1  # the last such version (counted once however many chunks it has)

    def mismatch(self, version: int) -> None:
        if version != self._mismatched:
            self._mismatched = version
            self.mismatches += 1

    def replace(self, version: int, tensors: dict[str, tuple[np.ndarray, str, list[int]]]) -> None:
        """A full version completed: it is the base from now on."""
        self.version, self.tensors = version, tensors

    def apply(self, version: int, pieces: list[tuple[str, int, int, int, np.ndarray, np.ndarray]]) -> None:
        """A delta onto `self.version` completed: apply its pieces (name, offset, span, encoding,
        positions, values) in place; `version` is the base from now on. Raises ValueError on a
        piece that does not fit (then the base is left as it was only if the first piece failed:
        the caller drops the base and waits for a full push)."""
        for name, offset, span, encoding, positions, values in pieces:
            if name not in self.tensors:
                raise ValueError(f"a delta for {name}, which version {self.version} does not have")
            flat, dtype, shape = self.tensors[name]
            if not flat.flags.writeable:  # still the received frame of a full push: copy once
                flat = flat.copy()
                self.tensors[name] = (flat, dtype, shape)
            apply_piece(flat, offset, span, encoding, positions, values)
        self.version = version

    def drop(self) -> None:
        """A delta that did not fit: nothing here can be trusted until the next full push."""
        self.version, self.tensors = -1, {}
