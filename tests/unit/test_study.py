"""`asyncgrpo study` without real training: spec validation, aggregation from fabricated run
directories, the statistics against hand-computed values, resumability and Ctrl-C with fake runners."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from asyncgrpo.study.report import RESULT_COLUMNS, aggregate
from asyncgrpo.study.results import accuracy_auc, tail_mean, value_at
from asyncgrpo.study.runner import (EXIT_INTERRUPTED, RUN_LOG, RUN_RECORD, StudyError, SubprocessRunner,
                                    override_settings, run_study)
from asyncgrpo.study.spec import (
    RUN_DEFAULTS,
    STUDY_SPECS_DIR,
    RunPlan,
    Spec,
    SpecError,
    find_spec,
    override_value,
    read_spec_file,
)
from asyncgrpo.study.stats import mean_ci, paired_difference, paired_ratio, pareto_front, t_quantile

GRID_SPEC = {
    "name": "demo",
    "base": ["train.max_steps=3"],
    "grid": {
        "train.fixed_staleness": [0, 2],
        "mode": {
            "bypass": {"algo.mode": "bypass"},
            "tis": {"algo.mode": "decoupled", "algo.correction.is_level": "token", "algo.correction.is_threshold": 2.0},
        },
    },
    "seeds": [0, 1, 2],
    "baseline": {"train.fixed_staleness": 0, "mode": "bypass"},
}


def write_spec(tmp_path: Path, data: dict, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def with_changes(**changes) -> dict:
    return {**GRID_SPEC, **changes}


# ------------------------------------------------------------------------------------- spec validation


def test_spec_with_an_unknown_top_level_key_fails_in_one_line_naming_it(tmp_path):
    with pytest.raises(SpecError) as err:
        Spec.load(write_spec(tmp_path, with_changes(seed=[0])))
    message = str(err.value)
    assert "unknown key 'seed'" in message and str(tmp_path / "spec.yaml") in message and "\n" not in message


@pytest.mark.parametrize(("text", "named"), [
    (b"name: a\nname: b\nseeds: [0]\n", "found duplicate key 'name'"),  # safe_load would keep 'b' silently
    (b"grid:\n  algo.mode: [bypass]\n  algo.mode: [naive]\n", "found duplicate key 'algo.mode'"),
    (b"name: \xff\xfe\n", "not UTF-8 text"),
    (b"? [1, 2]\n: x\n", "found unhashable key"),
])
def test_a_spec_with_a_key_given_twice_or_not_utf8_fails_in_one_line(tmp_path, text, named):
    (tmp_path / "spec.yaml").write_bytes(text)
    with pytest.raises(SpecError) as err:
        read_spec_file(tmp_path / "spec.yaml")
    assert named in str(err.value) and "\n" not in str(err.value)


def test_a_spec_may_merge_a_yaml_anchor_and_override_a_merged_key(tmp_path):
    (tmp_path / "spec.yaml").write_text("shared: &shared {a: 1, b: 2}\nmerged:\n  <<: *shared\n  b: 3\n")
    assert read_spec_file(tmp_path / "spec.yaml")["merged"] == {"a": 1, "b": 3}


@pytest.mark.parametrize("grid, named", [({}, "grid must be a non-empty mapping"),
                                         ({"train.fixed_staleness": []}, "grid.train.fixed_staleness: empty list"),
                                         ({"mode": {}}, "grid.mode: no levels")])
def test_an_empty_grid_or_factor_fails_naming_it(tmp_path, grid, named):
    with pytest.raises(SpecError, match=named):
        Spec.load(write_spec(tmp_path, with_changes(grid=grid, baseline=None)))


def test_a_value_the_config_refuses_fails_before_any_run_naming_the_cell(tmp_path):
    spec = with_changes(grid={"train.fixed_staleness": [0, 2], "algo.mode": ["bypass", "bogus"]}, baseline=None)
    with pytest.raises(SpecError) as err:
        Spec.load(write_spec(tmp_path, spec))
    message = str(err.value)
    assert "cell train.fixed_staleness=0 algo.mode=bogus" in message
    assert "algo.mode must be one of" in message and "\n" not in message


def test_an_unknown_config_key_in_a_named_level_fails_naming_the_cell(tmp_path):
    spec = with_changes(grid={"mode": {"ok": {"algo.mode": "naive"}, "typo": {"algo.moed": "naive"}}}, baseline=None)
    with pytest.raises(SpecError, match=r"cell mode=typo: unknown config key"):
        Spec.load(write_spec(tmp_path, spec))


def test_base_contradicting_a_cell_fails_naming_the_cell(tmp_path):
    spec = with_changes(base=["train.max_staleness=3"], grid={"train.fixed_staleness": [-1, 2]}, baseline=None)
    with pytest.raises(SpecError, match=r"cell train.fixed_staleness=2: train.max_staleness=3 contradicts"):
        Spec.load(write_spec(tmp_path, spec))


@pytest.mark.parametrize("changes, named", [
    ({"grid": {"seed": [0, 1]}, "baseline": None}, "grid.seed: seed is set by the study"),
    ({"base": ["run_dir=x"]}, "base: run_dir is set by the study"),
    ({"seeds": []}, "seeds must be a non-empty list"),
    ({"seeds": [1, 1]}, "seeds must be distinct"),
    ({"seeds": [0, 2**32]}, r"seeds must be a non-empty list of integers in \[0, 2\*\*32\)"),  # every seed, not the first
    ({"baseline": {"train.fixed_staleness": 5, "mode": "bypass"}}, r"baseline: train.fixed_staleness=5 is not one"),
    ({"baseline": {"mode": "bypass"}}, "missing: train.fixed_staleness"),
    ({"name": "a b"}, "name must be"),
])
def test_spec_structure_errors_name_the_key(changes, named):
    with pytest.raises(SpecError, match=named):
        Spec.parse(with_changes(**changes))


def test_a_good_spec_gives_every_cell_in_grid_order_seed_by_seed_with_its_overrides_and_run_dirs(tmp_path):
    spec = Spec.load(write_spec(tmp_path, GRID_SPEC))
    cells = spec.cells()
    assert [c.label for c in cells] == [
        "train.fixed_staleness=0 mode=bypass", "train.fixed_staleness=0 mode=tis",
        "train.fixed_staleness=2 mode=bypass", "train.fixed_staleness=2 mode=tis",
    ]
    assert cells[3].overrides == ("train.fixed_staleness=2", "algo.mode='decoupled'",
                                  "algo.correction.is_level='token'", "algo.correction.is_threshold=2.0")
    assert spec.baseline_cell() == cells[0]
    plans = spec.runs(tmp_path / "s")
    # Every cell at one seed before the next seed: a study stopped part-way stays paired.
    assert [(p.cell, p.seed) for p in plans] == [(c, s) for s in spec.seeds for c in cells]
    assert len(plans) == 12
    assert plans[5].run_dir == tmp_path / "s" / "runs" / "train.fixed_staleness-0__mode-tis" / "seed_1"
    # The study's run defaults come first, so the spec's base and cells override them; seed last.
    assert plans[5].overrides == (*RUN_DEFAULTS, "train.max_steps=3", *cells[1].overrides, "seed=1")


def test_grid_values_are_written_so_the_config_reads_them_back_as_given():
    from asyncgrpo.config import load

    assert [override_value(v) for v in (None, True, 3, 2.0, "0.5_2.0", [1, "a"])] == [
        "null", "true", "3", "2.0", "'0.5_2.0'", "[1,'a']"]
    cfg = load([f"algo.correction.is_threshold={override_value('0.5_2.0')}",
                f"algo.correction.is_level={override_value(None)}", f"train.max_steps={override_value(7)}"])
    assert cfg.algo.correction.is_threshold == "0.5_2.0" and cfg.algo.correction.is_level is None
    assert cfg.train.max_steps == 7


def test_the_spec_round_trips_through_the_study_dirs_spec_yaml():
    spec = Spec.parse(GRID_SPEC, extra_base=["task.eval_size=20"])
    again = Spec.parse(yaml.safe_load(yaml.safe_dump(spec.to_dict(), sort_keys=False)))
    assert again.base == ["train.max_steps=3", "task.eval_size=20"]
    assert [c.overrides for c in again.cells()] == [c.overrides for c in spec.cells()]
    assert again.baseline == spec.baseline and again.seeds == spec.seeds


# ------------------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("df, expected", [(1, 12.706204736), (2, 4.302652730), (4, 2.776445105),
                                          (9, 2.262157163), (30, 2.042272456), (1e6, 1.959966)])
def test_t_quantile_matches_published_values(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, rel=1e-6)
    assert t_quantile(0.025, df) == pytest.approx(-expected, rel=1e-6)


def test_mean_ci_is_the_t_interval_computed_by_hand():
    estimate = mean_ci([0.2, 0.3, 0.4, None])  # None: a run without that metric, left out
    # mean 0.3, s = 0.1, half width = t(0.975, 2) * 0.1 / sqrt(3) = 4.302653 * 0.057735 = 0.248414
    assert estimate.n == 3 and estimate.mean == pytest.approx(0.3)
    assert estimate.half_width == pytest.approx(4.30265273 * 0.1 / math.sqrt(3), rel=1e-7)
    assert estimate.low == pytest.approx(0.3 - 0.2484138, abs=1e-6)
    one = mean_ci([0.5])
    assert one.mean == 0.5 and one.half_width is None and one.low is None  # no interval from one seed
    assert mean_ci([]).mean is None


def test_paired_difference_pairs_by_seed_and_skips_seeds_missing_on_either_side():
    cell = {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.9}  # seed 3 has no baseline run
    base = {0: 0.4, 1: 0.4, 2: 0.6, 4: 0.1}  # seed 4 has no cell run
    estimate = paired_difference(cell, base)
    # differences 0.1, 0.2, 0.1: mean 0.13333, s = 0.057735, half width 4.302653 * 0.057735 / sqrt(3)
    assert estimate.n == 3 and estimate.mean == pytest.approx(0.4 / 3)
    assert estimate.half_width == pytest.approx(4.30265273 * 0.0577350269 / math.sqrt(3), rel=1e-6)


def test_paired_ratio_is_the_geometric_mean_by_seed_and_skips_seeds_missing_or_zero_on_either_side():
    cell = {0: 300.0, 1: 330.0, 2: 260.0, 3: 100.0, 5: 0.0, 6: 50.0}
    base = {0: 200.0, 1: 300.0, 2: 200.0, 3: 0.0, 4: 100.0, 5: 10.0}  # 3, 5: a zero; 4, 6: one side only
    estimate = paired_ratio(cell, base)
    logs = [math.log(1.5), math.log(1.1), math.log(1.3)]
    mean, s = sum(logs) / 3, math.sqrt(sum((x - sum(logs) / 3) ** 2 for x in logs) / 2)
    half = 4.30265273 * s / math.sqrt(3)
    assert estimate.n == 3 and estimate.mean == pytest.approx(math.exp(mean))
    assert (estimate.low, estimate.high) == pytest.approx((math.exp(mean - half), math.exp(mean + half)), rel=1e-6)


def test_paired_ratio_interval_stays_above_zero_and_inverts_with_the_sides_swapped():
    # Ratios 0.5 and 4: a symmetric interval on their plain mean (2.25) would reach far below 0.
    cell, base = {0: 50.0, 1: 400.0}, {0: 100.0, 1: 100.0}
    forward, backward = paired_ratio(cell, base), paired_ratio(base, cell)
    assert forward.low > 0 and forward.low < forward.mean < forward.high
    assert forward.mean == pytest.approx(1 / backward.mean)
    assert (forward.low, forward.high) == pytest.approx((1 / backward.high, 1 / backward.low))
    assert paired_ratio({0: 2.0}, {0: 1.0}).low is None  # one pair: no interval


def test_pareto_front_keeps_the_points_no_other_beats_in_both_coordinates():
    points = [(100.0, 0.30), (200.0, 0.25), (150.0, 0.20), (200.0, 0.20), (50.0, 0.30), (300.0, 0.10)]
    # (150, 0.20) and (200, 0.20) lose to (200, 0.25); (50, 0.30) ties (100, 0.30) on accuracy and is slower.
    assert pareto_front(points) == [0, 1, 5]
    assert pareto_front([(1.0, 1.0), (1.0, 1.0)]) == [0, 1]  # equal points beat neither
    assert pareto_front([]) == []


def test_report_names_the_cells_on_the_front_of_samples_per_s_and_accuracy_auc(tmp_path):
    run_study(Spec.parse(GRID_SPEC), tmp_path, runner=FakeRunner(), log=lambda _: None)
    front = (tmp_path / "report.md").read_text().split("## Throughput and accuracy together")[1].split("##")[0]
    # tis beats bypass in accuracy at equal samples/s; staleness 2 is faster (1.2x), staleness 0 more accurate.
    assert ("slowest first: train.fixed_staleness=0 mode=tis (501 samples/s, acc. AUC 0.230), "
            "train.fixed_staleness=2 mode=tis (601 samples/s, acc. AUC 0.210).") in front


def test_front_figure_draws_each_run_and_spans_the_runs_not_the_two_seed_intervals(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from asyncgrpo.study import plots

    spec = Spec.parse(GRID_SPEC)
    # Two seeds a cell: a t-interval (t = 12.7) many times wider than the spread of the runs.
    values = [[(100.0, 0.20), (110.0, 0.22)], [(200.0, 0.25), (190.0, 0.24)], [(150.0, 0.10), (160.0, 0.12)]]
    by_cell = [(cell, [SimpleNamespace(row={"samples_per_s": x, "accuracy_auc": y}) for x, y in runs])
               for cell, runs in zip(spec.cells(), values)]
    drawn = {}
    monkeypatch.setattr(plots, "_save_figure", lambda fig, path: drawn.setdefault("fig", fig) and path)
    plots._plot_front(spec, by_cell, tmp_path / "front.png")
    ax = drawn["fig"].axes[0]
    dots = [c for c in ax.collections if c.get_offsets().shape[0] == 2]  # a scatter per cell, a dot per run
    assert sorted(tuple(map(tuple, d.get_offsets().tolist())) for d in dots) == sorted(
        tuple(runs) for runs in values)
    low, high = ax.get_xlim()
    assert 90 < low < 100 and 200 < high < 210  # the runs with a margin, not mean +- 12.7 s / sqrt(2)
    low, high = ax.get_ylim()
    assert 0.08 < low < 0.10 and 0.25 < high < 0.27
    import matplotlib.pyplot as plt

    plt.close(drawn["fig"])


def test_accuracy_bands_over_two_seeds_stay_within_0_and_1_and_so_does_the_axis(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from asyncgrpo.study import plots

    # Two seeds that part ways: 0.9 and 0.0 at the end, a t-interval (t = 12.7) from -5 to +6.
    curves = [[(0.0, 0.15), (100.0, 0.9)], [(0.0, 0.15), (100.0, 0.0)]]
    x, mean, (low, high) = plots._band(curves, plots.ACCURACY_RANGE)
    assert mean[-1] == pytest.approx(0.45) and low[-1] == 0.0 and high[-1] == 1.0
    assert plots._band(curves)[2][0][-1] < -1  # uncut without limits (a reward's or a length's band)

    spec = Spec.parse(GRID_SPEC)
    by_cell = [(cell, [SimpleNamespace(eval_curve=c) for c in curves]) for cell in spec.cells()[:1]]
    drawn = {}
    monkeypatch.setattr(plots, "_save_figure", lambda fig, path: drawn.setdefault("fig", fig) and path)
    plots._plot_curves(spec, by_cell, lambda r: r.eval_curve, "held-out sampled accuracy", tmp_path / "a.png",
                       markers=True, limits=plots.ACCURACY_RANGE)
    low, high = drawn["fig"].axes[0].get_ylim()
    assert -0.1 < low <= 0.0 and 1.0 <= high < 1.1
    import matplotlib.pyplot as plt

    plt.close(drawn["fig"])


def test_paired_interval_is_narrower_than_unpaired_when_seeds_shift_both_cells():
    # Each seed moves both cells by the same amount (its warm start): pairing removes it.
    base = {s: 0.1 * s for s in range(5)}
    cell = {s: 0.1 * s + 0.05 + 0.001 * (-1) ** s for s in range(5)}
    paired = paired_difference(cell, base)
    assert paired.low > 0
    assert mean_ci(list(cell.values())).half_width > 10 * paired.half_width


def test_accuracy_auc_is_trapezoids_over_eval_points_divided_by_the_samples_spanned():
    assert accuracy_auc([(0, 0.1), (1000, 0.3)]) == pytest.approx(0.2)  # start and end only: their mean
    assert accuracy_auc([(0, 0.0), (100, 0.2), (300, 0.2)]) == pytest.approx((100 * 0.1 + 200 * 0.2) / 300)
    assert accuracy_auc([(0, 0.1)]) is None


# ------------------------------------------------------------------------------------- fabricated runs


def fake_accuracy(plan: RunPlan) -> float:
    """A value that depends on the cell and the seed, known to the tests."""
    staleness = int(plan.cell.values["train.fixed_staleness"])
    return 0.30 - 0.02 * staleness + (0.05 if plan.cell.values["mode"] == "tis" else 0.0) + 0.01 * plan.seed


GAP_ONSET = 6  # fabricated periodic evaluations: from this step on, greedy - sampled grows with staleness


def fake_gap(plan: RunPlan, step: int) -> float:
    """Greedy minus sampled accuracy of a fabricated periodic evaluation: 0.2, plus 0.05 per step of
    staleness from GAP_ONSET on; the same on every seed, so a paired difference has no width."""
    return 0.2 + (0.05 * int(plan.cell.values["train.fixed_staleness"]) if step >= GAP_ONSET else 0.0)


def fabricate_run(plan: RunPlan, status: str = "finished", steps: int = 3,
                  engines_reused: list[int] | None = None, eval_every: int = 0) -> None:
    """What `asyncgrpo train` leaves in a run_dir: metrics.jsonl (step and eval records) and summary.json.
    With `eval_every`, periodic evaluations at its multiples (sampled 0.1 + 0.01 seed, greedy that plus
    `fake_gap`)."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    staleness = int(plan.cell.values["train.fixed_staleness"])
    tis = plan.cell.values["mode"] == "tis"
    end = fake_accuracy(plan)
    records = [{"step": 0, "eval/accuracy": 0.1, "eval/greedy_accuracy": 0.3, "eval/when": "start"}]
    for step in range(1, steps + 1):
        # Entropy falls with the step and with staleness; completions lengthen with staleness.
        record = {"step": step, "samples": 128 * step, "reward/mean": 0.1 + 0.01 * step,
                  "staleness/mean": min(step - 1, staleness), "staleness/max": min(step - 1, staleness),
                  "loss/clipfrac": 0.01 * step, "policy/entropy": 1.0 - 0.01 * step - 0.1 * staleness,
                  "response/length_mean": 5.0 + staleness + 0.01 * plan.seed}
        if tis:
            record["is/ess"] = 0.9 + 0.01 * step
        records.append(record)
        if eval_every and step % eval_every == 0 and step < steps:
            sampled = 0.1 + 0.01 * plan.seed
            records.append({"step": step, "eval/accuracy": sampled, "eval/greedy_accuracy": sampled + fake_gap(plan, step),
                            "eval/when": "periodic"})
    if status == "finished":
        records.append({"step": steps, "eval/accuracy": end, "eval/greedy_accuracy": end + 0.2, "eval/when": "end"})
    (plan.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"status": status, "steps": steps, "samples": 128 * steps, "wall_s": 60.0 + plan.seed,
               "train_s": 20.0 / (1 + 0.1 * staleness), "samples_per_s": (500.0 + plan.seed) * (1 + 0.1 * staleness), "eval_accuracy_start": 0.1,
               "eval_greedy_accuracy_start": 0.3, "staleness_max": min(steps - 1, staleness)}
    if engines_reused is not None:
        summary["engines_reused"] = engines_reused
    # A study resumed on another commit: seed 2's runs ran "b..." with changes to tracked files.
    summary["code"] = {"version": "0.1.0", "commit": ("b" if plan.seed == 2 else "a") * 40, "dirty": plan.seed == 2}
    if status == "finished":
        summary.update(eval_accuracy_end=end, eval_greedy_accuracy_end=end + 0.2)
    else:
        summary["error"] = "TrainingFailed: fabricated"
    (plan.run_dir / "summary.json").write_text(json.dumps(summary))


