"""Weight pushes through shared memory (weights.backend=shm): exact round trips, the seqlock that
catches a slot rewritten mid-load, the layout fingerprint, clean-up; in-process publisher and
subscriber lists, real files in a temporary directory."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_weights_zmq import ListPublisher, ListSubscriber, Target, model, spec_of

from asyncgrpo.config import load
from asyncgrpo.weights.shm import NUM_SLOTS, ShmWeightReceiver, ShmWeightSender, layout
from asyncgrpo.composition import weights_backend


@pytest.fixture
def pair(tmp_path):
    """A sender and a joined receiver over one model's tensor list; the sender is closed after."""
    named = model([(300, 17), (5,), (2, 3, 4)])
    publisher = ListPublisher()
    sender = ShmWeightSender(publisher, spec_of(named), torch.float32, str(tmp_path))
    subscriber = ListSubscriber([])
    receiver = ShmWeightReceiver(subscriber, spec_of(named), torch.float32, timeout_s=5.0)
    receiver.join(sender.join_address())
    yield named, publisher, sender, subscriber, receiver
    receiver.close()
    sender.close()


def deliver(publisher: ListPublisher, subscriber: ListSubscriber) -> None:
    subscriber.messages.extend(publisher.messages)
    publisher.messages.clear()


def test_a_push_arrives_exactly_and_only_the_announcement_crosses_the_socket(pair):
    named, publisher, sender, subscriber, receiver = pair
    assert sender.push(1, iter(named)) == sum(t.numel() * 4 for _, t in named)
    assert sum(m.tensors[0].nbytes for m in publisher.messages) < 100  # slot and fingerprint only
    deliver(publisher, subscriber)
    assert receiver.poll(0.0)
    target = Target()
    assert receiver.apply_newest(target) == 1
    for name, tensor in named:
        assert torch.equal(target.loaded[name], tensor)


def test_bfloat16_slots_hold_half_the_bytes_and_round_like_the_engine(tmp_path):
    named = model([(64, 8)])
    assert layout(spec_of(named), torch.bfloat16)[1] == layout(spec_of(named), torch.float32)[1] // 2
    publisher = ListPublisher()
    sender = ShmWeightSender(publisher, spec_of(named), torch.bfloat16, str(tmp_path))
    receiver = ShmWeightReceiver(ListSubscriber([]), spec_of(named), torch.bfloat16, timeout_s=5.0)
    receiver.join(sender.join_address())
    sender.push(3, iter(named))
    receiver.subscriber.messages.extend(publisher.messages)
    receiver.poll(0.0)
    target = Target()
    assert receiver.apply_newest(target) == 3
    assert torch.equal(target.loaded["layer0.weight"], named[0][1].to(torch.bfloat16))
    receiver.close()
    sender.close()


def test_only_the_newest_announced_version_is_loaded(pair):
    named, publisher, sender, subscriber, receiver = pair
    for version in (1, 2):
        sender.push(version, iter([(n, t + version) for n, t in named]))
    deliver(publisher, subscriber)
    receiver.poll(0.0)
    target = Target()
    assert receiver.apply_newest(target) == 2
    assert torch.equal(target.loaded["layer1.weight"], named[1][1] + 2)
    assert receiver.apply_newest(target) is None


class RewritingTarget(Target):
    """Loads; during the first load the learner pushes `versions` (as if the engine were slow)."""

    def __init__(self, sender, named, versions: list[int], publisher, subscriber) -> None:
        super().__init__()
        self.sender, self.named, self.pending = sender, named, list(versions)
        self.publisher, self.subscriber = publisher, subscriber

    def load_weights(self, named_tensors) -> None:
        named_tensors = list(named_tensors)
        for version in self.pending:
            self.sender.push(version, iter([(n, t + version) for n, t in self.named]))
        self.pending = []
        deliver(self.publisher, self.subscriber)
        super().load_weights(named_tensors)


