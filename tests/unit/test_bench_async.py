"""tools/bench_async.py: its pure parts (limits from a run's own busy time, spreads over repeats,
speed-ups paired by repeat, the baseline's choice, the modes and their order) on synthetic run
files; and the generator's count of weight loads inside waits, which its busy time needs. No
processes, no vLLM, no Ray."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tools import bench_async as ba

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ a synthetic run of the two loops


def pipeline_run(steps: int, eta: int, quota: int, gen_s: float, load_s: float, learn_s: float,
                 overhead_s: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """summary.json and metrics.jsonl of a run of one generator and one learner with constant costs,
    as the product's loops would produce them (the generator granted at most eta + 1 steps ahead of
    its weights, its weight loads; the learner's steps): one vLLM call of `gen_s` per step's `quota`
    groups, a load of `load_s` per new version (at the top of the loop, or inside the wait for
    tickets), a learner step of
    `learn_s` busy seconds, and `overhead_s` of the driver's between steps (off both stages)."""
    ready: list[float] = []  # when call c's groups are in the queue
    ends: list[float] = []  # when learner step s ends, i.e. version s + 1 is pushed
    records: list[dict[str, Any]] = []
    learner_clock = 0.0

    def advance_learner() -> None:
        # Every step whose groups exist can be placed: nothing later changes it.
        nonlocal learner_clock
        while len(ends) < min(len(ready), steps):
            s = len(ends)
            arrive = learner_clock + overhead_s
            start = max(arrive, ready[s])
            records.append({"step": s + 1, "time/step_s": start - arrive + learn_s, "time/ack_wait_s": 0.0,
                            "time/gen_wait_s": start - arrive, "time/train_s": learn_s})
            learner_clock = start + learn_s
            ends.append(learner_clock)

    t, version, calls = 0.0, 0, 0
    throttle_s = load_in_wait_s = 0.0
    while True:
        advance_learner()
        newest = sum(end <= t for end in ends)
        if newest > version:  # the top of the loop: a busy load
            t, version = t + load_s, newest
        if calls > eta + version:  # granted nothing until version calls - eta arrives
            needed = calls - eta
            if needed > steps:  # never pushed: wait for the shutdown
                break
            arrival = max(t, ends[needed - 1])
            throttle_s += arrival - t + load_s
            load_in_wait_s += load_s
            t, version = arrival + load_s, sum(end <= arrival for end in ends)
        t += gen_s
        ready.append(t)
        calls += 1
    advance_learner()
    train_s = ends[-1] + overhead_s
    wall_s = max(train_s, t) + 0.01  # the shutdown is heard a little after the clock stops
    throttle_s += wall_s - t
    learner_idle = sum(r["time/gen_wait_s"] for r in records)
    summary = {
        "steps": steps, "train_s": train_s, "samples": steps * quota * 8,
        "samples_per_s": steps * quota * 8 / train_s,
        "generators": [{"gen/wall_s": wall_s, "gen/groups_sent": calls * quota, "gen_time/throttle_s": throttle_s,
                        "gen/weight_load_in_wait_s": load_in_wait_s, "gen/send_blocked_s": 0.0,
                        "gen/idle_frac": throttle_s / wall_s, "gen/tokens_generated": calls * quota * 40}],
        "learner": {"idle_frac": learner_idle / ends[-1], "staleness_histogram": {"0": steps * quota}},
    }
    return summary, records


costs = st.floats(min_value=0.001, max_value=1.0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.integers(2, 40), eta=st.integers(0, 4), gen_s=costs, learn_s=costs,
       load_s=st.floats(min_value=0.0, max_value=0.1), overhead_s=st.floats(min_value=0.0, max_value=0.05))
def test_no_run_beats_its_own_limits(steps, eta, gen_s, learn_s, load_s, overhead_s):
    summary, records = pipeline_run(steps, eta, 4, gen_s, load_s, learn_s, overhead_s)
    run = ba.run_figures(summary, records, groups_per_step=4)
    assert run["t_learn_s"] == pytest.approx(learn_s)
    # The generator's work: every call, every load; per step, as the learner takes a call's groups.
    assert gen_s - 1e-9 <= run["t_gen_s"] <= gen_s + load_s + 1e-9
    # The edge: T_gen is the generator's mean cost over all its calls, including those after the
    # clock stopped. Every trained call's work lies inside the clock, and besides calls only two
    # loads can reach past it (one under way, then the last version's): at most 2 x load_s.
    edge = 2 * load_s / summary["train_s"]
    assert run["fraction_of_pipeline_limit"] <= 1 + edge + 1e-9
    assert run["overlap"] <= run["overlap_limit"] * (1 + edge) + 1e-9
    assert 1 <= run["overlap_limit"] <= 2


