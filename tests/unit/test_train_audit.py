"""The trained-vs-sampled audit (asyncgrpo/queue/audit.py): the KS distance against hand-computed
values, the bounded reservoir, departure under a length-biased filter and none under an unbiased
one, and the accounting identity on a scripted stream through the replay queue."""

from __future__ import annotations

import random

import numpy as np
import pytest

from asyncgrpo.config import load
from asyncgrpo.driver.loop import note_audit_departure
from asyncgrpo.queue.audit import Reservoir, TrainAudit, departure, ks_distance, not_trained_total
from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.queue.replay_queue import GroupLimits, ReplayQueue, StalenessEviction
from asyncgrpo.queue.sources import QueueTimeout
from asyncgrpo.schema import ConfigError
from asyncgrpo.wire import Grant, Heartbeat, ScoredGroup, TicketRequest, example_group, holder_identity


def identity_holds(stats: dict[str, float]) -> bool:
    return stats["audit/sampled"] == stats["audit/trained"] + not_trained_total(stats) + stats["audit/queued"]


# ------------------------------------------------------------------------------- the statistics


def test_ks_distance_of_two_shifted_samples_is_the_hand_computed_one_half():
    # F_a - F_b at 1, 2, 3, 4, 5, 6: .25-0, .5-0, .75-.25, 1-.5, 1-.75, 1-1 -> the largest is 0.5.
    assert ks_distance([1, 2, 3, 4], [3, 4, 5, 6]) == pytest.approx(0.5)
    # Unequal sizes with ties: F_a(1) = 2/3 against F_b(1) = 1/4.
    assert ks_distance([1, 1, 2], [1, 2, 2, 2]) == pytest.approx(2 / 3 - 1 / 4)


def test_ks_distance_is_zero_for_equal_distributions_one_for_disjoint_and_zero_with_an_empty_side():
    assert ks_distance([3, 1, 2], [1, 2, 3, 1, 2, 3]) == 0.0
    assert ks_distance([1, 2], [5, 6, 7]) == 1.0
    assert ks_distance([], [1.0]) == 0.0


def test_a_reservoir_keeps_everything_below_its_size_and_a_uniform_sample_of_that_size_beyond():
    small = Reservoir(10, seed=0, columns=1)
    for i in range(7):
        small.add(i, [i])
    assert small.rows()[:, 0].tolist() == list(range(7))
    assert small.rows(leave_out=[3, 99])[:, 0].tolist() == [0, 1, 2, 4, 5, 6]
    big = Reservoir(500, seed=0, columns=1)
    for i in range(20_000):
        big.add(i, [i])
    rows = big.rows()[:, 0]
    assert len(rows) == 500 and big.seen == 20_000
    assert ks_distance(rows, np.arange(20_000)) < 0.1  # uniform over the stream, not its start
    assert big.rows(leave_out=[int(rows[0])])[:, 0].tolist() == rows[1:].tolist()  # keys follow replaced rows


def scored(seq: int, length: int, reward: float, version: int = 0, generator_id: int = 0) -> ScoredGroup:
    g = example_group(num_samples=2, tokens_per_sample=length, seed=seq)
    g.generator_id, g.incarnation, g.seq = generator_id, 0, seq
    g.versions[:] = version
    g.rewards[:] = [reward, 0.0]
    return g


def audited_run(keep) -> dict[str, float]:
    """400 groups of random lengths and rewards arrive; those `keep(group)` refuses are filtered,
    the others trained a step of 4 at a time."""
    rng = random.Random(0)
    audit = TrainAudit(reservoir_groups=4096)
    step: list[ScoredGroup] = []
    for seq in range(400):
        group = scored(seq, length=rng.randint(1, 40), reward=rng.random())
        audit.arrive(group)
        if keep(group):
            step.append(group)
        else:
            audit.settle("filtered")
        if len(step) == 4:
            audit.train(step, learner_version=audit.version + 1)
            step = []
    return audit.stats(step, lost=0, given_back=0)


def test_a_length_biased_filter_makes_the_trained_lengths_depart_and_the_summary_says_so():
    stats = audited_run(keep=lambda g: g.lengths.mean() <= 15)
    assert identity_holds(stats)
    assert stats["audit/ks_length"] > 0.3 and stats["audit/ks_reward"] < 0.1
    assert stats["audit/trained_length_p90"] <= 15 < stats["audit/sampled_length_p90"]
    message = departure(stats, max_ks=0.1, min_groups=100)
    assert message is not None and message.startswith("trained distribution departs from the sampled one")
    assert "completion length" in message and "reward" not in message.split("length (")[1]


def test_an_unbiased_filter_leaves_the_trained_distribution_where_the_sampled_one_is():
    stats = audited_run(keep=lambda g: g.seq % 2 == 0)  # every other group, whatever its length or reward
    assert identity_holds(stats)
    assert stats["audit/ks_length"] < 0.1 and stats["audit/ks_reward"] < 0.1
    assert departure(stats, max_ks=0.1, min_groups=100) is None


