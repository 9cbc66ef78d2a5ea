import math

import numpy as np
import pytest

from asyncgrpo.driver import TrainingFailed
from asyncgrpo.driver.evaluation import check_probe, probe_report


def report(gap: float) -> dict:
    start = [np.zeros(4, dtype=np.float32)]
    learner = [np.full(4, -1.0, dtype=np.float32)]
    generator = [learner[0] + np.array([0, gap, 0, 0], dtype=np.float32)]
    return probe_report(generator, learner, start, generator_version=7, learner_version=7)


def test_a_probe_within_tolerance_passes():
    check_probe(report(5e-4), tolerance=1e-3)


@pytest.mark.parametrize("gap", [2e-3, 0.5, math.nan])
def test_a_probe_beyond_tolerance_fails_the_run_with_the_gap_and_the_key(gap):
    with pytest.raises(TrainingFailed, match="train.probe_tolerance=0.001"):
        check_probe(report(gap), tolerance=1e-3)
