"""The presets in configs/ compose, validate, and (with local data) build their task."""

from pathlib import Path

import pytest

from asyncgrpo.config import load

from asyncgrpo.composition import run_task
from asyncgrpo.rewards.scorer import Scorer
from asyncgrpo.schema import CONFIG_DIR

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "gsm8k_sample.jsonl"
PRESETS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads(name):
    load([], config_name=name)


def test_the_gsm8k_preset_runs_its_task_and_rewards_on_the_sample():
    cfg = load([f"data.train_files=[{SAMPLE}]", f"data.eval_files=[{SAMPLE}]", "data.chat_template=false"],
               config_name="gsm8k_qwen05b_1gpu")
    task = run_task(cfg)
    assert len(task.eval_problems()) == 16 and task.train_report.bad == 0
    scorer = Scorer(task, cfg.reward)
    try:
        problem = task.eval_problems()[0]
        [score] = scorer.score([problem], [[f"so\n#### {problem.answer}", "#### -1", "no idea"]], timeout_s=30)
        assert score.rewards.tolist() == pytest.approx([1.1, 0.1, 0.0])
        assert set(score.meta()) == {"reward/math", "reward/format", "reward/errors"}
    finally:
        scorer.close()


def test_the_8gpu_preset_scores_with_a_judge_and_drops_on_error():
    cfg = load([], config_name="qwen7b_8gpu_judge")
    assert [t.name for t in cfg.reward.terms] == ["math", "judge", "format"]
    assert cfg.reward.on_error == "drop_group" and cfg.reward.judge.api_key_env == "JUDGE_API_KEY"
    assert cfg.rollout.num_generators + cfg.learner.world_size == 8
