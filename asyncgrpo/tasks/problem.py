"""What a task is: problems with a prompt and a reference answer, and the task's own check."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

# Problem.extra key of a reference completion that is more than the answer (a worked scratchpad): what
# the warm start trains on and measures, while rewards still compare with `answer`.
REFERENCE_KEY = "reference"
# Problem.extra key of the (start, end) character spans of the reference completion that an environment
# writes, not the policy (a tool's result, a game's answer): the warm start neither trains on them nor
# counts their probability, as in an episode they are appended, never sampled.
OBSERVATIONS_KEY = "observations"


@dataclass(frozen=True)
class Problem:
    """One prompt; `prompt` is the text the model sees (after any template), `answer` the reference.

    `extra` carries task data for rewards (countdown's numbers, a file record's other fields,
    the raw prompt before templating); it takes no part in equality or hashing.
    """

    id: int
    prompt: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def reference_completion(problem: Problem) -> str:
    """The completion the warm start imitates: extra[REFERENCE_KEY] where the task writes one, else the answer."""
    return problem.extra.get(REFERENCE_KEY, problem.answer)


def reference_segments(problem: Problem) -> list[tuple[str, bool]]:
    """The reference completion cut into (text, written by the policy) pieces, in order: one policy piece
    for a single-turn task; policy turns and environment observations (extra[OBSERVATIONS_KEY]) otherwise."""
    text, segments, position = reference_completion(problem), [], 0
    for start, end in problem.extra.get(OBSERVATIONS_KEY, ()):
        segments += [(text[position:start], True), (text[start:end], False)]
        position = end
    segments.append((text[position:], True))
    return [(piece, policy) for piece, policy in segments if piece]


class Task(Protocol):
    """A verifiable task. `make_task` (through `composition.run_task`) builds the configured one;
    `run_stream` is the run's stream of `train_problems`."""

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Training problems in a seeded order (endless for the built-in tasks)."""

    def eval_problems(self) -> list[Problem]:
        """The held-out problems, the same for every seed."""

    def score(self, completion_text: str, problem: Problem) -> float:
        """The task's own check of a completion (held-out accuracy, and the default reward)."""

    @property
    def max_answer_chars(self) -> int:
        """The longest reference answer, in characters (sizes the warm start's completions)."""

    def settings(self) -> dict[str, Any]:
        """What identifies the task's problems (part of the warm-start cache key)."""
