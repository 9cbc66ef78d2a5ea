"""A thin wrapper around a vLLM engine: sample with log-probs, score fixed sequences, load weights.

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): for the tiny models of the CPU
default that is faster than a separate engine process, and `collective_rpc` then calls our
function on the worker directly, so new weights are loaded without a copy through a pipe.

Two ways to sample. `generate` is one call that returns when its slowest sample is done (held-out
evaluations). The generator's loop instead drives vLLM's engine a step at a time: `submit` adds a
group's request, `step` runs one engine step and returns the groups whose n samples have all
finished, while the others keep decoding; `label_version` names the weights loaded between two
steps, so every token reports the version that sampled it.

A LoRA run with rollout.lora_apply=vllm builds the engine with vLLM's LoRA path on (`EngineAdapter`):
every request then runs through one adapter, which each push replaces in place (`load_adapter`)
between two steps, as a full push replaces the weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Completion:
    token_ids: np.ndarray  # int32 [L]
    logprobs: np.ndarray  # float32 [L]: log-prob of each sampled token under the sampling distribution
    finished: bool  # False when cut off by max_tokens
    # Policy version that sampled each token; None = all by the version loaded when the call began.
    versions: np.ndarray | None = None
    # What ended it when `finished`: the stop text it ended with (an environment's, kept in token_ids)
    # or None for the end-of-sequence token.
    stop_reason: str | None = None
    # uint8 [L]: 1 on tokens the policy sampled, 0 on an environment's (an episode's observations);
    # None = all the policy's.
    policy_mask: np.ndarray | None = None


@dataclass
class FinishedGroup:
    """A request submitted with `VLLMEngine.submit` whose n samples have all finished."""

    request_id: str
    completions: list[Completion]


def token_versions(spans: Sequence[Any] | None, num_tokens: int) -> np.ndarray | None:
    """Per-token policy versions [num_tokens] int32 from vLLM's weight-version spans (`start`, `end`,
    `version` as the label `label_version` set); None when vLLM reported none."""
    if not spans or not all(str(span.version).isdigit() for span in spans):
        return None  # unlabelled (vLLM's "default" before the first label): the caller knows the version
    versions = np.empty(num_tokens, dtype=np.int32)
    for span in spans:
        versions[span.start:span.end] = int(span.version)
    return versions


def _load_named_weights(worker, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
    # Runs inside the vLLM worker; HF names and shapes (vLLM pads the vocabulary itself). The
    # reload path re-applies the backend's post-load processing (CPU kernels repack linear
    # weights, which a plain model.load_weights would not redo).
    worker.model_runner.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
    return len(named_tensors)


def _copy_named_weights(worker, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
    # The in-place path (see _keep_cpu_weights_unpacked): the model's own loader copies into the
    # live parameters, which the GEMMs read directly; nothing to re-process.
    worker.model_runner.model.load_weights(named_tensors)
    return len(named_tensors)


def _unpacked_linear_weights(worker) -> bool:
    """True if every linear layer still holds its full weight (nothing was repacked away)."""
    for module in worker.model_runner.model.modules():
        if hasattr(module, "cpu_linear") and getattr(module, "weight", None) is not None:
            if module.weight.numel() == 0 or module.cpu_linear is not torch.nn.functional.linear:
                return False
    return True


def _keep_weight_for_torch_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    # Stands in for vLLM's CPU GEMM dispatch: the layer multiplies with its own weight tensor
    # through torch (oneDNN underneath) instead of a prepacked copy.
    layer.cpu_linear = torch.nn.functional.linear


def _keep_cpu_weights_unpacked() -> bool:
    """Before an in-process CPU engine is built: keep linear weights as plain tensors.

    vLLM's CPU backend repacks each linear weight for its GEMM kernels and frees the original, so
    new weights can only arrive through `reload_weights`, which rebuilds every layer (about 14 ms
    per push for the 115k-parameter default, a third of a 128-sequence generation call). With the
    weights kept, a push is an in-place copy (about 1.5 ms); torch's linear instead of the
    prepacked GEMM cost 0-10% more per generation call in side-by-side runs here, well under what
    a push saves. Returns False where this does not apply (GPU, or an engine in another process).
    """
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm.model_executor.layers.utils as layer_utils

    if not hasattr(layer_utils, "dispatch_cpu_unquantized_gemm"):
        return False
    # linear.py and vocab_parallel_embedding.py import it from this module when they process weights.
    layer_utils.dispatch_cpu_unquantized_gemm = _keep_weight_for_torch_linear
    return True


def _seed_worker(worker, seed: int) -> None:
    # Runs where the sampler runs: requests without a seed of their own draw from these generators.
    import random

    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def _saved_tensors(model_dir: str) -> list[dict[str, torch.Tensor]]:
    """Each *.safetensors file of a Hugging Face directory, as name -> tensor."""
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return [load_file(file) for file in files]


def _drop_rotary_reload_warning(record: logging.LogRecord) -> bool:
    # The rotary cos/sin cache is derived, not a checkpoint weight: vLLM keeps its own copy on
    # every reload and warns about it each time.
    return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def _drop_raw_prompt_warning(record: logging.LogRecord) -> bool:
    # Token-id prompts go to LLMEngine.add_request as vLLM's own LLM.generate passes them; the
    # renderer it recommends instead would re-tokenize nothing here.
    return not record.getMessage().startswith("Passing raw prompts to InputProcessor")


def _sampling_params(n: int, max_tokens: int, temperature: float, stop: Sequence[str], **more: Any) -> Any:
    """vLLM's SamplingParams for n samples of a prompt, as both ways of sampling need them: the
    log-prob of each sampled token (logprobs=0: the token alone), no text (rewards decode it) unless
    `stop` texts end a turn (an environment's: vLLM matches them on the text; kept in the output)."""
    from vllm import SamplingParams

    if stop:
        more.update(stop=list(stop), include_stop_str_in_output=True)
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, logprobs=0, detokenize=bool(stop),
                          **more)


