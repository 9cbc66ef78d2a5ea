"""Supervised warm start of the tiny model on a task, stopped at a target sampled accuracy.

RL with GRPO needs a policy that already solves some problems when sampling (otherwise
every group gets reward 0 and there is no signal), but not most of them (otherwise there
is little left to learn). Supervised accuracy on this task takes off abruptly at a
seed-dependent step (between ~250 and ~900 steps of 64 problems), so training stops as
soon as the held-out expected sampled accuracy reaches the target rather than after a
fixed number of steps.

Only a warm start that reached its target is cached under the key of its inputs: that model is
the same whatever the machine's speed. One stopped by `max_seconds` first depends on how many
steps fitted in that time, so it is cached apart, under a key that names `max_seconds` too, and
never stands in for a complete one (a short test run's partial model would otherwise become every
later default run's starting point).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from asyncgrpo.envs import Environment, EnvironmentSpec, named_environment
from asyncgrpo.runtime.files import private_dir
from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.tasks.problem import Problem, Task, reference_segments

# Bump whenever a change here would produce a different model for the same inputs, so
# stale cache entries are not reused.
# 3: partial warm starts (stopped by max_seconds) are cached apart from complete ones.
WARMSTART_VERSION = 3
WARMSTART_RECORD = "warmstart.json"

BATCH_SIZE = 64
LEARNING_RATE = 1e-3
CHECK_EVERY_STEPS = 10
LOG_EVERY_STEPS = 100
# Sampling seed for accuracy checks, separate from the training seed so that the same
# model always measures the same accuracy.
MEASURE_SEED = 1234
# One intra-op thread: a 0.1M-parameter model has little work to split, and on 2 cores
# shared with other processes a step measured ~40 ms with one thread but 70-900 ms with
# two (OpenMP workers spin-waiting for a busy core).
TRAIN_THREADS = 1

IGNORE_INDEX = -100


def warm_model_cache_key(
    model_spec: TinyModelSpec, task: Task, seed: int, target_accuracy: float
) -> str:
    identity = {
        "model": model_spec.to_dict(),
        "task": task.settings(),
        "seed": seed,
        "target_accuracy": target_accuracy,
        "version": WARMSTART_VERSION,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def ensure_warm_model(
    cache_root: Path,
    *,
    model_kwargs: dict[str, int],
    task: Task,
    seed: int,
    target_accuracy: float,
    max_seconds: float,
    log: Callable[[str], None] = print,
) -> Path:
    """Directory of a warm-started model in Hugging Face format, trained on first use.

    `model_kwargs` are the TinyModelSpec sizes (model.hidden_size, ...); `target_accuracy` and
    `max_seconds` are model.warmstart_target_accuracy and model.warmstart_max_seconds (no defaults
    here: config's are the only ones).

    The directory holds config.json, model.safetensors, tokenizer files and
    warmstart.json (measured accuracies, steps, seconds, seed). It is written under a
    temporary name and renamed into place, so an interrupted run leaves no entry behind.
    """
    model_spec = TinyModelSpec(**model_kwargs)
    # Checked before anything in it is reused: a cache another user can write could hand us their model.
    cache_root = private_dir(cache_root)
    key = warm_model_cache_key(model_spec, task, seed, target_accuracy)
    complete_dir, partial_dir = cache_root / f"tiny-qwen2-{key}", cache_root / partial_entry_name(key, max_seconds)
    if _reached_target(complete_dir):
        return complete_dir
    if (partial_dir / WARMSTART_RECORD).is_file():
        log(f"WARNING: reusing a warm start that stopped short of its target after {max_seconds:g}s: {partial_dir}")
        return partial_dir

    staging_dir = Path(tempfile.mkdtemp(prefix=f".tiny-qwen2-{key}.", dir=cache_root))
    try:
        record = _train_and_save(
            staging_dir, model_spec, task, seed, target_accuracy, max_seconds, log
        )
        model_dir = complete_dir if record["reached_target"] else partial_dir
        try:
            os.rename(staging_dir, model_dir)
        except OSError:
            # Another process finished the same entry first; its copy is equivalent.
            if not (model_dir / WARMSTART_RECORD).is_file():
                raise
            shutil.rmtree(staging_dir)
    except BaseException:
        shutil.rmtree(staging_dir, ignore_errors=True)
        raise
    log(
        f"warm start saved to {model_dir}: expected sampled accuracy "
        f"{record['expected_sampled_accuracy']:.3f} "
        f"(one sample each: {record['sampled_accuracy']:.3f}), "
        f"greedy {record['greedy_accuracy']:.3f}, "
        f"{record['steps']} steps, {record['seconds']:.1f}s"
    )
    return model_dir


def partial_entry_name(key: str, max_seconds: float) -> str:
    """The cache entry of a warm start that `max_seconds` stopped before its target."""
    return f"tiny-qwen2-{key}-partial-{max_seconds:g}s"


def _reached_target(model_dir: Path) -> bool:
    try:
        return bool(json.loads((model_dir / WARMSTART_RECORD).read_text())["reached_target"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _train_and_save(
    directory: Path,
    model_spec: TinyModelSpec,
    task: Task,
    seed: int,
    target_accuracy: float,
    max_seconds: float,
    log: Callable[[str], None],
) -> dict[str, object]:
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        tokenizer = build_char_tokenizer()
        model = build_model(model_spec, tokenizer, seed)
        steps, seconds, reached = _train_until_target(
            model, tokenizer, task, seed, target_accuracy, max_seconds, log
        )
        eval_problems = task.eval_problems()
        record = {
            "expected_sampled_accuracy": expected_sampled_accuracy(model, tokenizer, eval_problems),
            "sampled_accuracy": measure_accuracy(
                model, tokenizer, task, eval_problems, greedy=False
            ),
            "greedy_accuracy": measure_accuracy(model, tokenizer, task, eval_problems, greedy=True),
            "eval_problems": len(eval_problems),
            "target_accuracy": target_accuracy,
            "reached_target": reached,
            "steps": steps,
            "seconds": seconds,
            "seed": seed,
            "model": model_spec.to_dict(),
            "task": task.settings(),
            "version": WARMSTART_VERSION,
        }
    finally:
        torch.set_num_threads(previous_threads)
    if not reached:
        log(
            f"WARNING: warm start did not reach expected sampled accuracy {target_accuracy} within "
            f"{max_seconds}s; saving it anyway at {record['expected_sampled_accuracy']:.3f}"
        )
    save_model(model, tokenizer, directory)
    (directory / WARMSTART_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _train_until_target(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    task: Task,
    seed: int,
    target_accuracy: float,
    max_seconds: float,
    log: Callable[[str], None],
) -> tuple[int, float, bool]:
    """Trains until a check reaches the target or time runs out: (steps, seconds, reached)."""
    eval_batch = _supervised_batch(tokenizer, task.eval_problems())
    batches = _batched(task.train_problems(seed), BATCH_SIZE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    start = time.monotonic()
    for step in itertools.count(1):
        model.train()
        input_ids, labels = _supervised_batch(tokenizer, next(batches))
        logits = model(input_ids=input_ids).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        elapsed = time.monotonic() - start
        if step % CHECK_EVERY_STEPS == 0:
            accuracy = _expected_accuracy(model, *eval_batch)
            if step % LOG_EVERY_STEPS == 0:
                log(
                    f"warm start step {step}: loss {loss.item():.3f}, "
                    f"expected sampled accuracy {accuracy:.3f}, {elapsed:.0f}s"
                )
            if accuracy >= target_accuracy:
                return step, elapsed, True
        if elapsed >= max_seconds:
            return step, elapsed, False
    raise AssertionError("unreachable")


def _batched(problems: Iterator[Problem], size: int) -> Iterator[list[Problem]]:
    while True:
        yield list(itertools.islice(problems, size))


def _supervised_batch(
    tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+reference+eos ids, with labels only on what the policy writes: the reference
    completion (the answer, or the task's worked scratchpad or episode: `reference_segments`) and the eos.
    An environment's observations inside an episode are inputs without labels (the policy never samples
    them), and an episode whose last piece is an observation (the environment ended it) has no eos."""
    prompt_ids = tokenizer([p.prompt for p in problems], add_special_tokens=False).input_ids
    segments = [reference_segments(p) for p in problems]
    # One tokenizer call for every piece of every reference: a single-turn reference is one piece, so
    # its ids are those of the whole reference, as they always were.
    piece_ids = iter(tokenizer([text for pieces in segments for text, _ in pieces], add_special_tokens=False).input_ids)
    completions = []
    for pieces in segments:
        ids, labels = [], []
        for _, policy in pieces:
            piece = next(piece_ids)
            ids += piece
            labels += piece if policy else [IGNORE_INDEX] * len(piece)
        if not pieces or pieces[-1][1]:
            ids, labels = [*ids, tokenizer.eos_token_id], [*labels, tokenizer.eos_token_id]
        completions.append((ids, labels))
    length = max(len(p) + len(ids) for p, (ids, _) in zip(prompt_ids, completions, strict=True))
    input_rows, label_rows = [], []
    for prompt, (ids, labels) in zip(prompt_ids, completions, strict=True):
        padding = length - len(prompt) - len(ids)
        input_rows.append([*prompt, *ids] + [tokenizer.pad_token_id] * padding)
        label_rows.append([IGNORE_INDEX] * len(prompt) + labels + [IGNORE_INDEX] * padding)
    return torch.tensor(input_rows), torch.tensor(label_rows)


@torch.no_grad()
def expected_sampled_accuracy(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: Sequence[Problem]
) -> float:
    """Mean probability that temperature-1 sampling emits exactly the answer then eos (in an episode, the
    policy's pieces given the environment's observations, which are not sampled and so not counted).

    This is the expectation of sampled accuracy, computed exactly by one teacher-forced
    forward pass instead of estimated by sampling, so the stopping check is both cheap
    and free of sampling noise (one sample per problem on 500 problems would carry about
    +-1.5 points of noise at 12%).
    """
    return _expected_accuracy(model, *_supervised_batch(tokenizer, problems))


@torch.no_grad()
def _expected_accuracy(
    model: Qwen2ForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor
) -> float:
    model.eval()
    targets = labels[:, 1:]
    answered = targets != IGNORE_INDEX
    logprobs = model(input_ids=input_ids).logits[:, :-1].log_softmax(dim=-1)
    target_logprobs = logprobs.gather(2, targets.clamp(min=0)[..., None])[..., 0]
    return (target_logprobs * answered).sum(dim=1).exp().mean().item()


@torch.no_grad()
def measure_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    task: Task,
    problems: Sequence[Problem],
    *,
    greedy: bool,
) -> float:
    """Mean score of one completion per problem, sampled at temperature 1 or greedy.

    A plain loop re-running the full (at most a dozen tokens) sequence each step is much
    faster than HF generate for a model this small. Prompts are batched by token length
    so no padding is needed.
    """
    environment = task_environment(task)
    if environment is not None:
        return _episode_accuracy(model, tokenizer, task, problems, environment, greedy=greedy)
    model.eval()
    generator = torch.Generator().manual_seed(MEASURE_SEED)
    max_new_tokens = task.max_answer_chars + 1
    prompt_ids = tokenizer([p.prompt for p in problems], add_special_tokens=False).input_ids
    rows_by_length: dict[int, list[int]] = {}
    for row, ids in enumerate(prompt_ids):
        rows_by_length.setdefault(len(ids), []).append(row)

    total_score = 0.0
    for rows in rows_by_length.values():
        sequences = torch.tensor([prompt_ids[row] for row in rows])
        prompt_length = sequences.size(1)
        finished = torch.zeros(len(rows), dtype=torch.bool)
        for _ in range(max_new_tokens):
            next_logits = model(input_ids=sequences).logits[:, -1]
            if greedy:
                next_tokens = next_logits.argmax(dim=-1)
            else:
                next_tokens = torch.multinomial(
                    next_logits.softmax(dim=-1), 1, generator=generator
                ).squeeze(1)
            next_tokens = next_tokens.masked_fill(finished, tokenizer.pad_token_id)
            sequences = torch.cat([sequences, next_tokens[:, None]], dim=1)
            finished |= next_tokens == tokenizer.eos_token_id
            if finished.all():
                break
        for row, completion in zip(rows, sequences[:, prompt_length:].tolist(), strict=True):
            if tokenizer.eos_token_id in completion:
                completion = completion[: completion.index(tokenizer.eos_token_id)]
            text = tokenizer.decode(completion, skip_special_tokens=True)
            total_score += task.score(text, problems[row])
    return total_score / len(problems)


