import numpy as np
import torch

from asyncgrpo.learner.batch import collate, completion_logprobs
from asyncgrpo.wire import ScoredGroup


def make_group(prompt, completions, version=0, rewards=None, seq=0):
    tokens = np.concatenate([np.asarray(c, dtype=np.int32) for c in completions])
    return ScoredGroup(
        generator_id=0, seq=seq, prompt_id=seq,
        prompt_tokens=np.asarray(prompt, dtype=np.int32),
        tokens=tokens,
        logprobs=-np.arange(1, tokens.size + 1, dtype=np.float32) / 10,
        versions=np.full(tokens.size, version, dtype=np.int32),
        lengths=np.asarray([len(c) for c in completions], dtype=np.int32),
        rewards=np.asarray(rewards or [0.0] * len(completions), dtype=np.float32),
    )


def test_collate_layout():
    groups = [make_group([5, 6, 7], [[1, 2], [3]], version=4, rewards=[1, 0]),
              make_group([8], [[9, 9, 9], []], version=2, seq=1)]
    batch = collate(groups, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 1, 2], [5, 6, 7, 3, 0], [8, 9, 9, 9, 0], [8, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    # Token t of a completion is predicted by the logits at prompt_len + t - 1.
    assert batch.logit_index[0].tolist() == [2, 3, 0]
    assert batch.logit_index[2].tolist() == [0, 1, 2]
    assert batch.mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]
    assert batch.targets[0, :2].tolist() == [1, 2]
    np.testing.assert_allclose(batch.rollout_logp[0, :2].numpy(), [-0.1, -0.2])
    np.testing.assert_allclose(batch.rollout_logp[1, :1].numpy(), [-0.3])
    assert batch.rewards.tolist() == [1, 0, 0, 0]
    assert batch.group_index.tolist() == [0, 0, 1, 1]
    assert batch.group_version_min.tolist() == [4, 2]
    assert batch.num_tokens == 6
    assert batch.truncated.tolist() == [0, 0, 0, 0]


def test_collate_and_select_carry_each_completions_truncation_flag():
    group = make_group([5], [[1, 2], [3], [4, 4]], rewards=[1, 0, 0])
    group.truncated = np.array([0, 1, 1], dtype=np.uint8)
    batch = collate([make_group([8], [[9]], seq=1), group], pad_id=0)
    assert batch.truncated.tolist() == [0, 0, 1, 1] and batch.truncated.dtype == torch.float32
    assert batch.select(torch.tensor([2, 0])).truncated.tolist() == [1, 0]


def test_completion_logprobs_matches_full_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11)
    logit_index = torch.tensor([[2, 3, 4], [0, 1, 1], [4, 5, 5]])
    targets = torch.randint(0, 11, (3, 3))
    expected = (logits / 0.7).log_softmax(-1)
    expected = torch.stack([expected[b, logit_index[b], targets[b]] for b in range(3)])
    torch.testing.assert_close(completion_logprobs(logits, logit_index, targets, 0.7), expected)