def test_no_departure_is_judged_before_the_minimum_of_trained_groups():
    stats = audited_run(keep=lambda g: g.lengths.mean() <= 15)
    assert departure(stats, max_ks=0.1, min_groups=int(stats["audit/trained"]) + 1) is None


def test_groups_still_queued_are_left_out_of_the_sampled_distribution_until_their_fate_is_known():
    audit = TrainAudit(reservoir_groups=4096)
    trained = [scored(seq, 3, 0.0) for seq in range(100)]
    queued = [scored(seq, 3, 1.0) for seq in range(100, 150)]  # the newest policy's, better groups
    for group in trained + queued:
        audit.arrive(group)
    audit.train(trained, learner_version=1)
    stats = audit.stats(queued, lost=0, given_back=0)
    assert stats["audit/ks_reward"] == 0.0 and stats["audit/sampled_reward_mean"] == 0.0
    assert identity_holds(stats) and stats["audit/queued"] == 50


def test_the_staleness_on_arrival_counts_from_the_newest_take_and_at_training_from_the_step():
    audit = TrainAudit(reservoir_groups=16)
    audit.arrive(scored(0, 3, 1.0, version=0))
    audit.train([scored(0, 3, 1.0, version=0)], learner_version=3)
    audit.arrive(scored(1, 3, 1.0, version=1))  # arrives while the learner is at 3: 2 versions old
    stats = audit.stats([], lost=0, given_back=0)
    assert (stats["audit/sampled_staleness_mean"], stats["audit/sampled_staleness_max"]) == (1.0, 2)
    assert (stats["audit/trained_staleness_mean"], stats["audit/trained_staleness_max"]) == (3.0, 3)


def test_the_driver_puts_the_departure_into_the_summarys_audit(capsys):
    summary = {"audit": audited_run(keep=lambda g: g.lengths.mean() <= 15)}
    assert note_audit_departure(summary, max_ks=0.1, min_groups=100) == summary["audit"]["departure"]
    assert "[audit] trained distribution departs" in capsys.readouterr().out
    assert note_audit_departure({}, max_ks=0.1, min_groups=100) is None  # no steps: nothing to say


# ------------------------------------------------------------------------------- the queue's accounting


class Grants:
    """Stands in for the GrantRouter: the last answer to each generator process."""

    def __init__(self) -> None:
        self.last: dict[bytes, Grant] = {}

    def send_to(self, identity: bytes, grant: Grant) -> bool:
        self.last[identity] = grant
        return True


class SignalByRewards:
    """algo.filter_groups' decision without its settings: a group whose rewards are all equal goes."""

    def keeps(self, group: ScoredGroup) -> bool:
        return bool(np.ptp(group.rewards) > 0)


class Generator:
    """One generator process on the in-process queue: asks for tickets, sends (or loses) groups."""

    def __init__(self, queue: ReplayQueue, grants: Grants, generator_id: int) -> None:
        self.queue, self.grants, self.id = queue, grants, generator_id
        self.request = self.newest_grant = self.seq = 0
        self.unsent: dict[int, int] = {}  # slot -> prompt position

    def ask(self, version: int, wanted: int, given_back: tuple[int, ...] = ()) -> list[int]:
        self.request += 1
        positions = [self.unsent.pop(slot) for slot in given_back]
        self.queue.put(TicketRequest(self.id, 0, self.request, version, wanted, self.newest_grant,
                                     sorted(self.unsent.values()), positions))
        answer = self.grants.last[holder_identity(self.id, 0)]
        if answer.slots:
            self.newest_grant = answer.grant
            self.unsent.update(zip(answer.slots, answer.positions))
        return list(answer.slots)

    def send(self, slot: int, version: int, *, samples: int = 2, equal: bool = False, lose: bool = False) -> None:
        g = example_group(num_samples=samples, tokens_per_sample=3, seed=slot)
        g.generator_id, g.incarnation, g.seq, g.pos = self.id, 0, self.seq, self.unsent.pop(slot)
        g.versions[:] = version
        g.rewards[:] = 1.0 if equal else np.arange(samples)
        self.seq += 1
        if not lose:
            self.queue.put(g)