class FakeRunner:
    """Records the runs it is asked for; writes a finished run, or a failed one for `fail`, or
    raises KeyboardInterrupt (after writing an interrupted summary, as the real run does) at `interrupt_at`."""

    def __init__(self, fail: set[str] = frozenset(), interrupt_at: int | None = None, pooled: bool = False,
                 steps: int = 3, eval_every: int = 0) -> None:
        self.calls: list[str] = []
        self.fail, self.interrupt_at, self.pooled = fail, interrupt_at, pooled
        self.steps, self.eval_every = steps, eval_every

    def __call__(self, plan: RunPlan) -> int:
        self.calls.append(plan.label)
        assert json.loads((plan.run_dir / RUN_RECORD).read_text())["overrides"] == list(plan.overrides)
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            fabricate_run(plan, status="interrupted", steps=1)
            raise KeyboardInterrupt
        failed = plan.label in self.fail
        # A pool's first run starts the engine; every later one takes it.
        reused = ([0] if len(self.calls) > 1 else []) if self.pooled else None
        fabricate_run(plan, status="failed" if failed else "finished", engines_reused=reused, steps=self.steps,
                      eval_every=self.eval_every)
        return 1 if failed else 0


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as handle:
        return list(csv.DictReader(handle))


def test_aggregate_writes_a_results_row_per_run_with_every_column(tmp_path):
    spec = Spec.parse(GRID_SPEC)
    outcome = run_study(spec, tmp_path, runner=FakeRunner(), log=lambda _: None)
    assert outcome.exit_code == 0 and len(outcome.ran) == 12
    rows = read_csv(tmp_path / "results.csv")
    assert list(rows[0]) == ["train.fixed_staleness", "mode", "seed", *RESULT_COLUMNS, "status", "commit", "run_dir"]
    assert len(rows) == 12
    row = next(r for r in rows if r["train.fixed_staleness"] == "2" and r["mode"] == "tis" and r["seed"] == "1")
    end = 0.30 - 0.04 + 0.05 + 0.01
    assert float(row["eval_accuracy_start"]) == 0.1
    assert float(row["eval_accuracy_end"]) == pytest.approx(end)
    assert float(row["eval_greedy_accuracy_end"]) == pytest.approx(end + 0.2)
    assert float(row["accuracy_auc"]) == pytest.approx((0.1 + end) / 2)  # start and end evals only
    assert float(row["samples_per_s"]) == pytest.approx(501.0 * 1.2) and float(row["wall_s"]) == 61.0 and float(row["train_s"]) == pytest.approx(20.0 / 1.2)
    assert float(row["staleness_mean"]) == pytest.approx((0 + 1 + 2) / 3)  # warm-up steps 0, 1, then 2
    assert float(row["staleness_max"]) == 2
    assert float(row["clipfrac"]) == pytest.approx(0.02)
    assert float(row["ess"]) == pytest.approx(0.92)
    assert row["status"] == "finished" and row["steps"] == "3" and row["samples"] == "384"
    assert row["commit"] == "aaaaaaa" and next(r for r in rows if r["seed"] == "2")["commit"] == "bbbbbbb+dirty"
    bypass = next(r for r in rows if r["mode"] == "bypass")
    assert bypass["ess"] == ""  # no is/ess logged without algo.correction.is_level
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["accuracy_auc_vs_samples_per_s.png", "accuracy_vs_samples.png", "entropy_vs_samples.png",
                     "final_accuracy_vs_mode.png",
                     "final_accuracy_vs_train.fixed_staleness.png", "greedy_accuracy_vs_samples.png",
                     "greedy_gap_vs_samples.png", "length_vs_samples.png", "reward_vs_samples.png"]


