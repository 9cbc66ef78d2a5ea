import torch

from asyncgrpo.learner.metrics import version_span


def test_version_span_counts_only_real_tokens_and_is_zero_for_an_empty_completion():
    versions = torch.tensor([[3, 3, 4, 9], [2, 5, 5, 0], [7, 7, 7, 7]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert version_span(versions, mask).tolist() == [1, 5, 0]


def test_the_token_age_histogram_counts_each_completion_token_by_the_version_that_sampled_it():
    from asyncgrpo.learner.metrics import token_age_histogram

    # Two completions at learner version 6: one sampled by 6, 5, 5 (in-flight loads), one by 1 and 2
    # with a padding slot whose version must not count.
    token_versions = torch.tensor([[6, 5, 5], [1, 2, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    shares = token_age_histogram(6, token_versions, mask)
    assert shares == {"staleness/tokens_age_0": 0.2, "staleness/tokens_age_1": 0.4, "staleness/tokens_age_2": 0.0,
                      "staleness/tokens_age_3": 0.0, "staleness/tokens_age_4plus": 0.4}
