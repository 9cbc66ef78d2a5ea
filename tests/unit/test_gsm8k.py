"""The GSM8K-format task on the shipped sample file."""

import json
from pathlib import Path

import pytest

from asyncgrpo.config import load

from asyncgrpo.composition import run_task
from asyncgrpo.data import DataError
from asyncgrpo.tasks.gsm8k import GSM8KTask, gsm8k_reference_answer

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "gsm8k_sample.jsonl"


def gsm8k_cfg(*extra: str):
    return load(["task.name=gsm8k", "model.path=/nonexistent/model", "task.eval_size=4",
                 f"data.train_files=[{SAMPLE}]", *extra])


def test_sample_file_loads_every_record():
    task = run_task(gsm8k_cfg())
    assert isinstance(task, GSM8KTask)
    assert task.num_train_problems + len(task.eval_problems()) == 16
    assert task.train_report.bad == 0
    answers = {p.extra["raw_prompt"]: p.answer for p in [*task.eval_problems(), *task._train]}
    assert answers["A temperature of 5 degrees drops by 12 degrees overnight. What is the new temperature?"] == "-7"
    assert "3625" in answers.values()  # "#### 3,625" loses its thousands separator
    assert "11.75" in answers.values()


@pytest.mark.parametrize(("raw", "expected"), [
    ("work\n#### 72", "72"),
    ("work\n####  1,234.", "1234"),
    ("so the answer is $\\boxed{\\frac{3}{4}}$", "\\frac{3}{4}"),
    ("\\boxed{10\\%}", "10"),
    ("72", "72"),
    ("-3/4", "-3/4"),
    ("a long worked solution\nwith no marked answer", None),
    ("#### ", None),
])
def test_reference_answers_after_hashes_or_boxed(raw, expected):
    assert gsm8k_reference_answer(raw) == expected


@pytest.mark.parametrize(("completion", "score"), [
    ("She has 42 - 35 = 7 left.\n#### 7", 1.0),
    ("The answer is \\boxed{7}.", 1.0),
    ("so the answer is 7.", 1.0),
    ("7 muffins", 1.0),  # last number, when nothing marks the answer
    ("#### 7.0", 1.0),
    ("#### 8", 0.0),
    ("I do not know", 0.0),
    ("#### 7\n#### 9", 0.0),  # the last marked answer counts
])
def test_score_compares_the_final_answer_by_value(completion, score):
    task = run_task(gsm8k_cfg())
    problem = next(p for p in [*task.eval_problems(), *task._train] if p.answer == "7")
    assert task.score(completion, problem) == score


def test_records_without_a_final_answer_are_bad_data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "q1", "answer": "worked\n#### 3"}) + "\n"
                    + json.dumps({"question": "q2", "answer": "worked but\nunfinished"}) + "\n"
                    + json.dumps({"question": "q3", "answer": "#### 5"}) + "\n")
    task = run_task(load(["task.name=gsm8k", "model.path=/m", f"data.train_files=[{path}]"]))
    assert task.train_report.skipped == {"bad_answer": 1}
    assert task.train_report.examples["bad_answer"] == ["d.jsonl:2"]
    with pytest.raises(DataError, match="d.jsonl:2"):
        run_task(load(["task.name=gsm8k", "model.path=/m", f"data.train_files=[{path}]", "data.strict=true"]))


def test_chat_template_and_length_filter_use_the_models_tokenizer():
    from asyncgrpo.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    cfg = gsm8k_cfg("data.chat_template=true", "model.max_positions=120", "rollout.max_new_tokens=20")
    task = run_task(cfg, tokenizer)
    kept = [*task._train, *task.eval_problems()]
    assert all(p.prompt.startswith("[") and p.prompt.endswith("]") for p in kept)
    assert all(len(p.prompt) <= 100 for p in kept)
    assert task.train_report.skipped["too_long"] == 16 - len(kept)