def task_environment(task: Task) -> EnvironmentSpec | None:
    """The environment whose episodes a task's references are (its `environment` attribute, an env.name:
    MultiplyTask with the tool, GuessTask), or None for a single-turn task."""
    name = getattr(task, "environment", "")
    return named_environment(name) if name else None


@dataclass
class _Episode:
    """One problem played against its environment by `_episode_accuracy`."""

    environment: Environment
    tokens: list[int]
    budget: int
    turn: str = ""
    last_turn: str = ""
    spent: int = 0
    done: bool = False

    def advance(self, token: int, tokenizer: PreTrainedTokenizerFast, stops: tuple[str, ...]) -> None:
        """The policy sampled `token`: end at eos; at a stop text call the environment and append its
        observation; end when it says done or the budget (observations included) is spent."""
        if token == tokenizer.eos_token_id:
            self.done = True
            return
        self.tokens.append(token)
        self.turn += tokenizer.decode([token], skip_special_tokens=True)
        self.spent += 1
        if any(self.turn.endswith(stop) for stop in stops):
            step = self.environment.step(self.turn)
            observed = tokenizer(step.observation, add_special_tokens=False).input_ids
            self.tokens += observed
            self.spent += len(observed)
            self.last_turn, self.turn, self.done = self.turn, "", step.done
        self.done = self.done or self.spent >= self.budget

    @property
    def scored_text(self) -> str:
        """The policy's last turn: an observation is never scored as if the policy wrote it."""
        return self.turn or self.last_turn


