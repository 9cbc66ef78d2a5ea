"""Weight-push latency over the zmq backend: learner gather -> wire -> generator's running vLLM engine.

    .venv/bin/python -m tools.bench_push                 # tiny default model and a ~100M-parameter one
    .venv/bin/python -m tools.bench_push --sizes tiny --pushes 20
    .venv/bin/python -m tools.bench_push --sizes qwen2.5-0.5b --pushes 5   # any `asyncgrpo make-model` shape
    .venv/bin/python -m tools.bench_push --backends zmq,shm              # side by side (the default)
    .venv/bin/python -m tools.bench_push --backends zmq-bf16,zmq-delta --lr 1e-6   # delta pushes vs full bf16
    .venv/bin/python -m tools.bench_push --sizes 100M --train-steps 20 --lr 1e-6   # real steps, delta bytes
    .venv/bin/python -m tools.bench_push --sizes qwen2.5-0.5b --backends zmq --lora-rank 16   # + adapter rows
    .venv/bin/python -m tools.bench_push --sizes qwen2.5-0.5b --backends zmq --lora-rank 16 --adapter-only \
        --lora-apply merge,vllm        # merged in place vs vLLM's LoRA path

For each model size (random weights, Qwen2 architecture, float32, saved in Hugging Face format) and
each weight backend (`weights.backend`: zmq chunks over a ZeroMQ socket, shm shared-memory slots;
zmq-bf16: zmq with `weights.wire_dtype=bfloat16`; zmq-delta: that with `weights.delta=true`, whose
first push is full and the others carry only the elements whose bf16 value changed):
- a generator process (core 0) runs a vLLM engine and the backend's receiver, built from config as
  in a run; it loads every push into the engine and acknowledges the version with a `VersionAck`;
- this process (core 1) is the learner: an FSDP2-wrapped model (world size 1); `Learner.push_weights`
  gathers each tensor as the sender needs it and copies it (into a chunk, or into the slot).
Latency = from the start of the push to the arrival of the generator's acknowledgement, so it
covers gather, copy, send, receive, assemble and the engine load. Blocked = how long the learner
is inside the push (gather and copy; zmq's sending itself is ZeroMQ's I/O thread). MB/s = payload
bytes / median latency. Correctness: after the last push the engine's log-probs of fixed sequences
are compared with the learner's forward (a bf16 wire rounds the weights: zmq-bf16 and zmq-delta
get the same updates, so their differences must be equal).

Between pushes every weight moves by +-lr (`--lr`, a random sign per element, seeded: every row
gets the same updates), as an Adam step of that learning rate roughly does: what changes in bf16
depends on it (1e-6 is the learning rate the "your model" profile gives a real model). A real
run's changed fraction is its `perf/push_changed_frac` (docs/METRICS.md).

`--train-steps N` measures instead what real optimizer steps change: the learner alone (no
generator; nobody subscribes) trains N GRPO steps (AdamW at `--lr`, no warm-up) on synthetic groups
(random tokens and 0/1 rewards, `--groups` x 4 samples of up to 8 tokens) with `weights.delta=true`
over a bf16 wire, and reports each push's changed fraction and bytes against a full bf16 push.

Adapter rows (`--lora-rank R`, R > 0): the same model trained as LoRA (rank R, every linear layer of
the decoder layers, weights.lora_push=adapter): a push carries the adapters only and the generator
merges them onto its copy of the base's targeted layers (asyncgrpo/weights/adapters.py), so its
load time is the merge plus the engine's load. With `--lora-apply vllm` (or `merge,vllm`: both, side
by side) the generator's engine runs vLLM's LoRA path instead (rollout.lora_apply=vllm) and a load
replaces its adapter (rows labelled `-vllm`). Each push perturbs what trains (all parameters, or
the adapters), so every load changes the weights.

Prints a table, then one JSON line.
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
from pathlib import Path

from tools import list_type, nonnegative_int, positive_float, positive_int

SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate)
    "tiny": (64, 2, 2, 2, 192),
    "100M": (1024, 8, 16, 16, 2816),
}
BACKENDS = ("zmq", "shm", "zmq-bf16", "zmq-delta")
LORA_APPLY = ("merge", "vllm")


def model_sizes() -> list[str]:
    """What `build` makes: a SIZES entry or an `asyncgrpo make-model` shape."""
    from asyncgrpo.models.shapes import SHAPES

    return [*SIZES, *(name for name in SHAPES if name not in SIZES)]


def build(size: str, directory: Path) -> int:
    """A model directory of `size`: a SIZES entry, or a shape of `asyncgrpo make-model` (real vocabulary)."""
    from asyncgrpo.models.shapes import SHAPES, make_model
    from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
    from asyncgrpo.models.tokenizer import build_char_tokenizer

    if size in SHAPES:
        return make_model(size, directory).num_parameters

    hidden, layers, heads, kv_heads, intermediate = SIZES[size]
    spec = TinyModelSpec(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                         intermediate_size=intermediate, max_positions=32)
    tokenizer = build_char_tokenizer()
    model = build_model(spec, tokenizer, seed=0)
    save_model(model, tokenizer, directory)
    return sum(p.numel() for p in model.parameters())


def generator_process(overrides: list[str], model_dir: str, weights_endpoint: str, join_address: dict,
                      acks_endpoint: str, pushes: int, probes: list[list[int]], results: mp.Queue) -> None:
    os.sched_setaffinity(0, [0])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    from asyncgrpo.config import load

    from asyncgrpo.composition import engine_adapter, pushed_adapters, weights_backend
    from asyncgrpo.rollout.engine import VLLMEngine
    from asyncgrpo.weights import make_receiver
    from asyncgrpo.weights.adapters import adapter_receiver
    from asyncgrpo.wire import Sender, Subscriber, VersionAck

    cfg = load(overrides)
    adapters = pushed_adapters(cfg, model_dir)
    # As rollout/parts.py builds them: under rollout.lora_apply=vllm the engine runs vLLM's LoRA path.
    engine = VLLMEngine(model_dir, seed=0, max_model_len=32, dtype="float32", kv_cache_gib=0.25, gpu_memory_utilization=0.3,
                        max_running_seqs=256, prefix_caching=True,
                        adapter=engine_adapter(cfg, adapters, model_dir, model_dir))
    # A LoRA run's adapter pushes are merged on the way into the engine or loaded as its adapter
    # (else the receiver itself).
    receiver = make_receiver(cfg.weights, weights_backend(cfg), Subscriber(weights_endpoint), model_dir,
                             torch.device("cpu"), adapters=adapters, engine_dtype=cfg.rollout.dtype,
                             startup_timeout_s=cfg.wire.startup_timeout_s, timeout_s=cfg.wire.timeout_s)
    receiver = adapter_receiver(receiver, model_dir, adapters, cfg.rollout.lora_apply)
    receiver.join({**join_address, "rank": 1})
    acks = Sender(acks_endpoint)
    acks.send(VersionAck(generator_id=0, version=0), timeout_s=60)  # ready
    load_s: list[float] = []
    while len(load_s) < pushes:
        receiver.poll(timeout_s=1.0)
        start = time.perf_counter()
        version = receiver.apply_newest(engine)
        if version is None:
            continue
        load_s.append(time.perf_counter() - start)
        acks.send(VersionAck(generator_id=0, version=version), timeout_s=60)
    results.put({"load_s": load_s, "probe_logp": [x.tolist() for x in engine.sequence_logprobs(probes, temperature=1.0)]})


def step_weights(model, lr: float, seed: int) -> None:
    """Every weight moves by +-lr, the sign random per element (seeded: every row the same updates)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:  # under LoRA the adapters only: the generator's base is the files'
                continue
            local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2's DTensor: world size 1 holds it all
            local.add_(lr * (torch.randint(0, 2, local.shape, generator=generator, dtype=local.dtype) * 2 - 1))


