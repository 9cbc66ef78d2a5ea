"""The generator registry: sequence accounting, reports, and prompt positions across resumes."""

import pytest

from asyncgrpo.registry import GeneratorRegistry, WeightsRejected
from asyncgrpo.wire import Heartbeat


def test_prompt_positions_add_up_over_any_number_of_resumes():
    first = GeneratorRegistry()
    for seq in range(5):
        assert first.admit(0, seq)
    second = GeneratorRegistry()
    second.load_state_dict(first.state_dict())  # resumed: the generator's sequence numbers restart at 0
    assert second.groups_received(0) == 5
    for seq in range(3):
        assert second.admit(0, seq)
    third = GeneratorRegistry()
    third.load_state_dict(second.state_dict())
    assert third.groups_received(0) == 8 and third.groups_received(1) == 0


def test_duplicates_and_gaps_are_counted():
    registry = GeneratorRegistry()
    assert registry.admit(1, 0) and registry.admit(1, 3)
    assert not registry.admit(1, 2)
    registry.on_heartbeat(Heartbeat(1, next_seq=6, version=0))
    assert registry.stats() == {"queue/lost": 2 + 2, "queue/duplicates": 1}


def test_a_generator_that_rejected_weights_ends_the_run_with_its_reason():
    registry = GeneratorRegistry()
    registry.check_weights_accepted()
    registry.on_heartbeat(Heartbeat(0, next_seq=0, version=0, weights_rejected=2, rejection="too_large: 300 bytes"))
    with pytest.raises(WeightsRejected, match="generator 0: 2 rejected, first: too_large"):
        registry.check_weights_accepted()