def test_report_gives_per_cell_means_with_intervals_and_paired_differences_against_the_baseline(tmp_path):
    run_study(Spec.parse(GRID_SPEC), tmp_path, runner=FakeRunner(), log=lambda _: None)
    report = (tmp_path / "report.md").read_text()
    assert "12 finished, 0 failed or interrupted, 0 not started" in report
    assert "Engines are not reused across runs" in report
    assert "from before the field existed): aaaaaaa (8 runs), bbbbbbb+dirty (4 runs)." in report
    # Cell staleness 2, tis: end accuracy 0.31 + 0.01 s over seeds 0, 1, 2: mean 0.32, s = 0.01.
    half = t_quantile(0.975, 2) * 0.01 / math.sqrt(3)
    accuracy, rest = report.split("## Training per cell")
    training, differences = rest.split("## Paired differences against the baseline")
    line = next(x for x in accuracy.splitlines() if x.startswith("| 2 | tis | 3 |"))
    assert f"| 0.100 [0.100, 0.100] | 0.320 [{0.32 - half:.3f}, {0.32 + half:.3f}] |" in line
    line = next(x for x in training.splitlines() if x.startswith("| 2 | tis | 3 |"))
    assert "| 61.0 [58.5, 63.5] |" in line  # wall_s 60 + seed: mean 61, s = 1, half width 2.484
    # Paired against staleness 0 bypass: the seed effect cancels, every difference is 0.01: s = 0, no width.
    line = next(x for x in differences.splitlines() if x.startswith("| 2 | tis | 3 |"))
    assert "+0.010 [0.010, 0.010]" in line
    # samples/s paired as a ratio: (500 + seed) x 1.2 over (500 + seed) is 1.2 on every seed; the
    # training loop's seconds, 20 / 1.2 over 20.
    ratios = differences.split("| n pairs | ratio samples/s | ratio train s |")[1]
    line = next(x for x in ratios.splitlines() if x.startswith("| 2 | tis | 3 |"))
    assert line.endswith("| 1.200 [1.200, 1.200] | 0.833 [0.833, 0.833] |")
    assert "Baseline: train.fixed_staleness=0 mode=bypass" in report