def bench_size(size: str, backend: str, pushes: int, lr: float, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """One row; `extra`: more overrides (an adapter row's learner.lora.*)."""
    import numpy as np
    import torch

    from asyncgrpo.config import load
    from asyncgrpo.learner.learner import Learner
    from asyncgrpo.wire import Receiver, VersionAck

    base_backend, _, variant = backend.partition("-")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / size
        params = build(size, model_dir)
        overrides = ["learner.warmup_steps=0", f"model.path={model_dir}", f"run_dir={tmp}/run",
                     f"weights.backend={base_backend}", *extra]
        overrides += {"": [], "bf16": ["weights.wire_dtype=bfloat16"],
                      "delta": ["weights.wire_dtype=bfloat16", "weights.delta=true"]}[variant]
        cfg = load(overrides)
        learner = Learner.from_config(cfg, str(model_dir), cores=[1])
        acks = Receiver()
        probes = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24]]
        results: mp.Queue = mp.get_context("spawn").Queue()
        process = mp.get_context("spawn").Process(
            target=generator_process,
            args=(overrides, str(model_dir), learner.weights.endpoint, learner.weights.join_address(), acks.endpoint,
                  pushes, probes, results))
        process.start()

        def wait_ack(version: int, timeout_s: float) -> None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                message = acks.recv(1.0)
                if isinstance(message, VersionAck) and message.version >= version:
                    return
                if not process.is_alive():
                    raise RuntimeError("the generator process died")
            raise TimeoutError(f"no acknowledgement of version {version} within {timeout_s:.0f} s")

        wait_ack(0, 600)  # engine start
        time.sleep(0.5)  # the subscription must be live before the first publish
        latencies, blocked_s, payloads, changed = [], [], [], []
        for version in range(1, pushes + 1):
            step_weights(learner.policy.model, lr, seed=version)  # a different model each push
            start = time.perf_counter()
            learner.version = version
            payloads.append(learner.push_weights())
            changed.append(getattr(learner.weights, "changed_fraction", 1.0))
            blocked_s.append(time.perf_counter() - start)
            wait_ack(version, 120)
            latencies.append(time.perf_counter() - start)
        generator = results.get(timeout=120)
        process.join(timeout=60)
        learner_logp = learner.sequence_logprobs(probes)
        diff = max(float(np.abs(np.asarray(g, dtype=np.float32) - l).max())
                   for g, l in zip(generator["probe_logp"], learner_logp))
        learner.close()
        acks.close()
    return {
        "size": size,
        "backend": backend,
        "params": params,
        "bytes_per_push": statistics.median(payloads),
        "bytes_first_push": payloads[0],
        "changed_fraction_median": statistics.median(changed[1:] or changed),
        "latency_ms_median": 1e3 * statistics.median(latencies),
        "latency_ms_max": 1e3 * max(latencies),
        "latency_ms_min": 1e3 * min(latencies),
        "learner_blocked_ms_median": 1e3 * statistics.median(blocked_s),
        "engine_load_ms_median": 1e3 * statistics.median(generator["load_s"]),
        "engine_load_ms_max": 1e3 * max(generator["load_s"]),
        "mb_per_s": statistics.median(payloads) / 1e6 / statistics.median(latencies),
        "lr": lr,
        "probe_max_abs_diff": diff,
        "pushes": pushes,
    }