def test_a_sync_run_overlaps_nothing_and_an_async_one_reaches_the_pipeline():
    sync, records = pipeline_run(200, 0, 4, gen_s=0.06, load_s=0.002, learn_s=0.05, overhead_s=0.0)
    run = ba.run_figures(sync, records, groups_per_step=4)
    assert run["step_s"] == pytest.approx(0.06 + 0.002 + 0.05, rel=0.01)
    assert run["overlap"] == pytest.approx(1.0, abs=0.01)
    assert run["fraction_of_pipeline_limit"] == pytest.approx(1 / run["overlap_limit"], rel=0.01)
    pipelined, records = pipeline_run(200, 2, 4, gen_s=0.06, load_s=0.002, learn_s=0.05, overhead_s=0.0)
    run = ba.run_figures(pipelined, records, groups_per_step=4)
    assert run["fraction_of_pipeline_limit"] == pytest.approx(1.0, rel=0.02)
    assert run["overlap"] == pytest.approx(run["overlap_limit"], rel=0.02)


def test_a_slower_sync_run_scores_lower_not_higher():
    """The old fraction_of_limit (speed-up over the sync run / overlap limit) rose as the sync run
    slowed; a fraction of the run's own limit falls with it."""
    fast = ba.run_figures(*pipeline_run(50, 0, 4, 0.06, 0.002, 0.05, overhead_s=0.0), groups_per_step=4)
    slow = ba.run_figures(*pipeline_run(50, 0, 4, 0.06, 0.002, 0.05, overhead_s=0.03), groups_per_step=4)
    assert slow["samples_per_s"] < fast["samples_per_s"]
    assert slow["fraction_of_pipeline_limit"] < fast["fraction_of_pipeline_limit"]


# ---------------------------------------------------------------------------- busy time by hand


def generator_report(**values: float) -> dict[str, float]:
    report = {"gen/wall_s": 10.0, "gen/groups_sent": 40, "gen/idle_frac": 0.0}
    report.update(values)
    return report


def test_generator_busy_time_is_wall_but_waits_with_the_loads_inside_them_added_back():
    report = generator_report(**{"gen_time/throttle_s": 3.0, "gen/send_blocked_s": 1.0, "gen_time/ask_s": 0.5,
                                 "gen_time/rejoin_s": 0.5, "gen/weight_load_in_wait_s": 0.2,
                                 # Busy phases, already in the wall time: never added again.
                                 "gen_time/generate_s": 4.0, "gen_time/score_wait_s": 0.3, "gen/weight_load_s": 0.4})
    assert ba.generator_busy_s(report) == pytest.approx(10.0 - 5.0 + 0.2)
    # 40 groups in 5.2 busy seconds, 8 a step.
    assert ba.t_gen_s([report], groups_per_step=8) == pytest.approx(5.2 / 40 * 8)
    # A summary from before gen/weight_load_in_wait_s: the loads in waits count as waiting.
    assert ba.generator_busy_s(generator_report(**{"gen_time/throttle_s": 3.0})) == pytest.approx(7.0)


def test_several_generators_add_their_rates():
    one = generator_report()  # 40 groups in 10 s
    two = generator_report(**{"gen/wall_s": 5.0, "gen/groups_sent": 10})  # 10 groups in 5 s
    assert ba.t_gen_s([one, two], groups_per_step=6) == pytest.approx(6 / (4.0 + 2.0))
    assert ba.t_gen_s([one, generator_report(**{"gen/groups_sent": 0})], groups_per_step=4) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no generator sent"):
        ba.t_gen_s([generator_report(**{"gen/groups_sent": 0})], groups_per_step=4)