def test_results_give_the_greedy_gap_the_greedy_auc_and_the_end_entropy_and_length_of_each_run(tmp_path):
    run_study(Spec.parse(GRID_SPEC), tmp_path, runner=FakeRunner(steps=10, eval_every=2), log=lambda _: None)
    row = next(r for r in read_csv(tmp_path / "results.csv")
               if r["train.fixed_staleness"] == "2" and r["mode"] == "bypass" and r["seed"] == "1")
    assert float(row["greedy_gap_end"]) == pytest.approx(0.2)  # the end evaluation: greedy = sampled + 0.2
    # Gap at steps 0, 2, 4 (0.2), 6, 8 (0.3), 10 (the end: 0.2), trapezoids over 10 steps of 128 samples.
    assert float(row["greedy_gap_auc"]) == pytest.approx((0.2 * 4 + 0.25 * 2 + 0.3 * 2 + 0.25 * 2) / 10)
    # Greedy: 0.3 at the start, sampled (0.11) + gap at steps 2 to 8, the end's 0.30 - 0.04 + 0.01 + 0.2.
    greedy = [0.3, 0.31, 0.31, 0.41, 0.41, 0.47]
    expected = sum((greedy[i] + greedy[i + 1]) / 2 for i in range(5)) * 2 / 10
    assert float(row["greedy_accuracy_auc"]) == pytest.approx(expected)
    # The last tenth of 10 steps is step 10 alone: entropy 1.0 - 0.1 - 0.2, length 5 + 2 + 0.01.
    assert float(row["entropy_end"]) == pytest.approx(0.7)
    assert float(row["length_end"]) == pytest.approx(7.01)


