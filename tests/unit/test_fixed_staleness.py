"""train.fixed_staleness=k: the learner's delayed publication (asyncgrpo/learner/publication.py).
Once step v's groups are taken, before they train, it publishes version v + 1 - k's weights,
labelled v + 1 - k; at the end, the newest. The dispatcher's lower bound that goes with it is
tested in tests/unit/test_dispatch.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncgrpo.config import load
from asyncgrpo.learner.learner import Learner
from asyncgrpo.learner.parts import held_dtype, outside_sections, version_ring
from asyncgrpo.learner.publication import VersionPublisher, VersionRing
from asyncgrpo.driver.preflight import memory_estimate
from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.wire import VersionAck


class VersionedPolicy:
    """Weights that say which version they are: every entry holds the version number."""

    def __init__(self) -> None:
        self.version = 0

    def full_state_dict(self):
        yield "w", torch.full((3,), float(self.version))
        yield "step", torch.tensor([self.version], dtype=torch.int64)  # not floating: kept as it is


class Sender:
    bytes_pushed = 0

    def __init__(self) -> None:
        self.pushes: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.shutdowns: list[str] = []

    def push(self, version, named_tensors) -> int:
        tensors = dict(named_tensors)
        self.pushes.append((version, tensors))
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def shutdown(self, reason: str) -> None:
        self.shutdowns.append(reason)


def learner_with(k: int, *overrides: str) -> Learner:
    cfg = load([f"train.fixed_staleness={k}", "rollout.num_generators=1", "train.groups_per_step=2", *overrides])
    queue = ReplayQueue(None, 8, StalenessEviction(cfg.train.max_staleness, drop_stale=False), limits=None)
    return Learner(cfg, policy=VersionedPolicy(), model_dir="", pad_id=0, rank=0, world_size=1, source=queue,
                   registry=queue.registry, weights=Sender(), owns_process_group=False,
                   **outside_sections(cfg), ring=version_ring(cfg))


def advance(learner: Learner) -> int:
    """What train_on does after the optimizer step: the next version, then its push. Returns the
    bytes the step's metrics report."""
    learner.version += 1
    learner.policy.version = learner.version
    return learner.publisher.after_update(learner.version).get("perf/push_bytes", 0)


def take_and_train(learner: Learner) -> int:
    """One step's publishing as `Learner.step` does it: after the take, then the update and its
    push. Returns the bytes the step's metrics report."""
    learner.publisher.after_take(learner.version)
    return advance(learner)


def labels_and_contents(learner: Learner) -> list[tuple[int, float, int]]:
    return [(v, float(t["w"][0]), int(t["step"][0])) for v, t in learner.weights.pushes]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_take_of_step_v_publishes_the_weights_of_version_v_plus_1_minus_k_under_their_own_label(k):
    learner = learner_with(k)
    published = []
    for step in range(8):
        sent = take_and_train(learner)
        published.append(learner.publisher.pushed_version)
        assert (sent > 0) == (step + 1 - k >= 1)  # nothing during the warm-up
    # Step v's take publishes v + 1 - k (version 0 is the one the generators start from: not sent again).
    assert labels_and_contents(learner) == [(v + 1 - k, v + 1 - k, v + 1 - k) for v in range(k, 8)]
    assert published == [max(0, v + 1 - k) for v in range(8)]
    assert learner.publisher.ring.versions == list(range(9 - k, 9))  # k copies held, no more
    # The end of the run: the true newest weights, then Shutdown.
    learner.finish()
    assert labels_and_contents(learner)[-1] == (8, 8, 8)
    assert learner.publisher.pushed_version == 8 and learner.weights.shutdowns == ["training finished"]


@pytest.mark.parametrize("k", [1, 3])
def test_the_version_that_fills_the_next_step_is_published_before_this_step_trains(k):
    # So the generators sample step v + 1 while the learner trains step v (the overlap).
    learner = learner_with(k)
    learner.version = learner.publisher.pushed_version = learner.policy.version = 10
    learner.intake.wait_for_generators = lambda version: False  # no generators here
    learner.intake.take = lambda version: []  # the step's groups (none needed: training is faked)
    seen_while_training = []

    def train_on(groups, timer=None):
        seen_while_training.append((learner.version, learner.publisher.pushed_version))
        advance(learner)
        return {"perf/samples": 1, "perf/tokens": 1, "reward/all_equal_frac": 0.0}

    learner.train_on = train_on
    for _ in range(6):
        learner.step()
    # Step v trains with v + 1 - k published (the resumed run's first k - 1 steps: its own weights, 10).
    assert seen_while_training == [(v, max(10, v + 1 - k)) for v in range(10, 16)]


