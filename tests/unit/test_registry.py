"""The generator registry: sequence accounting per incarnation, reports, acknowledged versions and
restarts."""

import numpy as np
import pytest

from asyncgrpo.queue.registry import REPORTED_COUNTERS, GeneratorRegistry, WeightsRejected
from asyncgrpo.wire import Heartbeat, VersionAck


def test_a_new_incarnation_counts_from_sequence_number_zero_without_false_duplicates():
    registry = GeneratorRegistry()
    for seq in range(4):
        assert registry.admit(0, seq)
    registry.rejoin(0, incarnation=1)
    for seq in range(3):
        assert registry.admit(0, seq, incarnation=1)
    assert not registry.admit(0, 1, incarnation=1)  # a replay within the new incarnation is still one
    assert registry.stats() == {"queue/lost": 0, "queue/duplicates": 1, "queue/old_incarnation": 0,
                                "queue/old_incarnation_reports": 0}


def test_what_the_dead_incarnation_announced_but_never_delivered_is_lost():
    registry = GeneratorRegistry()
    assert registry.admit(0, 0) and registry.admit(0, 1)
    registry.on_heartbeat(Heartbeat(0, next_seq=5, version=0))  # it had sent 5: 2, 3, 4 never arrived
    registry.mark_down(0)
    registry.rejoin(0, incarnation=1)
    assert registry.stats()["queue/lost"] == 3


def test_late_messages_of_a_replaced_incarnation_are_counted_and_dropped():
    registry = GeneratorRegistry()
    assert registry.admit(0, 0)
    registry.on_ack(VersionAck(0, 3))
    registry.rejoin(0, incarnation=1)
    assert not registry.admit(0, 1, incarnation=0)  # still in a socket buffer when the process died
    registry.on_ack(VersionAck(0, 9, incarnation=0))
    registry.on_heartbeat(Heartbeat(0, next_seq=40, version=9, reward_errors=5))
    assert registry.stats() == {"queue/lost": 0, "queue/duplicates": 0, "queue/old_incarnation": 1,
                                "queue/old_incarnation_reports": 2}
    # The newcomer has loaded nothing yet, and the old process's report moved nothing.
    assert registry.acked_versions([0]) == {0: -1}
    assert registry.report_increments()["reward/errors"] == 0
    assert registry.admit(0, 0, incarnation=1)  # the newcomer's first group is not a duplicate


def test_a_message_of_a_newer_incarnation_replaces_the_old_one_even_before_its_rejoin():
    registry = GeneratorRegistry()
    assert registry.admit(0, 0) and registry.admit(0, 1)
    assert registry.admit(0, 0, incarnation=2)
    assert not registry.admit(0, 2, incarnation=0)
    assert registry.stats() == {"queue/lost": 0, "queue/duplicates": 0, "queue/old_incarnation": 1,
                                "queue/old_incarnation_reports": 0}
    with pytest.raises(ValueError, match="incarnation 1 rejoins"):
        registry.rejoin(0, incarnation=1)


def test_a_restarted_generators_counters_continue_its_predecessors():
    registry = GeneratorRegistry()
    registry.on_heartbeat(Heartbeat(0, next_seq=0, version=0, idle_s=4.0, reward_calls=10))
    assert registry.report_increments()["reward/calls"] == 10
    registry.rejoin(0, incarnation=1)
    registry.on_heartbeat(Heartbeat(0, next_seq=0, version=0, idle_s=1.0, reward_calls=3, incarnation=1))
    increments = registry.report_increments()
    assert (increments["reward/calls"], increments[REPORTED_COUNTERS["idle_s"]]) == (3, 1.0)


def test_a_down_generator_is_not_waited_for_and_waits_do_not_time_out_until_it_rejoins():
    registry = GeneratorRegistry()
    registry.on_ack(VersionAck(0, 2))
    registry.on_ack(VersionAck(1, 2))
    assert registry.restart_grace_until(10.0) < 0  # no restart ever: no grace
    registry.mark_down(1)
    assert registry.acked_versions([0, 1]) == {0: 2}
    assert registry.restart_grace_until(10.0) == float("inf")
    registry.rejoin(1, incarnation=1)
    assert registry.acked_versions([0, 1]) == {0: 2, 1: -1}
    assert np.isfinite(registry.restart_grace_until(10.0))


def test_duplicates_and_gaps_are_counted():
    registry = GeneratorRegistry()
    assert registry.admit(1, 0) and registry.admit(1, 3)
    assert not registry.admit(1, 2)
    registry.on_heartbeat(Heartbeat(1, next_seq=6, version=0))
    assert registry.stats() == {"queue/lost": 2 + 2, "queue/duplicates": 1, "queue/old_incarnation": 0,
                                "queue/old_incarnation_reports": 0}


def test_a_generator_that_rejected_weights_ends_the_run_with_its_reason():
    registry = GeneratorRegistry()
    registry.check_weights_accepted()
    registry.on_heartbeat(Heartbeat(0, next_seq=0, version=0, weights_rejected=2, rejection="too_large: 300 bytes"))
    with pytest.raises(WeightsRejected, match="generator 0: 2 rejected, first: too_large"):
        registry.check_weights_accepted()