@torch.no_grad()
def _episode_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    task: Task,
    problems: Sequence[Problem],
    environment: EnvironmentSpec,
    *,
    greedy: bool,
) -> float:
    """measure_accuracy for a task whose references are episodes: each problem played against a fresh
    environment as an episode runs (a turn ends at a stop text, which it keeps; the observation follows;
    the episode ends at eos, when the environment says done or when the budget, the longest reference and
    an eos, observations included, is spent), scored on the policy's last turn. Rows of different lengths
    run together left-padded, positions counted from each row's first token."""
    model.eval()
    generator = torch.Generator().manual_seed(MEASURE_SEED)
    episodes = []
    for problem in problems:
        env = environment.new()
        start = problem.prompt + env.reset(problem)
        episodes.append(_Episode(env, tokenizer(start, add_special_tokens=False).input_ids, task.max_answer_chars + 1))
    while active := [e for e in episodes if not e.done]:
        width = max(len(e.tokens) for e in active)
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(e.tokens)) + e.tokens for e in active])
        attention_mask = torch.tensor([[0] * (width - len(e.tokens)) + [1] * len(e.tokens) for e in active])
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, -1]
        if greedy:
            next_tokens = logits.argmax(dim=-1)
        else:
            next_tokens = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)
        for episode, token in zip(active, next_tokens.tolist(), strict=True):
            episode.advance(token, tokenizer, environment.stop)
    for episode in episodes:
        episode.environment.close()
    return sum(task.score(e.scored_text, p) for e, p in zip(episodes, problems, strict=True)) / len(problems)
