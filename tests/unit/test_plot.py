"""`asyncgrpo plot`: synthetic run directories -> non-empty PNGs, overlays, missing keys."""

import json
import random
from pathlib import Path

import pytest

from asyncgrpo import cli
from asyncgrpo.metrics.runs import load_run
from asyncgrpo.plot import plot_runs, run_labels

FIGURES = {"reward.png", "eval_accuracy.png", "staleness.png", "is_mismatch.png", "throughput.png", "audit.png"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(path: Path, steps: int = 40, seed: int = 0, generators: int = 1) -> Path:
    rng = random.Random(seed)
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"rollout:\n  num_generators: {generators}\n")
    records = [{"step": 0, "eval/accuracy": 0.15, "eval/greedy_accuracy": 0.4, "eval/when": "start"}]
    for s in range(1, steps + 1):
        step_s = 0.2 + 0.05 * rng.random()
        records.append({
            "step": s, "samples": 128 * s, "reward/mean": 0.2 + 0.3 * s / steps + rng.gauss(0, 0.05),
            "staleness/min": 0, "staleness/mean": 1.5, "staleness/max": min(s - 1, 2),
            "time/step_s": step_s, "time/gen_wait_s": 0.1 * step_s, "time/gen_idle_s": 0.2 * step_s,
            "perf/samples_per_s": 128 / step_s, "time/wall_s": 0.25 * s,
            "is/mean": 1.0, "is/max": 1.5, "mismatch/kl": 1e-4, "loss/pg": 0.0,
        })
    records.append({"step": steps, "eval/accuracy": 0.45, "eval/greedy_accuracy": 0.8, "eval/when": "end"})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4')  # torn line
    (path / "summary.json").write_text(json.dumps({
        "status": "finished", "steps": steps,
        "learner": {"staleness_histogram": {"0": 10, "1": 200, "2": 300}},
        "generators": [{"gen_time/generate_s": 50.0, "gen_time/throttle_s": 5.0, "gen_time/weights_s": 3.0}] * generators,
    }))
    return path


def assert_pngs(paths, directory: Path) -> None:
    assert {p.name for p in paths} == FIGURES
    for path in paths:
        assert path.parent == directory
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_one_run_writes_every_figure_under_run_dir_plots(tmp_path):
    run = make_run(tmp_path / "run1")
    assert_pngs(plot_runs([run]), run / "plots")


def test_loaded_run_separates_steps_evals_and_skips_a_torn_line(tmp_path):
    run = load_run(make_run(tmp_path / "r", steps=10, generators=2))
    assert len(run.steps) == 10 and len(run.evals) == 2 and run.num_generators == 2
    xs, ys = run.series("reward/mean", "time/wall_s")
    assert len(xs) == len(ys) == 10
    assert run.at_step(10, "samples") == 1280 and run.at_step(0, "time/wall_s") == 0.0


def test_several_runs_overlay_into_one_directory_via_the_cli(tmp_path, monkeypatch, capsys):
    a = make_run(tmp_path / "a", seed=1)
    b = make_run(tmp_path / "b", steps=25, seed=2, generators=2)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plot", str(a), str(b)]) == 0
    printed = capsys.readouterr().out.split()
    assert {Path(p).name for p in printed} == FIGURES
    assert_pngs([tmp_path / p for p in printed], tmp_path / "plots_compare")
    single = plot_runs([a], tmp_path / "mine")
    assert single[0].parent == tmp_path / "mine"
    # A two-run overlay draws more than the single run on the same figure.
    assert (tmp_path / "plots_compare" / "reward.png").stat().st_size > single[0].stat().st_size


def test_missing_keys_give_no_data_panels_instead_of_errors(tmp_path, monkeypatch):
    from asyncgrpo import plot

    missing: list[str] = []
    real_no_data = plot._no_data
    monkeypatch.setattr(plot, "_no_data", lambda ax, what="": missing.append(what) or real_no_data(ax, what))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(json.dumps({"step": 1, "samples": 128, "reward/mean": 0.5}) + "\n")
    paths = plot_runs([bare])
    assert_pngs(paths, bare / "plots")
    drawn_bare = len(missing)
    assert drawn_bare > 0  # a reward alone: the other panels say so
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "summary.json").write_text(json.dumps({"status": "failed"}))
    assert_pngs(plot_runs([empty]), empty / "plots")
    assert len(missing) - drawn_bare > drawn_bare  # no records at all: the reward panel too


