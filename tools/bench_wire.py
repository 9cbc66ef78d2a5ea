"""Throughput of the group stream: this wire vs a Ray actor queue vs an in-process memcpy.

Same payloads for every path (groups of 8 samples, 512 and 8,192 tokens each, made from the same
seeds in every process):
- zmq:     a producer process encodes and sends with `Sender`; a consumer Ray actor receives,
           decodes and queues with `Receiver` + `ReplayQueue` and takes batches, as the learner
           (a Ray actor) does. The transport is the learner's default on a loopback host (`auto`: ipc);
- zmq-tcp: the same over TCP loopback (`transport="tcp"`), without CURVE (`insecure=True`): a run's
           TCP wire adds CURVE's encryption on top;
- ray:     a Ray task puts the same `ScoredGroup`s into `ray.util.queue.Queue` (pickled through the
           object store); this process gets them one by one;
- memcpy:  this process copies the encoded frames' bytes into a preallocated buffer (the limit);
- bare:    for reference, the same encoded frames over the same transport and socket options, with
           no encode, decode or queue: what the transport alone allows on this machine.

Besides wall-clock rates, each process measures its own CPU time (all its threads, ZeroMQ's I/O
thread included) over the timed groups: CPU per group does not depend on what else the machine
runs, and `mb_per_cpu_s_large` (payload MB per CPU-second of producer + consumer) is the rate one
fully available core would sustain. Ray runs for the whole benchmark, as it does under training.

Prints a table, then, last, one JSON line. Run: `.venv/bin/python -m tools.bench_wire`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import zmq

from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.wire import Receiver, ScoredGroup, Sender, encode_group, example_group
from tools import positive_float, positive_int

SAMPLES_PER_GROUP = 8
SHAPES = {"small": 512, "large": 8192}
# Groups timed per (path, shape) at --scale 1: each run takes a second or a few on 2 cores.
TIMED_GROUPS = {
    ("zmq", "small"): 10_000, ("zmq", "large"): 3_000,
    ("zmq-tcp", "small"): 10_000, ("zmq-tcp", "large"): 3_000,
    ("bare", "small"): 20_000, ("bare", "large"): 4_000,
    ("ray", "small"): 1_000, ("ray", "large"): 600,
    ("memcpy", "small"): 20_000, ("memcpy", "large"): 4_000,
}
WARMUP_GROUPS = 64
DISTINCT_GROUPS = 4  # producers cycle through a few groups so payload generation is not timed
TAKE_BATCH = 8
TIMEOUT_S = 60.0
SPAWN = mp.get_context("spawn")


def payload_groups(tokens_per_sample: int) -> list[ScoredGroup]:
    return [example_group(SAMPLES_PER_GROUP, tokens_per_sample, seed=seed) for seed in range(DISTINCT_GROUPS)]


def group_bytes(group: ScoredGroup) -> int:
    return sum(len(frame) if isinstance(frame, bytes) else frame.nbytes for frame in encode_group(group))


class Result(dict):
    """groups_per_s, and CPU seconds per group of the producer and consumer side (None: not measured)."""


# ------------------------------------------------------------------------------------ zmq, bare
# The producer is a plain process (a generator's sending side), the consumer a Ray actor (the
# learner); each measures its own CPU time.


def zmq_producer(endpoint: str, tokens_per_sample: int, count: int, bare: bool, results: Connection) -> None:
    groups = payload_groups(tokens_per_sample)
    encoded = [encode_group(group) for group in groups]
    sender = Sender(endpoint)
    cpu_start = 0.0
    for seq in range(WARMUP_GROUPS + count):
        if seq == WARMUP_GROUPS:
            cpu_start = time.process_time()
        if bare:
            sender.socket.send_multipart(encoded[seq % len(groups)], copy=False)
        else:
            group = groups[seq % len(groups)]
            group.generator_id, group.seq = 0, seq
            sender.send(group, TIMEOUT_S)
    # Stay connected until the consumer has everything: over ipc, a writer's exit makes libzmq drop
    # what the reader had not read yet (docs/WIRE.md, "Transport"). By then the I/O thread is done.
    if results.poll(TIMEOUT_S * 3):
        results.recv()
    results.send(time.process_time() - cpu_start)
    sender.close(linger_s=TIMEOUT_S)
    zmq.Context.instance().term()


class ZmqConsumer:
    """The learner's side: `Receiver` + `ReplayQueue`, taken from in batches. Runs as a Ray actor,
    like the learner, so that its process carries what a learner's does (Ray's worker threads)."""

    def __init__(self, transport: str, count: int, bare: bool) -> None:
        self.count, self.bare = count, bare
        self.receiver = Receiver(transport=transport, insecure=True)  # the transport's cost, without CURVE
        self.queue = None if bare else ReplayQueue(self.receiver, 64, StalenessEviction(1 << 30, drop_stale=True),
                                                   limits=None).start()

    def endpoint(self) -> tuple[str, str]:
        return self.receiver.endpoint, self.receiver.transport

    def measure(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) over the timed groups, after the warm-up."""
        receiver, queue, count = self.receiver, self.queue, self.count
        try:
            if queue is None:
                for _ in range(WARMUP_GROUPS):
                    receiver.socket.recv_multipart(copy=False)
                wall_start, cpu_start = time.perf_counter(), time.process_time()
                for _ in range(count):
                    receiver.socket.recv_multipart(copy=False)
            else:
                queue.take(WARMUP_GROUPS, learner_version=0, timeout_s=TIMEOUT_S)
                wall_start, cpu_start = time.perf_counter(), time.process_time()
                taken = 0
                while taken < count:
                    taken += len(queue.take(min(TAKE_BATCH, count - taken), learner_version=0, timeout_s=TIMEOUT_S))
            wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
            if queue is not None:
                stats = queue.stats()
                assert stats["queue/lost"] == 0 and stats["wire/rejected"] == 0, stats
            return wall, cpu
        finally:
            if queue is not None:
                queue.close()
            else:
                receiver.close()


