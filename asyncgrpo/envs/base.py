"""What an environment is: the protocol a multi-turn episode talks to, and one step's answer.

An episode (asyncgrpo/rollout/episodes.py) is a prompt, then turns: the policy writes until a stop
text of the environment (a tool call's close tag), the end of its answer (EOS) or the token budget;
on a stop text the environment is called with what the policy wrote in that turn and answers with an
observation, appended to the episode and never trained on. The episode ends when the policy ends its
answer, the environment says done, `env.max_turns` turns are used, or the budget
(rollout.max_new_tokens, observations included) runs out.

One `Environment` object serves one episode (so it may keep the episode's state); `EnvironmentSpec`
says how to make one and which texts end a policy turn. Calls may be slow (a tool, a service): the
generator runs them on threads with a timeout (asyncgrpo/envs/calls.py) while its engine decodes
other episodes. `step` may be a plain function or a coroutine function.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from asyncgrpo.tasks.problem import Problem


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one policy turn.

    observation: text appended to the episode after the turn (the tool's result, the game's
    feedback); tokenized by the generator, never trained on. reward: added to the episode's
    environment reward (logged as reward/env). done: the episode ends here. bad_action: the turn's
    call did not parse (counted as gen/env_bad_actions; the observation should say so).
    observation_tokens: the observation's token ids, appended as they are instead of tokenizing the
    text (an environment that renders a chat template itself: no retokenisation drift).
    replaces_prompt: only from `reset`, with observation_tokens: they are the episode's prompt instead
    of the task's (an agent's own rendering of its first request); the group's common prefix is sent
    as its prompt, the rest of each episode's prompt as environment tokens (rollout/groups.py).
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    bad_action: bool = False
    observation_tokens: tuple[int, ...] | None = None
    replaces_prompt: bool = False


class Environment(Protocol):
    """One episode's environment."""

    def reset(self, problem: Problem) -> str | EnvStep:
        """Start the episode of `problem`; returns text appended to the prompt before the first turn
        ("" for none), or an EnvStep (its tokens appended, or replacing the prompt; never done)."""

    def step(self, action: str) -> EnvStep | Awaitable[EnvStep]:
        """The policy's turn `action` (its text, the stop text included) -> the environment's answer."""

    def close(self) -> None:
        """The episode is over (finished, dropped or aborted)."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """How a generator makes environments: `new()` is a fresh one per episode; `stop` are the texts
    that end a policy turn and call it (kept in the turn's text); `eos_calls`: a turn that ends with
    the end-of-sequence token calls it too (a chat's assistant message ends so), instead of ending
    the episode, which then ends only when the environment says done (or at the limits).
    token_turns: the environment works in token ids: `new(tokenizer)` is given the generator's
    tokenizer, and `step(action, token_ids)` the turn's sampled ids (a tuple) besides its text (an
    agent's chat server hands back the engine's exact turn)."""

    name: str
    new: Callable[..., Environment]
    stop: tuple[str, ...]
    eos_calls: bool = False
    token_turns: bool = False