def synthetic_groups(groups: int, vocab: int, seed: int) -> list:
    """`groups` groups of 4 samples: 6-token prompts, 4 to 8 completion tokens, 0/1 rewards (never all equal)."""
    import numpy as np

    from asyncgrpo.wire import ScoredGroup

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        lengths = rng.integers(4, 9, size=4).astype(np.int32)
        total = int(lengths.sum())
        out.append(ScoredGroup(
            generator_id=0, seq=g, prompt_id=g, prompt_tokens=rng.integers(3, vocab, size=6).astype(np.int32),
            tokens=rng.integers(3, vocab, size=total).astype(np.int32),
            logprobs=-rng.uniform(0.5, 5.0, size=total).astype(np.float32),
            versions=np.zeros(total, dtype=np.int32), lengths=lengths,
            rewards=np.array([1, 0, 1, 0], dtype=np.float32)[rng.permutation(4)]))
    return out


def train_steps(size: str, steps: int, lr: float, groups: int) -> dict:
    """The learner alone: `steps` real GRPO steps with delta pushes; each push's bytes and changed fraction."""
    from asyncgrpo.config import load
    from asyncgrpo.learner.learner import Learner

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / size
        params = build(size, model_dir)
        cfg = load(["learner.warmup_steps=0", f"learner.lr={lr}", f"model.path={model_dir}", f"run_dir={tmp}/run",
                    "weights.backend=zmq", "weights.wire_dtype=bfloat16", "weights.delta=true",
                    "weights.full_every=1000000"])
        learner = Learner.from_config(cfg, str(model_dir), cores=[1])
        vocab = learner.policy.model.config.vocab_size
        full = learner.weights.payload_bytes
        pushed, changed, step_s = [], [], []
        try:
            learner.push_weights()  # version 0, full: the base of the first delta
            for i in range(steps):
                start = time.perf_counter()
                metrics = learner.train_on(synthetic_groups(groups, min(vocab, 60), seed=i))
                step_s.append(time.perf_counter() - start)
                pushed.append(metrics["perf/push_bytes"])
                changed.append(metrics["perf/push_changed_frac"])
        finally:
            learner.close()
    return {"size": size, "params": params, "lr": lr, "steps": steps, "full_bf16_bytes": full,
            "delta_bytes": pushed, "changed_fraction": changed, "step_s_median": statistics.median(step_s),
            "bytes_ratio_deltas_only": full * steps / sum(pushed)}


def print_train_rows(rows: list[dict]) -> None:
    import statistics as st

    print()
    for r in rows:
        print(f"{r['size']:<13} lr {r['lr']:g}: {r['steps']} steps; changed fraction median {st.median(r['changed_fraction']):.4f} "
              f"(min {min(r['changed_fraction']):.4f}, max {max(r['changed_fraction']):.4f}); full bf16 push "
              f"{r['full_bf16_bytes'] / 1e6:.2f} MB, delta median {st.median(r['delta_bytes']) / 1e6:.3f} MB: "
              f"{r['bytes_ratio_deltas_only']:.1f}x fewer bytes (deltas only)")
        for every in (20,):
            mean = (r["full_bf16_bytes"] + (every - 1) * st.mean(r["delta_bytes"])) / every
            print(f"{'':<13} with a full push every {every} (weights.full_every's default): "
                  f"{r['full_bf16_bytes'] / mean:.1f}x fewer bytes")
    print()
    print(json.dumps({"train_steps": rows}))