def test_sampled_equals_trained_plus_every_reason_not_trained_plus_queued_on_a_scripted_stream():
    grants = Grants()
    # No throttle and max_staleness 0: a group sampled a version before its step comes stale.
    queue = ReplayQueue(None, 16, StalenessEviction(0, drop_stale=True),
                        limits=GroupLimits(vocab_size=32000, max_positions=4096, max_samples=2),
                        dispatcher=Dispatcher(4, 0, throttle=False, capacity_groups=16), grants=grants,
                        signal_filter=SignalByRewards(), audit=TrainAudit(reservoir_groups=64))
    g0, g1 = Generator(queue, grants, 0), Generator(queue, grants, 1)
    assert g0.ask(version=0, wanted=8) == list(range(8))
    for slot in range(4):
        g0.send(slot, version=0)
    g0.send(4, version=0, equal=True)  # filtered: all-equal rewards
    g0.send(5, version=0, samples=3)  # rejected: more samples than a prompt gets
    g0.send(6, version=0, lose=True)  # lost in transit: the next report shows it
    assert len(queue.take(4, learner_version=0, timeout_s=1)) == 4
    queue.put(Heartbeat(0, next_seq=g0.seq, version=0, groups_dropped=1))  # slot 7's rewards failed...
    assert sorted(g0.ask(version=0, wanted=4, given_back=(7,))) == [4, 5, 6, 7]  # ...and it gives it back
    for slot in (5, 6, 7):
        g0.send(slot, version=1)
    with pytest.raises(QueueTimeout):  # the learner is at version 1 from here on
        queue.take(4, learner_version=1, timeout_s=0.01)
    g0.send(4, version=0)  # arrives a version old: stale at step 1 under max_staleness 0
    with pytest.raises(QueueTimeout):
        queue.take(4, learner_version=1, timeout_s=0.01)
    assert g1.ask(version=1, wanted=2) == [4, 8]
    queue.generator_down(1)  # its slots go to the next asker; its late group is unheld
    g1.send(4, version=1)
    assert sorted(g0.ask(version=1, wanted=2)) == [4, 8]
    g0.send(4, version=1)
    assert len(queue.take(4, learner_version=1, timeout_s=1)) == 4
    g0.send(8, version=1)  # still queued
    stats = queue.stats()
    reasons = {reason: stats[f"audit/not_trained/{reason}"]
               for reason in ("dropped_stale", "unheld", "filtered", "rejected", "lost", "given_back")}
    assert reasons == dict.fromkeys(reasons, 1)
    assert (stats["audit/trained"], stats["audit/queued"], stats["audit/sampled"]) == (8, 1, 15)
    assert identity_holds(stats)
    assert stats["audit/trained_staleness_max"] == 0 and stats["audit/sampled_staleness_max"] == 1


def test_without_a_dispatcher_sequence_gaps_are_the_lost_groups_and_the_identity_still_holds():
    queue = ReplayQueue(None, 8, StalenessEviction(1, drop_stale=True), limits=None,
                        audit=TrainAudit(reservoir_groups=64))
    for seq, version in ((0, 0), (1, 0), (3, 0), (4, 1)):  # 2 never arrives
        queue.put(scored(seq, length=3, reward=1.0, version=version))
    queue.take(2, learner_version=0, timeout_s=1)
    queue.take(1, learner_version=2, timeout_s=1)  # group 3 is two versions old by now: dropped
    stats = queue.stats()
    assert (stats["audit/sampled"], stats["audit/trained"], stats["audit/queued"]) == (5, 3, 0)
    assert (stats["audit/not_trained/lost"], stats["audit/not_trained/dropped_stale"]) == (1, 1)
    assert identity_holds(stats)


def test_a_queue_without_an_audit_logs_no_audit_keys():
    queue = ReplayQueue(None, 4, StalenessEviction(1, drop_stale=True), limits=None)
    queue.put(scored(0, 3, 1.0))
    assert not [key for key in queue.stats() if key.startswith("audit/")]


@pytest.mark.parametrize("override", ["log.audit_max_ks=1.5", "log.audit_max_ks=-0.1", "log.audit_min_groups=-1",
                                      "log.audit_reservoir_groups=0"])
def test_a_bad_audit_setting_fails_in_one_line_naming_the_key(override):
    with pytest.raises(ConfigError) as err:
        load([override])
    assert override.split("=")[0] in str(err.value) and "\n" not in str(err.value)


def test_every_audit_key_of_a_step_and_of_the_summary_is_documented():
    from metrics_doc import METRICS_DOC, STEP_SECTION, SUMMARY_SECTION, section_keys, undocumented

    doc = METRICS_DOC.read_text()
    stats = audited_run(keep=lambda g: g.lengths.mean() <= 15)
    assert any(key.startswith("audit/not_trained/") for key in stats) and "audit/ks_length" in stats
    assert undocumented(stats.keys(), section_keys(doc, STEP_SECTION)) == []
    summary = {"audit": dict(stats)}
    note_audit_departure(summary, max_ks=0.1, min_groups=100)
    assert "audit" in section_keys(doc, SUMMARY_SECTION, "Top level")
    assert undocumented(summary["audit"].keys(), section_keys(doc, SUMMARY_SECTION, "audit")
                        | section_keys(doc, STEP_SECTION)) == []
