"""tools/bench_tail.py: its pure parts (a run's long-tail figures, the spreads and the two speed-ups)
on synthetic run files. No processes, no vLLM, no Ray."""

from __future__ import annotations

from typing import Any

import pytest
from tools import bench_tail as bt


def summary(samples_per_s: float, occupancy: float) -> dict[str, Any]:
    generator = {"gen/wall_s": 10.0, "gen_time/throttle_s": 1.0, "gen_time/ask_s": 0.0, "gen/send_blocked_s": 0.0,
                 "gen/weight_load_in_wait_s": 0.0, "gen/groups_sent": 40, "gen/idle_frac": 0.1,
                 "gen/tokens_generated": 4000, "gen/engine_occupancy": occupancy}
    return {"steps": 2, "train_s": 10.0, "samples_per_s": samples_per_s, "generators": [generator],
            "learner": {"idle_frac": 0.2, "staleness_histogram": {"0": 2, "2": 2}}, "eval_accuracy_end": 0.5}


RECORDS = [{"step": 1, "time/step_s": 5.0, "time/ack_wait_s": 0.0, "time/gen_wait_s": 1.0, "perf/tokens": 3000,
            "staleness/tokens_age_0": 1.0, "staleness/tokens_age_1": 0.0},
           {"step": 2, "time/step_s": 5.0, "time/ack_wait_s": 0.0, "time/gen_wait_s": 1.0, "perf/tokens": 1000,
            "staleness/tokens_age_0": 0.5, "staleness/tokens_age_1": 0.5},
           {"step": 2, "eval/accuracy": 0.5, "eval/when": "end"}]  # not a step: left out


def test_a_runs_figures_add_tokens_per_second_occupancy_and_the_mean_token_ages():
    figures = bt.tail_figures(summary(100.0, 0.9), RECORDS, groups_per_step=4)
    assert figures["tokens_per_s"] == 400.0  # 4,000 trained completion tokens over 10 s
    assert figures["engine_occupancy"] == 0.9 and figures["staleness_mean"] == 1.0
    assert figures["tokens_age_0"] == 0.75 and figures["tokens_age_1"] == 0.25 and figures["tokens_age_4plus"] == 0.0


def run(mode: str, eta: int, repeat: int, samples_per_s: float) -> dict[str, Any]:
    return {"mode": mode, "eta": eta, "repeat": repeat, "samples_per_s": samples_per_s}


def test_speed_ups_are_against_the_best_sync_mode_and_the_call_batched_generator_paired_by_repeat():
    runs = [run("sync", 0, 0, 100), run("sync", 0, 1, 110), run("sync, learner 2 cores", 0, 0, 90),
            run("sync, learner 2 cores", 0, 1, 95), run(bt.BATCHED, 2, 0, 150), run(bt.BATCHED, 2, 1, 160),
            run(bt.CONTINUOUS, 2, 0, 300), run(bt.CONTINUOUS, 2, 1, 320)]
    result = bt.summarize(runs)
    assert result["sync_baseline_mode"] == "sync"
    continuous = result["modes"][bt.CONTINUOUS]
    assert continuous["speedup_vs_sync"]["median"] == pytest.approx(310 / 105)
    assert continuous["speedup_vs_sync"]["per_repeat"] == [3.0, pytest.approx(320 / 110)]
    assert continuous["speedup_vs_batched"]["median"] == pytest.approx(310 / 155)
    assert result["modes"][bt.BATCHED]["speedup_vs_batched"]["median"] == 1.0


def test_the_asynchronous_modes_differ_only_in_whether_the_engine_is_refilled():
    batched, continuous = bt.async_modes(2)
    assert set(batched.overrides) ^ set(continuous.overrides) == {"rollout.continuous=false",
                                                                  "rollout.continuous=true"}
    assert "rollout.inflight_updates=true" in batched.overrides and batched.eta == continuous.eta == 2


@pytest.mark.parametrize("argv, says", [
    (["trian.max_steps=3"], "trian"),
    (["--sync-configs", "default,default"], "twice"),
    (["rollout.inflight_updates=false", "train.fixed_staleness=2"], "mode 'sync'"),
    (["learner.cpu_cores=zz"], "learner.cpu_cores='zz'"),
])
def test_bad_arguments_are_one_line_and_exit_2_before_the_first_run(argv, says, monkeypatch, capsys):
    monkeypatch.setattr(bt, "run_benchmark", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exit_info:
        bt.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and says in err.strip().splitlines()[-1]