# The one adapter every request of a LoRA engine names. Its path is never read: the adapter is added
# from tensors before any request names it, and with one adapter slot it is never evicted; were vLLM
# ever to look for it on disk, the request would fail (no stale adapter could be loaded from there).
POLICY_ADAPTER_ID = 1
_POLICY_ADAPTER_PATH = "/nonexistent/asyncgrpo-adapter-pushed-from-tensors"
# vLLM 0.32's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class EngineAdapter:
    """vLLM's LoRA path (rollout.lora_apply=vllm): the adapter's PEFT adapter_config.json fields
    (`r`, `lora_alpha`, `target_modules`, ...) and the tensors it starts from, under PEFT's names
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)."""

    peft_config: dict[str, Any]
    initial: dict[str, torch.Tensor]

    @property
    def max_lora_rank(self) -> int:
        """The smallest rank vLLM accepts as max_lora_rank that holds this adapter's."""
        rank = int(self.peft_config["r"])
        fitting = [allowed for allowed in VLLM_LORA_RANKS if allowed >= rank]
        if not fitting:
            raise ValueError(f"vLLM's LoRA path takes adapters of rank <= {VLLM_LORA_RANKS[-1]}, not {rank}")
        return fitting[0]


@dataclass(frozen=True)
class _ServedAdapter:
    """A LoRA engine's one adapter: its PEFT config (what `load_adapter` builds each push with) and
    the request every generation names, built once rather than per request."""

    peft_config: dict[str, Any]
    request: Any  # vllm.lora.request.LoRARequest

    @classmethod
    def of(cls, adapter: EngineAdapter) -> _ServedAdapter:
        from vllm.lora.request import LoRARequest

        return cls(dict(adapter.peft_config), LoRARequest("asyncgrpo-policy", POLICY_ADAPTER_ID, _POLICY_ADAPTER_PATH))