def test_a_slot_rewritten_mid_load_is_detected_and_the_newest_version_reloaded(pair):
    named, publisher, sender, subscriber, receiver = pair
    sender.push(1, iter([(n, t + 1) for n, t in named]))
    deliver(publisher, subscriber)
    receiver.poll(0.0)
    # While version 1 loads, the learner pushes 2 (other slot) and 3 (over version 1's slot).
    target = RewritingTarget(sender, named, [2, 3], publisher, subscriber)
    assert receiver.apply_newest(target) == 3
    assert receiver.torn_loads == 1
    for name, tensor in named:
        assert torch.equal(target.loaded[name], tensor + 3)


def test_a_load_into_the_other_slot_is_not_torn(pair):
    named, publisher, sender, subscriber, receiver = pair
    sender.push(1, iter(named))
    deliver(publisher, subscriber)
    receiver.poll(0.0)
    target = RewritingTarget(sender, named, [2], publisher, subscriber)  # version 2 goes to the other slot
    assert receiver.apply_newest(target) == 1
    assert receiver.torn_loads == 0
    assert torch.equal(target.loaded["layer0.weight"], named[0][1])


def test_a_different_tensor_layout_is_rejected_and_counted(tmp_path):
    named = model([(4, 4)])
    publisher = ListPublisher()
    sender = ShmWeightSender(publisher, spec_of(named), torch.float32, str(tmp_path))
    other = model([(4, 4), (2,)])
    receiver = ShmWeightReceiver(ListSubscriber([]), spec_of(other), torch.float32, timeout_s=5.0)
    with pytest.raises(ValueError, match="different model directories"):
        receiver.join(sender.join_address())
    sender.push(1, iter(named))
    receiver.subscriber.messages.extend(publisher.messages)
    assert not receiver.poll(0.0)
    assert receiver.rejections()[0] == 1
    assert "different tensor layout" in receiver.rejections()[1]
    sender.close()


def test_a_push_that_does_not_match_the_model_is_refused(pair):
    named, _, sender, _, _ = pair
    with pytest.raises(ValueError, match="where the model has"):
        sender.push(1, iter(reversed(named)))
    with pytest.raises(ValueError, match="2 tensors where the model has 3"):
        sender.push(1, iter(named[:2]))


def test_close_removes_the_slot_files(tmp_path):
    sender = ShmWeightSender(ListPublisher(), spec_of(model([(8,)])), torch.float32, str(tmp_path))
    paths = sender.join_address()["shm_paths"]
    assert len(paths) == NUM_SLOTS and all(os.path.isfile(p) for p in paths)
    assert oct(os.stat(paths[0]).st_mode & 0o777) == "0o600"  # only this user's processes may read the weights
    sender.close()
    assert not any(os.path.exists(p) for p in paths)
    assert not os.listdir(tmp_path)


def test_too_little_room_for_the_slots_is_one_clear_error(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1, 0, 1))
    with pytest.raises(ValueError, match="weights.shm_dir or weights.backend=zmq"):
        ShmWeightSender(ListPublisher(), spec_of(model([(1024,)])), torch.float32, str(tmp_path))


@pytest.mark.parametrize(("overrides", "backend"), [
    ([], "shm"),  # loopback host: one node, ipc
    (["wire.transport=tcp"], "zmq"),
    (["weights.backend=zmq"], "zmq"),
    (["wire.host=10.0.0.1"], "zmq"),
])
def test_backend_auto_is_shared_memory_only_when_the_wire_stays_on_this_node(overrides, backend):
    assert weights_backend(load(overrides)) == backend


def test_announcements_carry_the_slot_and_fingerprint_as_int64(pair):
    named, publisher, sender, _, _ = pair
    sender.push(2, iter(named))
    body = publisher.messages[0].tensors[0]
    assert body.dtype == np.int64 and body[0] == 2 % NUM_SLOTS


