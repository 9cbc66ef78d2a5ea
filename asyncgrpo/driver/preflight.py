"""Before anything heavy starts: does this config fit this model and this machine?

`preflight(cfg, model_dir)` checks the model directory (asyncgrpo/models/check.py; its weights' files
only by their headers, and a run only: check=true sizes a shape without weights), plans a weight
push (chunks, bytes on the wire, the largest tensor), sizes vLLM's KV cache against one call's
sequences and estimates each actor's peak memory. `check_rewards(cfg)` imports every user reward
function and probes the judge endpoint. `asyncgrpo train ... check=true` prints the report and
starts nothing; every run calls both before Ray starts (the reward check first, before the model is
prepared), so bad settings fail in one line (the CLI exits 2). check=true also runs
`check_data(cfg, model_dir)`: a file task's data files loaded, counted, and prompts longer than the
context refused (a run reads them once Ray is up, and skips such prompts as bad data).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgrpo.contract import call_sizes
from asyncgrpo.runtime.resources import cpu_head_size_error
from asyncgrpo.schema import Config

if TYPE_CHECKING:
    from asyncgrpo.learner.lora import AdapterLayout

GIB = float(1 << 30)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Measured here: a CPU vLLM engine with the tiny model holds about 1 GiB; a learner process with
# torch and transformers imported about 0.5 GiB (summary.json's peak_rss_mib of a default run).
VLLM_RUNTIME_GIB = 1.2
EMBEDDED_ARCHITECTURES = frozenset({"Qwen2ForCausalLM"})
LEARNER_RUNTIME_GIB = 0.6


class PreflightError(ValueError):
    """Settings that cannot work with this model; one line naming the key to change."""


def kv_cache_plan(cfg: Config, num_layers: int, num_kv_heads: int, head_dim: int) -> dict[str, Any]:
    """Tokens rollout.kv_cache_gib holds, and what the largest vLLM call's sequences need at most."""
    bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * _DTYPE_BYTES[cfg.rollout.dtype]
    holds = int(cfg.rollout.kv_cache_gib * GIB) // bytes_per_token
    largest_call = max(call_sizes(cfg.rollout.groups_per_call, cfg.rollout.num_generators, cfg.train.groups_per_step))
    sequences = largest_call * cfg.rollout.samples_per_prompt
    # A sequence is at most the context (prompt + completion); in-flight segments resume from it too.
    needed = sequences * cfg.model.max_positions
    if holds < needed:
        raise PreflightError(
            f"rollout.kv_cache_gib={cfg.rollout.kv_cache_gib:g} holds {holds:,} tokens "
            f"({bytes_per_token:,} bytes each), but one vLLM call's {sequences} sequences of up to "
            f"model.max_positions={cfg.model.max_positions} need {needed:,} "
            f"({needed * bytes_per_token / GIB:.2f} GiB): raise rollout.kv_cache_gib or lower "
            f"rollout.groups_per_call or model.max_positions")
    return {"bytes_per_token": bytes_per_token, "tokens_held": holds, "tokens_needed_per_call": needed}


def push_plan(cfg: Config, spec: list[tuple[str, tuple[int, ...], Any]]) -> dict[str, Any]:
    """What one weight push carries (zmq: in chunks; shm: one announcement, the tensors in a slot)."""
    from asyncgrpo.composition import weights_backend
    from asyncgrpo.weights import push_dtype
    from asyncgrpo.weights.zmq import chunk_plan

    backend = weights_backend(cfg)
    dtype = push_dtype(cfg.weights, backend, cfg.rollout.dtype)
    numels = [math.prod(shape) for _, shape, _ in spec]
    largest = max(range(len(spec)), key=lambda i: numels[i])
    return {
        "backend": backend,
        "tensors": len(spec),
        "wire_dtype": str(dtype).removeprefix("torch."),
        "bytes_per_push": sum(numels) * dtype.itemsize,
        "chunks_per_push": len(chunk_plan(numels, dtype.itemsize, cfg.weights.chunk_bytes)),
        "largest_tensor": spec[largest][0],
        "largest_tensor_bytes": numels[largest] * dtype.itemsize,
    }


