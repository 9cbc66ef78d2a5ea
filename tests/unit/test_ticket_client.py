"""The generator's ticket client (asyncgrpo/rollout/tickets.py): only the answer to its newest
request counts, what it gives back is repeated until a request carrying it is answered, and the
run's one prompt stream is read at any position."""

from __future__ import annotations

import itertools

import pytest

from asyncgrpo.dispatch import Ticket
from asyncgrpo.rollout.tickets import REPLY_TIMEOUTS_S, PositionedPrompts, TicketClient
from asyncgrpo.tasks import ArithmeticTask
from asyncgrpo.wire import Grant, TicketRequest


class Wire:
    """The groups socket and the grant channel: `answers` maps a request number to what comes back."""

    def __init__(self) -> None:
        self.requests: list[TicketRequest] = []
        self.answers: dict[int, list[Grant]] = {}
        self.inbox: list[Grant] = []

    def try_send(self, message, timeout_s: float) -> bool:
        self.requests.append(message)
        self.inbox.extend(self.answers.get(message.request, []))
        return True

    def recv(self, timeout_s: float) -> Grant | None:
        return self.inbox.pop(0) if self.inbox else None

    def close(self) -> None:
        pass


def test_only_the_answer_to_the_newest_request_counts_and_a_late_one_is_reported_unreceived():
    wire = Wire()
    client = TicketClient(wire, wire, generator_id=1, incarnation=2)
    assert client.ask(0, 4) == []  # request 1: no answer in time
    assert client.unanswered == 1 and client.reply_timeout_s == 2 * REPLY_TIMEOUTS_S[0]
    # Request 2's turn: request 1's late answer arrives first and is ignored.
    wire.answers[2] = [Grant(1, 1, [0, 1], [0, 1]), Grant(2, 2, [2], [5])]
    assert client.ask(0, 4) == [Ticket(2, 5)]
    assert client.reply_timeout_s == REPLY_TIMEOUTS_S[0] and client.unsent == {2}
    wire.answers[3] = [Grant(3, 2)]
    client.ask(1, 4)
    request = wire.requests[-1]
    assert (request.generator_id, request.incarnation, request.version, request.newest_grant, request.unsent) == \
        (1, 2, 1, 2, [2])


def test_a_given_back_slot_is_repeated_until_a_request_carrying_it_is_answered():
    wire = Wire()
    client = TicketClient(wire, wire, generator_id=0, incarnation=0)
    wire.answers[1] = [Grant(1, 1, [0, 1], [0, 1])]
    client.ask(0, 2)
    client.sent(0)
    client.gave_back(1)
    assert client.ask(0, 2) == [] and wire.requests[-1].given_back == [1]  # request 2: unanswered
    wire.answers[3] = [Grant(3, 1)]
    client.ask(0, 2)
    assert wire.requests[-1].given_back == [1] and wire.requests[-1].unsent == []
    client.ask(0, 2)
    assert wire.requests[-1].given_back == []


def test_positioned_prompts_read_forward_back_within_the_window_and_back_beyond_it():
    task = ArithmeticTask(num_digits=2, eval_size=4)
    stream = list(itertools.islice(task.train_problems(seed=3), 40))
    prompts = PositionedPrompts(lambda: task.train_problems(seed=3), window=8)
    for position in (5, 2, 30, 25, 3, 39, 0):
        assert prompts.at(position) == stream[position]


def test_a_finite_stream_that_ends_before_a_granted_position_fails_in_one_line():
    prompts = PositionedPrompts(lambda: iter([]))
    with pytest.raises(RuntimeError, match="ended before position 0"):
        prompts.at(0)