def test_a_generator_that_joins_late_finds_the_newest_version_in_the_slots(pair):
    # A restarted generator subscribes after the announcements went out: the slots say what they hold.
    named, publisher, sender, _, _ = pair
    for version in (1, 2):
        sender.push(version, iter([(n, t + version) for n, t in named]))
    late = ShmWeightReceiver(ListSubscriber([]), spec_of(named), torch.float32, timeout_s=5.0)
    late.join(sender.join_address())
    target = Target()
    assert late.apply_newest(target) == 2
    assert all(torch.equal(target.loaded[n], t + 2) for n, t in named)
    # The re-announcement is for a subscriber that came up late: a generator holding it skips it.
    publisher.messages.clear()
    sender.republish()
    late.subscriber.messages.extend(publisher.messages)
    assert not late.poll(0.0) and late.apply_newest(target) is None
    late.close()


def test_a_republish_before_any_push_sends_nothing(pair):
    _, publisher, sender, _, _ = pair
    sender.republish()
    assert publisher.messages == []


def test_slots_of_a_sender_never_closed_are_removed_when_its_process_exits(tmp_path):
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_weights_zmq import ListPublisher\n"
        "from asyncgrpo.weights.shm import ShmWeightSender\n"
        "sender = ShmWeightSender(ListPublisher(), [('w', (8,), torch.float32)], torch.float32, sys.argv[1])\n"
        "print(sender.directory)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path), os.path.dirname(__file__)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    directory = result.stdout.strip().splitlines()[-1]
    assert directory.startswith(str(tmp_path)) and not os.path.exists(directory)


def _dead_pid() -> int:
    """A pid no process has now: a child that has exited and been reaped."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_start_removes_only_this_users_slots_of_dead_runs(tmp_path):
    from asyncgrpo.runtime.files import process_start_time
    from asyncgrpo.weights.shm import SLOT_DIR_PREFIX, remove_stale_slots

    me = os.getpid()
    dead = tmp_path / f"{SLOT_DIR_PREFIX}{_dead_pid()}-12345-abc"
    alive = tmp_path / f"{SLOT_DIR_PREFIX}{me}-{process_start_time(me)}-def"
    reused = tmp_path / f"{SLOT_DIR_PREFIX}{me}-{process_start_time(me) + 1}-ghi"  # our pid, another process's start
    others = tmp_path / f"{SLOT_DIR_PREFIX}{_dead_pid()}-12345-jkl"
    unnamed = tmp_path / f"{SLOT_DIR_PREFIX}oldstyle"  # an older run's name records no process: left alone
    for directory in (dead, alive, reused, others, unnamed):
        directory.mkdir()
        (directory / "slot0").write_bytes(b"\0" * 64)
    if os.geteuid() == 0:
        os.chown(others, 4242, 4242)
    removed = remove_stale_slots(str(tmp_path))
    assert sorted(removed) == sorted([str(dead), str(reused)] + ([] if os.geteuid() == 0 else [str(others)]))
    assert not dead.exists() and not reused.exists()
    assert alive.exists() and unnamed.exists() and (others.exists() or os.geteuid() != 0)


def test_a_senders_slot_directory_names_its_process_so_a_later_start_can_tell_it_is_alive(tmp_path):
    from asyncgrpo.weights.shm import remove_stale_slots

    sender = ShmWeightSender(ListPublisher(), spec_of(model([(8,)])), torch.float32, str(tmp_path))
    try:
        assert os.path.basename(sender.directory).startswith(f"asyncgrpo-weights-{os.getpid()}-")
        assert remove_stale_slots(str(tmp_path)) == []
        assert os.path.isdir(sender.directory)
    finally:
        sender.close()


def test_shm_is_refused_in_one_line_off_x86_64_and_auto_picks_zmq(tmp_path, monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(ValueError, match="x86-64 memory ordering .* aarch64 .* use weights.backend=zmq") as caught:
        ShmWeightSender(ListPublisher(), spec_of(model([(8,)])), torch.float32, str(tmp_path))
    assert "\n" not in str(caught.value) and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="use weights.backend=zmq"):
        ShmWeightReceiver(ListSubscriber([]), spec_of(model([(8,)])), torch.float32, timeout_s=1.0)
    assert weights_backend(load([])) == "zmq"
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert weights_backend(load([])) == "shm"
