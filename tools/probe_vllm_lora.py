"""Probe vLLM's LoRA path and its weight-transfer API on this build (issue 32, items 2 and 5).

    .venv/bin/python -m tools.probe_vllm_lora                    # the tiny default model (~1 min)
    .venv/bin/python -m tools.probe_vllm_lora --sizes tiny,100M  # and a ~100M-parameter shape

For each model size (random weights, Qwen2, float32, saved in Hugging Face format) two engine
processes run side by side, started from the same base model directory:
- "lora": `LLM(..., enable_lora=True, max_lora_rank, max_loras, max_cpu_loras)`, adapters given as
  PEFT directories (adapter_config.json + adapter_model.safetensors) through `LoRARequest`;
- "merged": the project's own `VLLMEngine`, which loads W + alpha/r * B @ A for the targeted layers
  through `load_weights` (the merge-in-place alternative; the worker keeps the base weights of the
  targeted layers, as a generator merging in place would have to).
Random adapters (every linear layer of the decoder, B not zero so the adapter changes the model)
at ranks 8 and 16. Measured:
- parity: log-probs of fixed sequences (temperature 1) through vLLM's LoRA path, through the
  merged engine and through a transformers forward of the merged model (this process);
- cost: adding an adapter (a new lora_int_id per version) from a file, from a file in /dev/shm and
  from tensors in memory (no file; vLLM's own loader, called inside the worker); removing one;
  what happens past max_loras; merging + loading in place;
- throughput: decode tokens/s of one fixed workload on the merged engine and on the LoRA engine
  (no adapter, one adapter, two adapters in one batch), interleaved, `--repeats` times; reported as
  ratios to the merged engine of the same repetition (median and range);
- weight transfer: vLLM's `init_weight_transfer_engine` / `start_weight_update` / `update_weights`
  with the "ipc" engine on this CPU build.

Prints a table, then one JSON line. Run it under the heavy lock (it runs two vLLM engines).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tools import list_type, positive_float, positive_int

# The decoder's linear layers a PEFT adapter targets: module -> its parent in a Qwen2 layer.
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PEFT_PREFIX = "base_model.model."


# ---------------------------------------------------------------------------------- pure helpers


def target_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each targeted linear layer of a Qwen2 config.json."""
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (q_out, hidden), "k_proj": (kv_out, hidden), "v_proj": (kv_out, hidden),
            "o_proj": (hidden, q_out), "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
            "down_proj": (hidden, intermediate)}


def random_adapter(config: dict[str, Any], rank: int, *, seed: int, b_scale: float) -> dict[str, torch.Tensor]:
    """A PEFT LoRA adapter's tensors for every targeted layer, in PEFT's names
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`: A [rank, in], B [out, rank]).
    A ~ N(0, 1/in) as PEFT initialises it; B ~ N(0, b_scale^2) instead of PEFT's zeros, so that the
    adapter changes the model and a path that dropped it shows in the log-probs."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (out_features, in_features) in target_shapes(config).items():
            stem = f"{PEFT_PREFIX}model.layers.{layer}.{TARGETS[module]}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * b_scale
    return tensors


def adapter_config(rank: int, alpha: float, base_model: str) -> dict[str, Any]:
    """adapter_config.json of a plain PEFT LoRA adapter on every targeted layer (what vLLM's
    PEFTHelper reads: r, lora_alpha, target_modules, bias)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
            "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(TARGETS), "bias": "none",
            "use_rslora": False, "use_dora": False}


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """A PEFT adapter directory: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def base_weight_name(peft_name: str) -> str:
    """The Hugging Face weight an adapter tensor modifies:
    base_model.model.model.layers.0.mlp.up_proj.lora_B.weight -> model.layers.0.mlp.up_proj.weight."""
    if not peft_name.startswith(PEFT_PREFIX):
        raise ValueError(f"not a PEFT adapter tensor name: {peft_name}")
    stem, kind, suffix = peft_name[len(PEFT_PREFIX):].rsplit(".", 2)
    if kind not in ("lora_A", "lora_B") or suffix != "weight":
        raise ValueError(f"not a LoRA A/B weight: {peft_name}")
    return f"{stem}.weight"


def merged_weights(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], rank: int,
                   alpha: float) -> dict[str, torch.Tensor]:
    """W + alpha/rank * B @ A for each weight the adapter targets (Hugging Face names), computed in
    float32 and returned in W's dtype; `base` needs only the targeted weights."""
    merged = {}
    for name, lora_a in adapter.items():
        if ".lora_A." not in name:
            continue
        target = base_weight_name(name)
        lora_b = adapter[name.replace(".lora_A.", ".lora_B.")]
        weight = base[target]
        delta = (alpha / rank) * (lora_b.float() @ lora_a.float())
        merged[target] = (weight.float() + delta).to(weight.dtype)
    return merged


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired_ratios(values: Sequence[float], references: Sequence[float]) -> dict[str, float]:
    """values[i] / references[i] for measurements taken in the same repetition, as `spread`."""
    if len(values) != len(references) or not values:
        raise ValueError(f"need as many values as references, got {len(values)} and {len(references)}")
    return spread([value / reference for value, reference in zip(values, references)])