def adapter_overrides(rank: int, lora_apply: str) -> tuple[str, ...]:
    """An adapter row's settings: LoRA of rank `rank` on every linear layer, adapter-only pushes,
    applied by the generator as `lora_apply` says (rollout.lora_apply)."""
    return (f"learner.lora.rank={rank}", f"learner.lora.alpha={2 * rank}", "learner.lora.target_modules=[all-linear]",
            "weights.lora_push=adapter", f"rollout.lora_apply={lora_apply}")


def adapter_rows(sizes: list[str], backends: list[str], pushes: int, rank: int, lr: float,
                 lora_applies: list[str]) -> list[dict[str, float]]:
    """The adapter rows (`--lora-rank`), labelled `<backend>+lora<rank>` (merged in place) or
    `<backend>+lora<rank>-vllm` (vLLM's LoRA path), each with its bytes as a fraction of the full
    push's (`full_over_adapter_bytes`, from the two tensor specs)."""
    from asyncgrpo.learner.lora import adapter_layout
    from asyncgrpo.schema import LoraConfig
    from asyncgrpo.weights.adapters import adapter_fraction, adapter_spec
    from asyncgrpo.weights.base import model_spec

    rows = []
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:  # the shapes only: rebuilt to read the specs
            build(size, Path(tmp))
            fraction = adapter_fraction(adapter_spec(adapter_layout(tmp, LoraConfig(rank=rank))), model_spec(tmp))
        for backend in backends:
            for lora_apply in lora_applies:
                row = bench_size(size, backend, pushes, lr, adapter_overrides(rank, lora_apply))
                row["backend"] = f"{backend}+lora{rank}" + ("-vllm" if lora_apply == "vllm" else "")
                row["full_over_adapter_bytes"] = 1 / fraction
                rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_push", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=list_type(choices=model_sizes()), default="tiny,100M",
                        help=f"of {', '.join(model_sizes())}")
    parser.add_argument("--pushes", type=positive_int, default=10)
    parser.add_argument("--backends", type=list_type(choices=BACKENDS), default="zmq,shm",
                        help=f"of {', '.join(BACKENDS)}")
    parser.add_argument("--lr", type=positive_float, default=1e-4, help="each weight moves by +-lr between pushes")
    parser.add_argument("--train-steps", type=nonnegative_int, default=0,
                        help="measure real steps' deltas instead (see above)")
    parser.add_argument("--groups", type=positive_int, default=4, help="--train-steps: groups of 4 samples per step")
    parser.add_argument("--lora-rank", type=nonnegative_int, default=0,
                        help="> 0: also the adapter rows, LoRA of this rank")
    parser.add_argument("--adapter-only", action="store_true", help="with --lora-rank: the adapter rows alone")
    parser.add_argument("--lora-apply", type=list_type(choices=LORA_APPLY), default="merge",
                        help="with --lora-rank: how the generator applies adapter pushes, of merge, vllm (rollout.lora_apply)")
    args = parser.parse_args(argv)
    if args.adapter_only and args.lora_rank < 1:
        parser.error("--adapter-only measures the adapter rows: it needs --lora-rank >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.train_steps:
        print_train_rows([train_steps(size, args.train_steps, args.lr, args.groups) for size in args.sizes])
        return 0
    sizes, backends = args.sizes, args.backends
    rows = [] if args.adapter_only else [bench_size(size, backend, args.pushes, args.lr) for size in sizes
                                         for backend in backends]
    if args.lora_rank > 0:
        rows += adapter_rows(sizes, backends, args.pushes, args.lora_rank, args.lr, args.lora_apply)
    print()
    header = (f"{'model':<13} {'backend':<17} {'params':>12} {'MB/push':>8} {'changed':>7} {'latency ms':>10} {'max ms':>7} {'blocked ms':>10} "
              f"{'load ms':>7} {'MB/s':>6} {'probe diff':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['size']:<13} {r['backend']:<17} {r['params']:>12,} {r['bytes_per_push'] / 1e6:>8.2f} "
              f"{r['changed_fraction_median']:>7.4f} {r['latency_ms_median']:>10.1f} "
              f"{r['latency_ms_max']:>7.1f} {r['learner_blocked_ms_median']:>10.1f} "
              f"{r['engine_load_ms_median']:>7.1f} {r['mb_per_s']:>6.0f} {r['probe_max_abs_diff']:>10.2e}")
    print()
    print(json.dumps({"pushes": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
