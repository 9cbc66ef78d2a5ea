"""tools/soak.py: its pure parts (the kill schedule, the noise bound, the queue identity, the
sent = received + lost ledger, the command line), without running anything."""

from __future__ import annotations

import json

import pytest
from tools import soak

Consumed = soak.chaos.Consumed

GOOD_QUEUE = {"queue/received": 100, "queue/consumed": 80, "queue/dropped_stale": 3, "queue/dropped_unheld": 12,
              "queue/depth": 5}


# ------------------------------------------------------------------------------ kill schedule


def test_the_schedule_kills_every_interval_and_none_within_the_margin_of_the_end():
    assert soak.kill_schedule(30, 5) == [300, 600, 900, 1200, 1500]  # not at 1800: the bound itself
    assert soak.kill_schedule(1.5, 0.5) == [30.0, 60.0]  # 90 s is within 20 s of the end
    assert soak.kill_schedule(1.5, 0.5, end_margin_s=0) == [30.0, 60.0, 90.0]


def test_no_kill_is_scheduled_when_the_interval_is_longer_than_the_run():
    assert soak.kill_schedule(4, 5) == []


def test_a_kill_is_due_at_its_time_and_never_past_the_cutoff():
    schedule = [30.0, 60.0]
    assert not soak.kill_due(schedule, 0, 29.9, cutoff_s=70)
    assert soak.kill_due(schedule, 0, 30.0, cutoff_s=70)
    assert soak.kill_due(schedule, 1, 65.0, cutoff_s=70)  # late (a restart was under way): still due
    assert not soak.kill_due(schedule, 1, 70.5, cutoff_s=70)
    assert not soak.kill_due(schedule, 2, 100.0, cutoff_s=200)  # all done


# -------------------------------------------------------------------------------- the noise


def test_within_noise_is_two_standard_errors_of_a_difference_of_proportions():
    # sqrt(0.5 * 0.5 / 100 + 0.4 * 0.6 / 100) = sqrt(0.0049) = 0.07
    ok, diff, bound = soak.within_noise(0.5, 0.4, 100)
    assert ok and diff == pytest.approx(0.1) and bound == pytest.approx(0.14)
    # sqrt(0.8 * 0.2 / 500 + 0.76 * 0.24 / 500) = sqrt(0.0006848) = 0.026169
    ok, diff, bound = soak.within_noise(0.76, 0.8, 500)
    assert ok and diff == pytest.approx(-0.04) and bound == pytest.approx(0.052338, abs=1e-6)


def test_a_difference_beyond_two_standard_errors_is_not_noise():
    # sqrt(0.25 / 100 + 0.21 / 100) = 0.067823: bound 0.135647 < 0.2
    ok, diff, bound = soak.within_noise(0.5, 0.3, 100)
    assert not ok and diff == pytest.approx(0.2) and bound == pytest.approx(0.135647, abs=1e-6)
    assert not soak.within_noise(0.3, 0.5, 100)[0]  # either direction


def test_identical_certain_accuracies_are_within_noise_and_different_ones_are_not():
    assert soak.within_noise(1.0, 1.0, 500) == (True, 0.0, 0.0)
    assert not soak.within_noise(1.0, 0.0, 500)[0]


def test_one_reference_is_compared_with_the_evaluations_sampling_noise_only():
    assert soak.within_references(0.5, [0.4], 100) == soak.within_noise(0.5, 0.4, 100)


def test_the_references_spread_widens_the_bound_to_a_prediction_interval():
    # mean 0.6, s = 0.1, K = 3: t_0.975(2) x 0.1 x sqrt(4/3) = 4.303 x 0.11547 = 0.49687
    ok, diff, bound = soak.within_references(0.69, [0.5, 0.6, 0.7], 500)
    assert ok and diff == pytest.approx(0.09) and bound == pytest.approx(0.49687, abs=1e-4)
    # the first full soak's pair, 0.694 against 0.548 alone, is beyond the evaluation's noise
    assert not soak.within_references(0.694, [0.548], 500)[0]


def test_references_that_agree_leave_the_evaluations_noise_as_the_bound_and_catch_a_shift():
    ok, diff, bound = soak.within_references(0.4, [0.6, 0.6, 0.6], 500)
    assert bound == pytest.approx(soak.within_noise(0.4, 0.6, 500)[2]) and not ok and diff == pytest.approx(-0.2)


def test_more_references_narrow_the_interval_for_the_same_spread():
    few = soak.within_references(0.6, [0.5, 0.7], 10_000)[2]
    many = soak.within_references(0.6, [0.5, 0.7] * 5, 10_000)[2]
    assert many < few


