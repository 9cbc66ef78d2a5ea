"""A LoRA run's adapter-only pushes through weights.backend=nccl (gloo on CPU stands in): both ends
built by make_sender / make_receiver from the adapter spec, the generator's receiver wrapped to
merge; the load target is a recorder, so no vLLM is needed here."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from asyncgrpo.config import load

from asyncgrpo.composition import pushed_adapters, weights_backend
from asyncgrpo.learner.lora import adapter_layout
from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.weights import make_receiver, make_sender
from asyncgrpo.weights.adapters import AdapterMerge, adapter_spec, adapter_receiver
from asyncgrpo.wire import Publisher, Subscriber

pytestmark = pytest.mark.slow

OVERRIDES = ["learner.lora.rank=4", "learner.lora.alpha=7", "weights.backend=nccl", "rollout.num_generators=1",
             "wire.host=127.0.0.1"]


class Recorder:
    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, named_tensors) -> None:
        self.weights.update((name, t.clone()) for name, t in named_tensors)


def generator_main(endpoint: str, model_dir: str, address: dict, results: mp.Queue) -> None:
    cfg = load(OVERRIDES)
    layout = pushed_adapters(cfg, model_dir)  # as rollout/parts.py builds the receiver
    receiver = make_receiver(cfg.weights, weights_backend(cfg), Subscriber(endpoint), model_dir, torch.device("cpu"),
                             adapters=layout, engine_dtype=cfg.rollout.dtype,
                             startup_timeout_s=cfg.wire.startup_timeout_s, timeout_s=cfg.wire.timeout_s)
    receiver = adapter_receiver(receiver, model_dir, layout, "merge")
    receiver.join({**address, "rank": 1})
    target, deadline = Recorder(), time.monotonic() + 60
    while receiver.newest_version < 1 and time.monotonic() < deadline:
        receiver.poll(0.2)
        receiver.apply_newest(target)
    results.put({name: t.numpy() for name, t in target.weights.items()})
    receiver.close()


def adapters(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    layout = adapter_layout(model_dir, load(OVERRIDES).learner.lora)
    return [(name, torch.randn(shape) * 0.1) for name, shape, _ in adapter_spec(layout)]


def test_an_adapter_push_over_the_collective_backend_lands_merged(tmp_path):
    tokenizer = build_char_tokenizer()
    save_model(build_model(TinyModelSpec.from_config(load([]).model), tokenizer, seed=0), tokenizer, tmp_path)
    model_dir, cfg = str(tmp_path), load(OVERRIDES)
    publisher = Publisher()
    # As learner/parts.py builds it.
    sender = make_sender(cfg.weights, weights_backend(cfg), publisher, model_dir, torch.device("cpu"),
                         adapters=pushed_adapters(cfg, model_dir), engine_dtype=cfg.rollout.dtype,
                         num_generators=cfg.rollout.num_generators, host=cfg.wire.host,
                         startup_timeout_s=cfg.wire.startup_timeout_s, max_restarts=cfg.rollout.max_restarts)
    context = mp.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=generator_main, args=(publisher.endpoint, model_dir, sender.join_address(), results))
    process.start()
    try:
        sender.wait_for_joins()
        time.sleep(0.5)  # the subscription is live
        named = adapters(model_dir)
        assert sender.push(1, named) == sum(t.numel() * 4 for _, t in named)
        loaded = results.get(timeout=60)
    finally:
        process.join(timeout=30)
        publisher.close()
    expected = AdapterMerge(model_dir, adapter_layout(model_dir, cfg.learner.lora)).merged(named)
    assert loaded.keys() == dict(expected).keys() and expected
    for name, tensor in expected:
        assert torch.equal(torch.from_numpy(loaded[name]), tensor), name
