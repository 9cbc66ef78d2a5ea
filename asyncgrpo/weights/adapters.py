"""Adapter-only weight pushes for LoRA runs (`weights.lora_push=adapter`, learner.lora.rank > 0).

A LoRA run trains only the adapters (asyncgrpo/learner/lora.py), so a push needs only them: A [rank,
in] and B [out, rank] of every targeted layer, under their Hugging Face module paths
(`model.layers.0.self_attn.q_proj.lora_A.weight`), in `adapter_spec`'s fixed order (decoder
layers in module order, A before B). Which layers, their shapes and the scale are the learner's
`learner.lora.AdapterLayout`, which the composition roots build from learner.lora and hand in
(`composition.pushed_adapters`). Every backend is built from that spec instead of the model's
(`weights.make_sender` / `make_receiver`), so its fingerprint, chunk plan or slot layout is the
adapters'.

Generator side, `AdapterMerge` turns a push back into plain weights: it keeps the base weights of
the targeted layers, read once from the run's model directory, and for each push loads

    W + (alpha / rank) * B @ A        (LoraLinear.merge's expression, in float32)

per targeted layer through the engine's ordinary `load_weights` (Hugging Face names; vLLM stacks
q/k/v and gate/up itself). Always from the kept base, so pushes never accumulate. The engine then
holds exactly what a merged push would have given it, and sampling, the probe and evaluations need
nothing new. The untargeted layers are never touched: they are the base's from the engine's start
(or a pooled engine's reset, which reloads the whole starting model directory).

The base is kept in the dtype its files store it in (what the learner upcasts losslessly to
float32) and merged in float32 like the learner does: with float32 adapters on the wire (the
default `weights.wire_dtype` for a float32 engine) the merged tensor is the learner's bit for bit.
A float32 copy would cost twice the memory of a bf16 checkpoint for no gain in exactness.

With rollout.lora_apply=vllm the generator's engine runs vLLM's LoRA path instead: `AdapterLoad`
hands each checked push, under PEFT's names, to the engine's `load_adapter`, which replaces the one
adapter every request runs through (asyncgrpo/rollout/engine.py). No base copy, no merge; the engine
decodes through the adapter (docs/LORA.md measures both).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from asyncgrpo.learner.lora import ADAPTER_WEIGHTS, EXPORTED_ADAPTER_DIR, PEFT_PREFIX, AdapterLayout, peft_name
from asyncgrpo.schema import WeightsConfig
from asyncgrpo.weights.base import TensorSpec, WeightReceiver, WeightTarget, model_spec

LORA_PUSHES = ("adapter", "merged")
# How a generator applies an adapter push (rollout.lora_apply): merged into its weights, or through
# vLLM's LoRA path.
LORA_APPLIES = ("merge", "vllm")
_A, _B = ".lora_A.weight", ".lora_B.weight"


class AdapterTarget(Protocol):
    """An engine that runs every request through one adapter (`VLLMEngine` built with one)."""

    def load_adapter(self, peft_tensors: dict[str, torch.Tensor]) -> None: ...


def pushes_adapters(weights: WeightsConfig, lora_rank: int) -> bool:
    """Whether this run's pushes carry adapters only (a LoRA run, learner.lora.rank > 0, with
    weights.lora_push=adapter)."""
    return lora_rank > 0 and weights.lora_push == "adapter"


def adapter_spec(layout: AdapterLayout) -> list[TensorSpec]:
    """What an adapter push carries, in order: per targeted layer, lora_A [rank, in] then lora_B
    [out, rank] (float32, as the learner holds them; the sender casts to the wire dtype)."""
    spec: list[TensorSpec] = []
    for path, (out, inp) in layout.shapes.items():
        spec += [(path + _A, (layout.rank, inp), torch.float32), (path + _B, (out, layout.rank), torch.float32)]
    return spec


def pushed_spec(model_dir: str, adapters: AdapterLayout | None) -> list[TensorSpec]:
    """What every push of this run carries, in order: the tensors of the model in `model_dir`, or
    a LoRA run's `adapters` (None: pushes carry the model)."""
    return adapter_spec(adapters) if adapters is not None else model_spec(model_dir)


