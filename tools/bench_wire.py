"""Throughput of the group stream: this wire vs a Ray actor queue vs an in-process memcpy.

Same payloads for every path (groups of 8 samples, 512 and 8,192 tokens each):
- zmq:    a producer process encodes and sends with `Sender`; this process receives, decodes and
          queues with `Receiver` + `ReplayQueue` and takes batches, as the learner does;
- ray:    a Ray task puts the same `ScoredGroup`s into `ray.util.queue.Queue` (pickled through the
          object store); this process gets them one by one;
- memcpy: this process copies the encoded frames' bytes into a preallocated buffer (the limit);
- bare:   for reference, the same encoded frames over a bare ZeroMQ PUSH -> PULL pair, with no
          encode, decode or queue: what the transport alone allows on this machine.

Prints a table, then, last, one JSON line. Run: `.venv/bin/python tools/bench_wire.py`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np
import zmq

from asyncgrpo.replay import ReplayQueue
from asyncgrpo.wire import Receiver, ScoredGroup, Sender, encode_group, example_group

SAMPLES_PER_GROUP = 8
SHAPES = {"small": 512, "large": 8192}
# Groups timed per (path, shape) at --scale 1: each run takes a few seconds on 2 cores.
TIMED_GROUPS = {
    ("zmq", "small"): 10_000, ("zmq", "large"): 3_000,
    ("bare", "small"): 20_000, ("bare", "large"): 4_000,
    ("ray", "small"): 1_000, ("ray", "large"): 600,
    ("memcpy", "small"): 20_000, ("memcpy", "large"): 4_000,
}
WARMUP_GROUPS = 64
DISTINCT_GROUPS = 4  # producers cycle through a few groups so payload generation is not timed
TAKE_BATCH = 8
TIMEOUT_S = 60.0


def payload_groups(tokens_per_sample: int) -> list[ScoredGroup]:
    return [example_group(SAMPLES_PER_GROUP, tokens_per_sample, seed=seed) for seed in range(DISTINCT_GROUPS)]


def group_bytes(group: ScoredGroup) -> int:
    return sum(len(frame) if isinstance(frame, bytes) else frame.nbytes for frame in encode_group(group))


# ------------------------------------------------------------------------------------------- zmq


def zmq_producer(endpoint: str, tokens_per_sample: int, count: int) -> None:
    groups = payload_groups(tokens_per_sample)
    sender = Sender(endpoint)
    for seq in range(count):
        group = groups[seq % len(groups)]
        group.generator_id, group.seq = 0, seq
        sender.send(group, TIMEOUT_S)
    sender.close(linger_s=TIMEOUT_S)
    zmq.Context.instance().term()


def bench_zmq(tokens_per_sample: int, count: int) -> float:
    queue = ReplayQueue(Receiver(), capacity_groups=64, max_staleness=1 << 30).start()
    producer = mp.get_context("spawn").Process(
        target=zmq_producer, args=(queue.receiver.endpoint, tokens_per_sample, WARMUP_GROUPS + count)
    )
    producer.start()
    try:
        queue.take(WARMUP_GROUPS, learner_version=0, timeout_s=TIMEOUT_S)
        start = time.perf_counter()
        taken = 0
        while taken < count:
            taken += len(queue.take(min(TAKE_BATCH, count - taken), learner_version=0, timeout_s=TIMEOUT_S))
        elapsed = time.perf_counter() - start
        stats = queue.stats()
        assert stats["queue/lost"] == 0 and stats["wire/rejected"] == 0, stats
    finally:
        producer.join(TIMEOUT_S)
        queue.close()
    return count / elapsed


def bare_producer(endpoint: str, tokens_per_sample: int, count: int) -> None:
    frames = [encode_group(group) for group in payload_groups(tokens_per_sample)]
    context = zmq.Context.instance()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 8)
    push.connect(endpoint)
    for index in range(count):
        push.send_multipart(frames[index % len(frames)], copy=False)
    push.close(linger=int(TIMEOUT_S * 1000))
    context.term()


def bench_bare(tokens_per_sample: int, count: int) -> float:
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 8)
    endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    producer = mp.get_context("spawn").Process(
        target=bare_producer, args=(endpoint, tokens_per_sample, WARMUP_GROUPS + count)
    )
    producer.start()
    try:
        for _ in range(WARMUP_GROUPS):
            pull.recv_multipart(copy=False)
        start = time.perf_counter()
        for _ in range(count):
            pull.recv_multipart(copy=False)
        elapsed = time.perf_counter() - start
    finally:
        producer.join(TIMEOUT_S)
        pull.close(linger=0)
    return count / elapsed


# ------------------------------------------------------------------------------------------- ray


def bench_ray(tokens_per_sample: int, count: int) -> float:
    import ray
    from ray.util.queue import Queue

    @ray.remote(num_cpus=1)
    def ray_producer(queue: Queue, tokens_per_sample: int, count: int) -> None:
        groups = payload_groups(tokens_per_sample)
        for seq in range(count):
            group = groups[seq % len(groups)]
            group.generator_id, group.seq = 0, seq
            queue.put(group, timeout=TIMEOUT_S)

    queue = Queue(maxsize=64)
    done = ray_producer.remote(queue, tokens_per_sample, WARMUP_GROUPS + count)
    for _ in range(WARMUP_GROUPS):
        queue.get(timeout=TIMEOUT_S)
    start = time.perf_counter()
    for _ in range(count):
        queue.get(timeout=TIMEOUT_S)
    elapsed = time.perf_counter() - start
    ray.get(done, timeout=TIMEOUT_S)
    queue.shutdown()
    return count / elapsed


# ---------------------------------------------------------------------------------------- memcpy


def bench_memcpy(tokens_per_sample: int, count: int) -> float:
    frames = [
        [np.frombuffer(frame, dtype=np.uint8) for frame in encode_group(group)]
        for group in payload_groups(tokens_per_sample)
    ]
    destination = np.empty(max(sum(f.nbytes for f in group) for group in frames), dtype=np.uint8)
    start = time.perf_counter()
    for index in range(count):
        offset = 0
        for frame in frames[index % len(frames)]:
            np.copyto(destination[offset:offset + frame.nbytes], frame)
            offset += frame.nbytes
    return count / (time.perf_counter() - start)


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the number of timed groups")
    args = parser.parse_args()

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    benches = {"zmq": bench_zmq, "bare": bench_bare, "ray": bench_ray, "memcpy": bench_memcpy}
    rows = []
    groups_per_s: dict[str, dict[str, float]] = {path: {} for path in benches}
    try:
        for shape, tokens in SHAPES.items():
            megabytes = group_bytes(example_group(SAMPLES_PER_GROUP, tokens)) / 1e6
            for path, bench in benches.items():
                rate = bench(tokens, max(1, int(TIMED_GROUPS[path, shape] * args.scale)))
                groups_per_s[path][shape] = rate
                rows.append((shape, path, rate, rate * megabytes))
    finally:
        ray.shutdown()

    print(f"{'shape':<7}{'path':<8}{'groups/s':>11}{'payload MB/s':>14}{'vs ray':>9}")
    for shape, path, rate, mb_per_s in rows:
        print(f"{shape:<7}{path:<8}{rate:>11,.0f}{mb_per_s:>14,.0f}{rate / groups_per_s['ray'][shape]:>8.1f}x")
    large_mb = group_bytes(example_group(SAMPLES_PER_GROUP, SHAPES["large"])) / 1e6
    print(json.dumps({
        "ratio_vs_ray_small": groups_per_s["zmq"]["small"] / groups_per_s["ray"]["small"],
        "ratio_vs_ray_large": groups_per_s["zmq"]["large"] / groups_per_s["ray"]["large"],
        "mb_per_s_large": groups_per_s["zmq"]["large"] * large_mb,
        "fraction_of_bare_zmq_large": groups_per_s["zmq"]["large"] / groups_per_s["bare"]["large"],
        "groups_per_s": groups_per_s,
        "samples_per_group": SAMPLES_PER_GROUP,
        "tokens_per_sample": SHAPES,
    }))


if __name__ == "__main__":
    main()
