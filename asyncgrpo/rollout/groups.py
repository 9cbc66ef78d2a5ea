"""Building the message a generator sends: a group's episodes and their rewards -> a `ScoredGroup`.

Pure: episodes and a `GroupScore` in, a `ScoredGroup` out; the caller assigns the sequence number
when it sends.
"""

from __future__ import annotations

import numpy as np

from asyncgrpo.rewards.scorer import GroupScore
from asyncgrpo.rollout.engine import Completion
from asyncgrpo.rollout.episodes import Episode, EpisodeGroup
from asyncgrpo.wire import ScoredGroup


def scored_group(generator_id: int, group: EpisodeGroup, score: GroupScore, env_on_error: str) -> ScoredGroup | None:
    """The group to send, its episodes packed end to end; `seq` is left at -1 for the sender.

    Each episode's reward is the rewards' score of its last turn plus the environment's rewards; an
    episode ended by a failed environment call scores 0 (env.on_error=zero). The admission version
    is recorded in meta and used for any token without a version of its own. None when the group
    must not be sent: reward.on_error=drop_group and a reward failed, or env.on_error=drop_group and
    an environment call failed, or its episodes' prompts (replaced by an environment) share no token.
    """
    if score.dropped or (group.failed and env_on_error == "drop_group"):
        return None
    episodes = group.episodes
    prompt = shared_prompt(group)
    if not prompt:
        return None
    completions = [_after(episode, len(prompt), group.admitted.version) for episode in episodes]
    env_rewards = np.asarray([episode.env_reward for episode in episodes], dtype=np.float32)
    rewards = np.where([bool(e.failed) for e in episodes], np.float32(0.0), score.rewards + env_rewards)
    meta = {"version": group.admitted.version, **score.meta()}
    if any(e.turns > 1 or e.env is not None for e in episodes):  # an environment's episodes
        meta["reward/env"] = float(env_rewards.mean())
    return ScoredGroup(
        generator_id=generator_id,
        seq=-1,  # assigned when sent, so heartbeats and sequence numbers agree
        prompt_id=group.admitted.problem.id,
        prompt_tokens=np.asarray(prompt, dtype=np.int32),
        tokens=np.concatenate([c.token_ids for c in completions]).astype(np.int32),
        logprobs=np.concatenate([c.logprobs for c in completions]).astype(np.float32),
        versions=np.concatenate([c.versions for c in completions]).astype(np.int32),
        lengths=np.asarray([c.token_ids.size for c in completions], dtype=np.int32),
        rewards=rewards.astype(np.float32),
        truncated=np.asarray([not c.finished for c in completions], dtype=np.uint8),
        policy_mask=np.concatenate([c.policy_mask for c in completions]).astype(np.uint8),
        meta=meta,
    )


def shared_prompt(group: EpisodeGroup) -> list[int]:
    """The prompt the group is sent with: the longest common prefix of its episodes' prompts (an
    environment's reset may have replaced them: EnvStep.replaces_prompt), the task's prompt when
    none was. Episodes without a token (ended at reset) are left out: nothing of theirs is trained.
    Empty when the prompts share no token (the learner needs one: the group cannot be sent)."""
    prompts = [episode.prompt for episode in group.episodes if episode.tokens] or [group.admitted.prompt]
    common = prompts[0]
    for prompt in prompts[1:]:
        same = 0
        for a, b in zip(common, prompt):
            if a != b:
                break
            same += 1
        common = common[:same]
    return list(common)


def _after(episode: Episode, shared: int, version: int) -> Completion:
    """`episode` as one completion after the group's first `shared` prompt tokens: the rest of its own
    prompt goes first, as environment tokens (policy mask 0, never trained; `version`, the group's
    admission version, ignored), then its tokens."""
    completion = episode.as_completion()
    rest = episode.prompt[shared:] if episode.tokens else []
    if not rest:
        return completion
    return Completion(token_ids=np.concatenate([np.asarray(rest, np.int32), completion.token_ids]),
                      logprobs=np.concatenate([np.zeros(len(rest), np.float32), completion.logprobs]),
                      finished=completion.finished,
                      versions=np.concatenate([np.full(len(rest), version, np.int32), completion.versions]),
                      policy_mask=np.concatenate([np.zeros(len(rest), np.uint8), completion.policy_mask]))
