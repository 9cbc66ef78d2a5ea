"""tools/bench_lora.py's pure parts: its modes and how it compares them (no training run)."""

from __future__ import annotations

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