def test_tail_mean_averages_the_last_tenth_of_a_curve_and_value_at_reads_between_evaluations():
    points = [(float(x), float(x)) for x in range(1, 21)]
    assert tail_mean(points) == pytest.approx(19.5)  # the last 2 of 20
    assert tail_mean(points[:3]) == 3.0 and tail_mean([]) is None  # at least one point
    curve = [(0.0, 0.1), (20.0, 0.3), (40.0, 0.2)]
    assert value_at(curve, 20.0) == pytest.approx(0.3)
    assert value_at(curve, 21.0) == pytest.approx(0.295)  # an evaluation a version late is read between
    assert value_at(curve, 41.0) is None and value_at([], 0.0) is None


def test_report_over_training_bolds_a_difference_from_the_first_step_its_interval_excludes_zero(tmp_path):
    run_study(Spec.parse(GRID_SPEC), tmp_path, runner=FakeRunner(steps=10, eval_every=2), log=lambda _: None)
    report = (tmp_path / "report.md").read_text()
    over = report.split("## Paired differences over training")[1]
    gap = over.split("### greedy - sampled accuracy")[1]
    header = next(x for x in gap.splitlines() if x.startswith("| train.fixed_staleness"))
    assert header.endswith("| step 0 | step 2 | step 4 | step 6 | step 8 | step 10 |")
    cells = next(x for x in gap.splitlines() if x.startswith("| 2 | bypass | 3 |")).strip("| ").split(" | ")[3:]
    assert [c.startswith("**") for c in cells] == [False, False, False, True, True, False]
    assert cells[3] == "**+0.100 [0.100, 0.100]**"  # from GAP_ONSET: 0.05 per step of staleness, k = 2
    # The same cell's sampled accuracy is the baseline's at every periodic step: no difference.
    sampled = over.split("### held-out sampled accuracy")[1].split("###")[0]
    cells = next(x for x in sampled.splitlines() if x.startswith("| 2 | bypass | 3 |")).strip("| ").split(" | ")[3:]
    assert cells[1:5] == ["+0.000 [0.000, 0.000]"] * 4
    # Entropy and length at the end, paired: staleness 2 has 0.2 nats less and 2 tokens more.
    policy = report.split("diff. entropy end")[1].split("##")[0]
    line = next(x for x in policy.splitlines() if x.startswith("| 2 | bypass | 3 |"))
    assert "-0.200 [-0.200, -0.200] | +2.000 [2.000, 2.000] |" in line