def test_learner_busy_time_is_the_step_but_its_waits():
    records = [{"step": 1, "time/step_s": 1.0, "time/ack_wait_s": 0.1, "time/gen_wait_s": 0.4},
               {"step": 2, "time/step_s": 0.6, "time/gen_wait_s": 0.1, "time/checkpoint_s": 0.2},
               {"eval/accuracy": 0.3, "step": 2}]  # not a step
    assert ba.t_learn_s(records) == pytest.approx(((1.0 - 0.5) + (0.6 - 0.1 + 0.2)) / 2)
    with pytest.raises(ValueError, match="no step record"):
        ba.t_learn_s([{"eval/accuracy": 0.3}])


# ------------------------------------------------------------------------------ across repeats


def run(mode: str, eta: int, repeat: int, samples_per_s: float, **extra: Any) -> dict[str, Any]:
    return {"mode": mode, "eta": eta, "repeat": repeat, "samples_per_s": samples_per_s, "step_s": 1.0,
            "t_gen_s": 0.5, "t_learn_s": 0.4, "fraction_of_pipeline_limit": 0.5, "overlap_limit": 1.8, "overlap": 0.9,
            "learner_idle_frac": 0.5, "generator_idle_frac": 0.4, "staleness_mean": float(eta),
            "staleness_max": eta, "accuracy_end": None, "greedy_accuracy_end": None, **extra}