def max_abs_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """Largest per-token absolute difference between two lists of log-prob arrays."""
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(a, b))


# ---------------------------------------------------------------------- inside the engine processes


def _lora_request(adapter: tuple | None):
    """vLLM's LoRARequest from (name, lora_int_id, path[, load_inplace]); None for the base model."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    name, lora_id, path, *inplace = adapter
    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=bool(inplace and inplace[0]))


def _prompt_logprobs(llm, sequences: list[list[int]], adapter: tuple[str, int, str] | None) -> list[np.ndarray]:
    """Log-prob of tokens 1..L-1 of each sequence at temperature 1 (as VLLMEngine.sequence_logprobs)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False,
                           lora_request=_lora_request(adapter))
    return [np.asarray([out.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))], dtype=np.float32)
            for s, out in zip(sequences, outputs)]


def _timed_generate(llm, prompts: list[list[int]], max_tokens: int,
                    adapters: list[tuple[str, int, str]] | None) -> dict[str, float]:
    """One fixed decode workload (every sample runs to max_tokens); seconds and tokens generated.
    `adapters`: one per prompt, cycled (None: the base model)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=0, detokenize=False)
    requests = None
    if adapters:
        requests = [_lora_request(adapters[i % len(adapters)]) for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                           lora_request=requests)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(out.outputs[0].token_ids) for out in outputs)}


def _add_lora_from_tensors(worker, lora_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> int:
    # Runs inside the vLLM worker: what LRUCacheWorkerLoRAManager.add_adapter does after reading
    # the files (vLLM 0.32 has no public way to add an adapter from tensors): LoRAModel from the
    # tensors, evict the oldest adapter when the CPU cache is full, add and activate it.
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    lora = LoRAModel.from_lora_tensors(lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
                                       model_vocab_size=manager.vocab_size)
    adapters = manager._adapter_manager
    adapters.remove_adapter(lora_id)
    if len(adapters) + 1 > adapters.capacity:
        adapters.remove_oldest_adapter()
    adapters.add_adapter(lora)
    adapters.activate_adapter(lora_id)
    return lora_id


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


class LoRAWorker:
    """An engine with vLLM's LoRA path on (and vLLM's "ipc" weight-transfer engine configured)."""

    def __init__(self, model_dir: str, options: dict[str, Any]) -> None:
        from vllm import LLM

        from asyncgrpo.rollout.engine import _keep_cpu_weights_unpacked

        # As VLLMEngine does on CPU (before the engine is built): torch's GEMM on plain weights.
        self.kept_unpacked = options["lora_gemm"] == "torch" and _keep_cpu_weights_unpacked()
        self.llm = LLM(model=model_dir, dtype="float32", seed=0, max_model_len=options["max_model_len"],
                       enforce_eager=True, kv_cache_memory_bytes=int(options["kv_cache_gib"] * (1 << 30)),
                       logprobs_mode="processed_logprobs", async_scheduling=False, enable_prefix_caching=False,
                       enable_lora=True, max_lora_rank=options["max_lora_rank"], max_loras=options["max_loras"],
                       max_cpu_loras=options["max_cpu_loras"], weight_transfer_config={"backend": "ipc"})

    def logprobs(self, sequences: list[list[int]], adapter: tuple[str, int, str] | None) -> list[np.ndarray]:
        return _prompt_logprobs(self.llm, sequences, adapter)

    def generate_timed(self, prompts: list[list[int]], max_tokens: int,
                       adapters: list[tuple[str, int, str]] | None) -> dict[str, float]:
        return _timed_generate(self.llm, prompts, max_tokens, adapters)

    def add_lora(self, adapter: tuple[str, int, str]) -> float:
        start = time.perf_counter()
        if not self.llm.llm_engine.add_lora(_lora_request(adapter)):
            raise RuntimeError(f"add_lora({adapter}) returned False")
        return time.perf_counter() - start

    def add_lora_from_tensors(self, lora_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> float:
        start = time.perf_counter()
        self.llm.collective_rpc(_add_lora_from_tensors, args=(lora_id, tensors, config))
        return time.perf_counter() - start

    def remove_lora(self, lora_id: int) -> float:
        start = time.perf_counter()
        if not self.llm.llm_engine.remove_lora(lora_id):
            raise RuntimeError(f"remove_lora({lora_id}) returned False")
        return time.perf_counter() - start

    def sample_with_switch(self, prompt: list[int], max_tokens: int, switch_after: int, first: tuple,
                           replacement: tuple) -> dict[str, list]:
        """One request sampled step by step on adapter `first`; after `switch_after` engine steps the
        same lora_int_id is replaced (`replacement`, load_inplace) while the request runs. Returns
        its tokens and their log-probs (temperature 1)."""
        from vllm import SamplingParams, TokensPrompt

        engine = self.llm.llm_engine
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=0, logprobs=0,
                                detokenize=False)
        engine.add_request("switch", TokensPrompt(prompt_token_ids=prompt), params, lora_request=_lora_request(first))
        steps, final = 0, None
        while engine.has_unfinished_requests():
            if steps == switch_after:
                engine.add_lora(_lora_request(replacement))
            final = next((out for out in engine.step() if out.finished), final)
            steps += 1
        completion = final.outputs[0]
        return {"token_ids": list(completion.token_ids),
                "logprobs": [c[t].logprob for t, c in zip(completion.token_ids, completion.logprobs)]}

    def list_loras(self) -> list[int]:
        return sorted(self.llm.llm_engine.list_loras())

    def weight_transfer(self) -> dict[str, str]:
        """Each step of vLLM's weight-transfer API with the "ipc" engine: "ok" or its error line.
        The update carries a handle of a CPU tensor from torch's own reduction (what the IPC
        trainer engine would send, with a device key of "cpu")."""
        from torch.multiprocessing.reductions import reduce_tensor

        steps: dict[str, str] = {}
        update = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[1]],
                  "ipc_handles": [{"cpu": reduce_tensor(torch.ones(1))[1]}]}
        for step, kwargs in (("init_weight_transfer_engine", {"init_info": {"packed": False}}),
                             ("start_weight_update", {}), ("update_weights", {"update_info": update}),
                             ("finish_weight_update", {})):
            try:
                self.llm.collective_rpc(step, kwargs=kwargs)
                steps[step] = "ok"
            except Exception as err:  # noqa: BLE001 - the probe reports what each step does here
                steps[step] = _first_line(err)
        return steps


class MergedWorker:
    """The project's VLLMEngine (no LoRA), adapters merged into its live weights in place."""

    def __init__(self, model_dir: str, options: dict[str, Any]) -> None:
        from asyncgrpo.rollout.engine import VLLMEngine, _saved_tensors

        self.engine = VLLMEngine(model_dir, seed=0, max_model_len=options["max_model_len"], dtype="float32",
                                 kv_cache_gib=options["kv_cache_gib"], gpu_memory_utilization=0.3,
                                 max_running_seqs=256, prefix_caching=False,
                                 in_place_cpu_weights=options["merged_load"] == "in_place")
        # The base weights of the targeted layers: merging in place needs W, not the live W + s*B@A.
        suffixes = tuple(f".{module}.weight" for module in TARGETS)
        self.base = {name: tensor.clone() for tensors in _saved_tensors(model_dir)
                     for name, tensor in tensors.items() if name.endswith(suffixes)}

    def info(self) -> dict[str, Any]:
        return {"weight_load_path": self.engine.weight_load_path,
                "base_copy_bytes": sum(t.numel() * t.element_size() for t in self.base.values())}

    def logprobs(self, sequences: list[list[int]], adapter: None = None) -> list[np.ndarray]:
        return self.engine.sequence_logprobs(sequences, temperature=1.0)

    def generate_timed(self, prompts: list[list[int]], max_tokens: int, adapters: None = None) -> dict[str, float]:
        return _timed_generate(self.engine.llm, prompts, max_tokens, None)

    def merge_load(self, adapter: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, float]:
        """Merge an adapter into the base weights and load the merged layers; seconds of each."""
        start = time.perf_counter()
        merged = merged_weights(self.base, adapter, rank, alpha)
        merge_s = time.perf_counter() - start
        self.engine.load_weights(merged.items())
        return {"merge_s": merge_s, "load_s": time.perf_counter() - start - merge_s, "tensors": len(merged),
                "bytes": sum(t.numel() * t.element_size() for t in merged.values())}