def bench_zmq(tokens_per_sample: int, count: int, transport: str = "auto", bare: bool = False) -> Result:
    import ray

    consumer = ray.remote(num_cpus=0)(ZmqConsumer).remote(transport, count, bare)
    endpoint, used = ray.get(consumer.endpoint.remote(), timeout=TIMEOUT_S)
    measured = consumer.measure.remote()
    producer_end, producer_results = mp.Pipe()
    producer = SPAWN.Process(target=zmq_producer, args=(endpoint, tokens_per_sample, count, bare, producer_results))
    producer.start()
    try:
        wall, consumer_cpu = ray.get(measured, timeout=TIMEOUT_S * 3)
        producer_end.send("done")
        producer_cpu = producer_end.recv() if producer_end.poll(TIMEOUT_S) else float("nan")
    finally:
        producer.join(TIMEOUT_S)
        ray.kill(consumer)
    return Result(groups_per_s=count / wall, producer_cpu_s=producer_cpu / count,
                  consumer_cpu_s=consumer_cpu / count, transport=used)


def bench_zmq_tcp(tokens_per_sample: int, count: int) -> Result:
    return bench_zmq(tokens_per_sample, count, transport="tcp")


def bench_bare(tokens_per_sample: int, count: int) -> Result:
    return bench_zmq(tokens_per_sample, count, bare=True)


# ------------------------------------------------------------------------------------------- ray


def bench_ray(tokens_per_sample: int, count: int) -> Result:
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
    # Ray's work is spread over the queue actor, the task's worker, the raylet and the object store:
    # no one process's CPU time is the path's, so none is reported.
    return Result(groups_per_s=count / elapsed, producer_cpu_s=None, consumer_cpu_s=None, transport="ray")


# ---------------------------------------------------------------------------------------- memcpy


def bench_memcpy(tokens_per_sample: int, count: int) -> Result:
    frames = [
        [np.frombuffer(frame, dtype=np.uint8) for frame in encode_group(group)]
        for group in payload_groups(tokens_per_sample)
    ]
    destination = np.empty(max(sum(f.nbytes for f in group) for group in frames), dtype=np.uint8)
    start, cpu_start = time.perf_counter(), time.process_time()
    for index in range(count):
        offset = 0
        for frame in frames[index % len(frames)]:
            np.copyto(destination[offset:offset + frame.nbytes], frame)
            offset += frame.nbytes
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return Result(groups_per_s=count / elapsed, producer_cpu_s=None, consumer_cpu_s=cpu / count, transport="-")