def test_not_a_run_directory_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        load_run(tmp_path)


def test_labels_are_unique_even_when_run_names_collide(tmp_path):
    assert run_labels([tmp_path / "x" / "run", tmp_path / "y" / "run"]) == ["x/run", "y/run"]
    assert run_labels([tmp_path / "a", tmp_path / "b"]) == ["a", "b"]


def test_steps_logged_again_after_a_resume_in_the_same_run_dir_replace_the_earlier_ones(tmp_path):
    # The first run logged steps 1-5 and checkpointed at 3; the resumed run appended 4-6.
    run = tmp_path / "continued"
    run.mkdir()
    lines = [{"step": s, "samples": s * 128, "reward/mean": 0.1} for s in range(1, 6)]
    lines += [{"step": s, "samples": s * 128, "reward/mean": 0.9} for s in range(4, 7)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    steps = load_run(run).steps
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["reward/mean"] for r in steps] == [0.1, 0.1, 0.1, 0.9, 0.9, 0.9]


def test_the_audit_figure_draws_every_panel_from_audit_keys_and_says_no_data_without_them(tmp_path, monkeypatch):
    from asyncgrpo import plot

    missing: list[str] = []
    monkeypatch.setattr(plot, "_no_data", lambda ax, what="": missing.append(what))
    bare = make_run(tmp_path / "bare")
    plot.plot_runs([bare])
    assert len(missing) == 4  # the other figures have data: only the audit's four panels miss theirs
    audited = make_run(tmp_path / "audited")
    (audited / "config.yaml").write_text("rollout:\n  num_generators: 1\nlog:\n  audit_max_ks: 0.1\n")
    records = [json.loads(line) for line in (audited / "metrics.jsonl").read_text().splitlines()[:-1]]
    for record in records:
        if "eval/accuracy" not in record:
            s = record["step"]
            record.update({f"audit/{side}_length_p{q}": q / 10 + (side == "sampled") for side in ("sampled", "trained")
                           for q in (10, 50, 90)})
            record.update({"audit/sampled_reward_mean": 0.3, "audit/trained_reward_mean": 0.35,
                           "audit/ks_length": 0.05, "audit/ks_reward": 0.12, "audit/not_trained/filtered": s})
    (audited / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    missing.clear()
    paths = plot.plot_runs([audited])
    assert missing == [] and audited / "plots" / "audit.png" in paths


def test_lines_that_are_not_step_records_are_skipped_and_counted_not_a_traceback(tmp_path, capsys):
    run = make_run(tmp_path / "r", steps=5)
    torn = load_run(run).skipped_lines  # make_run ends with a torn line, as a killed run does
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(b'\n5\n[1]\n{"step": {}, "eval/accuracy": 0.5}\n\xff\xfe garbage\n')
    assert load_run(run).skipped_lines == torn + 4
    assert len(load_run(run).steps) == 5
    assert cli.main(["plot", str(run), "--out", str(tmp_path / "out")]) == 0
    assert f"{torn + 4} lines that are not step records skipped" in capsys.readouterr().err


@pytest.mark.parametrize(("make", "said"), [
    (lambda run: (run / "summary.json").write_text("[1, 2]"), "summary.json: not a JSON object"),
    (lambda run: (run / "summary.json").write_bytes(b'{"a": "\xff"}'), "summary.json: not UTF-8 text"),
    (lambda run: ((run / "metrics.jsonl").unlink(), (run / "metrics.jsonl").mkdir()), "metrics.jsonl: Is a directory"),
])
def test_an_unreadable_run_file_is_one_line_naming_it(tmp_path, capsys, make, said):
    run = make_run(tmp_path / "r", steps=5)
    make(run)
    assert cli.main(["plot", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err


def test_an_out_directory_that_is_a_file_is_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "r", steps=5)
    (tmp_path / "taken").write_text("")
    assert cli.main(["plot", str(run), "--out", str(tmp_path / "taken")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"asyncgrpo: plot: --out: {tmp_path / 'taken'} is a file, not a directory"


def test_an_out_directory_below_a_file_names_the_file(tmp_path, capsys):
    run = make_run(tmp_path / "r", steps=5)
    (tmp_path / "taken").write_text("")
    assert cli.main(["plot", str(run), "--out", str(tmp_path / "taken" / "plots")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"asyncgrpo: plot: --out: {tmp_path / 'taken'} is a file, not a directory"