def test_report_has_no_over_training_section_without_periodic_evaluation(tmp_path):
    run_study(Spec.parse(GRID_SPEC), tmp_path, runner=FakeRunner(), log=lambda _: None)
    report = (tmp_path / "report.md").read_text()
    assert "## Paired differences over training" not in report
    assert "diff. greedy - sampled end" in report  # the end differences are there all the same


def test_a_failed_run_is_reported_and_left_out_of_the_statistics(tmp_path):
    spec = Spec.parse(GRID_SPEC)
    runner = FakeRunner(fail={"train.fixed_staleness=0 mode=tis seed=1"})
    outcome = run_study(spec, tmp_path, runner=runner, log=lambda _: None)
    assert outcome.exit_code == 1 and len(outcome.not_finished) == 1 and len(runner.calls) == 12
    report = (tmp_path / "report.md").read_text()
    assert "11 finished, 1 failed or interrupted" in report
    assert "train.fixed_staleness=0 mode=tis seed=1: failed: TrainingFailed: fabricated" in report
    assert next(x for x in report.splitlines() if x.startswith("| 0 | tis |")).startswith("| 0 | tis | 2 |")
    statuses = [r["status"] for r in read_csv(tmp_path / "results.csv")]
    assert statuses.count("failed") == 1


# ------------------------------------------------------------------------------------- resume and Ctrl-C


def test_a_rerun_skips_finished_runs_and_starts_unfinished_ones_again_from_scratch(tmp_path):
    spec = Spec.parse(GRID_SPEC)
    first = FakeRunner(fail={"train.fixed_staleness=2 mode=bypass seed=0"})
    run_study(spec, tmp_path, runner=first, log=lambda _: None)
    again = FakeRunner()
    outcome = run_study(spec, tmp_path, runner=again, log=lambda _: None)
    assert again.calls == ["train.fixed_staleness=2 mode=bypass seed=0"]  # only the one that failed
    assert len(outcome.skipped) == 11 and outcome.exit_code == 0
    failed_dir = spec.runs(tmp_path)[6].run_dir
    assert failed_dir.with_name("seed_0.incomplete-1").is_dir()  # the failed attempt is kept beside it
    assert json.loads((failed_dir / "summary.json").read_text())["status"] == "finished"
    third = FakeRunner()
    run_study(spec, tmp_path, runner=third, log=lambda _: None)
    assert third.calls == []


def test_more_seeds_on_a_rerun_run_only_the_new_seeds(tmp_path):
    run_study(Spec.parse(GRID_SPEC), tmp_path, runner=FakeRunner(), log=lambda _: None)
    runner = FakeRunner()
    run_study(Spec.parse(with_changes(seeds=[0, 1, 2, 3])), tmp_path, runner=runner, log=lambda _: None)
    assert len(runner.calls) == 4 and all(call.endswith("seed=3") for call in runner.calls)
    assert len(read_csv(tmp_path / "results.csv")) == 16


def test_a_rerun_whose_base_changed_is_refused_before_any_run(tmp_path):
    run_study(Spec.parse(GRID_SPEC), tmp_path, runner=FakeRunner(), log=lambda _: None)
    runner = FakeRunner()
    with pytest.raises(StudyError, match=r"finished with other settings.*train.max_steps=4"):
        run_study(Spec.parse(with_changes(base=["train.max_steps=4"])), tmp_path, runner=runner, log=lambda _: None)
    assert runner.calls == []


def test_a_rerun_whose_base_sets_the_same_values_in_another_order_reuses_the_finished_runs(tmp_path):
    base = ["train.max_steps=3", "learner.lr=5e-5", "model.cache_dir=/tmp/warm"]
    run_study(Spec.parse(with_changes(base=base)), tmp_path, runner=FakeRunner(), log=lambda _: None)
    runner = FakeRunner()
    run_study(Spec.parse(with_changes(base=[base[2], base[0], base[1]])), tmp_path, runner=runner, log=lambda _: None)
    assert runner.calls == []


def test_a_rerun_where_a_repeated_key_ends_on_another_value_is_refused_naming_it(tmp_path):
    run_study(Spec.parse(with_changes(base=["train.max_steps=3", "train.max_steps=5"])), tmp_path,
              runner=FakeRunner(), log=lambda _: None)
    runner = FakeRunner()
    with pytest.raises(StudyError, match=r"differing: train.max_steps=3, train.max_steps=5\)"):
        run_study(Spec.parse(with_changes(base=["train.max_steps=5", "train.max_steps=3"])), tmp_path,
                  runner=runner, log=lambda _: None)
    assert runner.calls == []


