"""Building the message a generator sends: a prompt's completions and their rewards -> a `ScoredGroup`.

Pure: arrays and a `GroupScore` in, a `ScoredGroup` out; the caller assigns the sequence number
when it sends.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncgrpo.rewards.scorer import GroupScore
from asyncgrpo.rollout.engine import Completion
from asyncgrpo.wire import ScoredGroup


def decode_completions(tokenizer: Any, completions: list[Completion]) -> list[str]:
    """The completions' texts, as the rewards see them (special tokens such as EOS left out)."""
    return [tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in completions]


def scored_group(generator_id: int, prompt_id: int, prompt_tokens: list[int], completions: list[Completion],
                 score: GroupScore, version: int) -> ScoredGroup | None:
    """The group to send, completions packed end to end; `seq` is left at -1 for the sender.

    `version` is the generator's loaded version, recorded in meta and used for any completion
    without per-token versions. None when the reward policy drops the group
    (reward.on_error=drop_group and a reward failed): it must not be sent.
    """
    if score.dropped:
        return None
    return ScoredGroup(
        generator_id=generator_id,
        seq=-1,  # assigned when sent, so heartbeats and sequence numbers agree
        prompt_id=prompt_id,
        prompt_tokens=np.asarray(prompt_tokens, dtype=np.int32),
        tokens=np.concatenate([c.token_ids for c in completions]).astype(np.int32),
        logprobs=np.concatenate([c.logprobs for c in completions]).astype(np.float32),
        versions=np.concatenate([c.versions if c.versions is not None else np.full(c.token_ids.size, version)
                                 for c in completions]).astype(np.int32),
        lengths=np.asarray([c.token_ids.size for c in completions], dtype=np.int32),
        rewards=score.rewards,
        truncated=np.asarray([not c.finished for c in completions], dtype=np.uint8),
        meta={"version": version, **score.meta()},
    )
