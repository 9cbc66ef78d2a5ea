"""Finished groups whose rewards are being computed (`ScoringBatch`), and how long the generator
waits for them (`score_timeout_s`): slow rewards (an HTTP judge) are computed while the engine
decodes on."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

from asyncgrpo.rewards.scorer import GroupScore, Scorer
from asyncgrpo.rollout.episodes import EpisodeGroup


def score_timeout_s(scorer: Scorer, calls: int, wait_timeout_s: float) -> float:
    """How long to wait for `calls` rewards of `scorer`: what they may take (Scorer.calls_bound_s),
    and `wait_timeout_s` (wire.timeout_s) beyond. Generous: every reward call is bounded by its own
    timeout and retries (a judge call by call_budget_s, which its waits and requests keep within);
    this only catches a hang."""
    return wait_timeout_s + scorer.calls_bound_s(calls)


@dataclass
class ScoringBatch:
    """Groups whose episodes have all ended, their rewards being computed by `scorer`."""

    groups: list[EpisodeGroup]
    future: concurrent.futures.Future
    scorer: Scorer

    @classmethod
    def submit(cls, scorer: Scorer, tokenizer: Any, groups: list[EpisodeGroup]) -> ScoringBatch:
        """Start scoring `groups` with `scorer`, on the text of each episode's last policy turn."""
        texts = [[episode.answer_text(tokenizer) for episode in group.episodes] for group in groups]
        return cls(groups, scorer.submit([group.admitted.problem for group in groups], texts), scorer)

    def scores(self, wait_timeout_s: float) -> list[GroupScore]:
        """Each group's rewards, waited for (score_timeout_s: one call per episode)."""
        calls = sum(len(group.episodes) for group in self.groups)
        return self.future.result(timeout=score_timeout_s(self.scorer, calls, wait_timeout_s))
