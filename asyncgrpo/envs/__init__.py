"""Environments for multi-turn episodes: the protocol (base.py), calls with timeouts and error counts
(calls.py), and the shipped environments: calculator.py (a tool), guess.py (a game with feedback),
http.py (any environment served over HTTP), agent.py (your agent code, over an OpenAI-compatible chat
endpoint served on loopback). `make_environment(cfg)` builds the configured one; the
generator's episode runner (asyncgrpo/rollout/episodes.py) drives it. docs/ENVIRONMENTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo.envs.base import Environment, EnvironmentSpec, EnvStep
from asyncgrpo.envs.calls import EnvCalls
from asyncgrpo.schema import EnvConfig

__all__ = ["ENV_NAMES", "ENV_ON_ERROR", "EnvStep", "Environment", "EnvironmentSpec", "EpisodeRules", "episode_rules",
           "make_environment", "named_environment"]

# env.name: "" is no environment (one policy turn per rollout).
ENV_NAMES = ("", "calculator", "guess", "http", "agent")
# env.on_error
ENV_ON_ERROR = ("zero", "drop_group")


def make_environment(cfg: EnvConfig) -> EnvironmentSpec | None:
    """The environment of `cfg.name`, or None for single-turn rollouts."""
    if cfg.name == "":
        return None
    if cfg.name == "calculator":
        from asyncgrpo.envs.calculator import calculator_spec

        return calculator_spec(cfg)
    if cfg.name == "guess":
        from asyncgrpo.envs.guess import guess_spec

        return guess_spec(cfg)
    if cfg.name == "http":
        from asyncgrpo.envs.http import http_spec

        return http_spec(cfg)
    if cfg.name == "agent":
        from asyncgrpo.envs.agent import agent_spec

        return agent_spec(cfg)
    raise ValueError(f"env.name must be one of {', '.join(repr(n) for n in ENV_NAMES)}, got {cfg.name!r}")


def named_environment(name: str) -> EnvironmentSpec | None:
    """The environment `name` (an env.name) with every other env.* key at its default: the one a
    task's references were played against (models/warmstart.py), whatever the run's env.* says."""
    return make_environment(EnvConfig(name=name))


@dataclass(frozen=True)
class EpisodeRules:
    """What a generator's episodes take of env.* (`episode_rules`): the policy turns an episode may
    have (max_turns), what a failed call does to its group (on_error: zero | drop_group), and how
    the calls run (threads, timeout_s, latency_s: `EnvCalls`)."""

    max_turns: int
    on_error: str
    threads: int
    timeout_s: float
    latency_s: float

    def calls(self) -> EnvCalls:
        """New threads for environment calls under these rules (the caller closes them)."""
        return EnvCalls(self.threads, self.timeout_s, self.latency_s)


def episode_rules(cfg: EnvConfig) -> EpisodeRules:
    """The episode rules of the env section `cfg`."""
    return EpisodeRules(cfg.max_turns, cfg.on_error, cfg.threads, cfg.timeout_s, cfg.latency_s)
