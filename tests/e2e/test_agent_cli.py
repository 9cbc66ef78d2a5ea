"""Bring your own agent end to end: `asyncgrpo train env.name=agent` on the embedded model, the example
calculator agent (OpenAI client code, examples/agent_calculator.py) driving every episode through the
generator's loopback chat server. A tiny budget: it tests the plumbing, not learning."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import cli, step_records

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
# Messages' texts back to back: the agent's first request renders to the task's own prompt, which the
# embedded model was warm-started on, so its replies (and the agent's rewards) are sensible.
CONTENT_ONLY = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_training_runs_on_episodes_an_openai_client_agent_plays(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        cli(tmp_path, "env.name=agent", "env.agent.fn=examples.agent_calculator:calculator_agent",
            f"env.agent.chat_template='{CONTENT_ONLY}'", "env.max_turns=2", "train.max_steps=3",
            "eval.at_start=false", "eval.at_end=false"),
        capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3
    records = step_records(tmp_path / "run")
    assert sum(r["env/calls"] for r in records) > 0 and sum(r["env/errors"] for r in records) == 0
    # The agent's rewards (1.0 per right answer) reach the learner: the warm-started model is right sometimes.
    assert max(r["reward/mean"] for r in records) > 0