def test_the_t_quantiles_fall_toward_the_normals():
    assert soak.t_975(1) == pytest.approx(12.706) and soak.t_975(4) == pytest.approx(2.776)
    assert all(a > b for a, b in zip(soak.T_975, soak.T_975[1:])) and soak.t_975(100) == 1.96


def test_no_reference_is_an_error():
    with pytest.raises(ValueError):
        soak.within_references(0.5, [], 100)


def phase_with(name: str, start: float | None, end: float | None) -> object:
    return soak.Phase(name, [], figures={"accuracy_start": start, "accuracy_end": end, "eval_size": 500})


def test_the_comparison_takes_the_start_from_the_same_seed_and_the_end_from_every_reference():
    disturbed = phase_with("disturbed", 0.014, 0.694)
    references = [phase_with("undisturbed", 0.014, 0.548), phase_with("undisturbed_seed1", 0.02, 0.70),
                  phase_with("undisturbed_seed2", 0.01, 0.62)]
    (same_start, ok), (within, text) = soak.compare(disturbed, references)
    assert same_start and within and "3 undisturbed runs" in text
    (same_start, _), (within, _) = soak.compare(disturbed, references[:1])
    assert same_start and not within
    (same_start, _), _ = soak.compare(phase_with("disturbed", 0.02, 0.6), references)
    assert not same_start  # the start is compared with the run of the same seed, not another's


def test_a_reference_without_its_accuracies_fails_the_comparison_naming_it():
    checks = soak.compare(phase_with("disturbed", 0.0, 0.5), [phase_with("undisturbed", 0.0, 0.5),
                                                              phase_with("undisturbed_seed1", 0.0, None)])
    assert checks == [(False, checks[0][1])] and "undisturbed_seed1" in checks[0][1]


def test_the_references_are_named_by_seed_after_the_first():
    assert [soak.reference_name(k, 4) for k in range(3)] == ["undisturbed", "undisturbed_seed5", "undisturbed_seed6"]


# --------------------------------------------------------------------------- queue identity


def test_the_queue_identity_holds_when_every_received_group_is_accounted_for():
    ok, text = soak.queue_identity(GOOD_QUEUE)
    assert ok and text.startswith("received 100 == consumed 80")


@pytest.mark.parametrize("key", soak.QUEUE_TERMS)
def test_the_queue_identity_breaks_when_any_term_is_off_by_one(key):
    ok, text = soak.queue_identity({**GOOD_QUEUE, key: GOOD_QUEUE[key] + 1})
    assert not ok and "received 100 !=" in text


def test_a_record_without_the_queue_counters_fails_the_identity_naming_them():
    ok, text = soak.queue_identity({"queue/received": 5, "queue/consumed": 5})
    assert not ok and "queue/depth" in text and "queue/dropped_unheld" in text


# ------------------------------------------------------------------ sent = received + lost


def test_sent_is_received_plus_lost_plus_a_tail_in_flight_within_the_lead():
    # Last incarnation sent 100; of the 120 received, 40 were a replaced incarnation's: 80 + 0 lost + 20 in flight.
    ok, in_flight, text = soak.sent_received_lost(100, received=120, lost=0, replaced_received=40, replaced_lost=0,
                                                  lead=48)
    assert ok and in_flight == 20 and "in flight at the shutdown 20" in text


def test_lost_groups_of_the_last_incarnation_count_against_what_it_sent():
    ok, in_flight, _ = soak.sent_received_lost(100, received=75, lost=5, replaced_received=0, replaced_lost=0,
                                               lead=48)
    assert ok and in_flight == 20


def test_more_received_than_sent_breaks_the_ledger():
    # A replaced incarnation's groups taken for the last one's (received that nobody sent) is negative in flight.
    ok, in_flight, _ = soak.sent_received_lost(100, received=150, lost=0, replaced_received=40, replaced_lost=0,
                                               lead=48)
    assert not ok and in_flight == -10


def test_sent_groups_neither_received_nor_counted_lost_beyond_the_lead_break_the_ledger():
    ok, in_flight, _ = soak.sent_received_lost(200, received=100, lost=0, replaced_received=0, replaced_lost=0,
                                               lead=48)
    assert not ok and in_flight == 100


