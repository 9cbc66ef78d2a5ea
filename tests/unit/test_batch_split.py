"""Splitting a step across ranks and into micro-batches (pure; no process group)."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.learner.batch import collate, micro_batch_plan, rank_shares
from asyncgrpo.wire import ScoredGroup


def groups_of(sizes: list[int], seed: int = 0) -> list[ScoredGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for g, samples in enumerate(sizes):
        lengths = rng.integers(0, 7, size=samples).astype(np.int32)
        total = int(lengths.sum())
        groups.append(ScoredGroup(
            generator_id=0, seq=g, prompt_id=g, prompt_tokens=rng.integers(3, 60, size=int(rng.integers(1, 9))).astype(np.int32),
            tokens=rng.integers(1, 60, size=total).astype(np.int32), logprobs=np.zeros(total, dtype=np.float32),
            versions=np.zeros(total, dtype=np.int32), lengths=lengths, rewards=np.zeros(samples, dtype=np.float32),
        ))
    return groups


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.integers(1, 5), st.integers(0, 64), st.booleans())
def test_every_row_goes_to_exactly_one_micro_batch_of_one_rank(sizes, world_size, budget, bucket):
    batch = collate(groups_of(sizes), pad_id=0)
    lengths = batch.attention_mask.sum(1).tolist()
    shares = rank_shares(batch, world_size)
    assert len(shares) == world_size
    seen = []
    for rows in shares:
        # Whole groups, contiguous: a rank's rows are one run of consecutive rows.
        assert rows == list(range(rows[0], rows[0] + len(rows))) if rows else True
        plan = micro_batch_plan(lengths, rows, budget, bucket)
        for micro in plan:
            assert micro
            assert len(micro) == 1 or budget == 0 or max(lengths[r] for r in micro) * len(micro) <= budget
        seen += [r for micro in plan for r in micro]
    assert sorted(seen) == list(range(batch.num_samples))
    group_rank = {}
    for rank, rows in enumerate(shares):
        for r in rows:
            assert group_rank.setdefault(int(batch.group_index[r]), rank) == rank


def test_shares_balance_tokens():
    batch = collate(groups_of([4] * 16, seed=3), pad_id=0)
    lengths = batch.attention_mask.sum(1)
    tokens = [int(lengths[rows].sum()) for rows in rank_shares(batch, 4)]
    biggest_group = max(int(lengths[batch.group_index == g].sum()) for g in range(16))
    assert max(tokens) - min(tokens) <= 2 * biggest_group, tokens


def test_bucketing_puts_similar_lengths_together():
    lengths = [1, 9, 2, 8, 3, 7]
    assert micro_batch_plan(lengths, range(6), 18, bucket_by_length=True) == [[1, 3], [5, 4], [2, 0]]
    assert micro_batch_plan(lengths, range(6), 18, bucket_by_length=False) == [[0, 1], [2, 3], [4, 5]]


def test_select_trims_padding_to_the_rows_taken():
    batch = collate(groups_of([3, 3], seed=1), pad_id=0)
    lengths = batch.attention_mask.sum(1)
    shortest = int(lengths.argmin())
    micro = batch.select(torch.tensor([shortest]))
    assert micro.input_ids.shape[1] == max(1, int(lengths[shortest]))
    assert torch.equal(micro.rewards, batch.rewards[[shortest]])