WORKERS = {"lora": LoRAWorker, "merged": MergedWorker}


def _serve(kind: str, model_dir: str, options: dict[str, Any], conn) -> None:
    """An engine process: build the worker, then run (method, args) calls until None."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        worker = WORKERS[kind](model_dir, options)
        conn.send(("ok", None))
    except Exception as err:  # noqa: BLE001 - reported to the parent as one line
        conn.send(("error", _first_line(err)))
        return
    while (message := conn.recv()) is not None:
        method, args = message
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception as err:  # noqa: BLE001 - reported to the parent as one line
            conn.send(("error", _first_line(err)))


class Remote:
    """One engine process, called method by method over a pipe."""

    def __init__(self, kind: str, model_dir: str, options: dict[str, Any]) -> None:
        context = mp.get_context("spawn")
        self.kind = kind
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(kind, model_dir, options, child), daemon=True)
        self.process.start()

    def _answer(self, what: str) -> Any:
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.kind} engine, {what}: {value}")
        return value

    def ready(self) -> None:
        self._answer("start")

    def call(self, method: str, *args: Any) -> Any:
        self.conn.send((method, args))
        return self._answer(method)

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


# --------------------------------------------------------------------------------- this process


def build_model_dir(size: str, directory: Path) -> dict[str, Any]:
    """A random base model: "tiny" is the embedded default (ModelConfig's sizes, as a run builds it),
    other sizes are tools.bench_push's or `asyncgrpo make-model` shapes; returns its config.json."""
    if size == "tiny":
        from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
        from asyncgrpo.models.tokenizer import build_char_tokenizer
        from asyncgrpo.schema import ModelConfig

        tokenizer = build_char_tokenizer()
        save_model(build_model(TinyModelSpec.from_config(ModelConfig()), tokenizer, seed=0), tokenizer, directory)
    else:
        from tools.bench_push import build

        build(size, directory)
    return json.loads((directory / "config.json").read_text())


def _hf_model(model_dir: Path, weights: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    missing = set(weights) - set(model.state_dict())
    if missing:
        raise KeyError(f"weights the model lacks: {sorted(missing)[:3]}")
    model.load_state_dict(weights, strict=False)
    return model


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> np.ndarray:
    """logits [L, V] of positions 0..L-1, ids [L]: log-prob of ids 1..L-1 ([L-1])."""
    return torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, ids[1:, None])[:, 0].numpy()


def hf_logprobs(model_dir: Path, weights: dict[str, torch.Tensor], sequences: list[list[int]]) -> list[np.ndarray]:
    """Log-probs of tokens 1..L-1 from a transformers forward (float32) of the model in `model_dir`
    with `weights` (Hugging Face names) replacing its own."""
    model = _hf_model(model_dir, weights)
    with torch.no_grad():
        return [_token_logprobs(model(torch.tensor([s])).logits[0], torch.tensor(s)) for s in sequences]


def hf_switched_logprobs(model_dir: Path, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                         sequence: list[int], split: int) -> np.ndarray:
    """Log-probs of tokens 1..L-1 when positions < split are computed (and cached) with `before`'s
    weights and the rest with `after`'s, attending to the cached keys/values: what an engine whose
    weights change while a sequence decodes computes (its KV cache keeps the old entries)."""
    ids = torch.tensor([sequence])
    with torch.no_grad():
        first = _hf_model(model_dir, before)(ids[:, :split], use_cache=True)
        rest = _hf_model(model_dir, after)(ids[:, split:], past_key_values=first.past_key_values, use_cache=True)
    return _token_logprobs(torch.cat([first.logits, rest.logits], dim=1)[0], ids[0])


def _base_targets(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    suffixes = tuple(f".{module}.weight" for module in TARGETS)
    return {name: tensor for file in sorted(model_dir.glob("*.safetensors"))
            for name, tensor in load_file(file).items() if name.endswith(suffixes)}


def probe_parity(lora: Remote, merged: Remote, model_dir: Path, adapters: dict[int, dict[str, Any]],
                 sequences: list[list[int]]) -> list[dict[str, Any]]:
    """Per rank: vLLM's LoRA path, the engine with merged weights and transformers' merged forward
    (kept in adapters[rank]["hf"] for later checks)."""
    base = _base_targets(model_dir)
    hf_base = hf_logprobs(model_dir, {}, sequences)
    rows = [{"rank": 0, "lora_vs_hf": max_abs_diff(lora.call("logprobs", sequences, None), hf_base),
             "merged_vs_hf": max_abs_diff(merged.call("logprobs", sequences), hf_base)}]
    for rank, adapter in adapters.items():
        weights = merged_weights(base, adapter["tensors"], rank, adapter["alpha"])
        hf_merged = adapter["hf"] = hf_logprobs(model_dir, weights, sequences)
        adapter["weights"] = weights
        via_lora = lora.call("logprobs", sequences, adapter["request"])
        merged.call("merge_load", adapter["tensors"], rank, adapter["alpha"])
        via_merged = merged.call("logprobs", sequences)
        rows.append({"rank": rank, "lora_vs_hf": max_abs_diff(via_lora, hf_merged),
                     "merged_vs_hf": max_abs_diff(via_merged, hf_merged),
                     "lora_vs_merged": max_abs_diff(via_lora, via_merged),
                     "adapter_effect": max_abs_diff(hf_merged, hf_base)})
    return rows


def probe_replace_in_place(lora: Remote, adapters: dict[int, dict[str, Any]],
                           sequences: list[list[int]]) -> dict[str, Any]:
    """One lora_int_id whose adapter is replaced (vLLM's `load_inplace=True` from a file, then from
    tensors): do requests after each replacement get the new adapter (vs transformers' merged
    forward), and what does a replacement cost."""
    (_, _, path8), (_, _, path16) = adapters[8]["request"], adapters[16]["request"]
    live_id = 50
    lora.call("add_lora", ("live", live_id, path8))
    first = max_abs_diff(lora.call("logprobs", sequences, ("live", live_id, path8)), adapters[8]["hf"])
    replace_file_s = lora.call("add_lora", ("live", live_id, path16, True))
    after_file = max_abs_diff(lora.call("logprobs", sequences, ("live", live_id, path16)), adapters[16]["hf"])
    config8 = adapter_config(8, adapters[8]["alpha"], "base")
    replace_tensors_s = lora.call("add_lora_from_tensors", live_id, adapters[8]["tensors"], config8)
    after_tensors = max_abs_diff(lora.call("logprobs", sequences, ("live", live_id, "in-memory")), adapters[8]["hf"])
    switch = _switch_mid_sequence(lora, adapters, live_id)
    lora.call("remove_lora", live_id)
    return {**switch, "first_vs_hf": first, "after_inplace_file_vs_hf": after_file, "after_tensors_vs_hf": after_tensors,
            "inplace_file_ms": 1e3 * replace_file_s, "inplace_tensors_ms": 1e3 * replace_tensors_s}


def _switch_mid_sequence(lora: Remote, adapters: dict[int, dict[str, Any]], live_id: int) -> dict[str, Any]:
    """Does a request already running pick up an adapter replaced in place (same lora_int_id)? Its
    log-probs are compared with a transformers forward that switches from the old adapter's merged
    weights to the new one's at the same token (keeping the keys/values cached before it)."""
    (_, _, path8), (_, _, path16) = adapters[8]["request"], adapters[16]["request"]
    prompt, switch_after = [1, 2, 3, 4], 4
    max_tokens = min(16, adapters[8]["max_model_len"] - len(prompt))
    lora.call("add_lora", ("live", live_id, path8, True))
    run = lora.call("sample_with_switch", prompt, max_tokens, switch_after, ("live", live_id, path8),
                    ("live", live_id, path16, True))
    sequence = prompt + run["token_ids"]
    sampled = np.asarray(run["logprobs"])
    model_dir, before, after = adapters[8]["model_dir"], adapters[8]["weights"], adapters[16]["weights"]
    # Step k computes the keys/values of the token sampled at step k-1: the positions up to the
    # switch_after-1'th sampled token were computed with the old adapter.
    switched = hf_switched_logprobs(model_dir, before, after, sequence, len(prompt) + switch_after - 1)
    old = hf_logprobs(model_dir, before, [sequence])[0]
    start = len(prompt) - 1  # log-prob of the first sampled token
    return {"switch_after_tokens": switch_after,
            "switched_vs_hf": float(np.max(np.abs(sampled - switched[start:]))),
            "switched_vs_old_only": float(np.max(np.abs(sampled - old[start:])))}


def probe_adapter_costs(lora: Remote, config: dict[str, Any], workdir: Path, args: argparse.Namespace,
                        sequences: list[list[int]]) -> dict[str, Any]:
    """A new adapter (new lora_int_id) per version, `args.versions` times, three ways: from a file
    written beforehand, from a file written into /dev/shm just then (the write timed too), from
    tensors (no file); then removing every adapter still loaded. Also: whether an adapter added from
    tensors serves requests (same log-probs as the same adapter read from a file)."""
    rank, alpha = args.rank, 2.0 * args.rank
    shm_root = Path(tempfile.mkdtemp(prefix="probe-lora-", dir="/dev/shm" if Path("/dev/shm").is_dir() else workdir))
    times: dict[str, list[float]] = {"disk_add": [], "shm_write": [], "shm_add": [], "tensors_add": []}
    next_id, shm_adapters = 1000, []
    try:
        for version in range(args.versions):
            tensors = random_adapter(config, rank, seed=100 + version, b_scale=args.b_scale)
            cfg = adapter_config(rank, alpha, "base")
            disk = write_adapter(workdir / f"version-{version}", tensors, cfg)
            times["disk_add"].append(lora.call("add_lora", (f"disk-{version}", next_id, str(disk))))
            start = time.perf_counter()
            shm = write_adapter(shm_root / f"version-{version}", tensors, cfg)
            times["shm_write"].append(time.perf_counter() - start)
            shm_adapters.append((f"shm-{version}", next_id + 1, str(shm)))
            times["shm_add"].append(lora.call("add_lora", shm_adapters[-1]))
            times["tensors_add"].append(lora.call("add_lora_from_tensors", next_id + 2, tensors, cfg))
            next_id += 3
        loaded_after_adds = lora.call("list_loras")
        from_tensors = lora.call("logprobs", sequences, ("tensors-last", next_id - 1, "in-memory"))
        from_file = lora.call("logprobs", sequences, shm_adapters[-1])
        past_slots = _past_max_loras(lora, shm_adapters, args)
        remove_ms = [1e3 * lora.call("remove_lora", lora_id) for lora_id in lora.call("list_loras")]
    finally:
        import shutil

        shutil.rmtree(shm_root, ignore_errors=True)
    return {**{f"{key}_ms": spread([1e3 * s for s in values]) for key, values in times.items()},
            "remove_ms": spread(remove_ms), "loaded_after_adds": loaded_after_adds,
            "tensors_vs_file_max_abs_diff": max_abs_diff(from_tensors, from_file),
            "adapter_bytes": sum(t.numel() * t.element_size() for t in tensors.values()), **past_slots}


def _past_max_loras(lora: Remote, adapters: list[tuple[str, int, str]], args: argparse.Namespace) -> dict[str, Any]:
    """One generate call whose requests name max_loras + 1 distinct adapters (more than a batch
    holds): does it finish, and how long it takes next to the same call with one adapter."""
    wanted = args.max_loras + 1
    if len(adapters) < wanted:
        return {"past_max_loras": f"not tried: {len(adapters)} adapters, {wanted} needed"}
    prompts = [[1 + i, 2 + i, 3 + i] for i in range(2 * wanted)]
    try:
        many = lora.call("generate_timed", prompts, 8, adapters[-wanted:])
        one = lora.call("generate_timed", prompts, 8, adapters[-1:])
    except RuntimeError as err:
        return {"past_max_loras": f"failed: {err}"}
    return {"past_max_loras": "finished", "past_max_loras_time_ratio": many["seconds"] / one["seconds"]}


def probe_throughput(lora: Remote, merged: Remote, adapters: list[tuple[str, int, str]], args: argparse.Namespace,
                     max_model_len: int) -> dict[str, Any]:
    """Decode tokens/s of one fixed workload, interleaved engine by engine, `args.repeats` times."""
    prompts = [[1 + i % 7, 2 + i % 5, 3 + i % 3, 4] for i in range(args.prompts)]
    max_tokens = min(args.max_tokens, max_model_len - len(prompts[0]))
    cases = {"merged": (merged, None), "lora_no_adapter": (lora, None), "lora_1_adapter": (lora, adapters[:1]),
             "lora_2_adapters": (lora, adapters[:2])}
    for remote, chosen in cases.values():  # warm-up: first calls carry one-time costs
        remote.call("generate_timed", prompts[:4], 4, chosen)
    tokens_per_s: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case, (remote, chosen) in cases.items():
            run = remote.call("generate_timed", prompts, max_tokens, chosen)
            tokens_per_s[case].append(run["tokens"] / run["seconds"])
    return {"workload": {"prompts": len(prompts), "max_tokens": max_tokens, "repeats": args.repeats},
            "tokens_per_s": {case: spread(values) for case, values in tokens_per_s.items()},
            "ratio_to_merged": {case: paired_ratios(values, tokens_per_s["merged"])
                                for case, values in tokens_per_s.items() if case != "merged"}}


def probe_merge_in_place(merged: Remote, adapter: dict[str, Any], rank: int, repeats: int) -> dict[str, Any]:
    """Merging an adapter into the kept base weights and loading the merged layers, `repeats` times."""
    runs = [merged.call("merge_load", adapter["tensors"], rank, adapter["alpha"]) for _ in range(repeats)]
    return {"merge_ms": spread([1e3 * run["merge_s"] for run in runs]),
            "load_ms": spread([1e3 * run["load_s"] for run in runs]),
            "merged_bytes": runs[0]["bytes"], "merged_tensors": runs[0]["tensors"], **merged.call("info")}


def probe_size(size: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every probe on one model size: two engine processes, side by side."""
    with tempfile.TemporaryDirectory(prefix="probe-vllm-lora-") as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "base"
        config = build_model_dir(size, model_dir)
        max_model_len = min(int(config["max_position_embeddings"]), 256)
        options = {"max_model_len": max_model_len, "kv_cache_gib": args.kv_cache_gib, "max_lora_rank": 16,
                   "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras, "merged_load": args.merged_load,
                   "lora_gemm": args.lora_gemm}
        adapters: dict[int, dict[str, Any]] = {}
        for index, rank in enumerate((8, 16)):
            tensors = random_adapter(config, rank, seed=index, b_scale=args.b_scale)
            path = write_adapter(workdir / f"rank-{rank}", tensors, adapter_config(rank, 2.0 * rank, str(model_dir)))
            adapters[rank] = {"tensors": tensors, "alpha": 2.0 * rank, "request": (f"rank-{rank}", index + 1, str(path)),
                              "model_dir": model_dir, "max_model_len": max_model_len}
        rng = np.random.default_rng(0)
        length = min(24, max_model_len - 1)
        sequences = [rng.integers(1, config["vocab_size"], size=length).tolist() for _ in range(args.sequences)]
        start = time.perf_counter()
        lora, merged = Remote("lora", str(model_dir), options), Remote("merged", str(model_dir), options)
        try:
            lora.ready()
            merged.ready()
            started_s = time.perf_counter() - start
            result: dict[str, Any] = {"size": size, "params": _parameter_count(model_dir), "engines_start_s": started_s,
                                      "options": options}
            result["parity"] = probe_parity(lora, merged, model_dir, adapters, sequences)
            result["replace_in_place"] = probe_replace_in_place(lora, adapters, sequences)
            result["merge_in_place"] = probe_merge_in_place(merged, adapters[args.rank], args.rank, args.repeats + 2)
            requests = [adapters[16]["request"], adapters[8]["request"]]
            result["throughput"] = probe_throughput(lora, merged, requests, args, max_model_len)
            result["adapters"] = probe_adapter_costs(lora, config, workdir, args, sequences)
            result["weight_transfer_ipc"] = lora.call("weight_transfer")
        finally:
            lora.close()
            merged.close()
    return result


def _parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    count = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            count += sum(int(np.prod(f.get_slice(name).get_shape())) for name in f.keys())
    return count


def print_report(results: list[dict[str, Any]], tolerance: float) -> None:
    """The human-readable table of each size's results."""
    for r in results:
        print(f"\n== {r['size']}: {r['params']:,} parameters, both engines started in {r['engines_start_s']:.1f} s; "
              f"{r['options']}")
        print(f"{'rank':>4} {'lora vs hf':>11} {'merged vs hf':>12} {'lora vs merged':>14} {'adapter effect':>14}"
              f"   (max |log-prob diff|, tolerance {tolerance:g})")
        for p in r["parity"]:
            print(f"{p['rank']:>4} {p['lora_vs_hf']:>11.2e} {p['merged_vs_hf']:>12.2e} "
                  f"{p.get('lora_vs_merged', float('nan')):>14.2e} {p.get('adapter_effect', float('nan')):>14.2e}")
        q = r["replace_in_place"]
        print(f"one lora_int_id replaced in place: from file {q['inplace_file_ms']:.1f} ms, then vs hf "
              f"{q['after_inplace_file_vs_hf']:.1e}; from tensors {q['inplace_tensors_ms']:.1f} ms, then vs hf "
              f"{q['after_tensors_vs_hf']:.1e} (before: {q['first_vs_hf']:.1e}); replaced while a request ran "
              f"(after {q['switch_after_tokens']} tokens): vs hf switching there {q['switched_vs_hf']:.1e}, "
              f"vs the old adapter throughout {q['switched_vs_old_only']:.1e}")
        m = r["merge_in_place"]
        print(f"merge in place ({m['weight_load_path']}): merge {m['merge_ms']['median']:.2f} ms + load "
              f"{m['load_ms']['median']:.2f} ms (median) for {m['merged_tensors']} tensors, "
              f"{m['merged_bytes'] / 1e6:.1f} MB; base copy kept {m['base_copy_bytes'] / 1e6:.1f} MB")
        a = r["adapters"]
        print(f"adapter rank {r.get('rank', '')}: {a['adapter_bytes'] / 1e6:.2f} MB; add_lora from disk "
              f"{a['disk_add_ms']['median']:.1f} ms, /dev/shm write {a['shm_write_ms']['median']:.1f} + add "
              f"{a['shm_add_ms']['median']:.1f} ms, from tensors {a['tensors_add_ms']['median']:.1f} ms, remove "
              f"{a['remove_ms']['median']:.2f} ms (medians); loaded after adds {a['loaded_after_adds']}; "
              f"from tensors vs file {a['tensors_vs_file_max_abs_diff']:.1e}; past max_loras: {a['past_max_loras']} "
              f"(time x{a.get('past_max_loras_time_ratio', float('nan')):.2f})")
        t = r["throughput"]
        print(f"decode tokens/s, {t['workload']}: merged {t['tokens_per_s']['merged']['median']:.0f}; ratio to merged "
              + ", ".join(f"{case} {q['median']:.2f} [{q['min']:.2f}-{q['max']:.2f}]"
                          for case, q in t["ratio_to_merged"].items()))
        print("weight transfer (ipc): " + "; ".join(f"{k}: {v}" for k, v in r["weight_transfer_ipc"].items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tools.bench_push import model_sizes

    parser = argparse.ArgumentParser(prog="python -m tools.probe_vllm_lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=list_type(choices=model_sizes()), default="tiny",
                        help="tiny (the embedded default), 100M, or a make-model shape")
    parser.add_argument("--rank", type=int, default=16, choices=(8, 16), help="rank of the cost and throughput probes")
    parser.add_argument("--b-scale", type=positive_float, default=0.05, help="std of the random B matrices")
    parser.add_argument("--versions", type=positive_int, default=6, help="adapter versions added one after another")
    parser.add_argument("--max-loras", type=positive_int, default=2,
                        help="vLLM's max_loras: distinct adapters in a batch")
    parser.add_argument("--max-cpu-loras", type=positive_int, default=4,
                        help="vLLM's max_cpu_loras: adapters kept loaded")
    parser.add_argument("--sequences", type=positive_int, default=8, help="sequences of the log-prob parity check")
    parser.add_argument("--prompts", type=positive_int, default=64, help="prompts of the throughput workload")
    parser.add_argument("--max-tokens", type=positive_int, default=24, help="tokens decoded per prompt")
    parser.add_argument("--repeats", type=positive_int, default=3, help="repetitions of the throughput workload")
    parser.add_argument("--kv-cache-gib", type=positive_float, default=0.25)
    parser.add_argument("--merged-load", default="in_place", choices=("in_place", "reload"),
                        help="the merged engine's load path: in_place (the CPU default: linear weights kept as "
                             "tensors, torch's GEMM) or reload (vLLM's reload_weights, its packed CPU GEMM; GPU's path)")
    parser.add_argument("--lora-gemm", default="vllm", choices=("vllm", "torch"),
                        help="the LoRA engine's base GEMM: vllm (its packed CPU kernel) or torch (linear weights "
                             "kept as tensors, as VLLMEngine's in-place path patches it)")
    args = parser.parse_args(argv)
    if args.max_cpu_loras < args.max_loras:
        parser.error("--max-cpu-loras must be at least --max-loras (vLLM keeps the batch's adapters loaded)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from asyncgrpo.schema import TrainConfig

    tolerance = TrainConfig().probe_tolerance
    results = [dict(probe_size(size, args), rank=args.rank) for size in args.sizes]
    print_report(results, tolerance)
    worst = max(max(p["lora_vs_hf"], p["merged_vs_hf"]) for r in results for p in r["parity"])
    print()
    print(json.dumps({"probe_tolerance": tolerance, "worst_parity": worst, "within_tolerance": worst <= tolerance,
                      "sizes": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