def test_the_held_copies_are_copies_not_views_of_the_live_weights():
    ring = VersionRing(1, torch.float32)
    live = torch.zeros(2)
    sent = []
    ring.hold(1, [("w", live)])
    live += 5  # the optimizer step changes the live tensor in place
    assert ring.publish(1, lambda v, named: sent.append((v, named)) or 8) == (1, 8)
    assert sent[0][1][0][1].tolist() == [0.0, 0.0]


def test_copies_are_held_in_the_dtype_the_weights_travel_in():
    assert held_dtype(load(["rollout.dtype=bfloat16"])) == torch.bfloat16
    assert held_dtype(load(["rollout.dtype=bfloat16", "weights.wire_dtype=float32"])) == torch.float32
    assert held_dtype(load(["rollout.dtype=bfloat16", "weights.backend=nccl"])) == torch.float32
    ring = VersionRing(1, torch.bfloat16)
    ring.hold(1, [("w", torch.tensor([1.0 + 2 ** -10])), ("i", torch.tensor([3]))])
    sent = []
    ring.publish(1, lambda v, n: sent.extend(n) or 1)
    (_, w), (_, i) = sent
    assert w.dtype == torch.bfloat16 and w.item() == 1.0  # rounded as the wire would round it
    assert i.dtype == torch.int64 and i.item() == 3


def test_a_skipped_version_fails_instead_of_publishing_a_hole():
    ring = VersionRing(2, torch.float32)
    ring.hold(1, [("w", torch.zeros(1))])
    with pytest.raises(RuntimeError, match="push every step"):
        ring.hold(3, [("w", torch.zeros(1))])


def test_a_resumed_learner_warms_up_again_from_the_checkpoint_version():
    learner = learner_with(2)
    learner.load_state_dict({"version": 10, "samples": 0, "staleness_histogram": {}, "ack_waits": 0, "idle_s": 0.0})
    learner.policy.version = 10  # the checkpoint's weights
    assert learner.publisher.pushed_version == 10  # the generators start from them
    for _ in range(4):
        take_and_train(learner)
    assert [v for v, *_ in labels_and_contents(learner)] == [11, 12]  # at the takes of steps 12 and 13


def test_fixed_staleness_zero_and_off_push_the_newest_weights_directly():
    for k in (0, -1):
        learner = learner_with(k)
        assert learner.publisher.ring is None
        advance(learner)
        assert labels_and_contents(learner) == [(1, 1, 1)]


def test_the_metrics_report_the_published_version_and_the_backlog_behind_it():
    learner = learner_with(2)
    for _ in range(5):
        take_and_train(learner)  # step 4's take published 3; version 5 now
    learner.source.put(VersionAck(0, 3))
    metrics = learner.intake.generator_metrics(learner.publisher.pushed_version)
    assert metrics["weights/published_version"] == 3 and metrics["weights/backlog"] == 0


def test_the_learner_waits_only_for_an_engine_more_than_max_backlog_versions_behind():
    from asyncgrpo.schema import ConfigError

    cfg = load(["rollout.num_generators=1", "train.groups_per_step=2",
                "train.max_staleness=1", "weights.max_backlog_versions=3", "wire.timeout_s=0.2"])
    queue = ReplayQueue(None, 8, StalenessEviction(1, drop_stale=False), limits=None)
    learner = Learner(cfg, policy=VersionedPolicy(), model_dir="", pad_id=0, rank=0, world_size=1, source=queue,
                      registry=queue.registry, weights=Sender(), owns_process_group=False,
                      **outside_sections(cfg))
    for _ in range(5):
        advance(learner)
    queue.put(VersionAck(0, 2))  # 3 behind version 5: past max_staleness, within the backlog
    learner._wait_for_generators()
    assert learner.ack_waits == 0
    learner.version += 1  # now 4 behind
    with pytest.raises(TimeoutError, match=r"load version >= 3 \(engine_lag_bound\(weights.max_backlog_versions, train.max_staleness\)=3\)"):
        learner._wait_for_generators()
    with pytest.raises(ConfigError, match="weights.max_backlog_versions must be >= 1"):
        load(["weights.max_backlog_versions=0"])


