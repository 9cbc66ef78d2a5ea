"""The replay queue's storage under tickets: groups filed in the slots their senders hold, handed
over a step at a time, and the answers to the generators' ticket requests.

`TicketSlots` owns the `Dispatcher` (asyncgrpo/queue/dispatch.py) and the grant socket; the replay
queue (asyncgrpo/queue/replay_queue.py) calls it with its lock held and does the counting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncgrpo.contract import check_admission_bound
from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.runtime import faults
from asyncgrpo.wire import Grant, GrantRouter, ScoredGroup, TicketRequest, holder_identity


class TicketSlots:
    """`grants` None: answers are dropped, as for a generator not connected (in-process tests)."""

    def __init__(self, dispatcher: Dispatcher, grants: GrantRouter | None) -> None:
        self.dispatcher, self.grants = dispatcher, grants
        self.filled: dict[int, ScoredGroup] = {}  # slot -> its group, not taken yet
        self._ticketed_answers = 0  # answers carrying tickets, for failpoint grant_drop_every

    @property
    def depth(self) -> int:
        return len(self.filled)

    def answer(self, request: TicketRequest) -> None:
        """A generator's ticket request (its report first), answered at once."""
        holder = (request.generator_id, request.incarnation)
        grant, tickets = self.dispatcher.request(holder, request.version, request.wanted, request.newest_grant,
                                                 request.unsent, request.given_back)
        if self.grants is not None and not (tickets and self._answer_lost()):
            # Not delivered (the process is gone): its next request, if any, reports it unreceived.
            self.grants.send_to(holder_identity(*holder), Grant(request.request, grant, [t.slot for t in tickets],
                                                                [t.position for t in tickets]))

    def _answer_lost(self) -> bool:
        """Failpoint grant_drop_every: whether this answer carrying tickets is to be lost on the way."""
        every = faults.every("grant_drop_every")
        if not every:
            return False
        self._ticketed_answers += 1
        return self._ticketed_answers % every == 0

    def fill(self, group: ScoredGroup) -> bool:
        """The group fills the slot its sender holds for its prompt; False if the slot is no longer
        its sender's (lost, then granted again; a replaced process): the group is unheld."""
        holder = (group.generator_id, group.incarnation)
        slot = self.dispatcher.slot_of(holder, group.pos)
        if slot is None or not self.dispatcher.arrived(holder, slot):
            return False
        self.filled[slot] = group
        return True

    def release(self, group: ScoredGroup) -> None:
        """A rejected group's slot is granted again (not its prompt: it was rejected for what it is)."""
        slot = self.dispatcher.slot_of((group.generator_id, group.incarnation), group.pos)
        if slot is not None:
            self.dispatcher.release(slot)

    def take_step(self, num_groups: int, learner_version: int,
                  too_stale: Callable[[ScoredGroup, int], bool]) -> tuple[list[ScoredGroup] | None, int]:
        """The step's groups in slot order once all are in (None before; finished groups of later
        steps fill its slots still being generated where the bound allows: `Dispatcher.fill_early`),
        and how many of its groups were `too_stale` (the queue's eviction policy): those are dropped
        and their slots granted again."""
        d = self.dispatcher
        if num_groups != d.groups_per_step:
            raise ValueError(f"with tickets a take is one step of {d.groups_per_step} groups, not {num_groups}")
        if d.step != learner_version:
            raise RuntimeError(f"the learner takes at version {learner_version} but the dispatcher is at step "
                               f"{d.step}: every version takes exactly one step of slots")
        for moved, slot in d.fill_early():
            self.filled[slot] = self.filled.pop(moved)
        dropped = 0
        for slot in d.step_slots():
            group = self.filled.get(slot)
            if group is not None and too_stale(group, learner_version):
                del self.filled[slot]
                d.release(slot)
                dropped += 1
        if not d.ready():
            return None, dropped
        return [self.filled.pop(slot) for slot, _, _ in d.take()], dropped

    def generator_down(self, generator_id: int, incarnation: int) -> None:
        """The generator's slots not arrived go to the next asker, and its late requests get none."""
        self.dispatcher.generator_down(generator_id, incarnation)

    def waiting_for(self) -> str:
        """What a timed-out take still misses, for its message."""
        return (f"the step still misses slots {self.dispatcher.missing()}; "
                + ("the run's prompts ran out (data.epochs): groups dropped on the way took prompts the last steps "
                   "needed; " if not self.dispatcher.prompts_left() else ""))

    def set_admission_bound(self, bound: int) -> None:
        """Divergence control's bound for new grants (asyncgrpo/contract.py, check_admission_bound)."""
        d = self.dispatcher
        d.admission_bound = check_admission_bound(bound, d.max_staleness, d.fixed_staleness)

    def stats(self) -> dict[str, float]:
        return {f"dispatch/{key}": value for key, value in self.dispatcher.counts.items()}

    def state_dict(self) -> dict[str, Any]:
        return self.dispatcher.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        bound, self.dispatcher = self.dispatcher.admission_bound, self.dispatcher.restored(state)
        self.dispatcher.admission_bound = bound  # divergence control's, kept as the learner set it

    def close(self) -> None:
        if self.grants is not None:
            self.grants.close()
