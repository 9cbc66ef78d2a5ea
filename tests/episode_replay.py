"""Replays a reference episode under an environment the way the episode runner writes one, to check
that a task's supervised trace is exactly what an episode would look like."""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo.envs import EnvironmentSpec
from asyncgrpo.tasks.problem import Problem, reference_completion, reference_segments


@dataclass
class Replayed:
    text: str
    observations: tuple[tuple[int, int], ...]
    last_turn: str
    turns: int
    reward: float
    done: bool
    bad_actions: int


def replay(spec: EnvironmentSpec, problem: Problem) -> Replayed:
    """Writes the reference's policy pieces character by character; whenever the turn so far ends with a
    stop text the environment is called with it and its observation appended (the runner's rule). Asserts
    that the text is the reference and the observations sit where the problem marks them."""
    env = spec.new()
    text, turn, observations, turns, reward, done, bad = env.reset(problem), "", [], 0, 0.0, False, 0
    policy_text = "".join(piece for piece, policy in reference_segments(problem) if policy)
    for index, character in enumerate(policy_text):
        assert not done, f"the environment ended the episode before {policy_text[index:]!r}"
        text, turn = text + character, turn + character
        if any(turn.endswith(stop) for stop in spec.stop):
            step = env.step(turn)
            observations.append((len(text), len(text) + len(step.observation)))
            text += step.observation
            reward, done, bad, turns = reward + step.reward, step.done, bad + step.bad_action, turns + 1
            last_turn, turn = turn, ""
    if turn:
        last_turn, turns = turn, turns + 1
    env.close()
    assert text == reference_completion(problem)
    assert tuple(observations) == tuple(problem.extra.get("observations", ()))
    return Replayed(text, tuple(observations), last_turn, turns, reward, done, bad)