def test_the_engine_lag_the_learner_allows_is_never_below_what_the_bound_serves():
    from asyncgrpo.contract import engine_lag_bound

    assert engine_lag_bound(max_staleness=2, max_backlog_versions=4) == 4
    assert engine_lag_bound(max_staleness=8, max_backlog_versions=4) == 9  # an engine 5-9 behind still gets slots
    assert engine_lag_bound(max_staleness=0, max_backlog_versions=1) == 1


def test_config_sets_max_staleness_and_refuses_what_would_break_it():
    from asyncgrpo.schema import ConfigError

    assert load(["train.fixed_staleness=3"]).train.max_staleness == 3
    assert load(["train.fixed_staleness=3", "train.max_staleness=3"]).train.max_staleness == 3
    assert load(["train.fixed_staleness=-1", "train.max_staleness=4"]).train.max_staleness == 4
    for overrides, key in [(["train.max_staleness=2"], "train.max_staleness=2 contradicts"),
                           (["train.stale_policy=drop"], "train.stale_policy must throttle"),
                           (["weights.push_every_steps=2"], "weights.push_every_steps must be 1"),
                           (["rollout.inflight_updates=true"], "rollout.inflight_updates must be false")]:
        with pytest.raises(ConfigError, match=key):
            load(["train.fixed_staleness=3", *overrides])
    with pytest.raises(ConfigError, match="train.fixed_staleness must be -1"):
        load(["train.fixed_staleness=-2"])


def test_config_accepts_fixed_staleness_and_the_learner_builds_a_fixed_dispatcher():
    cfg = load(["train.fixed_staleness=2", "rollout.num_generators=2"])
    assert cfg.train.max_staleness == 2
    from asyncgrpo.learner.parts import make_dispatcher

    d = make_dispatcher(cfg, positions_end=None)
    assert d.fixed_staleness and d.max_staleness == 2 and d.throttle
    assert not make_dispatcher(load([]), positions_end=None).fixed_staleness


def test_preflight_counts_the_held_versions_on_rank_0():
    base = ["learner.micro_batch_tokens=1024", "device=cpu", "learner.world_size=2"]
    plain = memory_estimate(load(base), 10**8, 1000, 4 * 10**8, "zmq")
    held = memory_estimate(load([*base, "train.fixed_staleness=3"]), 10**8, 1000, 4 * 10**8, "zmq")
    assert held["held_versions_gib"] == pytest.approx(3 * 4 * 10**8 / 2**30)
    assert held["learner_rank_gib"] - plain["learner_rank_gib"] == pytest.approx(held["held_versions_gib"])
    assert held["total_gib"] - plain["total_gib"] == pytest.approx(held["held_versions_gib"])  # rank 0 alone


def test_a_rank_without_a_sender_takes_part_in_every_gather_under_delayed_publication():
    # Every rank iterates each gather (a collective under FSDP2); only rank 0 has a sender.
    class CountingPolicy(VersionedPolicy):
        taken = 0

        def full_state_dict(self):
            for item in super().full_state_dict():
                CountingPolicy.taken += 1
                yield item

    policy = CountingPolicy()
    publisher = VersionPublisher(policy, None, learner_with(2).publisher.publication, VersionRing(2, torch.float32))
    for version in range(1, 4):
        publisher.after_take(version - 1)
        assert publisher.after_update(version) == {"perf/push_bytes": 0}
    assert CountingPolicy.taken == 3 * 2 and publisher.ring.versions == []
    publisher.push_final(3)
    assert CountingPolicy.taken == 4 * 2


def test_under_delta_pushes_the_changed_fraction_is_reported_only_in_steps_that_sent():
    learner = learner_with(2)
    learner.publisher.publication = dataclasses.replace(learner.publisher.publication, delta=True)
    learner.weights.changed_fraction = 0.25
    reported = []
    for _ in range(4):
        learner.publisher.after_take(learner.version)
        learner.version += 1
        learner.policy.version = learner.version
        reported.append(learner.publisher.after_update(learner.version))
    assert reported == [{"perf/push_bytes": 0}, {"perf/push_bytes": 0}] + [
        {"perf/push_bytes": reported[2]["perf/push_bytes"], "perf/push_changed_frac": 0.25}] * 2
    assert reported[2]["perf/push_bytes"] > 0
