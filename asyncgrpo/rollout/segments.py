"""In-flight weight updates as pure logic: sequences sampled in segments, every token tagged with
the policy version that sampled it. No engine here: the caller makes the calls.

    inflight = InFlight(prompts, first_call, version, max_new_tokens)
    while (call := inflight.next_call(segment_tokens)) is not None:
        ...                                 # load the newest weights: a safe point, nothing in flight
        inflight.extend(engine.generate(call.prompts, n=1, max_tokens_per_prompt=call.max_tokens, ...), version)
    completions = inflight.completions()

A continuation resumes from its prompt plus every token it already has, so no sampled token is
thrown away and the result equals one uninterrupted call, segment boundaries aside.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncgrpo.rollout.engine import Completion


def tag_versions(groups: list[list[Completion]], version: int) -> list[list[Completion]]:
    """One call, one version: tag every token of `groups` (in place) with `version`; returns `groups`."""
    for group in groups:
        for completion in group:
            completion.versions = np.full(completion.token_ids.size, version, dtype=np.int32)
    return groups


class Growing:
    """One sequence generated in segments, possibly by several policy versions."""

    def __init__(self, first: Completion, version: int) -> None:
        self.tokens, self.logprobs = [first.token_ids], [first.logprobs]
        self.versions = [np.full(first.token_ids.size, version, dtype=np.int32)]
        self.finished = first.finished
        self.length = int(first.token_ids.size)

    def extend(self, more: Completion, version: int) -> None:
        self.tokens.append(more.token_ids)
        self.logprobs.append(more.logprobs)
        self.versions.append(np.full(more.token_ids.size, version, dtype=np.int32))
        self.finished = more.finished
        self.length += int(more.token_ids.size)

    def token_list(self) -> list[int]:
        return np.concatenate(self.tokens).tolist()

    def completion(self) -> Completion:
        return Completion(token_ids=np.concatenate(self.tokens), logprobs=np.concatenate(self.logprobs),
                          finished=self.finished, versions=np.concatenate(self.versions))


@dataclass
class Continuation:
    """The next engine call: one sample per prompt, each with its own token limit."""

    prompts: list[list[int]]  # original prompt + the sequence's tokens so far
    max_tokens: list[int]


class InFlight:
    """The sequences of one batch (`first`: the first segment's call, n samples per prompt) until all finish."""

    def __init__(self, prompts: list[list[int]], first: list[list[Completion]], version: int,
                 max_new_tokens: int) -> None:
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.groups = [[Growing(c, version) for c in group] for group in first]
        self._waiting: list[Growing] = []  # the sequences the last `next_call` continues, in order

    def next_call(self, segment_tokens: int) -> Continuation | None:
        """What to generate next (at most `segment_tokens` more per sequence), or None when every
        sequence has stopped or reached max_new_tokens."""
        unfinished = [(prompt, s) for prompt, group in zip(self.prompts, self.groups) for s in group
                      if not s.finished and s.length < self.max_new_tokens]
        self._waiting = [s for _, s in unfinished]
        if not unfinished:
            return None
        return Continuation(prompts=[prompt + s.token_list() for prompt, s in unfinished],
                            max_tokens=[min(segment_tokens, self.max_new_tokens - s.length) for _, s in unfinished])

    def extend(self, outputs: list[list[Completion]], version: int) -> None:
        """Append the continuation call's outputs (one completion per prompt), sampled by `version`."""
        if len(outputs) != len(self._waiting):
            raise ValueError(f"{len(outputs)} outputs for {len(self._waiting)} continued sequences")
        for sequence, out in zip(self._waiting, outputs):
            sequence.extend(out[0], version)
        self._waiting = []

    def completions(self) -> list[list[Completion]]:
        return [[s.completion() for s in group] for group in self.groups]
