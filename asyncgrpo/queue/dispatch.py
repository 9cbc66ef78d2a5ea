"""Dynamic dispatch by tickets: prompts go to whichever generator asks, within the staleness budget.

Learner rank 0's queue thread owns one (replay_queue.py, Tickets), the generators ask through
rollout/tickets.py, and the simulator runs the same code.

A ticket is a slot and a prompt. Slots number the groups in training order: the learner at
version u trains exactly slots u*G .. u*G + G - 1 (G = train.groups_per_step), whoever generated
them, in whatever order they arrived. A generator asks for tickets with the version w of the
weights in its engine; under a throttling stale policy it is granted only slots within the
admission bound of asyncgrpo/contract.py (slot s only if s < (w + max_staleness + 1) * G), so every
group is trained within max_staleness of the weights that sampled it, for any number of
generators at any relative speeds. A faster generator simply asks more often and gets more slots.

Under `train.staleness_control=divergence` the learner moves the bound new slots are granted under,
`admission_bound` (<= max_staleness, through contract.check_admission_bound and the queue's
`set_admission_bound`, after every step); `slot_limit` alone reads it. What judges a slot already
granted (`fill_early`, the queue's drop at take time, the contract's `trainable`) keeps
max_staleness, so a slot granted under a higher bound stays trainable after the bound falls:
lowering it never strands a group, and the learner's next step is still filled (a generator with
the newest pushed weights is granted it: the push period is at most min_staleness + 1).

Under `train.fixed_staleness=k` (max_staleness = k) the contract's lower bound is granted too
(s // G >= w + k): a generator holding w fills step w + k exactly, and every step u past the warm-up is sampled by
version u - k (the learner publishes v + 1 - k only once step v is taken, so until then the engines
hold <= v - k and fill step v: no deadlock). The starting weights (version first_step: the run's, or a resumed
checkpoint's) fill steps first_step .. first_step + k.

Groups finish out of order (a continuous generator sends each the moment its samples are done).
A step does not wait for a slot whose group is still being generated when a later step's group has
finished and the slot's ticket can still be trained later within its bound: the two trade places
(`fill_early`). A step waits only for groups that must be trained at it. Generators name their
tickets by prompt position in their reports, so a ticket keeps its name when its slot moves.

A slot whose group will never be trained goes back to the pool and is granted again, lowest
first (the learner waits for it): when its holder dies (`holder_down`), when its group is lost in
transit (`heard_from`: the holder's report, sent after its groups on the same ordered socket, no
longer lists it), and when the group is dropped (`release`: stale, rejected, a reward failure).
A prompt whose group never arrived is given again (death, loss); one whose group was dropped for
what it is (its rewards failed, it came too stale) is not, as today.

Positions number the run's prompt stream; `state_dict` is what a checkpoint needs to continue:
the next step, the next new position and every position granted but not yet trained (they are
given again first).

Pure Python, no torch: the simulator imports it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from asyncgrpo.contract import Ticket, admission_floor, admission_limit, first_slot
from asyncgrpo.queue.holdings import FreeSlots, Held, Holder, Holdings


class Dispatcher:
    """Grants tickets, takes their groups back a step at a time, and re-grants what will never arrive.
    One owner (learner rank 0's queue thread); not thread-safe."""

    def __init__(self, groups_per_step: int, max_staleness: int, throttle: bool = True,
                 capacity_groups: int | None = None, first_step: int = 0, first_position: int = 0,
                 retry_positions: Iterable[int] = (), end_step: int | None = None,
                 positions_end: int | None = None, fixed_staleness: bool = False) -> None:
        """`capacity_groups`: the queue's; no slot is granted that the queue could not hold beside
        the next step's (None: no such limit). Without it, and without the throttle, a queue full of
        later slots could block the very group the next step waits for. `end_step`: the run's last
        step is end_step - 1 (train.max_steps); no slot of a later step is granted. `positions_end`:
        the prompt stream's length (finite data); no position at or past it is granted.
        `fixed_staleness` (train.fixed_staleness, with the throttle): the lower bound too (`slot_floor`)."""
        if groups_per_step < 1 or max_staleness < 0 or first_step < 0 or first_position < 0 \
                or (capacity_groups is not None and capacity_groups < groups_per_step) \
                or (end_step is not None and end_step < 0) or (positions_end is not None and positions_end < 0) \
                or (fixed_staleness and not throttle):
            raise ValueError(f"bad dispatcher settings: groups_per_step={groups_per_step}, "
                             f"max_staleness={max_staleness}, capacity_groups={capacity_groups}, "
                             f"first_step={first_step}, first_position={first_position}, end_step={end_step}, "
                             f"positions_end={positions_end}, fixed_staleness={fixed_staleness} "
                             f"with throttle={throttle}")
        self.groups_per_step, self.max_staleness, self.throttle = groups_per_step, max_staleness, throttle
        self.admission_bound = max_staleness  # new grants' (divergence control: contract.check_admission_bound)
        self.fixed_staleness = fixed_staleness
        # The version of the weights the run (or its resume) starts from: they sample steps
        # first_step .. first_step + max_staleness under fixed staleness (`slot_floor`).
        self.first_step = first_step
        self.capacity_groups, self.end_step, self.positions_end = capacity_groups, end_step, positions_end
        self.step = first_step  # the next step to take: its slots are step*G .. step*G + G - 1
        self._next_slot = first_slot(first_step, groups_per_step)  # never granted at or beyond this
        self._next_position = first_position
        self._free = FreeSlots()  # slots granted before and given back: granted again first, lowest first
        self._retry: deque[int] = deque(sorted(set(retry_positions)))  # prompts to give again before new ones
        self.holdings = Holdings()  # slots granted, their groups not arrived: who holds which
        self._filled: dict[int, tuple[Holder, int]] = {}  # slot -> (holder, position): arrived, not taken
        self._grants: dict[Holder, int] = {}  # holder -> how many grants it has been given
        # generator id -> its oldest process that may still ask: the newest seen asking, or the one
        # after the newest the driver reported dead. A request from an older one gets nothing: its
        # process is gone (or replaced), and slots granted to it would hold a step until a restart.
        self._live_from: dict[int, int] = {}
        self.counts = {"granted": 0, "regranted": 0, "lost": 0, "down": 0, "released": 0, "refused_arrivals": 0,
                       "unreceived": 0, "stale_requests": 0, "early": 0}

    # ---- generators ask

    def request(self, holder: Holder, loaded_version: int, wanted: int, newest_grant: int,
                unsent: Iterable[int], given_back: Iterable[int]) -> tuple[int, list[Ticket]]:
        """One ticket request (wire TicketRequest), read after every group its holder sent before
        it: take its report (given back, grants that never reached it, groups lost in transit; the
        report names prompt positions, which stay with their tickets while slots may move), then
        grant. A request from a replaced process (an older incarnation) or one reported dead
        (`generator_down`: its request was still on the stream) gets nothing; the first from a newer
        one retires its predecessors."""
        generator_id, incarnation = holder
        live_from = self._live_from.get(generator_id, 0)
        if incarnation < live_from:
            self.counts["stale_requests"] += 1
            return 0, []
        if incarnation > live_from:
            self.generator_down(generator_id, incarnation - 1)
        # Unreceived grants first: a give-back repeated because its answer was lost may name a slot
        # that very answer granted again (with a new prompt); taken back as unreceived, prompt and
        # all, the slot is no longer this holder's and the repeated give-back passes it by.
        self.grants_unreceived(holder, newest_grant)
        self.given_back(holder, given_back)
        self.heard_from(holder, newest_grant, unsent)
        return self.grant(holder, loaded_version, wanted)

    def generator_down(self, generator_id: int, incarnation: int) -> list[int]:
        """Every process of `generator_id` up to `incarnation` is gone (the driver's report names the
        one that died; a newer one's first request retires the older): `holder_down` for each, and
        their requests still on their way get nothing. A newer process keeps its slots."""
        self._live_from[generator_id] = max(self._live_from.get(generator_id, 0), incarnation + 1)
        holders = {h for h in self.holdings.holders() if h[0] == generator_id and h[1] <= incarnation}
        return sorted(slot for holder in holders for slot in self.holder_down(holder))

    def slot_limit(self, loaded_version: int) -> float:
        """Slots below this may go to a generator holding `loaded_version`: the admission bound (under
        the throttle), and what the queue can hold from the next step on (with a capacity)."""
        bound = admission_limit(loaded_version, self.admission_bound, self.groups_per_step) if self.throttle else math.inf
        room = first_slot(self.step, self.groups_per_step) + self.capacity_groups \
            if self.capacity_groups is not None else math.inf
        end = first_slot(self.end_step, self.groups_per_step) if self.end_step is not None else math.inf
        return min(bound, room, end)

    def slot_floor(self, loaded_version: int) -> float:
        """Under fixed staleness, no slot below this goes to a generator holding `loaded_version`:
        with the bound above, a generator holding w > first_step fills step w + max_staleness only,
        and the starting weights (w == first_step: the run's, or the resumed checkpoint's) the steps
        first_step .. first_step + max_staleness; weights older than those, none.
        The learner's delayed publication (learner/publication.py) already keeps every engine at or
        below u - max_staleness until step u is taken; this bound makes exactness the dispatcher's own guarantee, so an
        engine that came by newer weights anyway is kept from sampling a step fresher than k."""
        if not self.fixed_staleness:
            return 0
        return admission_floor(loaded_version, self.max_staleness, self.groups_per_step, self.first_step)

    def can_grant(self, loaded_version: int) -> bool:
        """Whether a generator holding `loaded_version` would be granted anything now."""
        floor, limit = self.slot_floor(loaded_version), self.slot_limit(loaded_version)
        return self.prompts_left() and (self._free.lowest(floor, limit) is not None
                                        or floor <= self._next_slot < limit)

    def prompts_left(self) -> bool:
        """Whether a prompt is left to grant: one to give again, or a new position before the end."""
        return bool(self._retry) or self.positions_end is None or self._next_position < self.positions_end

    def grant(self, holder: Holder, loaded_version: int, wanted: int) -> tuple[int, list[Ticket]]:
        """Up to `wanted` tickets for `holder`, lowest slots first; (grant number, tickets). Fewer
        (or none) when the bound allows no more: the holder asks again with newer weights."""
        floor, limit = self.slot_floor(loaded_version), self.slot_limit(loaded_version)
        grant = self._grants.get(holder, 0) + 1
        tickets: list[Ticket] = []
        while len(tickets) < wanted and self.prompts_left():
            if (slot := self._free.lowest(floor, limit)) is not None:
                self._free.take(slot)
                self.counts["regranted"] += 1
            elif floor <= self._next_slot < limit:  # never past an ungranted slot: it would leave a hole
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            else:
                break
            if self._retry:
                position = self._retry.popleft()
            else:
                position, self._next_position = self._next_position, self._next_position + 1
            self.holdings.hold(slot, Held(holder, position, grant, loaded_version))
            tickets.append(Ticket(slot, position))
        if tickets:
            self._grants[holder] = grant
            self.counts["granted"] += len(tickets)
        return (grant if tickets else self._grants.get(holder, 0)), tickets

    # ---- groups arrive, or never will

    def arrived(self, holder: Holder, slot: int) -> bool:
        """`holder`'s group for `slot` has come in. True: it fills the slot (queue it). False: the
        slot is not this holder's (given to another after a death or a loss, or never granted):
        drop it, counted."""
        held = self.holdings.get(slot)
        if held is None or held.holder != holder:
            self.counts["refused_arrivals"] += 1
            return False
        self.holdings.unhold(slot)
        self._filled[slot] = (holder, held.position)
        return True

    def slot_of(self, holder: Holder, position: int) -> int | None:
        """The slot `holder` holds for the prompt at `position` (a group names its prompt, not its
        slot), or None: not granted to it, or given to another since."""
        return self.holdings.slot_of(holder, position)

    def grants_unreceived(self, holder: Holder, newest_received: int) -> list[int]:
        """`holder` asks again having received grants up to `newest_received` only: a later grant
        never reached it (and never will count: it takes only the answer to its newest request).
        Those slots are granted again, with their prompts. Returns them."""
        return self._take_back(holder, lambda slot, held: held.grant > newest_received, "unreceived")

    def given_back(self, holder: Holder, positions: Iterable[int]) -> int:
        """`holder` will not send the groups of the prompts at `positions` (their rewards failed):
        grant their slots again, not the prompts. A prompt it no longer holds is ignored (a
        give-back repeated after its answer was lost). Returns how many it held."""
        count = 0
        for position in positions:
            slot = self.holdings.slot_of(holder, position)
            if slot is not None:
                self._give_back(slot, self.holdings.unhold(slot).position, retry_prompt=False)
                count += 1
        self.counts["released"] += count
        return count

    def heard_from(self, holder: Holder, newest_grant: int, unsent: Iterable[int]) -> list[int]:
        """`holder`'s report, sent after all its groups so far on the same ordered socket: it has
        received grants up to `newest_grant` and not yet sent the groups of the prompts at `unsent`
        (positions). A ticket it was granted by then, not unsent and not arrived, was lost in
        transit: its slot is granted again (the prompt too). Returns the lost slots."""
        still = set(unsent)
        return self._take_back(holder, lambda slot, held: held.grant <= newest_grant and held.position not in still,
                               "lost")

    def holder_down(self, holder: Holder) -> list[int]:
        """`holder`'s process died: its slots not arrived are granted again, with their prompts.
        What it queued stays: those groups are valid and trained in their slots."""
        return self._take_back(holder, lambda slot, held: True, "down")

    def release(self, slot: int, retry_prompt: bool = False) -> None:
        """The group of `slot` will not be trained (dropped stale or from a full queue, or given back
        for failed rewards while still held): grant the slot again; the prompt only if `retry_prompt`."""
        if slot in self._filled:
            _, position = self._filled.pop(slot)
        elif slot in self.holdings:
            position = self.holdings.unhold(slot).position
        else:
            raise KeyError(f"slot {slot} is neither granted nor queued")
        self._give_back(slot, position, retry_prompt)
        self.counts["released"] += 1

    def _take_back(self, holder: Holder, which: Callable[[int, Held], bool], count: str) -> list[int]:
        """`holder`'s slots not arrived for which `which(slot, held)`, granted again with their
        prompts, counted under `count`; returned in order."""
        slots = [slot for slot, held in self.holdings.of(holder) if which(slot, held)]
        for slot in slots:
            self._give_back(slot, self.holdings.unhold(slot).position, retry_prompt=True)
        self.counts[count] += len(slots)
        return slots

    def _give_back(self, slot: int, position: int, retry_prompt: bool) -> None:
        self._free.push(slot)
        if retry_prompt:
            self._retry.append(position)

    # ---- the learner takes

    def step_slots(self) -> range:
        """The next step's slots."""
        first = first_slot(self.step, self.groups_per_step)
        return range(first, first + self.groups_per_step)

    def fill_early(self) -> list[tuple[int, int]]:
        """Let the next step train finished groups of later steps in place of its own that are still
        being generated, where that keeps every group within its bound; returns the moves
        (from_slot, to_slot) of the groups moved forward, for the holder of the groups (TicketSlots).

        A slot of the next step whose ticket is still out (held, its group being generated) trades
        places with the lowest filled slot of a later step whose step the held ticket can still be
        trained at (the admission bound, from the weights it was granted with: step <= version +
        max_staleness); a slot given back (free) trades with the lowest filled later slot, and is
        granted again later under the usual limit. The group moved forward is trained earlier, so
        less stale; the ticket moved back keeps its bound; no group is dropped or added, so what is
        trained is what was granted, and only the order of training changes (docs/ARCHITECTURE.md,
        Out-of-order completion). Only under the throttle (no bound is known otherwise) and not
        under fixed staleness (whose point is that step u holds version u - k's groups only)."""
        if not self.throttle or self.fixed_staleness or not self._filled:
            return []
        later = sorted(slot for slot in self._filled if slot >= first_slot(self.step + 1, self.groups_per_step))
        moves: list[tuple[int, int]] = []
        for slot in self.missing():
            if not later:
                break
            held = self.holdings.get(slot)
            if held is not None:
                bound = admission_limit(held.version, self.max_staleness, self.groups_per_step)
            elif slot in self._free:
                bound = math.inf
            else:  # not granted yet: later slots are not granted before it, so none is filled
                continue
            if later[0] >= bound:
                continue
            moved = later.pop(0)
            self._filled[slot] = self._filled.pop(moved)
            if held is not None:
                self.holdings.hold(moved, self.holdings.unhold(slot))
            else:
                self._free.take(slot)
                self._free.push(moved)
            moves.append((moved, slot))
        self.counts["early"] += len(moves)
        return moves

    def ready(self) -> bool:
        """Every slot of the next step has its group."""
        return all(slot in self._filled for slot in self.step_slots())

    def missing(self) -> list[int]:
        """The next step's slots still without a group (for a wait's message)."""
        return [slot for slot in self.step_slots() if slot not in self._filled]

    def take(self) -> list[tuple[int, Holder, int]]:
        """The next step's (slot, holder, position), in slot order; the step moves on."""
        if not self.ready():
            raise RuntimeError(f"step {self.step} is missing slots {self.missing()}")
        taken = [(slot, *self._filled.pop(slot)) for slot in self.step_slots()]
        self.step += 1
        return taken

    # ---- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the next step, and the prompts to give (again) first: every
        position granted or queued but not trained, and those already waiting to be retried."""
        pending = self.holdings.positions() | {pos for _, pos in self._filled.values()}
        return {"step": self.step, "next_position": self._next_position,
                "retry_positions": sorted(pending | set(self._retry))}

    def restored(self, state: dict[str, Any]) -> Dispatcher:
        """A dispatcher with these settings, continuing from `state` (a checkpoint's)."""
        return Dispatcher.from_state(state, self.groups_per_step, self.max_staleness, self.throttle,
                                     self.capacity_groups, self.end_step, self.positions_end, self.fixed_staleness)

    @classmethod
    def from_state(cls, state: dict[str, Any], groups_per_step: int, max_staleness: int,
                   throttle: bool = True, capacity_groups: int | None = None, end_step: int | None = None,
                   positions_end: int | None = None, fixed_staleness: bool = False) -> Dispatcher:
        """A dispatcher continuing from `state` at its step, which is the version the resumed run's
        weights have: under fixed staleness they sample its first max_staleness + 1 steps."""
        return cls(groups_per_step, max_staleness, throttle, capacity_groups, first_step=int(state["step"]),
                   first_position=int(state["next_position"]),
                   retry_positions=[int(p) for p in state["retry_positions"]], end_step=end_step,
                   positions_end=positions_end, fixed_staleness=fixed_staleness)
