"""The warm start on episode references: the environment's observations are inputs only (no loss, no
probability counted), episodes are measured played against their environment, and the single-turn tasks'
batches and cache keys are what they were."""

from types import SimpleNamespace

import pytest
import torch

from asyncgrpo.config import load

from asyncgrpo.composition import run_task
from asyncgrpo.models.tiny import TinyModelSpec, build_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.models.warmstart import (
    IGNORE_INDEX,
    _Episode,
    _expected_accuracy,
    _supervised_batch,
    measure_accuracy,
    task_environment,
    warm_model_cache_key,
)
from asyncgrpo.tasks import ArithmeticTask, GuessTask, LongtailTask, MultiplyTask
from asyncgrpo.tasks.problem import reference_completion, reference_segments

TOKENIZER = build_char_tokenizer()
MULTIPLY = MultiplyTask(left_digits=3, right_digits=2, eval_size=20, tool=True)
GUESS = GuessTask(max_number=64, eval_size=20)


def labelled_text(labels: list[int]) -> str:
    return "".join("~" if t == IGNORE_INDEX else TOKENIZER.decode([t]) for t in labels)


def test_observations_are_inputs_without_labels_and_a_finished_game_has_no_eos():
    problems = [MULTIPLY.problem(0), GUESS.problem(36)]  # secret 37
    input_ids, labels = _supervised_batch(TOKENIZER, problems)
    call, product = reference_segments(problems[0])[0][0], problems[0].answer
    observed = f"={product}\n"
    assert TOKENIZER.decode(input_ids[0]).startswith(problems[0].prompt + call + observed + product + "<eos>")
    assert labelled_text(labels[0].tolist()).rstrip("~") == \
        "~" * len(problems[0].prompt) + call + "~" * len(observed) + product + "<eos>"
    # The game ends when the environment says "correct": the policy never writes an eos there.
    assert labelled_text(labels[1].tolist()).rstrip("~") == \
        "~" * len("guess 1-64:") + "32\n" + "~" * 7 + "48\n" + "~" * 6 + "40\n" + "~" * 6 + "36\n" + "~" * 7 + \
        "38\n" + "~" * 6 + "37\n"
    assert TOKENIZER.eos_token_id not in labels[1].tolist()


@pytest.mark.parametrize("task", [ArithmeticTask(num_digits=2, eval_size=500),
                                  LongtailTask(min_digits=2, max_digits=16, exponent=2.5, eval_size=200),
                                  MultiplyTask(left_digits=3, right_digits=2, eval_size=50, tool=False)])
def test_single_turn_batches_are_prompt_then_the_whole_reference_and_eos_labelled(task):
    """What every warm start trained on before episodes (so existing warm starts stay bit-identical)."""
    problems = task.eval_problems()
    input_ids, labels = _supervised_batch(TOKENIZER, problems)
    for row, problem in enumerate(problems):
        prompt = TOKENIZER(problem.prompt, add_special_tokens=False).input_ids
        completion = [*TOKENIZER(reference_completion(problem), add_special_tokens=False).input_ids,
                      TOKENIZER.eos_token_id]
        padding = input_ids.size(1) - len(prompt) - len(completion)
        assert input_ids[row].tolist() == prompt + completion + [TOKENIZER.pad_token_id] * padding
        assert labels[row].tolist() == [IGNORE_INDEX] * len(prompt) + completion + [IGNORE_INDEX] * padding


def test_the_default_and_longtail_warm_start_cache_keys_are_unchanged():
    """Pinned from before the episode tasks: a change here would retrain every cached warm start."""
    keys = []
    for cfg in (load([]), load([], config_name="longtail")):
        spec = TinyModelSpec(hidden_size=cfg.model.hidden_size, num_layers=cfg.model.num_layers,
                             num_heads=cfg.model.num_heads, num_kv_heads=cfg.model.num_kv_heads,
                             intermediate_size=cfg.model.intermediate_size, max_positions=cfg.model.max_positions)
        keys.append(warm_model_cache_key(spec, run_task(cfg), cfg.seed, cfg.model.warmstart_target_accuracy))
    assert keys == ["10741d74b2259fc5", "8807554519e4c776"]


class FixedLogits(torch.nn.Module):
    """A stand-in model whose logits are given."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.logits)


def test_expected_accuracy_leaves_out_the_probability_of_observation_tokens():
    """The environment writes the observation, so how likely the model finds it must not matter; how likely
    it finds its own call must."""
    input_ids, labels = _supervised_batch(TOKENIZER, [MULTIPLY.problem(0)])
    logits = torch.randn(1, input_ids.size(1), len(TOKENIZER), generator=torch.Generator().manual_seed(0))
    base = _expected_accuracy(FixedLogits(logits), input_ids, labels)
    (call, _), (observed, _), _ = reference_segments(MULTIPLY.problem(0))
    first = len(MULTIPLY.problem(0).prompt) + len(call)  # the observation's first token
    changed = logits.clone()
    predicting_observation = slice(first - 1, first - 1 + len(observed))  # logits at t predict token t + 1
    changed[0, predicting_observation] = torch.randn(changed[0, predicting_observation].shape)
    assert _expected_accuracy(FixedLogits(changed), input_ids, labels) == pytest.approx(base, rel=1e-6, abs=0)
    changed[0, first - 2, input_ids[0, first - 1]] += 5.0  # the call's last character, "]", made likelier
    assert _expected_accuracy(FixedLogits(changed), input_ids, labels) > 10 * base


@pytest.mark.parametrize("problem", [MULTIPLY.problem(3), GUESS.problem(36), GUESS.problem(31)])
def test_an_episode_written_as_the_reference_is_the_reference_and_scores_one(problem):
    """The measuring loop's episode, fed the reference's policy tokens, calls the environment at the stop
    texts and ends as the reference does: the same tokens, the policy's last turn scored."""
    task = MULTIPLY if problem.prompt != GUESS.prompt else GUESS
    spec = task_environment(task)
    env = spec.new()
    episode = _Episode(env, TOKENIZER(problem.prompt + env.reset(problem), add_special_tokens=False).input_ids,
                       task.max_answer_chars + 1)
    policy = "".join(text for text, written in reference_segments(problem) if written)
    for token in TOKENIZER(policy, add_special_tokens=False).input_ids:
        assert not episode.done
        episode.advance(token, TOKENIZER, spec.stop)
    if not episode.done:  # the calculator episode ends with the policy's eos
        episode.advance(TOKENIZER.eos_token_id, TOKENIZER, spec.stop)
    assert episode.done
    assert TOKENIZER.decode(episode.tokens) == problem.prompt + reference_completion(problem)
    assert task.score(episode.scored_text, problem) == 1.0


def test_single_turn_tasks_have_no_environment_and_episode_tasks_theirs():
    assert task_environment(ArithmeticTask(num_digits=2, eval_size=500)) is None
    assert task_environment(MultiplyTask(left_digits=3, right_digits=2, eval_size=20, tool=False)) is None
    assert task_environment(MULTIPLY).stop == ("]",)
    assert task_environment(GUESS).stop == ("\n",)


def test_an_untrained_model_plays_the_held_out_episodes_and_scores_zero():
    model = build_model(TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32,
                                      max_positions=64), TOKENIZER, seed=0)
    for greedy in (False, True):
        assert measure_accuracy(model, TOKENIZER, MULTIPLY, MULTIPLY.eval_problems(), greedy=greedy) == 0.0
