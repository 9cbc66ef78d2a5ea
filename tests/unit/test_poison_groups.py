"""Poison groups: a group that decodes (or nearly) but cannot be trained on is rejected under a named
reason, counted under wire/rejected/<reason>, and never stops the learner from taking the next one."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from asyncgrpo.learner.batch import collate
from asyncgrpo.queue.replay_queue import GroupLimits, QueueFull, ReplayQueue, StalenessEviction
from asyncgrpo.wire import Receiver, ScoredGroup, encode

LIMITS = GroupLimits(vocab_size=100, max_positions=32, max_samples=4)
LIMIT_REASONS = ("empty_prompt", "too_many_samples", "too_long", "token_out_of_vocab")


def good_group(seq: int = 0, generator_id: int = 0, lengths: tuple[int, ...] = (3, 3, 3, 3),
               prompt_tokens: int = 5) -> ScoredGroup:
    """A group within LIMITS (and within the tiny model's 61-token vocabulary), rewards that differ."""
    rng = np.random.default_rng(seq)
    total = sum(lengths)
    return ScoredGroup(
        generator_id=generator_id, seq=seq, prompt_id=seq,
        prompt_tokens=rng.integers(3, 60, size=prompt_tokens).astype(np.int32),
        tokens=rng.integers(1, 60, size=total).astype(np.int32),
        logprobs=-rng.uniform(0.5, 3.0, size=total).astype(np.float32),
        versions=np.zeros(total, dtype=np.int32),
        lengths=np.array(lengths, dtype=np.int32),
        rewards=np.arange(len(lengths), dtype=np.float32) % 2,
        meta={"version": 0, "reward/accuracy": 0.5},
        pos=seq,  # one prompt per sequence number: its position in the prompt stream
    )


def changed(group: ScoredGroup, **fields: Any) -> ScoredGroup:
    for name, value in fields.items():
        setattr(group, name, value)
    return group


def frames_of(group: ScoredGroup, **header_changes: Any) -> list[bytes]:
    """The group's frames as a generator would send them, with header fields replaced."""
    frames = [bytes(frame) for frame in encode(group)]
    header = msgpack.unpackb(frames[0])
    header.update(header_changes)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def with_token(group: ScoredGroup, name: str, index: int, value: int) -> ScoredGroup:
    array = getattr(group, name).copy()
    array[index] = value
    return changed(group, **{name: array})


def tokenless_group(seq: int) -> ScoredGroup:
    return good_group(seq, lengths=(0, 0))


# case -> (the poison group's frames at sequence number 0, reason, whether its sequence number is
# used: a group the codec rejects has no header the learner can trust, so its number shows as lost).
POISON: dict[str, tuple[Callable[[], list[bytes]], str, bool]] = {
    # The codec's checks (no model needed).
    "NaN reward": (lambda: frames_of(good_group(), rewards=[math.nan, 1.0, 0.0, 1.0]), "bad_rewards", False),
    "reward that overflows float32": (lambda: frames_of(good_group(), rewards=[1e39, 1.0, 0.0, 1.0]),
                                      "bad_rewards", False),
    "NaN meta counter": (lambda: frames_of(changed(good_group(), meta={"version": 0, "reward/accuracy": math.nan})),
                         "bad_meta", False),
    "infinite meta counter": (lambda: frames_of(changed(good_group(), meta={"version": 0, "reward/errors": math.inf})),
                              "bad_meta", False),
    "meta counter that overflows float32": (
        lambda: frames_of(changed(good_group(), meta={"version": 0, "reward/accuracy": 1e39})), "bad_meta", False),
    "tokenless group whose meta version is not its version": (
        lambda: frames_of(tokenless_group(0), meta={"version": "0"}), "bad_versions", False),
    "truncation flags that miss a sample": (lambda: frames_of(good_group(), truncated=[0, 1, 0]), "bad_truncated", False),
    "negative token id": (lambda: frames_of(with_token(good_group(), "tokens", 0, -1)), "bad_tokens", False),
    "a policy mask entry of 2": (lambda: frames_of(with_token(good_group(), "policy_mask", 4, 2)), "bad_policy_mask",
                                 False),
    # The learner's limits (the model's vocabulary and context, the config's group size).
    "prompt token id beyond the vocabulary": (
        lambda: frames_of(with_token(good_group(), "prompt_tokens", 0, LIMITS.vocab_size)), "token_out_of_vocab", True),
    "completion token id beyond the vocabulary": (
        lambda: frames_of(with_token(good_group(), "tokens", -1, 2**31 - 1)), "token_out_of_vocab", True),
    "empty prompt": (lambda: frames_of(good_group(prompt_tokens=0)), "empty_prompt", True),
    "prompt + completion beyond the context": (
        lambda: frames_of(good_group(prompt_tokens=LIMITS.max_positions - 2)), "too_long", True),
    "more samples than a prompt gets": (lambda: frames_of(good_group(lengths=(1,) * (LIMITS.max_samples + 1))),
                                        "too_many_samples", True),
}


def eviction() -> StalenessEviction:
    return StalenessEviction(1000, drop_stale=True)


def assert_accounted(stats: dict[str, float]) -> None:
    assert stats["queue/received"] == sum(
        stats[key] for key in ("queue/consumed", "queue/dropped_stale", "queue/dropped_unheld", "queue/depth")), stats


@pytest.mark.parametrize("case", list(POISON))
def test_a_poison_group_on_the_socket_is_rejected_under_its_reason_counted_and_the_next_group_is_served(
    case: str,
) -> None:
    make_frames, reason, seq_used = POISON[case]
    queue = ReplayQueue(Receiver(), 4, eviction(), limits=LIMITS, poll_interval_s=0.01).start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(queue.receiver.endpoint)
        push.send_multipart(make_frames())
        push.send_multipart(encode(good_group(seq=1)))
        # One connection delivers in order: once the good group is served, the poison was handled.
        taken = queue.take(1, learner_version=0, timeout_s=10)
        stats = queue.stats()
    finally:
        push.close(linger=0)
        queue.close()
    assert [g.group_id for g in taken] == [(0, 1)]
    assert stats["wire/rejected"] == 1 and stats[f"wire/rejected/{reason}"] == 1, stats
    assert (stats["queue/received"], stats["queue/consumed"], stats["queue/duplicates"]) == (1, 1, 0)
    assert stats["queue/lost"] == (0 if seq_used else 1)
    assert_accounted(stats)


def test_put_counts_a_poison_group_without_raising_or_waiting_for_room_in_a_full_queue() -> None:
    queue = ReplayQueue(None, 1, eviction(), limits=LIMITS)
    queue.put(good_group(seq=0))
    queue.put(good_group(seq=1, prompt_tokens=0), timeout_s=0.0)  # waiting for room would raise QueueFull
    with pytest.raises(QueueFull):
        queue.put(good_group(seq=2), timeout_s=0.0)  # a good one still does
    stats = queue.stats()
    assert (stats["wire/rejected"], stats["wire/rejected/empty_prompt"]) == (1, 1)
    assert (stats["queue/received"], stats["queue/depth"]) == (1, 1)
    assert_accounted(stats)


def test_a_rejected_groups_sequence_number_is_used_so_it_is_not_lost_and_its_replay_is_a_duplicate() -> None:
    queue = ReplayQueue(None, 4, eviction(), limits=LIMITS)
    poison = good_group(seq=0, prompt_tokens=0)
    queue.put(poison)
    queue.put(poison)
    queue.put(good_group(seq=1))
    stats = queue.stats()
    assert (stats["wire/rejected"], stats["queue/duplicates"], stats["queue/lost"]) == (1, 1, 0)
    assert [g.seq for g in queue.take(1, learner_version=0, timeout_s=1)] == [1]


def test_fewer_samples_and_empty_completions_are_trainable_and_pass() -> None:
    for group in (good_group(lengths=(4,)), good_group(lengths=(0, 2, 0)), tokenless_group(0)):
        assert LIMITS.untrainable(group) is None


def test_limits_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        GroupLimits(vocab_size=0, max_positions=32, max_samples=4)


@st.composite
def groups_around_the_limits(draw: st.DrawFn) -> ScoredGroup:
    num_samples = draw(st.integers(1, LIMITS.max_samples + 1))
    lengths = draw(hnp.arrays(np.int32, num_samples, elements=st.integers(0, 12)))
    total = int(lengths.sum())
    ids = st.integers(0, LIMITS.vocab_size + 1)
    return ScoredGroup(
        generator_id=0, seq=0, prompt_id=0,
        prompt_tokens=draw(hnp.arrays(np.int32, draw(st.integers(0, LIMITS.max_positions - 6)), elements=ids)),
        tokens=draw(hnp.arrays(np.int32, total, elements=ids)),
        logprobs=np.full(total, -1.0, dtype=np.float32),
        versions=np.zeros(total, dtype=np.int32),
        lengths=lengths,
        rewards=np.arange(num_samples, dtype=np.float32),
    )


@settings(max_examples=200, deadline=None)
@given(groups_around_the_limits())
def test_limits_reject_exactly_the_untrainable_and_what_passes_collates_to_in_range_indices(
    group: ScoredGroup,
) -> None:
    ids = np.concatenate([group.prompt_tokens, group.tokens])
    violated = {reason for reason, broken in (
        ("empty_prompt", group.prompt_tokens.size == 0),
        ("too_many_samples", group.num_samples > LIMITS.max_samples),
        ("too_long", group.prompt_tokens.size + int(group.lengths.max()) > LIMITS.max_positions),
        ("token_out_of_vocab", ids.size > 0 and int(ids.max()) >= LIMITS.vocab_size),
    ) if broken}
    problem = LIMITS.untrainable(group)
    if violated:
        assert problem is not None and problem[0] in violated, (problem, violated)
        return
    assert problem is None
    batch = collate([group], pad_id=0)
    assert batch.input_ids.shape[1] <= LIMITS.max_positions
    assert int(batch.input_ids.max()) < LIMITS.vocab_size and int(batch.targets.max()) < LIMITS.vocab_size
    real = batch.mask.bool()
    row_length = batch.attention_mask.sum(1, keepdim=True).expand_as(batch.logit_index)
    assert bool((batch.logit_index[real] >= 0).all()) and bool((batch.logit_index[real] < row_length[real]).all())


def test_a_training_step_runs_on_what_the_queue_serves_after_poison_groups() -> None:
    from asyncgrpo.config import load
    from asyncgrpo.learner.parts import group_limits
    from asyncgrpo.learner.policy import Policy
    from asyncgrpo.learner.update import update
    from asyncgrpo.models.tiny import TinyModelSpec, build_model
    from asyncgrpo.models.tokenizer import build_char_tokenizer

    cfg = load(["learner.warmup_steps=0"])
    tokenizer = build_char_tokenizer()
    model = build_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=0)
    limits = group_limits(cfg, model)
    assert limits == GroupLimits(vocab_size=len(tokenizer), max_positions=cfg.model.max_positions,
                                 max_samples=cfg.rollout.samples_per_prompt)
    poison = [
        with_token(good_group(seq=0), "prompt_tokens", 0, limits.vocab_size),
        with_token(good_group(seq=2), "tokens", 0, limits.vocab_size),
        good_group(seq=4, prompt_tokens=0),
        good_group(seq=6, prompt_tokens=limits.max_positions),
        good_group(seq=8, lengths=(1,) * (limits.max_samples + 1)),
    ]
    # Trainable though unusual: one sample (advantage 0) and completions of zero tokens.
    good = [good_group(seq=1), good_group(seq=3, lengths=(2,)), good_group(seq=5, lengths=(0, 4, 0, 1)),
            good_group(seq=7)]
    queue = ReplayQueue(None, 16, eviction(), limits=limits)
    for group in sorted(poison + good, key=lambda g: g.seq):
        queue.put(group)
    stats = queue.stats()
    assert stats["wire/rejected"] == len(poison)
    assert {reason: stats[f"wire/rejected/{reason}"] for reason in LIMIT_REASONS} == {
        "empty_prompt": 1, "too_many_samples": 1, "too_long": 1, "token_out_of_vocab": 2}

    taken = queue.take(len(good), learner_version=0, timeout_s=1)
    assert [g.seq for g in taken] == [1, 3, 5, 7]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), None,
                    torch.device("cpu"), torch.device("cpu"), rank=0, temperature=cfg.rollout.temperature)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = update(policy, collate(taken, tokenizer.pad_token_id), cfg, rank=0, world_size=1,
                     max_new_tokens=cfg.rollout.max_new_tokens)
    assert math.isfinite(metrics["loss/total"]) and math.isfinite(metrics["optim/grad_norm"]), metrics
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
