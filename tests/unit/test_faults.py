"""asyncgrpo/runtime/faults.py (named failpoints from ASYNCGRPO_FAULTS) and the generator's faulty sink."""

from __future__ import annotations

import pytest

from asyncgrpo.runtime import faults
from asyncgrpo.queue.registry import GeneratorRegistry
from asyncgrpo.rollout.sink import FaultySink, with_faults
from asyncgrpo.wire import Heartbeat, WireError, decode, encode, example_group


class ListSink:
    def __init__(self, full_for: int = 0) -> None:
        self.sent: list = []
        self.full_for = full_for  # refuse this many sends first (a full socket)

    def try_send(self, message, timeout_s: float) -> bool:
        if self.full_for:
            self.full_for -= 1
            return False
        self.sent.append(message)
        return True

    def close(self) -> None:
        pass


def groups(n: int) -> list:
    out = []
    for seq in range(n):
        group = example_group(num_samples=2, tokens_per_sample=3, seed=seq)
        group.generator_id, group.seq = 0, seq
        out.append(group)
    return out


def test_every_failpoint_is_off_by_default(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.active() == {}
    assert all(faults.value(name) is None for name in faults.KNOWN)
    assert faults.every("wire_drop_every") == 0


def test_a_set_failpoint_reads_its_value(monkeypatch):
    monkeypatch.setenv(faults.ENV, '{"checkpoint_save_delay_s": 2.5, "wire_drop_every": 7}')
    assert faults.value("checkpoint_save_delay_s") == 2.5
    assert faults.every("wire_drop_every") == 7
    assert faults.value("wire_corrupt_every") is None


def test_an_unknown_failpoint_is_refused_in_the_environment_and_by_name(monkeypatch):
    monkeypatch.setenv(faults.ENV, '{"checkpoint_save_dealy_s": 5}')
    with pytest.raises(faults.FaultSpecError, match="unknown failpoint.*checkpoint_save_dealy_s"):
        faults.value("checkpoint_save_delay_s")
    monkeypatch.delenv(faults.ENV)
    with pytest.raises(faults.FaultSpecError, match="unknown failpoint"):
        faults.value("no_such_fault")


@pytest.mark.parametrize("raw", ["not json", "[1, 2]"])
def test_a_malformed_spec_is_refused(monkeypatch, raw):
    monkeypatch.setenv(faults.ENV, raw)
    with pytest.raises(faults.FaultSpecError):
        faults.active()


@pytest.mark.parametrize("value", [0, -3, 2.5, "10", True])
def test_a_count_failpoint_must_be_a_positive_integer(monkeypatch, value):
    import json

    monkeypatch.setenv(faults.ENV, json.dumps({"wire_corrupt_every": value}))
    with pytest.raises(faults.FaultSpecError, match="positive integer"):
        faults.every("wire_corrupt_every")


def test_a_slowdown_applies_to_the_generators_it_names_and_refuses_factors_below_one(monkeypatch):
    monkeypatch.setenv(faults.ENV, '{"generator_slowdown": {"1": 2, "3": 1.5}}')
    assert [faults.slowdown(g) for g in range(4)] == [1.0, 2.0, 1.0, 1.5]
    for bad in ('{"1": 0.5}', '[2]', '{"x": 2}', '{"1": "2"}'):
        monkeypatch.setenv(faults.ENV, '{"generator_slowdown": %s}' % bad)
        with pytest.raises(faults.FaultSpecError, match="generator_slowdown"):
            faults.slowdown(1)


def test_a_pace_applies_to_the_generators_it_names_and_refuses_negative_seconds(monkeypatch):
    monkeypatch.setenv(faults.ENV, '{"generator_pace_s": {"0": 0.02, "2": 0}}')
    assert [faults.pace_s(g) for g in range(3)] == [0.02, 0.0, 0.0]
    monkeypatch.delenv(faults.ENV)
    assert faults.pace_s(0) == 0.0
    for bad in ('{"1": -0.1}', '0.02', '{"a": 1}', '{"1": null}'):
        monkeypatch.setenv(faults.ENV, '{"generator_pace_s": %s}' % bad)
        with pytest.raises(faults.FaultSpecError, match="generator_pace_s"):
            faults.pace_s(1)


def test_the_sink_is_wrapped_only_when_a_wire_failpoint_is_set(monkeypatch):
    sink = ListSink()
    monkeypatch.delenv(faults.ENV, raising=False)
    assert with_faults(sink) is sink
    monkeypatch.setenv(faults.ENV, '{"wire_corrupt_every": 3}')
    wrapped = with_faults(sink)
    assert isinstance(wrapped, FaultySink) and (wrapped.drop_every, wrapped.corrupt_every) == (0, 3)


def test_dropped_groups_are_gaps_the_registry_counts_as_lost():
    sink = ListSink()
    faulty = FaultySink(sink, drop_every=4)
    for group in groups(12):
        assert faulty.try_send(group, 0.0)  # the generator believes each was sent
    assert faulty.dropped == 3 and [g.seq for g in sink.sent] == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    registry = GeneratorRegistry()
    for group in sink.sent:
        registry.admit(group.generator_id, group.seq)
    registry.on_heartbeat(Heartbeat(0, next_seq=12, version=0))  # the tail's loss is announced
    assert registry.lost == 3


def test_corrupted_groups_are_rejected_by_the_decoder_under_a_reason():
    sink = ListSink()
    faulty = FaultySink(sink, corrupt_every=3)
    for group in groups(6):
        faulty.try_send(group, 0.0)
    assert faulty.corrupted == 2
    reasons = []
    for message in sink.sent:
        frames = message if isinstance(message, list) else encode(message)
        try:
            decode(frames)
        except WireError as err:
            reasons.append(err.reason)
    assert reasons == ["bad_header", "bad_header"]


def test_a_group_refused_by_a_full_socket_is_counted_once_when_taken():
    sink = ListSink(full_for=2)
    faulty = FaultySink(sink, drop_every=2)
    first, second, third = groups(3)
    assert not faulty.try_send(first, 0.0) and not faulty.try_send(first, 0.0)
    assert faulty.try_send(first, 0.0)  # the first group, taken on the third try
    assert faulty.try_send(second, 0.0) and faulty.dropped == 1  # the second group is the one dropped
    assert faulty.try_send(third, 0.0)
    assert [g.seq for g in sink.sent] == [0, 2]


def test_acknowledgements_and_heartbeats_pass_untouched():
    sink = ListSink()
    faulty = FaultySink(sink, drop_every=1)
    beat = Heartbeat(0, next_seq=0, version=0)
    assert faulty.try_send(beat, 0.0) and sink.sent == [beat] and faulty.groups == 0
