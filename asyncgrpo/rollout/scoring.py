"""A generated batch whose rewards are being computed (`ScoringBatch`), and how long the generator
waits for them (`score_timeout_s`): slow rewards (an HTTP judge) are computed while the next batch
generates."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

from asyncgrpo.rewards.judge import call_budget_s
from asyncgrpo.rewards.scorer import GroupScore, Scorer
from asyncgrpo.rollout.engine import Completion
from asyncgrpo.rollout.groups import decode_completions
from asyncgrpo.schema import Config
from asyncgrpo.tasks import Problem


def score_timeout_s(cfg: Config, num_groups: int) -> float:
    """How long to wait for a batch's rewards. Generous: every reward call is bounded by its own
    timeout and retries (a judge call by call_budget_s, which its waits and requests keep within);
    this only catches a hang."""
    judge = cfg.reward.judge
    calls = num_groups * cfg.rollout.samples_per_prompt
    waves = -(-calls // max(1, judge.concurrency))
    per_call = max(cfg.reward.timeout_s, call_budget_s(judge))
    return cfg.wire.timeout_s + waves * per_call


@dataclass
class ScoringBatch:
    """A generated batch whose rewards are being computed."""

    problems: list[Problem]
    positions: list[int]  # each problem's position in the prompt stream
    prompts: list[list[int]]
    completions: list[list[Completion]]
    future: concurrent.futures.Future
    slots: list[int]  # each group's slot in the training order

    @classmethod
    def submit(cls, scorer: Scorer, tokenizer: Any, problems: list[Problem], positions: list[int],
               prompts: list[list[int]], completions: list[list[Completion]], slots: list[int]) -> ScoringBatch:
        """Start scoring a generated batch with `scorer`, on its completions' text."""
        texts = [decode_completions(tokenizer, group) for group in completions]
        return cls(problems, positions, prompts, completions, scorer.submit(problems, texts), slots)

    def scores(self, cfg: Config) -> list[GroupScore]:
        """Each group's rewards, waited for (score_timeout_s)."""
        return self.future.result(timeout=score_timeout_s(cfg, len(self.problems)))
