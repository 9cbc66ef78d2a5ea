"""train.staleness_control and the divergence keys: the default changes nothing, and each setting
divergence control cannot serve is refused in one line naming its key."""

from __future__ import annotations

import pytest

from asyncgrpo.config import load
from asyncgrpo.schema import ConfigError

DIVERGENCE = ["train.staleness_control=divergence", "train.max_staleness=4"]


def test_the_default_is_version_control_with_no_cap():
    t = load([]).train
    assert (t.staleness_control, t.min_staleness, t.divergence_cap) == ("versions", 0, 0.0)


def test_divergence_control_loads_with_a_throttle_and_room_to_move():
    t = load([*DIVERGENCE, "train.min_staleness=1", "train.divergence_metric=ess", "train.divergence_target=0.8",
              "train.divergence_cap=0.5", "train.divergence_cap_action=downweight"]).train
    assert (t.staleness_control, t.min_staleness, t.max_staleness, t.divergence_target) == ("divergence", 1, 4, 0.8)


@pytest.mark.parametrize(("overrides", "named_key"), [
    (["train.staleness_control=pid"], "train.staleness_control"),
    (["train.divergence_metric=tv"], "train.divergence_metric"),
    (["train.divergence_cap=-1"], "train.divergence_cap"),
    (["train.divergence_cap_action=clip"], "train.divergence_cap_action"),
    (["train.min_staleness=3"], "train.min_staleness"),  # > max_staleness = 2
    (["train.divergence_target=0"], "train.divergence_target"),
    (["train.divergence_metric=ess", "train.divergence_target=1.5"], "train.divergence_target"),
    (["train.staleness_control=divergence", "train.fixed_staleness=2"], "train.fixed_staleness"),
    ([*DIVERGENCE, "train.stale_policy=drop"], "train.stale_policy"),
    (["train.staleness_control=divergence", "train.max_staleness=0", "weights.push_every_steps=1"],
     "train.max_staleness"),
    ([*DIVERGENCE, "weights.push_every_steps=2"], "weights.push_every_steps"),  # > min_staleness + 1 = 1
])
def test_what_divergence_control_cannot_serve_is_refused_in_one_line(overrides, named_key):
    with pytest.raises(ConfigError) as err:
        load(overrides)
    assert named_key in str(err.value) and "\n" not in str(err.value)
