"""The groups a generator has submitted to its engine and not yet seen finish (`RunningGroups`):
each engine request's ticket, prompt and problem, so that a finished request becomes its group,
and so that the tickets of requests that will never finish can be named. Pure bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo.contract import Ticket
from asyncgrpo.tasks import Problem


@dataclass(frozen=True)
class Admitted:
    """A granted ticket whose prompt was submitted to the engine."""

    ticket: Ticket
    problem: Problem
    prompt: list[int]  # its tokens
    version: int  # the weights loaded when it was admitted: its oldest tokens' version


class RunningGroups:
    def __init__(self) -> None:
        self._by_request: dict[str, Admitted] = {}
        self._submitted = 0

    def request_id(self, ticket: Ticket) -> str:
        """A new engine request id for `ticket` (unique within this generator's process)."""
        self._submitted += 1
        return f"{ticket.position}-{self._submitted}"

    def add(self, request_id: str, admitted: Admitted) -> None:
        if request_id in self._by_request:
            raise RuntimeError(f"engine request {request_id} submitted twice")
        self._by_request[request_id] = admitted

    def finish(self, request_id: str) -> Admitted:
        """What the finished request `request_id` was admitted for; it is no longer running."""
        return self._by_request.pop(request_id)

    def drop_all(self) -> list[Admitted]:
        """Every running group, forgotten (the engine's requests were aborted)."""
        dropped, self._by_request = list(self._by_request.values()), {}
        return dropped

    def __len__(self) -> int:
        return len(self._by_request)
