from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.rollout.generator import throttle_limit


def test_synchronous_lock_step():
    # eta = 0: one step's worth of groups per loaded version.
    assert throttle_limit(0, 0, 16) == 16
    assert throttle_limit(0, 1, 16) == 32


@given(st.integers(0, 8), st.integers(0, 1000), st.integers(1, 64))
def test_every_allowed_group_is_within_the_staleness_bound(eta, version, quota):
    # A single generator's group k is consumed at learner version k // quota (no drops).
    last_allowed = throttle_limit(eta, version, quota) - 1
    assert last_allowed // quota - version <= eta
    # ...and the bound is tight: one more group would exceed it.
    assert (last_allowed + 1) // quota - version == eta + 1
