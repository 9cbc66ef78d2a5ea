"""tools/__init__.py's command-line checks, which the tools share, and the tools without a test file of
their own (chaos's --set, bench_wire, bench_learner, bench_push, bench_real): bad input is refused in
one line with exit status 2 before anything runs. Parsing only: no run, no engine, no Ray."""

from __future__ import annotations

import argparse

import pytest
import tools
from tools import bench_learner, bench_push, bench_real, bench_wire, chaos


def refused(call, capsys) -> str:
    """`call()` exits 2 (argparse's parser.error): its one error line."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(lines)
    return lines[-1]


# ------------------------------------------------------------------------------------- the helpers


@pytest.mark.parametrize("kind, bad", [
    (tools.positive_int, ["0", "-1", "x", "1.5"]),
    (tools.nonnegative_int, ["-1", "x"]),
    (tools.finite_float, ["nan", "inf", "-inf", "x"]),
    (tools.positive_float, ["nan", "inf", "0", "-1", "x"]),
    (tools.nonnegative_float, ["nan", "inf", "-0.5"]),
])
def test_number_types_refuse_nan_infinity_and_what_is_out_of_their_range(kind, bad):
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            kind(text)


def test_number_types_take_what_is_in_range():
    assert (tools.positive_int("3"), tools.nonnegative_int("0"), tools.finite_float("-2.5"),
            tools.positive_float("1e-6"), tools.nonnegative_float("0")) == (3, 0, -2.5, 1e-6, 0.0)


def test_a_comma_list_refuses_empty_items_unknown_choices_and_a_value_twice():
    assert tools.comma_list(" 1, 2", int) == [1, 2]
    assert tools.comma_list(",", allow_empty=True) == []
    assert tools.comma_list("1,1", float, unique=False) == [1.0, 1.0]  # e.g. two generators of one speed
    for text, options in [("", {}), ("1,,2", {}), ("a", {"choices": ["b"]}), ("0,0", {}), ("50,050", {"convert": int}),
                          ("1e-4,0.0001", {"convert": float}), ("1,x", {"convert": int})]:
        with pytest.raises(argparse.ArgumentTypeError):
            tools.comma_list(text, **options)


def test_overrides_must_be_key_value_and_leave_the_tools_keys_alone(capsys):
    parser = argparse.ArgumentParser(prog="tool")
    tools.check_overrides(parser, ["seed=1", "+x.y=2", "~z"], reserved=("run_dir",))
    assert "overrides are key=value" in refused(lambda: tools.check_overrides(parser, ["seed"]), capsys)
    line = refused(lambda: tools.check_overrides(parser, ["+run_dir=/x"], ("run_dir",), "the tool"), capsys)
    assert "run_dir is set by the tool itself" in line


def test_a_config_error_is_one_line_naming_what_was_composed(capsys):
    parser = argparse.ArgumentParser(prog="tool")
    line = refused(lambda: tools.load_config(parser, ["trian.max_steps=3"], what="mode 'x'"), capsys)
    assert line.startswith("tool: error: mode 'x': ") and "trian" in line
    assert tools.load_config(parser, ["train.max_steps=3"]).train.max_steps == 3


def test_a_fresh_folder_is_never_one_that_exists(tmp_path):
    first, second = tools.fresh_dir(tmp_path), tools.fresh_dir(tmp_path)
    assert first != second and first.parent == second.parent == tmp_path and first.is_dir() and second.is_dir()


# ------------------------------------------------------------------------------------ chaos --set


@pytest.mark.parametrize("setting, says", [
    ("run_dir=/tmp/x", "reserved"),
    ("train.max_staleness=4", "reserved"),
    ("train.groups_per_step=8", "reserved"),
    ("+train.steps_per_call=1", "reserved"),
    ("wire.record_dir=/tmp/r", "reserved"),
    ("rollout.num_generators", "key=value"),
    ("trian.max_steps=3", "trian"),
])
def test_chaos_set_is_checked_before_any_scenario_runs(setting, says, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(chaos, "run_scenario", lambda *a: pytest.fail("a scenario ran"))
    line = refused(lambda: chaos.main(["--set", setting, "--scenarios", chaos.SCENARIOS[0].name,
                                       "--out", str(tmp_path / "out")]), capsys)
    assert says in line
    assert not (tmp_path / "out").exists() and chaos.EXTRA_OVERRIDES == []


# ------------------------------------------------------------------------------------- bench_wire


@pytest.mark.parametrize(("argv", "says"), [
    (["--repeat", "0"], "argument --repeat: wants an integer >= 1, got '0'"),
    *((["--scale", bad], f"argument --scale: wants a finite number > 0, got '{bad}'")
      for bad in ("nan", "inf", "0", "-1")),
])
def test_bench_wire_refuses_no_repeat_and_a_scale_that_is_not_a_positive_number(argv, says, capsys):
    assert refused(lambda: bench_wire.parse_args(argv), capsys).endswith(says)


def test_bench_wire_takes_its_defaults():
    args = bench_wire.parse_args([])
    assert (args.scale, args.repeat) == (1.0, 1)


# ----------------------------------------------------------------------------------- bench_learner


@pytest.mark.parametrize(("argv", "says"), [
    (["--steps", "0"], "argument --steps: wants an integer >= 1, got '0'"),
    (["--warmup", "-5"], "argument --warmup: wants an integer >= 0, got '-5'"),
    (["--shapes", "foo"], "argument --shapes: unknown foo (choose from default, long)"),
    (["--shapes", "long,long"], "argument --shapes: long given twice in 'long,long'"),
    (["--world-sizes", "1,x"], "argument --world-sizes: wants an integer >= 1, got 'x'"),
    (["--world-sizes", "0"], "argument --world-sizes: wants an integer >= 1, got '0'"),
    (["--world-sizes", "1,1"], "argument --world-sizes: 1 given twice in '1,1'"),
    (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
    (["--groups", "0"], "argument --groups: wants an integer >= 1, got '0'"),
    (["learner.lora.rnak=4"], "unknown config key 'learner.lora.rnak' (did you mean learner.lora.rank?)"),
])
def test_bench_learners_parse_refuses_bad_arguments(argv, says, capsys):
    assert says in refused(lambda: bench_learner.parse_args(argv), capsys)


def test_bench_learner_parses_its_lists():
    args = bench_learner.parse_args(["--world-sizes", "2,1", "--shapes", "long", "--size", "qwen2.5-0.5b-2l"])
    assert (args.world_sizes, args.shapes, args.size) == ([2, 1], ["long"], "qwen2.5-0.5b-2l")
    assert bench_learner.parse_args([]).shapes == list(bench_learner.SHAPES)


# -------------------------------------------------------------------------------------- bench_push


@pytest.mark.parametrize(("argv", "says"), [
    (["--pushes", "0"], "argument --pushes: wants an integer >= 1, got '0'"),
    (["--backends", "zmq,tcp"], "argument --backends: unknown tcp (choose from zmq, shm, zmq-bf16, zmq-delta)"),
    (["--sizes", "tiny,1B"],
     "argument --sizes: unknown 1B (choose from tiny, 100M, qwen2.5-0.5b, qwen2.5-0.5b-2l, qwen2.5-7b, tiny-fullvocab)"),
    (["--backends", "zmq,zmq"], "argument --backends: zmq given twice in 'zmq,zmq'"),
    (["--lr", "nan"], "argument --lr: wants a finite number > 0, got 'nan'"),
    (["--lr", "0"], "argument --lr: wants a finite number > 0, got '0'"),
    (["--train-steps", "-1"], "argument --train-steps: wants an integer >= 0, got '-1'"),
    (["--adapter-only"], "--adapter-only measures the adapter rows: it needs --lora-rank >= 1"),
    (["--adapter-only", "--lora-rank", "0"], "--adapter-only measures the adapter rows: it needs --lora-rank >= 1"),
    (["--lora-rank", "8", "--lora-apply", "merge,fast"],
     "argument --lora-apply: unknown fast (choose from merge, vllm)"),
    (["--groups", "0"], "argument --groups: wants an integer >= 1, got '0'"),
])
def test_bench_pushs_parse_refuses_bad_arguments(argv, says, capsys):
    assert refused(lambda: bench_push.parse_args(argv), capsys).endswith(says)


def test_bench_push_takes_its_lists_and_every_make_model_shape():
    args = bench_push.parse_args(["--sizes", "tiny,qwen2.5-0.5b", "--backends", "zmq-delta", "--lora-rank", "16",
                                  "--adapter-only", "--lora-apply", "merge,vllm"])
    assert (args.sizes, args.backends, args.lora_apply) == (["tiny", "qwen2.5-0.5b"], ["zmq-delta"], ["merge", "vllm"])
    assert bench_push.parse_args([]).sizes == ["tiny", "100M"]


# -------------------------------------------------------------------------------------- bench_real


@pytest.mark.parametrize(("argv", "says"), [
    (["--steps", "1"], "--steps must be at least 2: the first step is not measured"),
    (["--shapes", "qwen2.5-0.5b-2I"], "argument --shapes: unknown qwen2.5-0.5b-2I"),
    (["--groups", "0"], "argument --groups: wants an integer >= 1, got '0'"),
    (["--shapes", "qwen2.5-0.5b,qwen2.5-0.5b"], "argument --shapes: qwen2.5-0.5b given twice"),
])
def test_bench_reals_parse_refuses_bad_arguments(argv, says, capsys):
    assert says in refused(lambda: bench_real.parse_args(argv), capsys)


def test_bench_real_runs_into_a_new_folder_each_time(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(bench_real, "make_model", lambda shape, models: models / shape)
    monkeypatch.setattr(bench_real, "run", lambda shape, model_dir, out, args: seen.append(out) or {})
    monkeypatch.setattr(bench_real, "print_table", lambda row: None)
    for _ in range(2):
        assert bench_real.main(["--shapes", "qwen2.5-0.5b-2l", "--out", str(tmp_path)]) == 0
    assert seen[0] != seen[1] and all(out.parent == tmp_path and out.is_dir() for out in seen)
