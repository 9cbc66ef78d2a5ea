"""The checkpoint-save notice (`SaveNotice`, wire type 6): its codec, every weight backend carrying
it from sender to receiver, and `SaveWatch`, the generator's deadline arithmetic on a fake clock."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
import torch
from test_weights_zmq import ListPublisher, ListSubscriber, model, spec_of

from asyncgrpo.weights import nccl
from asyncgrpo.weights.base import SaveWatch
from asyncgrpo.weights.shm import ShmWeightReceiver, ShmWeightSender
from asyncgrpo.weights.zmq import ZmqWeightReceiver, ZmqWeightSender
from asyncgrpo.wire import MsgType, SaveNotice, WireError, decode, encode
from asyncgrpo.wire.sockets import DOWNSTREAM_TYPES, UPSTREAM_TYPES

STARTS = SaveNotice(version=4, saving=True, timeout_s=1800.0)
ENDS = SaveNotice(version=4, saving=False, timeout_s=0.0)

# ------------------------------------------------------------------------------------- the codec


@pytest.mark.parametrize("notice", [STARTS, ENDS, SaveNotice(version=0, saving=True, timeout_s=0.25)])
def test_a_save_notice_round_trips(notice: SaveNotice) -> None:
    frames = encode(notice)
    assert len(frames) == 1 and msgpack.unpackb(frames[0])["t"] == int(MsgType.SAVE) == 6
    assert decode(frames) == notice


def header_with(**changes: Any) -> list[bytes]:
    header = msgpack.unpackb(encode(STARTS)[0])
    for key, value in changes.items():
        if value is ...:
            del header[key]
        else:
            header[key] = value
    return [msgpack.packb(header)]


MALFORMED: dict[str, tuple[list[Any], str]] = {
    "saving as an int": (header_with(saving=1), "bad_field"),
    "saving missing": (header_with(saving=...), "missing_field"),
    "bound as an int": (header_with(timeout_s=1800), "bad_field"),
    "NaN bound": (header_with(timeout_s=float("nan")), "bad_field"),
    "infinite bound": (header_with(timeout_s=float("inf")), "bad_field"),
    "negative bound": (header_with(timeout_s=-1.0), "bad_field"),
    "a save without a bound": (header_with(timeout_s=0.0), "bad_field"),
    "an end with a bound": (header_with(saving=False), "bad_field"),
    "version missing": (header_with(version=...), "missing_field"),
    "negative version": (header_with(version=-1), "bad_field"),
    "version as a bool": (header_with(version=True), "bad_field"),
    "an array frame": ([msgpack.packb({**msgpack.unpackb(encode(STARTS)[0]), "a": [["int32", [1]]]}), b"\0" * 4],
                       "frame_count"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_save_notice_is_a_wire_error(case: str) -> None:
    frames, reason = MALFORMED[case]
    with pytest.raises(WireError) as raised:
        decode(frames)
    assert raised.value.reason == reason, raised.value


def test_only_the_downstream_channel_takes_a_save_notice() -> None:
    assert SaveNotice in DOWNSTREAM_TYPES and SaveNotice not in UPSTREAM_TYPES


# ------------------------------------------------------------------------ every weight backend


def zmq_pair(tmp_path, named) -> tuple[Any, Any, ListPublisher, ListSubscriber]:
    publisher, subscriber = ListPublisher(), ListSubscriber([])
    return (ZmqWeightSender(publisher, spec_of(named), 4096, torch.float32), ZmqWeightReceiver(subscriber),
            publisher, subscriber)


def shm_pair(tmp_path, named) -> tuple[Any, Any, ListPublisher, ListSubscriber]:
    publisher, subscriber = ListPublisher(), ListSubscriber([])
    sender = ShmWeightSender(publisher, spec_of(named), torch.float32, str(tmp_path))
    receiver = ShmWeightReceiver(subscriber, spec_of(named), torch.float32, timeout_s=5.0)
    receiver.join(sender.join_address())
    return sender, receiver, publisher, subscriber


def nccl_pair(tmp_path, named) -> tuple[Any, Any, ListPublisher, ListSubscriber]:
    # The weight group is not formed: a notice travels over the PUB socket alone.
    publisher, subscriber = ListPublisher(), ListSubscriber([])
    sender = nccl.NcclWeightSender(publisher, "model-dir", 1, torch.device("cpu"), host="127.0.0.1", timeout_s=5.0)
    return sender, nccl.NcclWeightReceiver(subscriber, "model-dir", torch.device("cpu"), timeout_s=5.0), publisher, subscriber


@pytest.mark.parametrize("make_pair", [zmq_pair, shm_pair, nccl_pair], ids=["zmq", "shm", "nccl"])
def test_every_backend_carries_the_notices_to_the_receivers_save_watch(make_pair, tmp_path, monkeypatch) -> None:
    named = model([(4,)])
    monkeypatch.setattr(nccl, "model_spec", lambda model_dir: spec_of(named))
    sender, receiver, publisher, subscriber = make_pair(tmp_path, named)
    try:
        sender.announce(STARTS)
        subscriber.messages.extend(publisher.messages)
        assert receiver.poll(0.0) is False  # no weights, no stop: nothing for the loop to load
        assert receiver.saves.notice == STARTS and receiver.shutdown_reason is None
        assert receiver.rejections()[0] == 0
        sender.announce(ENDS)
        subscriber.messages.extend(publisher.messages[1:])
        receiver.poll(0.0)
        assert receiver.saves.notice is None and receiver.saves.ended == STARTS
    finally:
        receiver.close()
        sender.close()


# ------------------------------------------------------------------------------ the SaveWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_without_a_notice_a_wait_has_its_own_timeout() -> None:
    watch = SaveWatch(Clock())
    assert watch.deadline(started=100.0, timeout_s=8.0) == 108.0
    assert watch.until == -math.inf and watch.describe() == ""


def test_a_notice_extends_a_wait_to_its_bound_and_its_end_gives_the_timeout_again_from_there() -> None:
    clock = Clock()
    watch = SaveWatch(clock)
    clock.now = 102.0
    watch.note(SaveNotice(3, saving=True, timeout_s=60.0))
    assert watch.deadline(started=100.0, timeout_s=8.0) == 162.0  # announced at 102, bound 60 s
    assert "checkpoint save of version 3" in watch.describe() and "has not ended" in watch.describe()
    clock.now = 130.0
    watch.note(SaveNotice(3, saving=False, timeout_s=0.0))
    assert watch.notice is None and watch.deadline(started=100.0, timeout_s=8.0) == 138.0
    assert watch.describe() == "learner rank 0's checkpoint save of version 3 ended 0 s ago"
    # A wait that starts long after the save is not affected by it.
    assert watch.deadline(started=500.0, timeout_s=8.0) == 508.0


def test_newer_weights_end_a_save_whose_end_notice_was_lost_but_its_own_version_does_not() -> None:
    clock = Clock()
    watch = SaveWatch(clock)
    watch.note(SaveNotice(3, saving=True, timeout_s=60.0))
    watch.weights_loaded(3)  # pushed just before the save: the save is still running
    assert watch.notice is not None
    clock.now = 110.0
    watch.weights_loaded(4)
    assert watch.notice is None and watch.ended_at == 110.0


def test_an_older_notice_neither_replaces_nor_ends_a_newer_save() -> None:
    watch = SaveWatch(Clock())
    watch.note(SaveNotice(5, saving=True, timeout_s=60.0))
    watch.note(SaveNotice(4, saving=True, timeout_s=1.0))
    watch.note(SaveNotice(4, saving=False, timeout_s=0.0))
    assert watch.notice == SaveNotice(5, saving=True, timeout_s=60.0)
    watch.note(SaveNotice(6, saving=False, timeout_s=0.0))  # a later end covers it
    assert watch.notice is None


# ----------------------------------------------------------------- the driver's and ranks' waits


def test_what_may_wait_on_a_save_allows_checkpoint_timeout_s() -> None:
    from asyncgrpo.config import load
    from asyncgrpo.composition import collective_timeout_s, learner_wait_timeout_s, save_wait_timeout_s, steps_wait_timeout_s

    periodic = load(["wire.timeout_s=10", "train.save_every_steps=5", "train.checkpoint_timeout_s=900"])
    base = learner_wait_timeout_s(periodic)
    assert steps_wait_timeout_s(periodic) == base + 900  # a periodic save runs inside train_steps
    assert save_wait_timeout_s(periodic) == base + 2 * 900  # the interrupt's save, after that call
    assert collective_timeout_s(periodic) == base + max(periodic.wire.startup_timeout_s, 900)
    never = load(["wire.timeout_s=10", "train.checkpoint_on_interrupt=false", "rollout.max_restarts=0"])
    assert steps_wait_timeout_s(never) == collective_timeout_s(never) == learner_wait_timeout_s(never)