@pytest.mark.parametrize("first, second, same", [
    (["a=1", "b=2"], ["b=2", "a=1"], True),
    (["a=1", "a=2"], ["a=2"], True),  # the last one wins, as in Hydra
    (["a=1", "a=2"], ["a=2", "a=1"], False),
    (["+a=1"], ["a=1"], False),  # adding a key is not setting one
    (["a.b=1", "a.c=2"], ["a.c=2", "a.b=1"], True),
    (["a={b:1}", "a.b=2"], ["a.b=2", "a={b:1}"], False),  # a key and one inside it: their order decides
    (["r=[1]", "r[0]=2"], ["r[0]=2", "r=[1]"], False),
    (["~a", "a=1"], ["a=1"], False),  # a deletion: compared as written
    (["a=1"], ["a=1", "b=2"], False),
])
def test_overrides_compare_by_what_they_set_and_by_their_order_only_where_it_matters(first, second, same):
    assert (override_settings(first) == override_settings(second)) is same


def test_ctrl_c_stops_the_study_and_still_writes_the_results_of_the_finished_runs(tmp_path):
    spec = Spec.parse(GRID_SPEC)
    runner = FakeRunner(interrupt_at=3)
    outcome = run_study(spec, tmp_path, runner=runner, log=lambda _: None)
    assert outcome.interrupted and outcome.exit_code == 130
    assert len(runner.calls) == 3  # no run started after the interrupt
    rows = read_csv(tmp_path / "results.csv")
    assert [r["status"] for r in rows] == ["finished", "finished", "interrupted"]
    assert "2 finished, 1 failed or interrupted, 9 not started" in (tmp_path / "report.md").read_text()
    # The next invocation continues: the interrupted run again, then the rest.
    again = FakeRunner()
    run_study(spec, tmp_path, runner=again, log=lambda _: None)
    assert len(again.calls) == 10 and again.calls[0] == runner.calls[2]


def test_a_second_study_in_the_same_directory_is_refused_while_one_runs(tmp_path):
    spec = Spec.parse(GRID_SPEC)

    def nested(plan: RunPlan) -> int:
        with pytest.raises(StudyError, match="another asyncgrpo study is running"):
            run_study(spec, tmp_path, runner=FakeRunner(), log=lambda _: None)
        raise KeyboardInterrupt

    assert run_study(spec, tmp_path, runner=nested, log=lambda _: None).interrupted


