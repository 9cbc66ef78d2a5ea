"""tools/dispatch_study.py: its rows on a synthetic calibration (tickets reach the sum of uneven
generators' speeds), and the command's table and last JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_simulate import constant_run, fake_run
from tools import dispatch_study as ds

ROOT = Path(__file__).resolve().parents[2]


def test_rows_compare_tickets_against_the_sum_of_each_generator_alone():
    cal, _ = constant_run(generate_s=8.0, train_s=0.1, groups_per_step=16, max_staleness=2, steps=10)
    (row,) = ds.study(cal, speeds=[1.0, 0.5], etas=[2], calls=[1], seeds=2, cv=0.0, steps=60)
    assert row["alone"][0] > row["alone"][1] > 0 and row["limit"] == sum(row["alone"])
    assert 0.9 < row["tickets"]["ratio"] <= 1.0 + 1e-9
    assert row["tickets"]["ratio_min"] <= row["tickets"]["ratio"] <= row["tickets"]["ratio_max"]
    # 0.1 s of training a step: 16 groups x 2 samples / 0.1 s with generation free
    assert row["learner_bound"] == pytest.approx(320, rel=0.02)
    assert row["tickets_of_reachable"] == pytest.approx(row["tickets"]["samples_per_s"] / row["limit"])


def test_a_faster_learner_raises_the_learner_bound():
    cal, _ = constant_run(generate_s=8.0, train_s=0.1, groups_per_step=16, max_staleness=2, steps=10)
    (slow,) = ds.study(cal, speeds=[1.0], etas=[2], calls=[1], seeds=1, cv=0.0, steps=40)
    (fast,) = ds.study(cal, speeds=[1.0], etas=[2], calls=[1], seeds=1, cv=0.0, steps=40, train_scale=0.5)
    assert fast["learner_bound"] == pytest.approx(2 * slow["learner_bound"], rel=0.02)


def test_the_command_prints_a_table_and_a_last_json_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tools.dispatch_study", str(fake_run(tmp_path)), "--etas", "1",
                          "--calls", "1", "--seeds", "1", "--steps", "20"], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("speeds [1.0, 0.5]")
    payload = json.loads(lines[-1])
    assert [r["max_staleness"] for r in payload["rows"]] == [1]


def test_a_bad_argument_is_one_line_and_a_nonzero_exit(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tools.dispatch_study", str(fake_run(tmp_path)), "--speeds",
                          "1,fast"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0
    assert out.stderr.startswith("dispatch_study:")


@pytest.mark.parametrize("argv", [["--seeds", "0"], ["--speeds", "1,fast"], ["--etas", "x"], ["--calls", "0"]])
def test_bad_arguments_exit_2_in_one_line(argv, tmp_path, capsys):
    assert ds.main([str(fake_run(tmp_path)), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dispatch_study:")


def test_generators_of_equal_speed_are_a_valid_study(tmp_path, capsys):
    assert ds.main([str(fake_run(tmp_path)), "--speeds", "1,1", "--etas", "1", "--calls", "1", "--seeds", "1",
                    "--steps", "20"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["speeds"] == [1.0, 1.0]