def test_incarnations_count_each_processes_trained_groups_and_its_gaps():
    def group(incarnation, seq):
        return Consumed(run=0, version=0, generator=0, incarnation=incarnation, seq=seq, pos=seq,
                        prompt_id=seq, version_min=0)

    records = [group(0, s) for s in (0, 1, 2, 4)] + [group(1, s) for s in range(3)]
    assert soak.incarnations(records) == {(0, 0): soak.Incarnation(consumed=4, max_seq=4, gaps=1),
                                          (0, 1): soak.Incarnation(consumed=3, max_seq=2, gaps=0)}


def test_the_sent_check_takes_the_replaced_incarnations_from_the_recording():
    def group(incarnation, seq):
        return Consumed(run=0, version=0, generator=0, incarnation=incarnation, seq=seq, pos=seq,
                        prompt_id=seq, version_min=0)

    # Incarnation 0 (killed) trained 30 groups (what it queued kept its slots); incarnation 1 (the last,
    # restarts=1) trained 50 and sent 60: 10 in flight.
    records = [group(0, s) for s in range(30)] + [group(1, s) for s in range(50)]
    summary = {"generators": [{"gen/groups_sent": 60, "restarts": 1}],
               "learner": {"queue/received": 80, "queue/lost": 0}}
    ok, in_flight, _ = soak.sent_check(summary, records, lead=48)
    assert ok and in_flight == 10
    assert not soak.sent_check({**summary, "generators": []}, records, lead=48)[0]


# ------------------------------------------------------------------------------ command line


def test_the_command_line_defaults_to_thirty_minutes_a_kill_every_five():
    args = soak.parse_args([])
    assert (args.minutes, args.kill_every_minutes, args.seed, args.keep, args.out, args.overrides) == (
        30.0, 5.0, 0, False, "", [])
    assert args.references == 3


def test_the_command_line_takes_fractional_minutes_and_passes_overrides_through():
    args = soak.parse_args(["--minutes", "1.5", "--kill-every-minutes", "0.5", "--seed", "3", "--keep",
                            "--out", "/tmp/x", "rollout.num_generators=2", "train.max_staleness=1"])
    assert (args.minutes, args.kill_every_minutes, args.seed, args.keep, args.out) == (1.5, 0.5, 3, True, "/tmp/x")
    assert args.overrides == ["rollout.num_generators=2", "train.max_staleness=1"]


@pytest.mark.parametrize("argv", [
    ["train.max_steps=10"],  # the soak sets the steps and the time bound itself
    ["+seed=1"],
    ["rollout.max_restarts=9"],
    ["not_an_override"],
    ["learner.lr_schedule=cosine"],  # tied to train.max_steps: the two runs would differ
    ["--minutes", "0"],
    ["--kill-every-minutes", "-1"],
    ["--references", "0"],
    ["--minutes", "inf"],  # kill_schedule would never end
    ["--minutes", "nan"],
    ["--kill-every-minutes", "inf"],
    ["--kill-every-minutes", "1e-9"],  # rounds to 0 s
    ["--minutes", "5", "--kill-every-minutes", "5"],  # no kill: nothing disturbed, a meaningless PASS
    ["--minutes", "1e12", "--kill-every-minutes", "0.02"],  # billions of kills
])
def test_the_command_line_refuses_what_the_soak_controls_or_cannot_compare(argv):
    with pytest.raises(SystemExit) as exit_info:
        soak.parse_args(argv)
    assert exit_info.value.code == 2


def test_a_constant_learning_rate_schedule_may_be_named():
    assert soak.parse_args(["learner.lr_schedule=constant"]).overrides == ["learner.lr_schedule=constant"]


# ------------------------------------------------------------------------------------ watch


def test_the_watch_reads_only_new_complete_lines_and_flags_staleness_and_identity(tmp_path):
    path = tmp_path / "metrics.jsonl"
    watch = soak.Watch(path, bound=2)

    def step(n, staleness, **queue):
        return json.dumps({"loss/pg": 0.0, "step": n, "staleness/max": staleness, "time/wall_s": 1.0,
                           **GOOD_QUEUE, **queue}) + "\n"

    path.write_text(step(1, 0) + '{"eval/accuracy": 0.5}\n' + step(2, 2)[:20])  # the last line half-written
    watch.poll()
    assert (watch.step_records, watch.last_step, watch.started is not None) == (1, 1, True)
    with path.open("a") as file:
        file.write(step(2, 2)[20:] + step(3, 3) + step(4, 1, **{"queue/depth": 6}))
    watch.poll()
    assert (watch.step_records, watch.last_step, watch.staleness_max) == (4, 4, 3)
    assert watch.stale_steps == [3]
    assert len(watch.identity_breaks) == 1 and watch.identity_breaks[0].startswith("step 4:")