def push_names(named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """PEFT's saved names (`Policy.adapter_state_dict`) -> the module paths a push carries."""
    return ((name.removeprefix(PEFT_PREFIX), tensor) for name, tensor in named)


def read_base(model_dir: str, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` from the model directory's safetensors files, in their stored dtype."""
    from safetensors import safe_open

    wanted, found = set(names), {}
    for file in sorted(Path(model_dir).expanduser().glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in wanted.intersection(f.keys()):
                found[name] = f.get_tensor(name)
    missing = sorted(wanted - set(found))
    if missing:
        raise FileNotFoundError(f"{model_dir} lacks the base weights of {len(missing)} adapted layers "
                                f"(e.g. {missing[0]}): adapter pushes merge onto the run's model directory")
    return found


def check_adapters(shapes: dict[str, tuple[int, int]], named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The push `named` by name, checked whole before anything is loaded: exactly the adapter names
    of the layers `shapes` ([out, in] by module path), A [rank, in] and B [out, rank]; raises
    ValueError (one line) otherwise."""
    adapters = dict(named)
    expected = {path + suffix for path in shapes for suffix in (_A, _B)}
    if set(adapters) != expected:
        odd = sorted(set(adapters) ^ expected)
        raise ValueError(f"an adapter push must carry the {len(expected)} adapter tensors of this run's "
                         f"learner.lora settings; {len(odd)} names differ (e.g. {odd[0]})")
    for path, (out, inp) in shapes.items():
        lora_a, lora_b = adapters[path + _A], adapters[path + _B]
        if lora_a.shape[1] != inp or lora_b.shape[0] != out or lora_a.shape[0] != lora_b.shape[1]:
            raise ValueError(f"adapter push: {path} has A {list(lora_a.shape)} and B {list(lora_b.shape)}, "
                             f"not [rank, {inp}] and [{out}, rank]")
    return adapters


def initial_adapter(layout: AdapterLayout, start_dir: str, base_dir: str) -> dict[str, torch.Tensor]:
    """The adapter a generator under vLLM's LoRA path starts from, under PEFT's names: a fresh run's
    (B = 0, so the engine starts as the base model, as the learner does), or the one a resumed run's
    starting directory `start_dir` holds (the learner's export: `adapter/adapter_model.safetensors`)."""
    if Path(start_dir).resolve() == Path(base_dir).resolve():
        return {peft_name(name): torch.zeros(shape) for name, shape, _ in adapter_spec(layout)}
    from safetensors.torch import load_file

    saved = Path(start_dir) / EXPORTED_ADAPTER_DIR / ADAPTER_WEIGHTS
    if not saved.is_file():
        raise FileNotFoundError(f"{start_dir} holds no {EXPORTED_ADAPTER_DIR}/{ADAPTER_WEIGHTS} to start vLLM's LoRA "
                                "path from")
    tensors = load_file(str(saved))
    check_adapters(layout.shapes, push_names(tensors.items()))
    return tensors


def _layer_of(path: str) -> str:
    """The decoder layer a module path is in (`model.layers.3`): up to its first number."""
    parts = path.split(".")
    number = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    return ".".join(parts[:number + 1])


class AdapterMerge:
    """Generator side: the base of the targeted layers and the merge of each push (module docstring)."""

    def __init__(self, base_dir: str, layout: AdapterLayout) -> None:
        self.shapes = dict(layout.shapes)
        self.scaling = layout.scaling
        self.base = read_base(base_dir, [path + ".weight" for path in self.shapes])
        self._buffers: dict[tuple[int, int, int], torch.Tensor] = {}

    def check(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The push `named` by name, checked whole (`check_adapters`)."""
        return check_adapters(self.shapes, named)

    def merged_groups(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The merged weights of one push, a decoder layer at a time: each group's tensors are
        buffers reused by the next group, valid until the caller asks for it (load, or copy, first).
        Reused buffers spare a fresh allocation (page faults) per tensor per push, and a layer at a
        time bounds the extra memory to one layer's weights."""
        adapters = self.check(named)
        group: list[tuple[str, torch.Tensor]] = []
        layer = None
        for path, (out, inp) in self.shapes.items():
            if group and _layer_of(path) != layer:
                yield group
                group = []
            layer = _layer_of(path)
            buffer = self._buffer(out, inp, sum(1 for _, t in group if t.shape == (out, inp)))
            lora_a, lora_b = adapters[path + _A].to(torch.float32), adapters[path + _B].to(torch.float32)
            # LoraLinear.merge's W + scale * (B @ A), the same roundings in the same order (the add
            # is W's exact float32 value whatever its stored dtype): the learner's weight bit for bit.
            torch.mm(lora_b, lora_a, out=buffer).mul_(self.scaling).add_(self.base[path + ".weight"])
            group.append((path + ".weight", buffer))
        if group:
            yield group

    def merged(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Every targeted layer's merged weight for one push, as copies (tests, tools)."""
        return [(name, tensor.clone()) for group in self.merged_groups(named) for name, tensor in group]

    def _buffer(self, out: int, inp: int, index: int) -> torch.Tensor:
        """The `index`-th float32 [out, in] buffer (a layer may hold several layers of one shape)."""
        key = (out, inp, index)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(out, inp, dtype=torch.float32)
        return self._buffers[key]

    def onto(self, target: WeightTarget) -> WeightTarget:
        """`target` as a receiver loads into it: adapter pushes arrive merged."""
        return _MergingTarget(self, target)


class _MergingTarget:
    def __init__(self, merge: AdapterMerge, target: WeightTarget) -> None:
        self.merge, self.target = merge, target

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # A layer at a time: the engine copies each group before its buffers are reused.
        for group in self.merge.merged_groups(named_tensors):
            self.target.load_weights(group)


class AdapterLoad:
    """Generator side under vLLM's LoRA path: each push, checked, to the engine's `load_adapter`."""

    def __init__(self, layout: AdapterLayout) -> None:
        self.shapes = dict(layout.shapes)

    def onto(self, target: AdapterTarget) -> WeightTarget:
        """`target` as a receiver loads into it: adapter pushes replace the engine's adapter."""
        return _AdapterLoadingTarget(self, target)


class _AdapterLoadingTarget:
    def __init__(self, load: AdapterLoad, target: AdapterTarget) -> None:
        self.load, self.target = load, target

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        adapters = check_adapters(self.load.shapes, named_tensors)
        self.target.load_adapter({peft_name(name): tensor for name, tensor in adapters.items()})


class AdapterReceiver:
    """A backend's receiver (built from `adapter_spec`) whose `apply_newest` hands each adapter push
    to the target through `how` (an `AdapterMerge` or an `AdapterLoad`); everything else is the
    receiver's own."""

    def __init__(self, receiver: WeightReceiver, how: AdapterMerge | AdapterLoad) -> None:
        self.receiver, self.how = receiver, how

    def apply_newest(self, target: Any) -> int | None:
        return self.receiver.apply_newest(self.how.onto(target))

    def __getattr__(self, name: str) -> Any:  # shutdown_reason, newest_version, saves, poll, join, ...
        return getattr(self.receiver, name)


def adapter_receiver(receiver: WeightReceiver, base_dir: str, adapters: AdapterLayout | None,
                     lora_apply: str) -> WeightReceiver:
    """`receiver` itself, or under adapter pushes (`adapters`, None: pushes carry the model) one that
    applies them as rollout.lora_apply says (`lora_apply`): merged onto `base_dir`'s weights (the
    run's model directory: not a resumed run's starting directory, which holds merged weights), or
    loaded as the engine's adapter."""
    if adapters is None:
        return receiver
    if lora_apply == "vllm":
        return AdapterReceiver(receiver, AdapterLoad(adapters))
    return AdapterReceiver(receiver, AdapterMerge(base_dir, adapters))


def adapter_fraction(spec: list[TensorSpec], full: list[TensorSpec]) -> float:
    """An adapter push's elements over a full push's (bench and docs)."""
    return sum(math.prod(s) for _, s, _ in spec) / sum(math.prod(s) for _, s, _ in full)
