"""tools/bench_lora.py's pure parts: its modes and how it compares them (no training run)."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.config import load
from tools import bench_lora as bl


def test_the_lora_modes_differ_only_in_how_the_generator_applies_the_same_adapters():
    full, merge, vllm = bl.modes_for(rank=8, eta=2)
    assert (full.label, merge.label, vllm.label) == (bl.FULL, bl.MERGE, bl.VLLM)
    assert all("train.max_staleness=2" in m.overrides for m in (full, merge, vllm))
    assert not any("lora" in o for o in full.overrides)
    assert set(merge.overrides) ^ set(vllm.overrides) == {"rollout.lora_apply=merge", "rollout.lora_apply=vllm"}
    for mode in (full, merge, vllm):  # every mode is a valid config
        load(list(mode.overrides))


def test_a_pushs_load_time_is_the_generators_load_seconds_over_their_loads():
    assert bl.weight_load_ms([{"gen/weight_loads": 4, "gen/weight_load_s": 0.02},
                              {"gen/weight_loads": 1, "gen/weight_load_s": 0.03}]) == pytest.approx(10.0)
    assert bl.weight_load_ms([{"gen/weight_loads": 0, "gen/weight_load_s": 0.0}]) is None


def test_x_merge_is_each_modes_samples_per_second_over_lora_merges_in_the_same_repeat():
    runs = [{"mode": mode, "repeat": repeat, "samples_per_s": value}
            for repeat, values in enumerate([(300.0, 200.0, 150.0), (330.0, 220.0, 110.0)])
            for mode, value in zip((bl.FULL, bl.MERGE, bl.VLLM), values)]
    modes = bl.summarize(runs)["modes"]
    assert modes[bl.VLLM]["vs_merge"]["per_repeat"] == pytest.approx([0.75, 0.5])
    assert modes[bl.FULL]["vs_merge"]["per_repeat"] == pytest.approx([1.5, 1.5])
    assert modes[bl.MERGE]["vs_merge"] is None
    assert modes[bl.MERGE]["samples_per_s"]["median"] == pytest.approx(210.0)


def test_main_runs_each_mode_per_repeat_and_ends_with_the_comparison_as_one_json_line(tmp_path, monkeypatch, capsys):
    def fake_run(mode, repeat, common, out_dir):
        assert "train.max_steps=3" in common
        speed = {bl.FULL: 180.0, bl.MERGE: 200.0, bl.VLLM: 120.0}[mode.label]
        return {"mode": mode.label, "repeat": repeat, "samples_per_s": speed, "t_gen_s": 0.05,
                "gen_tokens_per_s": 900.0, "weight_load_ms": 1.0, "accuracy_end": 0.5}

    monkeypatch.setattr(bl, "run_once", fake_run)
    monkeypatch.setattr("sys.argv", ["bench_lora", "--steps", "3", "--repeats", "2", "--out", str(tmp_path)])
    assert bl.main() == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["rank"], result["repeats"], len(result["runs"])) == (8, 2, 6)
    assert result["modes"][bl.VLLM]["vs_merge"]["median"] == pytest.approx(0.6)


@pytest.mark.parametrize("argv, says", [
    (["trian.max_steps=3"], "trian"),
    (["weights.lora_push=merged"], "mode 'LoRA vllm'"),  # LoRA vllm needs adapter pushes
    (["--rank", "1024"], "mode 'LoRA vllm'"),  # beyond vLLM's largest adapter rank
])
def test_a_mode_that_cannot_run_is_refused_before_any_mode_runs(argv, says, monkeypatch, capsys):
    monkeypatch.setattr(bl, "run_once", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exit_info:
        bl.main(["--out", "/nonexistent/never", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and says in err.strip().splitlines()[-1]
