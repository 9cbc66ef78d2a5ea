"""weights.backend=nccl's protocol, for real across processes: announcements over the ZeroMQ PUB
socket, tensors broadcast through a separate process group (gloo on CPU stands in for NCCL: same
code path but the communicator). The load target is a recorder, so no vLLM is needed here."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.schema import ModelConfig
from asyncgrpo.weights.nccl import (
    NcclWeightReceiver,
    NcclWeightSender,
    buckets,
    model_spec,
)
from asyncgrpo.wire import Publisher, Subscriber

pytestmark = pytest.mark.slow


class Recorder:
    def __init__(self) -> None:
        self.loads: list[dict[str, np.ndarray]] = []

    def load_weights(self, named_tensors) -> None:
        self.loads.append({name: t.numpy().copy() for name, t in named_tensors})


def generator_main(endpoint: str, model_dir: str, address: dict, rank: int, versions: int,
                   first_poll_delay_s: float, results: mp.Queue) -> None:
    receiver = NcclWeightReceiver(Subscriber(endpoint), model_dir, torch.device("cpu"), timeout_s=60,
                                  bucket_bytes=20_000)
    receiver.join({**address, "rank": rank})
    time.sleep(first_poll_delay_s)
    target, applied = Recorder(), []
    deadline = time.monotonic() + 60
    while receiver.newest_version < versions and time.monotonic() < deadline:
        receiver.poll(0.2)
        version = receiver.apply_newest(target)
        if version is not None:
            applied.append(version)
    results.put((rank, applied, target.loads[-1] if target.loads else None))
    receiver.close()


def version_weights(model, version: int) -> list[tuple[str, torch.Tensor]]:
    return [(name, t + version) for name, t in model.state_dict().items()]


def test_every_generator_receives_every_version_exactly(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_model(TinyModelSpec.from_config(ModelConfig()), tokenizer, seed=0)
    save_model(model, tokenizer, tmp_path)
    publisher = Publisher()
    sender = NcclWeightSender(publisher, str(tmp_path), num_generators=2, device=torch.device("cpu"), host="127.0.0.1",
                              timeout_s=60, bucket_bytes=20_000)
    assert len(sender.buckets) > 3  # several collectives per push
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=generator_main, args=(publisher.endpoint, str(tmp_path), sender.join_address(),
                                                              rank, 3, delay, results))
                 for rank, delay in ((1, 0.0), (2, 1.0))]
    for process in processes:
        process.start()
    try:
        sender.wait_for_joins()  # returns once both generators joined
        time.sleep(0.5)  # subscriptions are live
        for version in (1, 2, 3):
            assert sender.push(version, version_weights(model, version)) > 0
        outcomes = sorted(results.get(timeout=60) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=30)
        publisher.close()
    expected = dict(version_weights(model, 3))
    for rank, applied, loaded in outcomes:
        assert applied and applied[-1] == 3 and applied == sorted(applied)
        assert loaded.keys() == expected.keys()
        for name, tensor in expected.items():
            np.testing.assert_array_equal(loaded[name], tensor.numpy(), err_msg=f"rank {rank}: {name}")


def test_buckets_cover_the_spec_in_order(tmp_path):
    tokenizer = build_char_tokenizer()
    save_model(build_model(TinyModelSpec.from_config(ModelConfig()), tokenizer, seed=0), tokenizer, tmp_path)
    spec = model_spec(str(tmp_path))
    for limit in (1, 10_000, 1 << 30):
        parts = buckets(spec, limit)
        assert [i for part in parts for i in part] == list(range(len(spec)))
        for part in parts:
            sizes = [int(np.prod(spec[i][1])) * 4 for i in part]
            assert len(part) == 1 or sum(sizes) <= limit


def test_the_advertised_port_is_held_from_its_advertisement_until_the_group_takes_it():
    import socket

    from asyncgrpo.wire.network import listening_socket

    listener = listening_socket("127.0.0.1")
    port = listener.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError):  # EADDRINUSE: nothing else can take it meanwhile
        other.bind(("127.0.0.1", port))
    listener.close()
