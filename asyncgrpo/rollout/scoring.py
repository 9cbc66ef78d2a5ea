"""Finished groups whose rewards are being computed (`ScoringBatch`), and how long the generator
waits for them (`score_timeout_s`): slow rewards (an HTTP judge) are computed while the engine
decodes on."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

from asyncgrpo.rewards.judge import call_budget_s
from asyncgrpo.rewards.scorer import GroupScore, Scorer
from asyncgrpo.rollout.episodes import EpisodeGroup
from asyncgrpo.schema import Config


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
    """Groups whose episodes have all ended, their rewards being computed."""

    groups: list[EpisodeGroup]
    future: concurrent.futures.Future

    @classmethod
    def submit(cls, scorer: Scorer, tokenizer: Any, groups: list[EpisodeGroup]) -> ScoringBatch:
        """Start scoring `groups` with `scorer`, on the text of each episode's last policy turn."""
        texts = [[episode.answer_text(tokenizer) for episode in group.episodes] for group in groups]
        return cls(groups, scorer.submit([group.admitted.problem for group in groups], texts))

    def scores(self, cfg: Config) -> list[GroupScore]:
        """Each group's rewards, waited for (score_timeout_s)."""
        return self.future.result(timeout=score_timeout_s(cfg, len(self.groups)))
