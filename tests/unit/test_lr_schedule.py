import math

import pytest

from asyncgrpo.learner.schedule import lr_multiplier
from asyncgrpo.schema import LearnerConfig


def test_linear_warmup_then_constant():
    learner = LearnerConfig(warmup_steps=4)
    assert [lr_multiplier(s, learner, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_to_floor():
    learner = LearnerConfig(warmup_steps=0, lr_schedule="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(0, learner, 100) == pytest.approx(1.0)
    assert lr_multiplier(50, learner, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(100, learner, 100) == pytest.approx(0.1)
    assert lr_multiplier(500, learner, 100) == pytest.approx(0.1)
