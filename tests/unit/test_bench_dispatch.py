"""tools/bench_dispatch.py's arithmetic: each run against the two "alone" runs of its own repeat."""

from __future__ import annotations

import json

import pytest
from tools import bench_dispatch as bench


def run(mode: str, repeat: int, samples_per_s: float, dropped: int = 0) -> dict:
    return {"mode": mode, "repeat": repeat, "samples_per_s": samples_per_s, "dropped": dropped,
            "sent_slow_frac": 0.3, "learner_idle_frac": 0.1}


def test_a_run_is_compared_with_the_sum_of_the_alone_runs_of_its_own_repeat():
    runs = [run("fast alone", 0, 100), run("slow alone", 0, 50), run("tickets", 0, 135),
            run("fast alone", 1, 80), run("slow alone", 1, 40), run("tickets", 1, 120), run("tickets", 2, 90),
            run("tickets, equal", 1, 144)]
    bench.of_sum_alone(runs)
    assert runs[2]["of_sum_alone"] == pytest.approx(0.9) and runs[5]["of_sum_alone"] == pytest.approx(1.0)
    assert "of_sum_alone" not in runs[6]  # its repeat has no alone runs
    assert runs[7]["of_sum_alone"] == pytest.approx(0.9)  # two full-speed generators: twice fast alone
    assert runs[0]["of_sum_alone"] == 1.0
    runs = runs[:7]
    modes = bench.summarize(runs)
    # Repeat 2's tickets run has no alone runs to compare with: left out of the spread.
    assert modes["tickets"]["of_sum_alone"] == {"median": pytest.approx(0.95), "min": pytest.approx(0.9),
                                                "max": pytest.approx(1.0)}
    assert "tickets, equal" not in modes


def test_figures_read_a_runs_summary_and_last_queue_record(tmp_path):
    (tmp_path / "config.yaml").write_text("rollout:\n  samples_per_prompt: 2\n")
    # Generator 0: 300 groups in 10 s busy (12 s, 2 s of it waiting for tickets); generator 1: 100 in 10 s.
    (tmp_path / "summary.json").write_text(json.dumps({
        "samples_per_s": 64.0, "learner": {"idle_frac": 0.2},
        "generators": [{"gen/groups_sent": 300, "gen/wall_s": 12.0, "gen_time/ask_s": 0.5, "gen_time/throttle_s": 1.5},
                       {"gen/groups_sent": 100, "gen/wall_s": 10.0}]}))
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "queue/consumed": 16, "queue/dropped_stale": 9}) + "\n"
        + json.dumps({"step": 2, "queue/consumed": 32, "queue/dropped_stale": 1, "queue/dropped_unheld": 2}) + "\n"
        + json.dumps({"step": 2, "eval/accuracy": 0.5}) + "\n")
    figures = bench.figures("tickets", 0, tmp_path)
    assert figures["dropped"] == 3 and figures["sent"] == [300, 100] and figures["sent_slow_frac"] == 0.25
    assert figures["samples_per_s"] == 64.0 and figures["learner_idle_frac"] == 0.2
    # Capacity: (30 + 10 groups per busy second) x 2 samples = 80 samples/s, of which the run made 64.
    assert figures["capacity_samples_per_s"] == pytest.approx(80.0)
    assert figures["of_capacity"] == pytest.approx(0.8)


def test_every_generator_gets_the_base_slowdown_and_the_slowed_one_the_product():
    assert bench.slowdowns("fast alone", 2, 1) == {}
    assert bench.slowdowns("slow alone", 2, 1) == {"0": 2}
    assert bench.slowdowns("tickets", 2, 1) == {"1": 2}
    assert bench.slowdowns("tickets, equal", 2, 4) == {"0": 4, "1": 4}
    assert bench.slowdowns("tickets", 2, 4) == {"0": 4, "1": 8}
    assert bench.slowdowns("slow alone", 2, 4) == {"0": 8}


def test_a_pace_replaces_the_slowdown_and_reaches_every_generator_of_the_run():
    assert bench.failpoints("fast alone", 2, 1, 0.0) == {}
    assert bench.failpoints("tickets", 2, 1, 0.0) == {"generator_slowdown": {"1": 2}}
    assert bench.failpoints("fast alone", 2, 1, 0.02) == {"generator_pace_s": {"0": 0.02}}
    assert bench.failpoints("slow alone", 2, 1, 0.02) == {"generator_pace_s": {"0": 0.04}}
    assert bench.failpoints("tickets", 3, 1, 0.02) == {"generator_pace_s": {"0": 0.02, "1": pytest.approx(0.06)}}
    assert bench.failpoints("tickets, equal", 3, 1, 0.02) == {"generator_pace_s": {"0": 0.02, "1": 0.02}}


@pytest.mark.parametrize(("argv", "says"), [
    *(([option, bad], f"argument {option}: wants a finite number, got '{bad}'")
      for option in ("--slowdown", "--base-slowdown", "--pace-s") for bad in ("nan", "inf")),
    *(([f"{key}=3"], f"{key} is set by bench_dispatch itself")
      for key in ("rollout.num_generators", "train.max_steps", "rollout.groups_per_call", "run_dir")),
    (["trian.max_steps=3"], "unknown config key 'trian.max_steps'"),
    (["seed"], "'seed': overrides are key=value"),
])
def test_bad_arguments_and_the_tools_own_keys_are_refused_by_its_parse(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and says in err.strip().splitlines()[-1]


def test_every_call_runs_into_a_new_folder_under_out(tmp_path, monkeypatch, capsys):
    seen = []

    def fake_run(label, repeat, slowdown, base, pace_s, steps, groups_per_call, out, extra):
        seen.append(out)
        return {"mode": label, "repeat": repeat, "samples_per_s": 1.0, "dropped": 0, "sent_slow_frac": 0.5,
                "learner_idle_frac": 0.1}

    monkeypatch.setattr(bench, "run", fake_run)
    for _ in range(2):
        assert bench.main(["--repeats", "1", "--out", str(tmp_path), "seed=3"]) == 0
    assert len(set(seen)) == 2 and all(out.parent == tmp_path and out.is_dir() for out in seen)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_dir"] == str(seen[-1])