def test_the_cli_exit_codes_say_spec_error_and_dry_run_lists_the_runs(tmp_path, capsys):
    from asyncgrpo.cli import main

    bad = write_spec(tmp_path, with_changes(grid={"algo.mode": ["bogus"]}, baseline=None), "bad.yaml")
    assert main(["study", str(bad)]) == 2
    assert "cell algo.mode=bogus" in capsys.readouterr().err
    good = write_spec(tmp_path, GRID_SPEC)
    assert main(["study", str(good), f"study_dir={tmp_path / 's'}", "--dry-run"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 12 and all(line.strip().startswith("to run") for line in listed)
    assert not (tmp_path / "s").exists()  # a dry run writes nothing


def test_a_cell_that_sets_what_its_runs_do_not_read_is_warned_of_once_before_anything_runs(tmp_path, capsys):
    from asyncgrpo.cli import main

    grid = {"mode": {"naive_tis": {"algo.mode": "naive", "algo.correction.is_level": "token"},
                     "tis": {"algo.mode": "decoupled", "algo.correction.is_level": "token"}}}
    spec = write_spec(tmp_path, with_changes(grid=grid, baseline=None))
    assert main(["study", str(spec), f"study_dir={tmp_path / 's'}", "--dry-run"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert warnings == ["[study] warning: cell mode=naive_tis: set but not read by its runs: "
                        "algo.correction.is_level=token (algo.mode=naive applies no rollout correction)"]


def test_the_subprocess_runner_passes_one_sigint_to_a_run_in_its_own_session(tmp_path, monkeypatch):
    """Ctrl-C reaches only the study (the run has its own session); the study passes one SIGINT on,
    waits for the run to write its summary and exit, then raises KeyboardInterrupt itself."""
    child = (
        "import os, signal, sys, time, pathlib\n"
        "out = pathlib.Path(sys.argv[1])\n"
        "def stop(signum, frame):\n"
        "    time.sleep(0.3)  # its clean-up; the study must wait for it\n"
        "    out.write_text(f'{os.getsid(0)} interrupted')\n"
        "    sys.exit(130)\n"
        "signal.signal(signal.SIGINT, stop)\n"
        "out.write_text('ready')\n"
        "time.sleep(60)\n"
    )
    marker = tmp_path / "marker"
    plan = Spec.parse(GRID_SPEC).runs(tmp_path)[0]
    runner = SubprocessRunner(log=lambda _: None)
    monkeypatch.setattr(runner, "command", lambda _: [sys.executable, "-c", child, str(marker)])
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def ctrl_c_when_ready() -> None:
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text() == "ready") and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_when_ready, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner(plan)
    finally:
        signal.signal(signal.SIGINT, previous)
    sid, word = marker.read_text().split()
    assert word == "interrupted" and int(sid) != os.getsid(0)
    assert (plan.run_dir / RUN_LOG).exists()


CHILD_WAITING_FOR_SIGINT = (
    "import signal, sys, time, pathlib\n"
    "out = pathlib.Path(sys.argv[1])\n"
    "def stop(signum, frame):\n"
    "    out.write_text('interrupted')\n"
    "    sys.exit(130)\n"
    "signal.signal(signal.SIGINT, stop)\n"
    "out.write_text('ready')\n"
    "time.sleep(60)\n"
)


def test_a_run_gets_a_sigint_when_the_study_dies_without_passing_one_on(tmp_path):
    """A study killed outright (SIGKILL, a closed terminal) leaves no run training unwatched."""
    marker = tmp_path / "marker"
    study_process = (
        "import sys\n"
        "from asyncgrpo.study.runner import SubprocessRunner\n"
        "from asyncgrpo.study.spec import Spec\n"
        f"plan = Spec.parse({{'name': 'x', 'grid': {{'seed_like': [1]}}, 'seeds': [0]}}).runs({str(tmp_path)!r})[0]\n"
        "runner = SubprocessRunner()\n"
        f"runner.command = lambda _: [sys.executable, '-c', {CHILD_WAITING_FOR_SIGINT!r}, {str(marker)!r}]\n"
        "runner(plan)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", study_process])
    try:
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text() == "ready"):
            assert time.monotonic() < deadline and parent.poll() is None, "the run did not start"
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while marker.read_text() != "interrupted":
            assert time.monotonic() < deadline, "the run got no SIGINT when the study died"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_aggregate_alone_rebuilds_the_results_from_the_run_directories(tmp_path):
    spec = Spec.parse(GRID_SPEC)
    run_study(spec, tmp_path, runner=FakeRunner(), log=lambda _: None)
    before = (tmp_path / "results.csv").read_text()
    (tmp_path / "results.csv").unlink()
    aggregate(tmp_path)
    assert (tmp_path / "results.csv").read_text() == before


def test_the_example_specs_in_configs_studies_load_and_set_nothing_their_runs_do_not_read(tmp_path):
    for path in sorted(STUDY_SPECS_DIR.glob("*.yaml")):
        data = read_spec_file(path)
        # A replay study's recordings exist only where they were made: its structure is checked.
        spec = Spec.parse(data, source=str(path)) if data.get("command") == "replay" else Spec.load(path)
        assert spec.cells() and spec.seeds
        assert spec.unread == [], path
        if spec.baseline is not None:
            assert spec.baseline_cell() is not None


def test_a_study_name_finds_its_spec_in_configs_studies():
    assert find_spec("quick") == STUDY_SPECS_DIR / "quick.yaml"


def test_report_says_how_many_runs_started_on_a_kept_engine(tmp_path):
    run_study(Spec.parse(GRID_SPEC), tmp_path, runner=FakeRunner(pooled=True), log=lambda _: None)
    report = (tmp_path / "report.md").read_text()
    assert "**Engines are kept between runs**" in report and "Engines are not reused" not in report
    assert "11 of the 12 finished runs started on generator engines kept from the run before" in report


class SlowRunner(FakeRunner):
    """A FakeRunner whose runs last a moment, counting how many run at once; with `block`, each run
    waits until `interrupt` (a Ctrl-C passed on) and then ends interrupted, as a real run does."""

    def __init__(self, block: bool = False, wrap_up_s: float = 0.0) -> None:
        super().__init__()
        self.block, self.wrap_up_s, self.now, self.most, self.presses = block, wrap_up_s, 0, 0, []
        self.lock, self.released = threading.Lock(), threading.Event()

    def __call__(self, plan: RunPlan) -> int:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            if self.block:
                self.calls.append(plan.label)
                nth = len(self.calls)
                self.released.wait(30)
                time.sleep(self.wrap_up_s if nth == 1 else 0.0)  # the first run takes longer to stop
                fabricate_run(plan, status="interrupted", steps=1)
                return EXIT_INTERRUPTED
            time.sleep(0.05)
            return super().__call__(plan)
        finally:
            with self.lock:
                self.now -= 1

    def interrupt(self, presses: int) -> None:
        self.presses.append(presses)
        self.released.set()


def test_concurrent_runs_go_n_at_a_time_and_report_as_one_after_another_would(tmp_path):
    runner = SlowRunner()
    outcome = run_study(Spec.parse(GRID_SPEC), tmp_path / "concurrent", runner=runner, log=lambda _: None,
                        concurrent=3)
    assert outcome.exit_code == 0 and len(outcome.ran) == 12 and runner.most == 3
    run_study(Spec.parse(GRID_SPEC), tmp_path / "in_turn", runner=FakeRunner(), log=lambda _: None)

    def rows(directory):
        return sorted((r["train.fixed_staleness"], r["mode"], r["seed"], r["eval_accuracy_end"], r["status"])
                      for r in read_csv(directory / "results.csv"))

    assert rows(tmp_path / "concurrent") == rows(tmp_path / "in_turn")


def test_ctrl_c_during_concurrent_runs_reaches_every_run_and_starts_no_other(tmp_path):
    runner = SlowRunner(block=True)
    logs: list[str] = []

    def press_ctrl_c_once_both_run() -> None:
        while len(runner.calls) < 2:
            time.sleep(0.01)
        signal.raise_signal(signal.SIGINT)  # handled in the main thread, as a terminal's Ctrl-C is

    threading.Thread(target=press_ctrl_c_once_both_run, daemon=True).start()
    outcome = run_study(Spec.parse(GRID_SPEC), tmp_path, runner=runner, log=logs.append, concurrent=2)
    assert outcome.interrupted and outcome.exit_code == EXIT_INTERRUPTED
    assert runner.presses == [1] and len(runner.calls) == 2  # both runs told once; no third started
    assert len(outcome.not_finished) == 2 and (tmp_path / "results.csv").is_file()
    assert any("interrupt: stopping the runs in progress" in line for line in logs)


def test_ctrl_c_during_concurrent_runs_reports_only_after_the_slowest_run_has_stopped(tmp_path):
    # Regression: waiting by Thread.join, a Ctrl-C could mark a worker thread whose run was still
    # stopping as ended (CPython 3.11), and the study reported without that run.
    for attempt in range(5):
        runner = SlowRunner(block=True, wrap_up_s=0.3)

        def press_ctrl_c_once_both_run() -> None:
            while len(runner.calls) < 2:
                time.sleep(0.01)
            signal.raise_signal(signal.SIGINT)

        threading.Thread(target=press_ctrl_c_once_both_run, daemon=True).start()
        outcome = run_study(Spec.parse(GRID_SPEC), tmp_path / str(attempt), runner=runner, log=lambda _: None,
                            concurrent=2)
        assert runner.now == 0, "the study returned while a run was still stopping"
        assert outcome.interrupted and len(outcome.ran) == 2 and len(outcome.not_finished) == 2


def test_concurrent_below_one_is_refused(tmp_path):
    with pytest.raises(StudyError, match="--concurrent"):
        run_study(Spec.parse(GRID_SPEC), tmp_path, runner=FakeRunner(), log=lambda _: None, concurrent=0)
