"""What a generator admitted for a granted ticket (`Admitted`): the ticket, its problem and prompt
tokens, and the weights loaded then. The episodes of asyncgrpo/rollout/episodes.py run for it."""

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
