"""The dispatcher's slot indexes: who holds which slot (`Holdings`), and the slots given back to
be granted again (`FreeSlots`).

A group names its prompt, not its slot, and each ticket request reports on its holder's tickets
only; walking every held slot for each would cost an arriving group O(slots held), thousands at
scale. So the held tickets are indexed three ways, kept in step by `hold` and `unhold` alone.

Pure Python, no torch: the simulator imports the dispatcher (dispatch.py), which owns one.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

Holder = tuple[int, int]  # (generator id, incarnation): a restarted generator is a new holder


@dataclass
class Held:
    holder: Holder
    position: int
    grant: int  # the holder's grant number that carried it (reports name the newest grant received)
    version: int  # the weights the holder had loaded when granted: its group samples from them on


class Holdings:
    """The slots granted and not arrived, each with its `Held` ticket.

    Invariants (`check`): every held slot is found by its (holder, position) (`slot_of`) and among
    its holder's slots (`of`); neither index names anything else; a holder with no slot is not
    listed (`holders`); a prompt is held once per holder at most (`hold` refuses a second)."""

    def __init__(self) -> None:
        self._held: dict[int, Held] = {}  # slot -> its ticket
        self._slot_by_prompt: dict[tuple[Holder, int], int] = {}  # (holder, position) -> slot
        self._slots_by_holder: dict[Holder, set[int]] = {}  # holder -> its slots, none empty

    def hold(self, slot: int, held: Held) -> None:
        key = (held.holder, held.position)
        if key in self._slot_by_prompt:  # a prompt is in one place at a time: held, queued, retried or trained
            raise RuntimeError(f"dispatcher: prompt {held.position} would be held twice by {held.holder}")
        self._held[slot] = held
        self._slot_by_prompt[key] = slot
        self._slots_by_holder.setdefault(held.holder, set()).add(slot)

    def unhold(self, slot: int) -> Held:
        """Forget `slot` (KeyError if not held); returns its ticket."""
        held = self._held.pop(slot)
        del self._slot_by_prompt[(held.holder, held.position)]
        slots = self._slots_by_holder[held.holder]
        slots.discard(slot)
        if not slots:
            del self._slots_by_holder[held.holder]
        return held

    def get(self, slot: int) -> Held | None:
        return self._held.get(slot)

    def __contains__(self, slot: int) -> bool:
        return slot in self._held

    def slot_of(self, holder: Holder, position: int) -> int | None:
        """The slot `holder` holds for the prompt at `position`, or None."""
        return self._slot_by_prompt.get((holder, position))

    def of(self, holder: Holder) -> list[tuple[int, Held]]:
        """`holder`'s (slot, ticket) pairs, lowest slot first."""
        return [(slot, self._held[slot]) for slot in sorted(self._slots_by_holder.get(holder, ()))]

    def holders(self) -> Iterator[Holder]:
        """Every holder with a slot held."""
        return iter(self._slots_by_holder)

    def positions(self) -> set[int]:
        """The prompt positions of every held ticket."""
        return {held.position for held in self._held.values()}

    def check(self) -> None:
        """Raise AssertionError naming the first invariant (class docstring) that does not hold; the
        dispatcher's property test calls it after every event."""
        by_holder: dict[Holder, set[int]] = {}
        for slot, held in self._held.items():
            if self._slot_by_prompt.get((held.holder, held.position)) != slot:
                raise AssertionError(f"slot {slot} ({held}) is not found by its prompt")
            by_holder.setdefault(held.holder, set()).add(slot)
        if len(self._slot_by_prompt) != len(self._held):
            raise AssertionError(f"the prompt index names {len(self._slot_by_prompt)} slots, "
                                 f"{len(self._held)} are held")
        if self._slots_by_holder != by_holder:
            raise AssertionError(f"the holder index {self._slots_by_holder} is not the held slots' {by_holder}")


class FreeSlots:
    """Slots granted before and given back: granted again first, lowest first (a heap)."""

    def __init__(self) -> None:
        self._heap: list[int] = []

    def push(self, slot: int) -> None:
        heapq.heappush(self._heap, slot)

    def lowest(self, floor: float, limit: float) -> int | None:
        """The lowest slot within [floor, limit), or None."""
        if not self._heap or self._heap[0] >= limit:
            return None
        if self._heap[0] >= floor:
            return self._heap[0]
        # The lowest is below this holder's floor (fixed staleness: a step for older weights); rare,
        # and the free slots are few.
        return min((slot for slot in self._heap if floor <= slot < limit), default=None)

    def take(self, slot: int) -> None:
        """Remove `slot` (ValueError if not free)."""
        if self._heap[0] == slot:
            heapq.heappop(self._heap)
        else:
            self._heap.remove(slot)
            heapq.heapify(self._heap)

    def __contains__(self, slot: int) -> bool:
        return slot in self._heap
