"""tools/chaos.py: the pure accounting of what a run trained (lost, duplicated, stale groups from the
recording) and of what it counted, without running anything."""

from __future__ import annotations

from tools import chaos

Consumed = chaos.Consumed


def taken(n: int, run: int = 0, generator: int = 0, incarnation: int = 0, first_seq: int = 0, first_pos: int = 0,
          version: int = 0, stale: int = 0) -> list:
    """n groups of one incarnation, numbered and positioned consecutively, each its own prompt."""
    return [Consumed(run=run, version=version, generator=generator, incarnation=incarnation, seq=first_seq + i,
                     pos=first_pos + i, prompt_id=1000 * generator + first_pos + i, version_min=version - stale)
            for i in range(n)]


def test_a_clean_stream_has_nothing_lost_or_duplicated():
    result = chaos.account(taken(32) + taken(32, generator=1, first_pos=32), epoch_size=100)
    assert (result.consumed, result.duplicates, result.seq_gaps, result.skipped) == (64, 0, 0, 0)


def test_a_missing_number_is_a_sequence_gap_and_a_skipped_prompt():
    records = taken(10)
    del records[4]
    result = chaos.account(records)
    assert (result.seq_gaps, result.skipped, result.duplicates) == (1, 1, 0)


def test_the_untrained_tail_is_not_counted_as_lost():
    # Groups sent after the last one trained (the run ended) leave no gap below it.
    assert chaos.account(taken(10)).skipped == 0


def test_a_restart_renumbers_from_zero_and_continues_the_prompts_without_duplicates():
    # Incarnation 0 trained positions 0..9; the newcomer, numbering from 0 again, is granted 10 on.
    records = taken(10) + taken(6, incarnation=1, first_pos=10)
    result = chaos.account(records)
    assert (result.duplicates, result.seq_gaps, result.skipped) == (0, 0, 0)


def test_a_replayed_sequence_number_is_a_duplicate():
    records = taken(5) + taken(1, first_seq=3, first_pos=5)
    result = chaos.account(records)
    assert (result.duplicate_seqs, result.duplicates) == (1, 1)


def test_a_prompt_position_trained_twice_is_a_duplicate_even_in_another_incarnation():
    # A restarted generator granted positions 8 and 9 again though they were trained.
    records = taken(10) + taken(4, incarnation=1, first_pos=8)
    result = chaos.account(records)
    assert (result.duplicate_prompts, result.duplicates, result.duplicate_seqs) == (2, 2, 0)


def test_the_same_prompt_twice_in_one_pass_of_the_stream_is_a_duplicate_but_not_in_the_next_pass():
    first = Consumed(0, 0, 0, 0, 0, pos=3, prompt_id=7, version_min=0)
    again_same_pass = Consumed(0, 0, 0, 0, 1, pos=5, prompt_id=7, version_min=0)
    next_pass = Consumed(0, 0, 0, 0, 2, pos=12, prompt_id=7, version_min=0)
    assert chaos.account([first, again_same_pass], epoch_size=10).duplicates == 1
    assert chaos.account([first, next_pass], epoch_size=10).duplicates == 0
    assert chaos.account([first, again_same_pass]).duplicates == 0  # no pass size: positions only


def test_a_resumed_run_numbers_again_but_its_records_are_its_own():
    # Run 0 trained positions 0..15 up to its checkpoint; run 1 (resumed) numbers from 0 at position 16.
    records = taken(16, run=0) + taken(16, run=1, first_pos=16, version=1)
    assert chaos.account(records).duplicates == 0
    # Had the resumed run restarted its prompts at 0, every prompt would have been trained twice.
    assert chaos.account(taken(16, run=0) + taken(16, run=1, version=1)).duplicate_prompts == 16


def test_staleness_is_the_take_version_minus_the_oldest_token_version():
    records = taken(4, version=5, stale=1) + taken(2, first_seq=4, first_pos=4, version=6, stale=3)
    assert chaos.account(records).staleness_max == 3


def test_counted_loss_sums_each_run_s_last_counters_and_every_step_s_reward_drops():
    run0 = [{"step": 1, "queue/lost": 1, "queue/dropped_stale": 0, "reward/groups_dropped": 2},
            {"step": 2, "queue/lost": 3, "queue/dropped_stale": 1, "wire/rejected": 2, "wire/rejected/bad_header": 1,
             "wire/rejected/too_long": 1, "reward/groups_dropped": 1}]
    run1 = [{"step": 3, "queue/lost": 2, "queue/dropped_stale": 1, "reward/groups_dropped": 0}]
    counted = chaos.counted_lost([run0, run1])
    assert (counted.lost_in_transit, counted.dropped_stale) == (5, 2)
    assert (counted.rejected, counted.rejected_limits, counted.reward_dropped) == (2, 1, 3)
    # A frame the codec rejected is already a gap in queue/lost; a group beyond the model's limits is not.
    assert counted.lost == 5 + 2 + 1 + 3


def test_the_lineage_keeps_a_run_s_steps_up_to_where_its_successor_resumed():
    run0 = [{"step": s} for s in range(1, 126)]  # killed at 125, its last checkpoint at 100
    run1 = [{"step": s} for s in range(101, 301)]
    kept = chaos.lineage([run0, run1], starts=[0, 100])
    assert [len(steps) for steps in kept] == [100, 200]
    assert kept[0][-1]["step"] == 100
    # A fresh start (no checkpoint to resume) keeps nothing of the run before it.
    assert chaos.lineage([run0, run1], starts=[0, 0])[0] == []


def test_a_recorded_step_belongs_to_the_last_run_that_started_at_or_before_it():
    starts = [0, 100, 100, 150]  # run 2 resumed from the same checkpoint as run 1, which had crashed early
    assert [chaos.run_of(v, starts) for v in (0, 99, 100, 149, 150, 300)] == [0, 0, 2, 2, 3, 3]


def test_positions_interleave_across_generators_and_a_position_twice_is_a_duplicate():
    # Generators 0 and 1 took positions 0,2,4,... and 1,3,5,... of the run's one stream.
    records = [Consumed(0, 0, i % 2, 0, i // 2, pos=i, prompt_id=i, version_min=0) for i in range(10)]
    assert chaos.account(records).skipped == 0
    again = records + [Consumed(0, 1, 1, 0, 5, pos=4, prompt_id=4, version_min=1)]  # position 4, other generator
    assert chaos.account(again).duplicate_prompts == 1
    del records[3]
    assert chaos.account(records).skipped == 1