def memory_estimate(cfg: Config, num_parameters: int, vocab_size: int, push_bytes: int,
                    backend: str, merge_base_bytes: int = 0) -> dict[str, float]:
    """Peak GiB per actor (an estimate: weights, optimizer state, the largest activations, buffers).
    `merge_base_bytes`: what a generator keeps of the base weights to merge adapter pushes onto
    (`merge_base_bytes`; 0 when pushes carry the model)."""
    learner, rollout = cfg.learner, cfg.rollout
    per_rank = num_parameters * (4 + 4 + 8) / learner.world_size  # fp32 weights, gradients, AdamW moments
    if learner.lora.rank > 0:  # a frozen base: no gradients or moments but the adapters' (left out: small)
        per_rank = num_parameters * 4 / learner.world_size
    # Each rank reads the whole fp32 model before FSDP2 shards it (tools/bench_real.py on the 0.5B
    # shape: 13.2 GiB peak, 11.5 estimated without this term).
    per_rank += num_parameters * 4
    if cfg.algo.kl.enabled and learner.lora.rank == 0:  # under LoRA the reference is the policy, adapters off
        bytes_per = 2 if learner.mixed_precision == "bf16" else 4
        per_rank += num_parameters * bytes_per / (1 if cfg.algo.kl.reference_on == "cpu" else learner.world_size)
    # One forward: the logits of a micro-batch dominate at large vocabularies (logits, their
    # log-softmax and its gradient, in fp32).
    tokens = learner.micro_batch_tokens or (
        cfg.train.groups_per_step * rollout.samples_per_prompt * cfg.model.max_positions // learner.world_size)
    per_rank += 3 * tokens * vocab_size * 4
    generator = num_parameters * _DTYPE_BYTES[rollout.dtype] + rollout.kv_cache_gib * GIB + merge_base_bytes
    shared = 0
    if backend == "shm":
        shared = 2 * push_bytes  # the two version slots, shared by the learner and every generator
    elif backend == "zmq":
        per_rank += push_bytes  # rank 0: the copies of one push until ZeroMQ has sent them
        generator += 2 * push_bytes  # one push being assembled and one waiting to be loaded
    # train.fixed_staleness=k: rank 0 holds the last k versions in CPU memory (asyncgrpo/learner/
    # publication.py), in the wire dtype; nccl sends, and so holds, float32. On a GPU that is host
    # memory, reported beside the rank's device memory, not in it.
    held_bytes = max(0, cfg.train.fixed_staleness) * (num_parameters * 4 if backend == "nccl" else push_bytes)
    held_in_rank = held_bytes if cfg.device == "cpu" else 0
    per_rank += held_in_rank
    estimate = {
        "learner_rank_gib": per_rank / GIB + LEARNER_RUNTIME_GIB,
        "generator_gib": generator / GIB + VLLM_RUNTIME_GIB,
        "shared_memory_gib": shared / GIB,
        "held_versions_gib": held_bytes / GIB,
        "merge_base_gib": merge_base_bytes / GIB,
    }
    # learner_rank_gib is rank 0's, the largest; only rank 0 holds the fixed-staleness versions.
    estimate["total_gib"] = (estimate["learner_rank_gib"] * learner.world_size
                             - held_in_rank / GIB * (learner.world_size - 1)
                             + estimate["generator_gib"] * rollout.num_generators + estimate["shared_memory_gib"])
    return estimate



def merge_base_bytes(adapters: AdapterLayout | None, stored_dtype: str) -> int:
    """The bytes a generator holds to merge a LoRA run's adapter pushes: the base weights of the
    targeted layers, as the model's files store them (weights/adapters.py, `AdapterMerge`); 0 when
    pushes carry the model (`adapters` None)."""
    if adapters is None:
        return 0
    return sum(out * inp for out, inp in adapters.shapes.values()) * _DTYPE_BYTES.get(stored_dtype, 4)


def machine_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def check_rewards(cfg: Config) -> dict[str, Any]:
    """Import reward.fn and each fn term's function, and probe the judge when a term asks it; raises
    PreflightError (one line) on a typo or an unreachable judge, which would otherwise surface only
    once the actors are up (an import error in every generator, or a run training on zeros)."""
    from asyncgrpo.rewards.errors import one_line
    from asyncgrpo.rewards.judge import JudgeError, probe_judge
    from asyncgrpo.rewards.scorer import fn_paths, term_configs
    from asyncgrpo.rewards.user_fn import RewardFnError, load_reward_fn

    report: dict[str, Any] = {"functions": []}
    for key, path in fn_paths(cfg.reward):
        try:
            load_reward_fn(path, key=key)
        except RewardFnError as err:
            raise PreflightError(one_line(str(err), limit=1000)) from None
        report["functions"].append(path)
    if any(term.resolved_kind == "judge" for term in term_configs(cfg.reward)):
        try:
            report["judge"] = probe_judge(cfg.reward.judge)
        except JudgeError as err:
            raise PreflightError(one_line(str(err), limit=1000)) from None
    if cfg.env.name:
        report["env"] = check_environment(cfg)
    return report


def check_environment(cfg: Config) -> dict[str, Any]:
    """Build the configured environment once (an HTTP one asks its server for its stop texts), so a
    dead server or a bad setting is one line before any actor starts, not an error in every generator."""
    from asyncgrpo.envs import make_environment
    from asyncgrpo.rewards.errors import one_line

    try:
        spec = make_environment(cfg.env)
    except ValueError as err:
        raise PreflightError(one_line(str(err), limit=1000)) from None
    return {"name": spec.name, "stop": list(spec.stop)}


def check_agent_template(cfg: Config, model_dir: str) -> None:
    """env.name=agent renders every request through env.agent.chat_template (or the tokenizer's own):
    render one here, so a missing or broken template is one line, not every episode refused."""
    from transformers import AutoTokenizer

    from asyncgrpo.envs.agent import Refused, render

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        render(tokenizer, cfg.env.agent.chat_template, [{"role": "user", "content": "1+1="}], generation_prompt=True)
    except Refused as err:
        raise PreflightError(f"env.name=agent: {err}") from None


def preflight(cfg: Config, model_dir: str) -> dict[str, Any]:
    """The report; raises ModelDirError or PreflightError (one line) when the settings cannot work."""
    from asyncgrpo.models.check import ModelDirError, check_model_dir, weights_error
    from asyncgrpo.learner.lora import LoraError, check_model
    from asyncgrpo.composition import pushed_adapters
    from asyncgrpo.weights.adapters import pushed_spec

    # A user's model is checked against vLLM's registry (importing it takes seconds); the embedded
    # model is our own Qwen2.
    architectures = None if cfg.model.path else EMBEDDED_ARCHITECTURES
    info = check_model_dir(model_dir, cfg.model.max_positions, supported_architectures=architectures)
    # check=true sizes a model from its config alone (docs/MODELS.md: a shape needs no weights); a run loads them.
    missing_weights = weights_error(model_dir)
    if missing_weights and not cfg.check:
        raise ModelDirError(f"{model_dir}: {missing_weights}")
    if cfg.env.name == "agent":
        check_agent_template(cfg, model_dir)
    try:  # learner.lora.target_modules against the model's layers, and the rank against their widths
        lora_targets = check_model(cfg.learner.lora, model_dir)
    except LoraError as err:
        raise PreflightError(str(err)) from None
    # A LoRA run's pushes carry its adapters (weights.lora_push).
    adapters = pushed_adapters(cfg, model_dir)
    push = push_plan(cfg, pushed_spec(model_dir, adapters))
    config = _text_config(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    head_size_error = cpu_head_size_error(head_dim) if cfg.device == "cpu" else None
    if head_size_error:
        raise PreflightError(f"{model_dir}: {head_size_error}")
    kv = kv_cache_plan(cfg, config.num_hidden_layers, config.num_key_value_heads, head_dim)
    # A merging generator keeps the base of the targeted layers; vLLM's LoRA path keeps none.
    merging = adapters if cfg.rollout.lora_apply == "merge" else None
    memory = memory_estimate(cfg, info.num_parameters, info.vocab_size, push["bytes_per_push"], push["backend"],
                             merge_base_bytes(merging, info.dtype))
    report = {"model": {**info.to_dict(), "weights": missing_weights or "present"}, "push": push, "kv_cache": kv,
              "memory_gib": memory}
    if lora_targets:
        report["lora"] = {"rank": cfg.learner.lora.rank, "layers": len(lora_targets)}
    if push["backend"] == "shm":
        check_shared_memory(cfg, 2 * push["bytes_per_push"])
    if cfg.device == "cpu":
        available = machine_memory_gib()
        report["memory_gib"]["machine"] = available
        if memory["total_gib"] > available:
            raise PreflightError(
                f"the actors need about {memory['total_gib']:.1f} GiB (learner {memory['learner_rank_gib']:.1f} x "
                f"{cfg.learner.world_size}, generator {memory['generator_gib']:.1f} x {cfg.rollout.num_generators}) "
                f"but this machine has {available:.1f} GiB: lower learner.micro_batch_tokens, rollout.kv_cache_gib "
                "or the number of actors, or turn algo.kl off")
    return report


def check_data(cfg: Config, model_dir: str) -> dict[str, Any] | None:
    """check=true for a file task: load data.train_files and data.eval_files as the run would (a
    missing file, a bad record under data.strict, no usable record: one line), count what they hold,
    and refuse any prompt that would not fit the context beside rollout.max_new_tokens, naming how
    many and the longest (the run would skip them as bad data). None for a built-in task."""
    from transformers import AutoTokenizer

    from asyncgrpo.data import DataError, DataReport, FieldMap, PromptFormat, load_problems
    from asyncgrpo.composition import run_task
    from asyncgrpo.tasks import FILE_TASKS

    if cfg.task.name not in FILE_TASKS:
        return None
    data = cfg.data
    for key, paths in (("data.train_files", data.train_files), ("data.eval_files", data.eval_files)):
        missing = [path for path in paths if not Path(path).expanduser().is_file()]
        if missing:
            raise PreflightError(f"{key}: {missing[0]}: no such file" + (f" (and {len(missing) - 1} more)"
                                                                          if len(missing) > 1 else ""))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        task = run_task(cfg, tokenizer)
        # Every prompt again, this time none dropped for its length (data.max_prompt_tokens still
        # filters by choice): their lengths, which the task does not keep.
        prompts = load_problems([*data.train_files, *data.eval_files],
                                report=DataReport("data", strict=False),
                                fields=FieldMap(prompt=data.prompt_field, answer=""),
                                prompt_format=PromptFormat(template=data.prompt_template,
                                                           chat_template=data.chat_template,
                                                           system_prompt=data.system_prompt),
                                max_prompt_tokens=data.max_prompt_tokens, tokenizer=tokenizer)
    except DataError as err:
        raise PreflightError(str(err)) from None
    lengths = [len(ids) for ids in tokenizer([p.prompt for p in prompts], add_special_tokens=False)["input_ids"]] \
        if prompts else []
    budget = cfg.model.max_positions - cfg.rollout.max_new_tokens
    longest = max(lengths, default=0)
    over = sum(length > budget for length in lengths)
    if over:
        raise PreflightError(
            f"{over} prompt{'s' if over != 1 else ''} of data.train_files/data.eval_files do not fit the context: "
            f"the longest has {longest} tokens, beside rollout.max_new_tokens={cfg.rollout.max_new_tokens} "
            f"model.max_positions={cfg.model.max_positions} leaves room for {budget}: raise model.max_positions, lower "
            "rollout.max_new_tokens, or set data.max_prompt_tokens to filter them")
    return {**task.report(), "describe": task.describe(), "longest_prompt_tokens": longest,
            "prompt_tokens_allowed": budget}


def check_shared_memory(cfg: Config, needed: int) -> None:
    """weights.backend=shm: room for the two version slots where they will live."""
    from asyncgrpo.weights.shm import default_directory

    directory = cfg.weights.shm_dir or default_directory()
    if not os.path.isdir(directory):
        raise PreflightError(f"weights.shm_dir={directory} is not a directory")
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise PreflightError(f"weights.backend=shm needs {needed / GIB:.2f} GiB free in {directory} for two weight "
                             f"slots, it has {free / GIB:.2f} GiB: set weights.shm_dir or weights.backend=zmq")


@contextmanager
def model_dir_for_check(cfg: Config) -> Iterator[str]:
    """model.path, or for the embedded model an untrained copy of its shape in a temporary
    directory (the check reads shapes and the tokenizer, not the weights; the warm start is not run)."""
    if cfg.model.path:
        yield str(Path(cfg.model.path).expanduser())
        return
    from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
    from asyncgrpo.models.tokenizer import build_char_tokenizer

    with tempfile.TemporaryDirectory(prefix="asyncgrpo-check-") as directory:
        tokenizer = build_char_tokenizer()
        save_model(build_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=cfg.seed), tokenizer,
                   Path(directory))
        yield directory


def format_report(report: dict[str, Any]) -> str:
    model, push, kv, memory = report["model"], report["push"], report["kv_cache"], report["memory_gib"]
    rewards = report.get("reward", {})
    lines = [
        f"model      {model['path']}: {model['architecture']}, {model['num_parameters']:,} parameters, "
        f"vocab {model['vocab_size']:,} (tokenizer {model['tokenizer_size']:,}), {model['num_layers']} layers, "
        f"context {model['max_positions']:,}"
        + ("" if model.get("weights", "present") == "present" else f"; weights: {model['weights']} (a run needs them)"),
        f"push       {push['bytes_per_push'] / 1e6:,.1f} MB in {push['wire_dtype']} over {push['backend']}"
        + (f", {push['chunks_per_push']} chunk(s)" if push["backend"] == "zmq" else "") + ", "
        f"largest tensor {push['largest_tensor']} {push['largest_tensor_bytes'] / 1e6:,.1f} MB",
        f"kv cache   {kv['tokens_held']:,} tokens held, one call needs at most {kv['tokens_needed_per_call']:,} "
        f"({kv['bytes_per_token']:,} bytes per token)",
        f"memory     learner rank ~{memory['learner_rank_gib']:.1f} GiB, generator ~{memory['generator_gib']:.1f} GiB, "
        + (f"shared weight slots {memory['shared_memory_gib']:.1f} GiB, " if memory["shared_memory_gib"] else "")
        + (f"train.fixed_staleness versions {memory['held_versions_gib']:.1f} GiB (rank 0), "
           if memory.get("held_versions_gib") else "")
        + (f"of each generator's the LoRA targets' base weights {memory['merge_base_gib']:.1f} GiB, "
           if memory.get("merge_base_gib") else "")
        + f"all actors ~{memory['total_gib']:.1f} GiB"
        + (f" of {memory['machine']:.1f} GiB here" if "machine" in memory else ""),
    ]
    if report.get("data"):
        data = report["data"]
        lines.append(f"data       {data['describe']}; longest prompt {data['longest_prompt_tokens']:,} tokens "
                     f"of {data['prompt_tokens_allowed']:,} allowed")
    if rewards.get("functions") or "judge" in rewards:
        lines.append("reward     " + ", ".join(
            [f"{path} imports" for path in rewards.get("functions", [])]
            + ([f"judge {rewards['judge']['url']} answered HTTP {rewards['judge']['status']}"] if "judge" in rewards
               else [])))
    return "\n".join(lines)


def _text_config(model_dir: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).get_text_config()
