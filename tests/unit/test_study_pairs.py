"""tools/study_pairs.py: cells of finished studies paired by seed, within a study and across two."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from tools import study_pairs

T_975_DF2 = 4.302652729911275  # Student's t, 0.975 quantile, 2 degrees of freedom
COLUMNS = ["control", "seed", "accuracy_auc", "eval_accuracy_end", "eval_greedy_accuracy_end", "samples_per_s",
           "train_s", "status", "run_dir"]


def write_study(directory: Path, rows: list[dict], columns: list[str] = COLUMNS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({"status": "finished", "run_dir": "x", "eval_greedy_accuracy_end": "", **row})
    return directory


def run(control: str, seed: int, sps: float, auc: float, end: float = 0.3, train_s: float = 100.0,
        status: str = "finished") -> dict:
    return {"control": control, "seed": seed, "samples_per_s": sps, "accuracy_auc": auc, "eval_accuracy_end": end,
            "train_s": train_s, "status": status}


def test_within_a_study_cells_pair_by_seed_for_the_geometric_mean_ratio_the_mean_difference_and_their_intervals(tmp_path):
    # B differs by seed and A's rows come in another order, so pairing by row order gives another
    # interval (the means are the same whatever the pairing: a geometric mean of ratios is the ratio
    # of the geometric means).
    study = write_study(tmp_path / "s", [
        run("fast", 2, 150, 0.20), run("fast", 0, 200, 0.30), run("fast", 1, 600, 0.25),
        run("slow", 0, 100, 0.10), run("slow", 1, 200, 0.20), run("slow", 2, 300, 0.30),
    ])
    row = study_pairs.compare(study_pairs.cell_runs(f"{study}:fast"), study_pairs.cell_runs(f"{study}:slow"))
    assert row["seeds"] == [0, 1, 2]
    assert row["samples_per_s"]["mean"] == pytest.approx((2 * 3 * 0.5) ** (1 / 3))
    logs = [math.log(2), math.log(3), math.log(0.5)]  # seeds 0, 1, 2
    mean, sd = sum(logs) / 3, math.sqrt(sum((x - sum(logs) / 3) ** 2 for x in logs) / 2)
    half = T_975_DF2 * sd / math.sqrt(3)
    assert row["samples_per_s"]["n"] == 3
    assert row["samples_per_s"]["low"] == pytest.approx(math.exp(mean - half))
    assert row["samples_per_s"]["high"] == pytest.approx(math.exp(mean + half))
    diffs = [0.20, 0.05, -0.10]
    sd = math.sqrt(sum((d - 0.05) ** 2 for d in diffs) / 2)
    assert row["accuracy_auc"]["mean"] == pytest.approx(0.05)
    assert row["accuracy_auc"]["low"] == pytest.approx(0.05 - T_975_DF2 * sd / math.sqrt(3))
    assert row["train_s"]["mean"] == pytest.approx(1.0)  # equal seconds everywhere: ratio 1


def test_across_two_studies_only_seeds_both_finished_are_paired(tmp_path):
    bypass = write_study(tmp_path / "bypass", [run("v8", s, 100 * (s + 1), 0.25 + s / 100) for s in range(5)])
    naive = write_study(tmp_path / "naive", [run("v8", 1, 400, 0.15), run("v8", 0, 200, 0.20),
                                             run("v8", 2, 999, 0.99, status="failed")])
    row = study_pairs.compare(study_pairs.cell_runs(f"{naive}:v8"), study_pairs.cell_runs(f"{bypass}/results.csv:v8"))
    assert row["seeds"] == [0, 1]
    assert row["samples_per_s"]["mean"] == pytest.approx(math.sqrt(2 * 2))
    assert row["accuracy_auc"]["mean"] == pytest.approx((-0.05 - 0.11) / 2)
    assert row["eval_greedy_accuracy_end"]["n"] == 0  # an empty column pairs nothing, no crash


def test_one_shared_seed_gives_the_pair_with_no_interval_and_no_bold(tmp_path, capsys):
    a = write_study(tmp_path / "a", [run("x", 0, 300, 0.4), run("x", 1, 300, 0.4)])
    b = write_study(tmp_path / "b", [run("x", 1, 100, 0.2)])
    assert study_pairs.main(["--pair", f"{a}:x", f"{b}:x"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "| 1 | 3.00x | 1.00x | +0.000 | - | +0.200 |" in lines[2] and "[" not in lines[2] and "**" not in lines[2]
    pair = json.loads(lines[-1])["pairs"][0]
    assert pair["seeds"] == [1] and pair["samples_per_s"]["low"] is None


def test_two_finished_runs_of_one_seed_in_a_cell_are_refused_not_one_silently_kept(tmp_path):
    study = write_study(tmp_path / "s", [run("x", 0, 100, 0.2), run("x", 0, 120, 0.3), run("x", 1, 100, 0.2)])
    with pytest.raises(study_pairs.PairError, match=r"more than one finished run of seed\(s\) \[0\]"):
        study_pairs.cell_runs(f"{study}:x")


def test_cells_equal_up_to_float_rounding_are_never_bold(tmp_path, capsys):
    # Equal in intent, not in the last bit: 0.1 + 0.2 against 0.3, and 100 against its next float.
    study = write_study(tmp_path / "s", [run("a", s, 100.00000000000001, repr(0.1 + 0.2), end=0.5) for s in range(3)]
                        + [run("b", s, 100.0, 0.3, end=0.5) for s in range(3)])
    assert study_pairs.main(["--pair", f"{study}:a", f"{study}:b"]) == 0
    out = capsys.readouterr().out
    assert "1.00x [1.00, 1.00]" in out and "+0.000 [+0.000, +0.000]" in out and "**" not in out


def test_a_cell_of_a_grid_of_several_factors_needs_every_factor_named(tmp_path):
    columns = ["train.fixed_staleness", "mode"] + COLUMNS[1:]
    study = write_study(tmp_path / "grid", [
        {**run("", s, 100 + k, 0.2), "train.fixed_staleness": k, "mode": mode}
        for s in range(2) for k in (0, 4) for mode in ("bypass", "naive")], columns)
    runs = study_pairs.cell_runs(f"{study}:train.fixed_staleness=4,mode=naive")
    assert sorted(runs) == [0, 1] and all(r["mode"] == "naive" and r["train.fixed_staleness"] == "4" for r in runs.values())
    with pytest.raises(study_pairs.PairError, match="needs key=value"):
        study_pairs.cell_runs(f"{study}:naive")
    with pytest.raises(study_pairs.PairError, match="leaves out the factors"):
        study_pairs.cell_runs(f"{study}:mode=naive")


def test_the_cli_prints_a_table_then_a_json_line_and_a_bad_side_is_one_line_exit_2(tmp_path, capsys):
    study = write_study(tmp_path / "s", [run("a", s, 150, 0.3) for s in range(3)] + [run("b", s, 100, 0.2) for s in range(3)])
    assert study_pairs.main(["--pair", f"{study}:a", f"{study}:b"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| A | B | pairs |")
    assert "**1.50x [1.50, 1.50]**" in lines[2]
    assert json.loads(lines[-1])["pairs"][0]["samples_per_s"]["mean"] == pytest.approx(1.5)

    for side, message in [(f"{study}:c", "no finished run of cell 'c'; its cells: ['control=a', 'control=b']"),
                          (f"{tmp_path / 'nowhere'}:a", "no results.csv there"),
                          ("just-a-cell", "expected STUDY:CELL")]:
        assert study_pairs.main(["--pair", side, f"{study}:b"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1


def test_cells_that_share_no_seed_are_refused(tmp_path):
    a = write_study(tmp_path / "a", [run("x", 0, 100, 0.2)])
    b = write_study(tmp_path / "b", [run("x", 1, 100, 0.2)])
    with pytest.raises(study_pairs.PairError, match="share no finished seed"):
        study_pairs.compare(study_pairs.cell_runs(f"{a}:x"), study_pairs.cell_runs(f"{b}:x"))
