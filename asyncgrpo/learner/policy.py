"""The policy being trained: the model under FSDP2, its optimizer and LR schedule, and the frozen
KL reference. Every method that touches sharded weights is a collective: every rank calls it.

Under LoRA (learner.lora.rank > 0, asyncgrpo/learner/lora.py) the adapters are added before
sharding and only they train; the KL reference is the same model with its adapters off, and the
weights that leave (`full_state_dict`) are merged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from asyncgrpo import algo
from asyncgrpo.learner.batch import Batch, completion_logprobs, completion_rows, target_logprobs
from asyncgrpo.learner.lora import add_adapters, adapters_off, is_adapter_name, lora_modules, peft_name
from asyncgrpo.learner.schedule import lr_multiplier
from asyncgrpo.schema import Config
from asyncgrpo.weights.base import distinct_state


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; biases and norm scales do not (decaying a norm scale towards 0 only hurts)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def shard(model: torch.nn.Module, mesh: DeviceMesh, bf16: bool, offload: bool) -> None:
    """FSDP2: each decoder layer is one unit (gathered just for its forward and backward), the root
    holds the rest (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16 else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Each rank's loss is its share of the global loss (global denominators), so the
            # gradients must be summed over ranks, not averaged.
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (gloo has no pre-multiplied sum, and with factor 1 there is nothing to scale).
            module.set_force_sum_reduction_for_comms(True)


class Policy:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, reference: torch.nn.Module | None,
                 reference_device: torch.device, device: torch.device, rank: int, temperature: float) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.reference, self.reference_device = reference, reference_device
        self.device, self.rank, self.temperature = device, rank, temperature
        self.loras = lora_modules(model)  # {} under full fine-tuning

    @classmethod
    def from_config(cls, cfg: Config, model_dir: str, device: torch.device, rank: int, world_size: int,
                    temperature: float) -> Policy:
        """Needs the default process group (every rank builds its shard of the same model).
        `temperature`: the generators' sampling temperature (rollout.temperature), which the log-probs
        are taken at, so that they are the sampling policy's."""
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM

        learner = cfg.learner
        bf16 = learner.mixed_precision == "bf16"
        if bf16 and device.type != "cuda":
            raise ValueError("learner.mixed_precision=bf16 needs a GPU; this learner runs on CPU")
        torch.manual_seed(cfg.seed)
        mesh = init_device_mesh(device.type, (world_size,))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        if learner.lora.rank > 0:  # before sharding: FSDP2 then shards base and adapters alike
            add_adapters(model, learner.lora)
        if learner.activation_checkpointing:
            # Non-reentrant checkpointing composes with FSDP2's hooks (the reentrant one re-runs them).
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        shard(model, mesh, bf16, offload=learner.offload_optimizer and device.type == "cuda")
        optimizer = torch.optim.AdamW(_param_groups(model, learner.weight_decay), lr=learner.lr,
                                      betas=tuple(learner.betas), weight_decay=learner.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, learner, cfg.train.max_steps))
        # Frozen starting weights for the KL penalty; forward only, no optimizer state.
        reference, reference_device = None, device
        # Under LoRA the reference is the policy with its adapters off: no second copy.
        if cfg.algo.kl.enabled and learner.lora.rank == 0:
            reference = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.bfloat16 if bf16 else torch.float32).eval()
            reference.requires_grad_(False)
            if cfg.algo.kl.reference_on == "cpu":
                # A full copy on each rank in CPU memory: no GPU memory, no collectives, slower forward.
                reference_device = torch.device("cpu")
            else:
                shard(reference.to(device), mesh, bf16, offload=False)
        return cls(model, optimizer, scheduler, reference, reference_device, device, rank, temperature)

    # ------------------------------------------------------------------------------ forward

    def logprobs(self, micro: Batch) -> torch.Tensor:
        """[B, T] log-probs of the completion tokens under the current weights, with gradient."""
        logits = self.model(input_ids=micro.input_ids, attention_mask=micro.attention_mask, use_cache=False).logits
        return completion_logprobs(logits, micro.logit_index, micro.targets, self.temperature)

    def logprobs_and_entropy(self, micro: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] log-probs of the completion tokens with gradient, and [B, T] the entropy (nats) of
        the sampling distribution (the softmax over the temperature) at each, without gradient:
        one forward pass serves the loss and the entropy diagnostic."""
        logits = self.model(input_ids=micro.input_ids, attention_mask=micro.attention_mask, use_cache=False).logits
        rows = completion_rows(logits, micro.logit_index, self.temperature)
        with torch.no_grad():
            entropy = algo.token_entropy(rows.detach())
        return target_logprobs(rows, micro.targets), entropy

    @property
    def has_reference(self) -> bool:
        """Whether `reference_logprobs` can run: a reference model, or adapters to turn off."""
        return self.reference is not None or bool(self.loras)

    @torch.no_grad()
    def reference_logprobs(self, micro: Batch) -> torch.Tensor:
        """[B, T] log-probs under the frozen starting weights, on the policy's device."""
        assert self.has_reference, "algo.kl.enabled=false: no reference"
        if self.reference is None:  # LoRA: the frozen base is the starting weights
            with adapters_off(self.model):
                logits = self.model(input_ids=micro.input_ids, attention_mask=micro.attention_mask,
                                    use_cache=False).logits
            return completion_logprobs(logits, micro.logit_index, micro.targets, self.temperature)
        on = self.reference_device
        logits = self.reference(input_ids=micro.input_ids.to(on), attention_mask=micro.attention_mask.to(on),
                                use_cache=False).logits
        return completion_logprobs(logits, micro.logit_index.to(on), micro.targets.to(on),
                                   self.temperature).to(self.device)

    @torch.no_grad()
    def sequence_logprobs(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """Log-prob of tokens 1..L-1 of each sequence given its prefix (all ranks return the same)."""
        self.model.eval()
        result = []
        for sequence in sequences:
            ids = torch.tensor([sequence], dtype=torch.int64, device=self.device)
            positions = torch.arange(len(sequence) - 1, device=self.device).unsqueeze(0)
            logp = completion_logprobs(self.model(input_ids=ids, use_cache=False).logits, positions, ids[:, 1:],
                                       self.temperature)
            result.append(logp[0].cpu().numpy().astype(np.float32))
        return result

    # ------------------------------------------------------------------------------ weights

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Unsharded parameters under their Hugging Face names, gathered one at a time as the
        caller asks for them (so sending one overlaps gathering the next); rank 0 gets them, the
        other ranks get nothing but must still exhaust the iterator (each gather is a collective).
        Under LoRA an adapted weight comes merged (W + scale * B A) and the adapters not at all, so
        the names and shapes are the base model's (weights.base.model_spec)."""
        state = dict(distinct_state(self.model))
        for name, tensor in state.items():
            if self.loras and is_adapter_name(name):
                continue
            tensor = self._gathered(tensor)
            path = name.removesuffix(".weight")
            if path in self.loras and name.endswith(".weight"):
                tensor = self.loras[path].merge(tensor, self._gathered(state[f"{path}.lora_A.weight"]),
                                                self._gathered(state[f"{path}.lora_B.weight"]))
            if self.rank == 0:
                yield name, tensor.detach()

    def adapter_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters, unsharded, under PEFT's saved names (`base_model.model.<path>.lora_A.weight`);
        rank 0 gets them, every rank must exhaust the iterator. Nothing under full fine-tuning."""
        for name, tensor in distinct_state(self.model):
            if self.loras and is_adapter_name(name):
                tensor = self._gathered(tensor)
                if self.rank == 0:
                    yield peft_name(name), tensor.detach()

    def _gathered(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a sharded one (a collective), or the tensor itself."""
        if hasattr(tensor, "full_tensor"):
            if tensor.device != self.device:  # sharded weights offloaded to CPU memory
                tensor = tensor.to(self.device)
            tensor = tensor.full_tensor()
        return tensor

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards of the weights and optimizer state, for torch.distributed.checkpoint
        (which reshards them for any world size). The LR schedule is in `schedule_state_dict`."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._state_options())

    def _state_options(self) -> Any:
        """Under LoRA a checkpoint holds the adapters and their optimizer state only: the frozen
        base is the run's model directory, loaded as the policy is built. Not strict on loading,
        since the base's keys are absent by design (DCP's own load still fails on a missing adapter)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if not self.loras:
            return None
        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def schedule_state_dict(self) -> dict[str, Any]:
        """The LR schedule's position: plain numbers, kept as JSON beside the sharded state."""
        return self.scheduler.state_dict()

    def load_schedule_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