def _add_adapter_from_tensors(worker, adapter_id: int, tensors: dict[str, torch.Tensor],
                              peft_config: dict[str, Any]) -> int:
    # Runs inside the vLLM worker. vLLM 0.32 adds adapters only from files; this is what its
    # LRU worker manager does after reading them (LoRAModel from the tensors, replace the adapter of
    # this id, activate it: the activation copies it into the layers' LoRA slots), minus the file.
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    # Copies: vLLM keeps the tensors it is given where their dtype and device already fit, and scales
    # B in place by alpha / r (LoRALayerWeights.optimize), which would change the caller's push (a
    # receive buffer, a shared-memory slot) under it.
    tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    adapter = LoRAModel.from_lora_tensors(adapter_id, tensors, helper, device="cpu",
                                          dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size)
    adapters = manager._adapter_manager
    adapters.remove_adapter(adapter_id)
    adapters.add_adapter(adapter)
    adapters.activate_adapter(adapter_id)
    return len(tensors)


class VLLMEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        seed: int,
        max_model_len: int,
        dtype: str,
        kv_cache_gib: float,
        gpu_memory_utilization: float,
        max_running_seqs: int,
        prefix_caching: bool,
        in_place_cpu_weights: bool = True,
        adapter: EngineAdapter | None = None,
    ) -> None:
        """`dtype`, `kv_cache_gib`, `gpu_memory_utilization` and `max_running_seqs` are rollout.dtype,
        rollout.kv_cache_gib, rollout.gpu_memory_utilization and rollout.max_running_seqs (no defaults
        here: config's are the only ones). `prefix_caching` off where weights are loaded while
        requests run: a prompt prefix cached under older weights would serve requests admitted after
        the load, and nothing would record it. `adapter`: vLLM's LoRA path on, every request through
        that adapter (None: plain weights)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        from vllm import LLM

        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_drop_rotary_reload_warning)
        logging.getLogger("vllm.v1.engine.input_processor").addFilter(_drop_raw_prompt_warning)
        wants_in_place = in_place_cpu_weights and _keep_cpu_weights_unpacked()
        # One adapter slot: every request names the same adapter, which a push replaces in place.
        lora = {} if adapter is None else dict(enable_lora=True, max_lora_rank=adapter.max_lora_rank, max_loras=1,
                                               max_cpu_loras=1)

        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=True,
            gpu_memory_utilization=gpu_memory_utilization,
            # An explicit size: otherwise vLLM on CPU reserves most of the machine's RAM.
            kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)),
            # The learner's forward is the reference: log-probs of the distribution actually
            # sampled (after temperature), not of the raw logits.
            logprobs_mode="processed_logprobs",
            max_num_seqs=max_running_seqs,
            enable_prefix_caching=prefix_caching,
            # Weights are loaded between two engine steps: no step may still be in flight then.
            async_scheduling=False,
            **lora,
        )
        self.engine = self.llm.llm_engine  # driven a step at a time by `submit` / `step`
        self._submitted: dict[str, int] = {}  # request id -> its sequences (n), until finished or aborted
        self.max_model_len = max_model_len
        # "in_place" (CPU, in-process engine, weights kept unpacked) or "reload" (vLLM's reload).
        self.weight_load_path = "reload"
        # vLLM's LoRA path: the adapter every request names (`serve_adapter`); None serves the model alone.
        self._served: _ServedAdapter | None = None
        self._max_lora_rank = 0 if adapter is None else adapter.max_lora_rank  # the slot vLLM sized
        if adapter is not None:
            self.serve_adapter(adapter)  # before any request names it
        if wants_in_place and self._in_place_loads_work(model_dir):
            self.weight_load_path = "in_place"

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int | Sequence[int],
        temperature: float,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> list[list[Completion]]:
        """n completions per prompt, in one call that returns when all are done; temperature 0 means
        greedy (log-probs then are of the argmax); `max_tokens` for all prompts or one per prompt.
        Only on an engine running nothing submitted (`LLM.generate` would run those requests too,
        and lose their outputs)."""
        from vllm import TokensPrompt

        if self._submitted:
            raise RuntimeError(f"generate() while {len(self._submitted)} submitted requests run: finish or abort them")
        if isinstance(max_tokens, int):
            sampling = _sampling_params(n, max_tokens, temperature, stop, seed=seed)
        else:
            sampling = [_sampling_params(n, limit, temperature, stop, seed=seed) for limit in max_tokens]
        requests = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self._lora_request())
        return [[self._completion(out) for out in request.outputs] for request in outputs]

    @staticmethod
    def _completion(out) -> Completion:
        token_ids = np.asarray(out.token_ids, dtype=np.int32)
        logprobs = np.empty(len(token_ids), dtype=np.float32)
        for position, (token, candidates) in enumerate(zip(out.token_ids, out.logprobs)):
            logprobs[position] = candidates[token].logprob
        finished = out.finish_reason == "stop"
        return Completion(token_ids=token_ids, logprobs=logprobs, finished=finished,
                          versions=token_versions(getattr(out, "weight_versions", None), len(token_ids)),
                          stop_reason=out.stop_reason if finished and isinstance(out.stop_reason, str) else None)

    # ---- step by step (the generator's loop)

    def submit(self, request_id: str, prompt: Sequence[int], *, n: int, max_tokens: int, temperature: float,
               stop: Sequence[str] = ()) -> None:
        """Add a request (n samples of `prompt`, each ending at EOS, max_tokens or a `stop` text);
        `step` returns it once all n have finished. Raises ValueError for a prompt the engine cannot
        take (longer than its context)."""
        from vllm import TokensPrompt
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        # FINAL_ONLY: `step` returns a group once, when all its n samples have finished.
        params = _sampling_params(n, max_tokens, temperature, stop, output_kind=RequestOutputKind.FINAL_ONLY)
        try:
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(map(int, prompt))), params,
                                    lora_request=self._lora_request())
        except VLLMValidationError as err:  # not a ValueError in vLLM 0.32
            raise ValueError(str(err)) from None
        self._submitted[request_id] = n

    def step(self) -> list[FinishedGroup]:
        """One engine step (a forward pass over every running sequence, prefills included); the
        groups it finished."""
        finished = []
        for output in self.engine.step():
            if output.finished and self._submitted.pop(output.request_id, None) is not None:
                finished.append(FinishedGroup(output.request_id, [self._completion(out) for out in output.outputs]))
        return finished

    @property
    def running_sequences(self) -> int:
        """Sequences submitted and not yet returned by `step` (waiting or decoding)."""
        return sum(self._submitted.values())

    def abort(self, request_ids: Sequence[str] | None = None) -> list[str]:
        """Drop the submitted requests `request_ids` (None: every one, leaving the engine empty, ready
        for `generate` or the next run); returns the ids dropped."""
        aborted = [r for r in (self._submitted if request_ids is None else request_ids) if r in self._submitted]
        if aborted:
            self.engine.abort_request(aborted)
        for request_id in aborted:
            del self._submitted[request_id]
        return aborted

    def label_version(self, version: int) -> None:
        """The weights now loaded are `version`'s: tokens sampled from the next step on report it."""
        self.engine.set_weight_version(str(version))

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]], *, temperature: float) -> list[np.ndarray]:
        """Log-prob of tokens 1..L-1 of each sequence given its prefix ([L-1] float32 each), at
        `temperature` (rollout.temperature: the distribution generation samples from)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature, detokenize=False)
        requests = [TokensPrompt(prompt_token_ids=list(map(int, s))) for s in sequences]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request())
        result = []
        for sequence, out in zip(sequences, outputs):
            values = [out.prompt_logprobs[i][int(sequence[i])].logprob for i in range(1, len(sequence))]
            result.append(np.asarray(values, dtype=np.float32))
        return result

    def _in_place_loads_work(self, model_dir: str) -> bool:
        """Self-check of the in-place path: every linear layer kept its weight; copying halved
        weights in place changes the log-probs (no layer computes with a stale copy); copying the
        model's own weights back restores them bit for bit. Any surprise (another vLLM version,
        another layer type) falls back to vLLM's reload, with a warning."""
        log = logging.getLogger(__name__)
        try:
            if not all(self.llm.collective_rpc(_unpacked_linear_weights)):
                raise RuntimeError("a linear layer was repacked anyway")
            probe = [list(range(1, min(self.max_model_len, 9)))]
            # Any temperature shows whether the weights changed; 1.0 reads the raw distribution.
            before = self.sequence_logprobs(probe, temperature=1.0)
            saved = _saved_tensors(model_dir)
            for scale in (0.5, 1.0):
                for tensors in saved:
                    named = [(name, tensor * scale) for name, tensor in tensors.items()]
                    self.llm.collective_rpc(_copy_named_weights, args=(named,))
                self.llm.reset_prefix_cache()
                after = self.sequence_logprobs(probe, temperature=1.0)
                unchanged = all(np.array_equal(a, b) for a, b in zip(before, after))
                if scale != 1.0 and unchanged:
                    raise RuntimeError("halved weights copied in place did not change the log-probs")
                if scale == 1.0 and not unchanged:
                    raise RuntimeError("log-probs differ after copying the model's own weights back")
        except Exception as err:  # noqa: BLE001 - any failure means: use the reload path
            log.warning("in-place weight loads unavailable (%s); using vLLM's reload_weights", err)
            return False
        return True

    def reseed(self, seed: int) -> None:
        """Restart the sampler's random streams from `seed`: a run on a reused engine draws the same
        samples as one on a fresh engine with the same seed (both reseed before their first call)."""
        self.llm.collective_rpc(_seed_worker, args=(seed,))

    def load_model_dir(self, model_dir: str) -> None:
        """Replace the weights with those of a Hugging Face directory of the same architecture (a
        reused engine taking the next run's starting model)."""
        for tensors in _saved_tensors(model_dir):
            self.load_weights(tensors.items())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        load = _copy_named_weights if self.weight_load_path == "in_place" else _load_named_weights
        self.llm.collective_rpc(load, args=(list(named_tensors),))
        self._forget_cached_prefixes()

    @property
    def serves_adapter(self) -> bool:
        """Whether vLLM's LoRA path is on (every request through the adapter `load_adapter` sets)."""
        return self._served is not None

    def _lora_request(self) -> Any:
        """What every request names: the one adapter `load_adapter` replaces in place, or None."""
        return None if self._served is None else self._served.request

    def serve_adapter(self, adapter: EngineAdapter) -> None:
        """A new engine, or a pooled one taken by another run: every request runs from now on through
        that run's adapter, built with its PEFT config (alpha, target modules: another run may differ in them)
        and starting from its initial tensors. The engine's LoRA slot was sized when it was built; an
        adapter of a larger rank needs another engine (the pool's engine_key keeps ranks apart)."""
        if not self._max_lora_rank:
            raise RuntimeError("serve_adapter on an engine built without an adapter (rollout.lora_apply=merge)")
        if int(adapter.peft_config["r"]) > self._max_lora_rank:
            raise ValueError(f"this engine holds adapters of rank <= {self._max_lora_rank}, not "
                             f"{adapter.peft_config['r']}: build another engine")
        self._served = _ServedAdapter.of(adapter)
        self.load_adapter(adapter.initial)

    def load_adapter(self, peft_tensors: dict[str, torch.Tensor]) -> None:
        """Replace the adapter every request runs through (PEFT's names, as adapter_model.safetensors
        holds them): running sequences continue on it from the next step, as after `load_weights`."""
        if self._served is None:
            raise RuntimeError("load_adapter on an engine built without an adapter (rollout.lora_apply=merge)")
        self.llm.collective_rpc(_add_adapter_from_tensors,
                                args=(POLICY_ADAPTER_ID, peft_tensors, self._served.peft_config))
        self._forget_cached_prefixes()

    def _forget_cached_prefixes(self) -> None:
        if not self._submitted:
            # Cached prefixes hold keys/values of the old weights (with requests running, prefix
            # caching is off: see the constructor). vLLM's cache key names the adapter, not its contents.
            self.llm.reset_prefix_cache()