# ------------------------------------------------------------------------------------------ main

BENCHES = {"zmq": bench_zmq, "zmq-tcp": bench_zmq_tcp, "bare": bench_bare, "ray": bench_ray, "memcpy": bench_memcpy}


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:,.0f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_wire", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=positive_float, default=1.0, help="multiply the number of timed groups")
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="time each path this many times; rates and CPU times reported are the medians")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results: dict[str, dict[str, Result]] = {path: {} for path in BENCHES}
    megabytes = {shape: group_bytes(example_group(SAMPLES_PER_GROUP, tokens)) / 1e6 for shape, tokens in SHAPES.items()}
    try:
        for shape, tokens in SHAPES.items():
            for path, bench in BENCHES.items():
                count = max(1, int(TIMED_GROUPS[path, shape] * args.scale))
                runs = [bench(tokens, count) for _ in range(args.repeat)]
                result = Result(runs[0])
                for key in ("groups_per_s", "producer_cpu_s", "consumer_cpu_s"):
                    if runs[0][key] is not None:
                        result[key] = statistics.median(run[key] for run in runs)
                result["all_groups_per_s"] = [run["groups_per_s"] for run in runs]
                results[path][shape] = result
    finally:
        ray.shutdown()

    print(f"{'shape':<7}{'path':<9}{'transport':<11}{'groups/s':>10}{'payload MB/s':>14}{'vs ray':>8}"
          f"{'CPU us/group: producer':>24}{'consumer':>10}{'total':>8}")
    for shape in SHAPES:
        ray_rate = results["ray"][shape]["groups_per_s"]
        for path in BENCHES:
            r = results[path][shape]
            total = (None if r["consumer_cpu_s"] is None
                     else r["consumer_cpu_s"] + (r["producer_cpu_s"] or 0.0))
            print(f"{shape:<7}{path:<9}{r['transport']:<11}{r['groups_per_s']:>10,.0f}"
                  f"{r['groups_per_s'] * megabytes[shape]:>14,.0f}{r['groups_per_s'] / ray_rate:>7.1f}x"
                  f"{_us(r['producer_cpu_s']):>24}{_us(r['consumer_cpu_s']):>10}{_us(total):>8}")

    def cpu_us(path: str) -> dict[str, dict[str, Any]]:
        return {shape: {side: None if r[f"{side}_cpu_s"] is None else round(r[f"{side}_cpu_s"] * 1e6, 1)
                        for side in ("producer", "consumer")} for shape, r in results[path].items()}

    zmq_large = results["zmq"]["large"]
    print(json.dumps({
        "ratio_vs_ray_small": results["zmq"]["small"]["groups_per_s"] / results["ray"]["small"]["groups_per_s"],
        "ratio_vs_ray_large": zmq_large["groups_per_s"] / results["ray"]["large"]["groups_per_s"],
        "mb_per_s_large": zmq_large["groups_per_s"] * megabytes["large"],
        "transport": zmq_large["transport"],
        "mb_per_cpu_s_large": megabytes["large"] / (zmq_large["producer_cpu_s"] + zmq_large["consumer_cpu_s"]),
        "mb_per_s_large_tcp": results["zmq-tcp"]["large"]["groups_per_s"] * megabytes["large"],
        "fraction_of_bare_zmq_large": zmq_large["groups_per_s"] / results["bare"]["large"]["groups_per_s"],
        "cpu_us_per_group": {path: cpu_us(path) for path in ("zmq", "zmq-tcp", "bare")},
        "groups_per_s": {path: {shape: r["groups_per_s"] for shape, r in by_shape.items()}
                         for path, by_shape in results.items()},
        "repeats_groups_per_s": {path: {shape: r["all_groups_per_s"] for shape, r in by_shape.items()}
                                 for path, by_shape in results.items()} if args.repeat > 1 else None,
        "payload_mb_per_group": megabytes,
        "samples_per_group": SAMPLES_PER_GROUP,
        "tokens_per_sample": SHAPES,
    }))


if __name__ == "__main__":
    main()
