"""The generator's ticket client (asyncgrpo/rollout/tickets.py): only the answer to its newest
request counts, what it gives back is repeated until a request carrying it is answered, and the
run's one prompt stream is read at any position."""

from __future__ import annotations

import itertools

import pytest

from one_line import raises_one_line

from asyncgrpo.contract import Ticket
from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.rollout.tickets import REPLY_TIMEOUTS_S, PositionedPrompts, TicketClient
from asyncgrpo.tasks import ArithmeticTask
from asyncgrpo.wire import Grant, TicketRequest, example_group


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
    assert client.reply_timeout_s == REPLY_TIMEOUTS_S[0] and client.unsent == {5}  # named by its prompt
    wire.answers[3] = [Grant(3, 2)]
    client.ask(1, 4)
    request = wire.requests[-1]
    assert (request.generator_id, request.incarnation, request.version, request.newest_grant, request.unsent) == \
        (1, 2, 1, 2, [5])


def test_a_given_back_ticket_is_repeated_until_a_request_carrying_it_is_answered():
    wire = Wire()
    client = TicketClient(wire, wire, generator_id=0, incarnation=0)
    wire.answers[1] = [Grant(1, 1, [0, 1], [7, 8])]
    sent, failed = client.ask(0, 2)
    client.sent(sent)
    client.gave_back(failed)
    assert client.ask(0, 2) == [] and wire.requests[-1].given_back == [8]  # request 2: unanswered
    wire.answers[3] = [Grant(3, 1)]
    client.ask(0, 2)
    assert wire.requests[-1].given_back == [8] and wire.requests[-1].unsent == []
    client.ask(0, 2)
    assert wire.requests[-1].given_back == []


class LossyQueueWire:
    """The groups socket straight into a real tickets queue, and a grant channel that loses the
    answers to the requests numbered in `lose`."""

    def __init__(self, groups_per_step: int, lose: set[int]) -> None:
        self.queue = ReplayQueue(None, 16, StalenessEviction(0, drop_stale=True), limits=None,
                                 dispatcher=Dispatcher(groups_per_step, 0, capacity_groups=16),
                                 grants=self)
        self.lose, self.inbox, self.seq = lose, [], 0

    def try_send(self, message, timeout_s: float) -> bool:
        self.queue.put(message)
        return True

    def send_to(self, identity: bytes, grant: Grant) -> bool:
        if grant.request not in self.lose:
            self.inbox.append(grant)
        return True

    def recv(self, timeout_s: float) -> Grant | None:
        return self.inbox.pop(0) if self.inbox else None

    def close(self) -> None:
        pass

    def send_group(self, client: TicketClient, ticket: Ticket) -> None:
        group = example_group(num_samples=2, tokens_per_sample=3, seed=ticket.position)
        group.generator_id, group.incarnation, group.seq, group.pos = 0, 0, self.seq, ticket.position
        group.versions[:] = 0
        self.seq += 1
        self.try_send(group, timeout_s=1)
        client.sent(ticket)


def test_a_give_back_whose_answer_was_lost_leaves_no_prompt_untrained():
    wire = LossyQueueWire(groups_per_step=2, lose={2})
    client = TicketClient(wire, wire, generator_id=0, incarnation=0)
    first = client.ask(0, 2)
    assert first == [Ticket(0, 0), Ticket(1, 1)]
    wire.send_group(client, first[0])
    client.gave_back(first[1])  # prompt 1's rewards failed: dropped for what it is, its slot to be filled again
    # Request 2 gives slot 1 back; its answer, slot 1 again with prompt 2, is lost.
    assert client.ask(0, 1) == []
    # Request 3 repeats the give-back: prompt 2 must come again, not be skipped for a new one.
    again = client.ask(0, 1)
    assert again == [Ticket(1, 2)]
    wire.send_group(client, again[0])
    assert [g.pos for g in wire.queue.take(2, 0, timeout_s=1)] == [0, 2]
    assert wire.queue.state_dict()["dispatch"]["retry_positions"] == []


def test_positioned_prompts_read_forward_back_within_the_window_and_back_beyond_it():
    task = ArithmeticTask(num_digits=2, eval_size=4)
    stream = list(itertools.islice(task.train_problems(seed=3), 40))
    prompts = PositionedPrompts(lambda: task.train_problems(seed=3), window=8)
    for position in (5, 2, 30, 25, 3, 39, 0):
        assert prompts.at(position) == stream[position]


def test_a_finite_stream_that_ends_before_a_granted_position_fails_in_one_line():
    prompts = PositionedPrompts(lambda: iter([]))
    with raises_one_line(RuntimeError, match="ended before position 0"):
        prompts.at(0)
