"""A thin wrapper around a vLLM engine: sample with log-probs, score fixed sequences, load weights.

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): for the tiny models of the CPU
default that is faster than a separate engine process, and `collective_rpc` then calls our
function on the worker directly, so new weights are loaded without a copy through a pipe.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Completion:
    token_ids: np.ndarray  # int32 [L]
    logprobs: np.ndarray  # float32 [L]: log-prob of each sampled token under the sampling distribution
    finished: bool  # False when cut off by max_tokens
    # Policy version that sampled each token; None = all by the version loaded when the call began.
    versions: np.ndarray | None = None


def _load_named_weights(worker, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
    # Runs inside the vLLM worker; HF names and shapes (vLLM pads the vocabulary itself). The
    # in-place reload path re-applies the backend's post-load processing (CPU kernels repack
    # linear weights, which a plain model.load_weights would not redo).
    worker.model_runner.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
    return len(named_tensors)


def _drop_rotary_reload_warning(record: logging.LogRecord) -> bool:
    # The rotary cos/sin cache is derived, not a checkpoint weight: vLLM keeps its own copy on
    # every reload and warns about it each time.
    return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


class VLLMEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        seed: int,
        max_model_len: int,
        dtype: str = "float32",
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        from vllm import LLM

        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_drop_rotary_reload_warning)

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
        )
        self.max_model_len = max_model_len

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        seed: int | None = None,
        max_tokens_per_prompt: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """n completions per prompt; temperature 0 means greedy (log-probs then are of the argmax)."""
        from vllm import SamplingParams, TokensPrompt

        def params(limit: int) -> SamplingParams:
            return SamplingParams(n=n, max_tokens=limit, temperature=temperature, logprobs=0, detokenize=False,
                                  seed=seed)

        sampling = [params(limit) for limit in max_tokens_per_prompt] if max_tokens_per_prompt else params(max_tokens)
        requests = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        return [[self._completion(out) for out in request.outputs] for request in outputs]

    @staticmethod
    def _completion(out) -> Completion:
        token_ids = np.asarray(out.token_ids, dtype=np.int32)
        logprobs = np.empty(len(token_ids), dtype=np.float32)
        for position, (token, candidates) in enumerate(zip(out.token_ids, out.logprobs)):
            logprobs[position] = candidates[token].logprob
        return Completion(token_ids=token_ids, logprobs=logprobs, finished=out.finish_reason == "stop")

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]], temperature: float = 1.0) -> list[np.ndarray]:
        """Log-prob of tokens 1..L-1 of each sequence given its prefix ([L-1] float32 each)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature, detokenize=False)
        requests = [TokensPrompt(prompt_token_ids=list(map(int, s))) for s in sequences]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        result = []
        for sequence, out in zip(sequences, outputs):
            values = [out.prompt_logprobs[i][int(sequence[i])].logprob for i in range(1, len(sequence))]
            result.append(np.asarray(values, dtype=np.float32))
        return result

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc(_load_named_weights, args=(list(named_tensors),))
        # Cached prefixes hold keys/values of the old weights.
        self.llm.reset_prefix_cache()
