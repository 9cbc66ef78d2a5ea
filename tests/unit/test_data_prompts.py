"""Prompt templates, chat templates, seeded shuffling with epochs, and the file task."""

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.config import load

from asyncgrpo.composition import run_task
from asyncgrpo.schema import ConfigError
from asyncgrpo.data import DataError, PromptFormat, epoch_stream, split_holdout
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.tasks import run_stream
from asyncgrpo.tasks.files import FileTask

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def arithmetic_file(tmp_path: Path, count: int = 40, name: str = "train.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"question": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(count)))
    return path


def test_chat_template_wraps_the_templated_prompt():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    fmt = PromptFormat(template="{prompt} answer:", chat_template=True, system_prompt="be brief")
    assert fmt.render("1+1=", tokenizer) == "<system>be brief\n<user>1+1= answer:\n<assistant>"


def test_chat_template_without_one_in_the_tokenizer_fails_clearly():
    with pytest.raises(DataError, match="data.chat_template"):
        PromptFormat(template="{prompt}", chat_template=True, system_prompt="").render("x", build_char_tokenizer())


@pytest.mark.parametrize("template", ["{% if %}", "{{ messages[5]['content'] }}", "{{ raise_exception('no system') }}"])
def test_a_chat_template_that_does_not_render_is_one_data_error_naming_the_setting(template):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    with pytest.raises(DataError, match="data.chat_template=true but the model's chat template does not render: ") as err:
        PromptFormat(template="{prompt}", chat_template=True, system_prompt="").render("x", tokenizer)
    assert "\n" not in str(err.value)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 60), seed=st.integers(0, 10**6), epochs=st.integers(1, 3))
def test_each_epoch_streams_every_item_once_in_the_same_seeded_order_again(size, seed, epochs):
    items = list(range(size))
    stream = list(epoch_stream(items, seed=seed, epochs=epochs, shuffle=True))
    assert Counter(stream) == Counter({i: epochs for i in items})
    assert list(epoch_stream(items, seed=seed, epochs=epochs, shuffle=True)) == stream


def test_no_training_prompts_is_one_data_error_not_an_endless_wait():
    with pytest.raises(DataError, match="no training prompts"):
        next(epoch_stream([], seed=0, epochs=0, shuffle=True))


def test_order_depends_on_seed_and_changes_per_epoch():
    items = list(range(50))
    two_epochs = list(epoch_stream(items, seed=1, epochs=2, shuffle=True))
    assert two_epochs[:50] != two_epochs[50:] and sorted(two_epochs[:50]) == items
    assert list(epoch_stream(items, seed=2, epochs=1, shuffle=True)) != two_epochs[:50]
    assert list(epoch_stream(items, seed=1, epochs=1, shuffle=False)) == items
    endless = epoch_stream(items, seed=1, epochs=0, shuffle=True)
    assert len(list(itertools.islice(endless, 1000))) == 1000


def test_holdout_is_fixed_and_disjoint():
    train, held = split_holdout(list(range(100)), 10)
    assert len(held) == 10 and not set(train) & set(held) and sorted(train + held) == list(range(100))
    assert split_holdout(list(range(100)), 10) == (train, held)


def files_cfg(tmp_path, *extra):
    return load(["task.name=files", f"data.train_files=[{arithmetic_file(tmp_path)}]", *extra])


def test_files_task_holds_out_eval_problems_and_checks_exact_answers(tmp_path):
    cfg = files_cfg(tmp_path, "task.eval_size=5")
    task = run_task(cfg, build_char_tokenizer())
    assert isinstance(task, FileTask)
    held = task.eval_problems()
    assert len(held) == 5 and task.num_train_problems == 35
    train_ids = {p.id for p in itertools.islice(task.train_problems(seed=0), 35)}
    assert train_ids.isdisjoint({p.id for p in held}) and len(train_ids) == 35
    problem = held[0]
    assert task.score(f" {problem.answer}<eos>", problem) == 1.0
    assert task.score(problem.answer + "0", problem) == 0.0
    assert "kept 40 of 40" in task.describe()


def test_eval_files_are_used_and_capped_by_eval_size(tmp_path):
    eval_file = arithmetic_file(tmp_path, count=30, name="eval.jsonl")
    task = run_task(files_cfg(tmp_path, f"data.eval_files=[{eval_file}]", "task.eval_size=10"))
    assert task.num_train_problems == 40 and len(task.eval_problems()) == 10
    assert {p.id for p in task.eval_problems()} <= set(range(40, 70))  # ids continue after the training records


def test_the_run_stream_of_a_file_task_covers_every_prompt_once_per_epoch_then_ends(tmp_path):
    cfg = files_cfg(tmp_path, "rollout.num_generators=2", "data.epochs=1", "task.eval_size=4")
    task = run_task(cfg)
    stream = list(run_stream(task, cfg))
    assert len(stream) == len({p.id for p in stream}) == task.num_train_problems


def test_a_builtin_tasks_run_stream_is_seeded_by_the_seed():
    cfg = load(["seed=3"])
    task = run_task(cfg)
    assert list(itertools.islice(run_stream(task, cfg), 5)) == list(itertools.islice(task.train_problems(seed=3000), 5))


def test_all_prompts_too_long_fails_with_the_reason_and_the_fix(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"question": "9" * 50, "answer": "1"}) + "\n" for _ in range(3)))
    cfg = load(["task.name=files", f"data.train_files=[{path}]"])
    with pytest.raises(DataError) as err:
        run_task(cfg, build_char_tokenizer())
    message = str(err.value)
    assert "too_long=3" in message and "model.max_positions" in message and "\n" not in message


def test_settings_change_with_file_contents(tmp_path):
    cfg = files_cfg(tmp_path)
    before = run_task(cfg).settings()
    arithmetic_file(tmp_path, count=41)
    assert run_task(cfg).settings() != before


@pytest.mark.parametrize(("overrides", "key"), [
    (["task.name=poetry"], "task.name"),
    (["task.name=files"], "data.train_files"),
    (["task.name=gsm8k", "data.train_files=[x.jsonl]"], "model.path"),
    (["task.name=countdown"], "model.path"),
    (["data.epochs=-1"], "data.epochs"),
    (["data.train_files=[x.jsonl]"], "data.train_files is read only by task.name=gsm8k|files"),
    (["task.name=longtail", "data.eval_files=[x.jsonl]"], "data.eval_files is read only by"),
    (["data.prompt_template=no-placeholder"], "data.prompt_template"),
])
def test_bad_task_and_data_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load(overrides)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_tiny_model_refusal_explains_why():
    with pytest.raises(ConfigError, match="32-token context"):
        load(["task.name=gsm8k", "data.train_files=[x.jsonl]"])
