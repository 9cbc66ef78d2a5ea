"""A generator's side of dynamic dispatch (asyncgrpo/queue/dispatch.py).

`TicketClient` asks learner rank 0 for tickets on the groups stream, so that each request is read
after every group sent before it and doubles as a report (the newest grant received, the slots
held but not sent, the slots given back), and waits for the answer on the generator's own grant
channel. Only the answer to the newest request counts: one that comes too late is ignored, and the
next request, reporting an older newest grant, gives its slots back.

`PositionedPrompts` is the run's one prompt stream, which every generator builds alike and reads
at the positions it is granted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from asyncgrpo.contract import Ticket
from asyncgrpo.rollout.sink import GroupSink
from asyncgrpo.tasks import Problem
from asyncgrpo.wire import Grant, GrantDealer, TicketRequest

# How long a request may take to be answered before it is asked again (and its answer ignored):
# the first wait, doubled after each unanswered request up to the last. The learner's receiving
# thread answers as it reads the stream, in milliseconds; no answer at all mostly means the grant
# channel's connection was not up yet when the answer left (a grant to an unknown peer is dropped).
REPLY_TIMEOUTS_S = (0.5, 5.0)


class TicketClient:
    def __init__(self, sink: GroupSink, grants: GrantDealer, generator_id: int, incarnation: int) -> None:
        self.sink, self.grants = sink, grants
        self.generator_id, self.incarnation = generator_id, incarnation
        self.reply_timeout_s = REPLY_TIMEOUTS_S[0]
        self.request = 0
        self.newest_grant = 0
        # Tickets are named by their prompts' positions: the dispatcher may move a ticket's slot.
        self.unsent: set[int] = set()  # granted, their groups not handed to the socket yet
        # Prompts whose groups will not be sent, until a request carrying them has been answered
        # (a request lost on the way would otherwise leave them held for good).
        self.given_back: set[int] = set()
        self.unanswered = 0  # requests whose answer did not come in time

    def ask(self, loaded_version: int, wanted: int) -> list[Ticket]:
        """Up to `wanted` tickets for weights `loaded_version`; [] if none now (the staleness bound
        or the queue's room: ask again with newer weights, or a moment later)."""
        self.request += 1
        carried = sorted(self.given_back)
        request = TicketRequest(self.generator_id, self.incarnation, self.request, loaded_version, wanted,
                                self.newest_grant, sorted(self.unsent), carried)
        if not self.sink.try_send(request, timeout_s=REPLY_TIMEOUTS_S[-1]):
            return []
        answer = self._answer(time.monotonic() + self.reply_timeout_s)
        if answer is None:
            self.unanswered += 1
            self.reply_timeout_s = min(2 * self.reply_timeout_s, REPLY_TIMEOUTS_S[-1])
            return []
        self.reply_timeout_s = REPLY_TIMEOUTS_S[0]
        self.given_back.difference_update(carried)
        if not answer.slots:
            return []
        self.newest_grant = answer.grant
        self.unsent.update(answer.positions)
        return [Ticket(slot, position) for slot, position in zip(answer.slots, answer.positions)]

    def _answer(self, deadline: float) -> Grant | None:
        while (remaining := deadline - time.monotonic()) > 0:
            message = self.grants.recv(remaining)
            if isinstance(message, Grant) and message.request == self.request:
                return message
        return None

    def sent(self, ticket: Ticket) -> None:
        """The group of `ticket` was handed to the socket (whether it arrives is the learner's to see)."""
        self.unsent.discard(ticket.position)

    def gave_back(self, ticket: Ticket) -> None:
        """The group of `ticket` will not be sent (its rewards failed): its slot goes to someone else."""
        self.unsent.discard(ticket.position)
        self.given_back.add(ticket.position)

    def close(self) -> None:
        self.grants.close()


class PositionedPrompts:
    """The run's one prompt stream, read at any position. Reading forward skips what other
    generators were granted; a position behind (a prompt given again after a loss or a death)
    comes from a window of the most recent `window` prompts read, or from the stream started over."""

    def __init__(self, make_stream: Callable[[], Iterator[Problem]], window: int = 4096) -> None:
        self._make_stream, self._window = make_stream, window
        self._stream, self._next = make_stream(), 0
        self._recent: OrderedDict[int, Problem] = OrderedDict()

    def at(self, position: int) -> Problem:
        if position in self._recent:
            return self._recent[position]
        if position < self._next:  # older than the window: rare, and the stream is cheap to replay
            self._stream, self._next = self._make_stream(), 0
        while self._next <= position:
            try:
                problem = next(self._stream)
            except StopIteration:
                raise RuntimeError(f"the prompt stream ended before position {position}, which learner rank 0 "
                                   "granted: the generator and the learner disagree on the data (data.* must "
                                   "be the same for both)") from None
            self._recent[self._next] = problem
            if len(self._recent) > self._window:
                self._recent.popitem(last=False)
            self._next += 1
        return self._recent[position]
