import torch

from asyncgrpo.learner.metrics import version_span


def test_version_span_counts_only_real_tokens_and_is_zero_for_an_empty_completion():
    versions = torch.tensor([[3, 3, 4, 9], [2, 5, 5, 0], [7, 7, 7, 7]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert version_span(versions, mask).tolist() == [1, 5, 0]