def test_spread_is_median_min_max_of_what_is_there():
    assert ba.spread([3.0, 1.0, 2.0, None, math.nan]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert ba.spread([1.0, 4.0]) == {"median": 2.5, "min": 1.0, "max": 4.0}
    assert ba.spread([None, None]) is None


def test_the_speed_up_is_a_ratio_of_medians_spread_by_ratios_paired_by_repeat():
    sync = [run("sync", 0, 0, 100.0), run("sync", 0, 1, 80.0), run("sync", 0, 2, 120.0)]
    fast = [run("async eta=2", 2, 2, 240.0), run("async eta=2", 2, 0, 150.0), run("async eta=2", 2, 1, 200.0)]
    speed = ba.speedup(fast, sync)
    assert speed["median"] == pytest.approx(200.0 / 100.0)
    assert speed["per_repeat"] == pytest.approx([1.5, 2.5, 2.0])  # in repeat order
    assert (speed["min"], speed["max"]) == pytest.approx((1.5, 2.5))
    # A repeat missing on one side is left out of the pairs, not of the medians.
    speed = ba.speedup(fast, sync[:2])
    assert speed["per_repeat"] == pytest.approx([1.5, 2.5]) and speed["median"] == pytest.approx(200.0 / 90.0)
    assert ba.speedup(fast, [run("sync", 0, 7, 50.0)])["min"] is None


def test_the_baseline_is_the_sync_mode_with_the_best_median_and_the_headline_the_default_eta():
    runs = [
        run("sync", 0, 0, 100.0), run("sync, vLLM 2 cores", 0, 0, 130.0), run("async eta=1", 1, 0, 150.0),
        run("async eta=2", 2, 0, 190.0),
        run("sync", 0, 1, 110.0), run("sync, vLLM 2 cores", 0, 1, 90.0), run("async eta=1", 1, 1, 160.0),
        run("async eta=2", 2, 1, 170.0),
        run("sync", 0, 2, 105.0), run("sync, vLLM 2 cores", 0, 2, 120.0), run("async eta=1", 1, 2, 150.0),
        run("async eta=2", 2, 2, 180.0, accuracy_end=0.3),
    ]
    result = ba.summarize(runs, default_eta=2, overrides={"sync": ["train.max_staleness=0"]})
    # Medians: sync 105, vLLM on 2 cores 120 (though its best run is no better than sync's).
    assert result["sync_baseline_mode"] == "sync, vLLM 2 cores"
    assert list(result["modes"]) == ["sync", "sync, vLLM 2 cores", "async eta=1", "async eta=2"]
    assert result["modes"]["sync"]["overrides"] == ["train.max_staleness=0"]
    assert result["modes"]["sync, vLLM 2 cores"]["samples_per_s"] == {"median": 120.0, "min": 90.0, "max": 130.0}
    assert result["modes"]["sync, vLLM 2 cores"]["speedup_vs_sync"]["median"] == pytest.approx(1.0)
    head = result["headline"]
    assert head["eta"] == 2 and head["mode"] == "async eta=2"
    assert head["speedup_vs_sync"]["median"] == pytest.approx(180.0 / 120.0)
    assert head["speedup_vs_sync"]["per_repeat"] == pytest.approx([190 / 130, 170 / 90, 180 / 120])
    assert head["samples_per_s"] == {"median": 180.0, "min": 170.0, "max": 190.0}
    assert list(result["speedup_vs_sync"]) == ["1", "2"]
    assert result["modes"]["async eta=2"]["accuracy_end"] == {"median": 0.3, "min": 0.3, "max": 0.3}
    assert result["modes"]["sync"]["accuracy_end"] is None  # evals off


def test_without_sync_runs_there_is_no_baseline_and_without_the_default_eta_no_headline():
    result = ba.summarize([run("async eta=2", 2, 0, 100.0)], default_eta=2)
    assert result["sync_baseline_mode"] is None and result["speedup_vs_sync"] == {"2": None}
    assert result["headline"]["speedup_vs_sync"] is None
    assert ba.summarize([run("sync", 0, 0, 100.0)], default_eta=2)["headline"] is None


# --------------------------------------------------------------------------------------- modes


def test_the_sync_modes_give_each_stage_both_cores_in_turn():
    modes, skipped = ba.sync_modes(list(ba.SYNC_CONFIGS), "cpu", [[0]], [[1]])
    assert skipped == {}
    learner = ("learner.cpu_cores=0-1", "learner.torch_threads=2", "learner.num_cpus_per_rank=2")
    generator = ("rollout.cpu_cores=0-1", "rollout.num_cpus_per_generator=2")
    assert {m.label: m.overrides for m in modes} == {
        "sync": ("train.max_staleness=0",),
        "sync, learner 2 cores": ("train.max_staleness=0", "rollout.cpu_cores=0", *learner),
        "sync, vLLM 2 cores": ("train.max_staleness=0", *generator, "learner.cpu_cores=1"),
        "sync, both 2 cores": ("train.max_staleness=0", *generator, *learner),
    }
    assert all(m.eta == 0 for m in modes)
    # Cores that are not neighbours are one quoted string to Hydra.
    modes, _ = ba.sync_modes(["vllm2"], "cpu", [[3]], [[1]])
    assert modes[0].overrides == ("train.max_staleness=0", "rollout.cpu_cores='1,3'",
                                  "rollout.num_cpus_per_generator=2", "learner.cpu_cores=1")


@pytest.mark.parametrize(("device", "generators", "learners", "why"), [
    ("cuda", [[0]], [[1]], "device=cuda"),
    ("cpu", [[0], [1]], [[2]], "one generator and one learner rank"),
    ("cpu", [[]], [[]], "not one core each"),  # fewer cores than processes: nothing pinned
    ("cpu", [[0, 1]], [[2]], "not one core each"),
])
def test_a_two_core_variant_that_cannot_be_expressed_is_skipped_with_the_reason(device, generators, learners, why):
    modes, skipped = ba.sync_modes(["default", "vllm2", "both2"], device, generators, learners)
    assert [m.label for m in modes] == ["sync"]
    assert set(skipped) == {"sync, vLLM 2 cores", "sync, both 2 cores"} and all(why in r for r in skipped.values())


def test_async_modes_always_hold_the_default_eta():
    assert [m.eta for m in ba.async_modes([0, 4, 1], default_eta=2)] == [1, 2, 4]
    assert [m.overrides for m in ba.async_modes([2], default_eta=2)] == [("train.max_staleness=2",)]
    assert ba.async_modes([0], default_eta=0) == []


def test_repeats_are_interleaved_and_rotated():
    a, b, c = (ba.Mode(label, 0, ()) for label in "abc")
    order = ba.interleaved([a, b, c], repeats=4)
    assert [(r, m.label) for r, m in order] == [
        (0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b"),
        (3, "a"), (3, "b"), (3, "c")]


def test_arguments_parse_and_refuse_nonsense():
    assert ba.parse_etas("0,2") == [0, 2]
    assert ba.parse_sync_configs("default, vllm2") == ["default", "vllm2"]
    for bad in ("", "1,x", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            ba.parse_etas(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown"):
        ba.parse_sync_configs("default,gpu")


def test_a_sync_config_named_twice_is_refused_two_modes_would_share_a_run_folder():
    with pytest.raises(argparse.ArgumentTypeError, match="twice"):
        ba.parse_sync_configs("default,default")
    assert ba.parse_sync_configs(",") == []  # no sync mode: still a choice


def refused_before_any_run(main, argv: list[str], monkeypatch, capsys) -> str:
    """`main(argv)` exits 2 with one error line, and nothing ran (run_benchmark is where runs start)."""
    monkeypatch.setattr(ba, "run_benchmark", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, says", [
    (["trian.max_steps=3"], "trian"),  # a typo: one line, not a traceback
    (["--etas", "2,4", "train.fixed_staleness=2"], "mode 'async eta=4'"),  # a mode against the user's overrides
    (["--etas", "0", "--sync-configs", ",", "train.max_staleness=0"], "no modes to run"),
    (["--sync-configs", "default,default"], "twice"),
    (["seed"], "key=value"),
    (["rollout.cpu_cores=zz"], "rollout.cpu_cores='zz'"),  # composes, but does not plan
])
def test_bad_overrides_and_empty_mode_lists_are_refused_before_the_first_run(argv, says, monkeypatch, capsys):
    assert says in refused_before_any_run(ba.main, ["--out", "/nonexistent/never", *argv], monkeypatch, capsys)


def test_the_table_prints_spreads_and_the_headline(capsys):
    runs = [run("sync", 0, r, 100.0 + r) for r in range(3)] + [run("async eta=2", 2, r, 180.0 + r) for r in range(3)]
    result = {**ba.summarize(runs, default_eta=2), "sync_skipped": {"sync, vLLM 2 cores": "device=cuda: ..."}}
    ba.print_table(result)
    out = capsys.readouterr().out
    assert "181 [180-182]" in out and "1.79 [1.78-1.80]" in out
    assert "sync baseline: sync" in out and "not run: sync, vLLM 2 cores" in out
    assert "headline (default max_staleness=2)" in out


# ------------------------------------------------------- the generator's loads inside its waits


def test_the_generator_counts_the_loads_done_inside_its_waits():
    """A synchronous generator loads each version inside its wait for tickets; those loads are work
    its wait timer holds, reported apart so the busy time can count them."""
    import test_generator as tg  # the generator's fakes, as the other generator tests import them

    class SlowLoads(tg.AddingEngine):
        def load_weights(self, named_tensors) -> None:
            time.sleep(0.01)
            super().load_weights(named_tensors)

    generator = tg.make_generator(tg.config(train={"max_staleness": 0}), versions=3, quota=2, engine=SlowLoads())
    stats = generator.run()
    assert stats["gen/weight_loads"] == 3
    # The fake learner pushes only while the generator waits: every load is inside the wait for tickets.
    assert stats["gen/weight_load_in_wait_s"] == stats["gen/weight_load_s"] >= 0.03
    assert stats["gen_time/throttle_s"] >= stats["gen/weight_load_in_wait_s"]
    busy = ba.generator_busy_s(stats)
    assert stats["gen_time/generate_s"] + stats["gen/weight_load_s"] <= busy <= stats["gen/wall_s"]


def test_run_benchmark_writes_every_run_and_the_summary_to_its_folder_and_prints_them_last_as_one_json_line(
        tmp_path, capsys):
    modes = [ba.Mode("a", 1, ("x=1",)), ba.Mode("b", 2, ("x=2",))]
    seen: list[tuple[str, int, Path]] = []

    def run_one(mode: ba.Mode, repeat: int, out_dir: Path) -> dict:
        seen.append((mode.label, repeat, out_dir))
        return {"mode": mode.label, "repeat": repeat, "samples_per_s": 10.0 * (repeat + 1)}

    def summarize(runs: list[dict]) -> dict:
        return {"modes": sorted({r["mode"] for r in runs}), "n": len(runs)}

    tables: list[dict] = []
    assert ba.run_benchmark("bench_x", modes, 2, str(tmp_path / "out"), run_one, summarize, tables.append,
                            {"steps": 7}) == 0
    out_dir = seen[0][2]
    assert out_dir.parent == tmp_path / "out" and all(d == out_dir for _, _, d in seen)
    assert sorted((label, repeat) for label, repeat, _ in seen) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads((out_dir / "bench_x.json").read_text()) == tables[0]
    assert (last["steps"], last["modes"], last["n"], len(last["runs"])) == (7, ["a", "b"], 4, 4)
    assert last["run_dir"] == str(out_dir)
    assert len((out_dir / "runs.jsonl").read_text().splitlines()) == 4
