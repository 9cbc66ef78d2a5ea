"""Peak memory of this process, for the summary of each actor."""

from __future__ import annotations

import resource
import sys


def peak_memory() -> dict[str, float]:
    """Peak resident set size (MiB), and on a GPU the peak memory torch allocated there (MiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    peak = {"peak_rss_mib": rss / 1024 if sys.platform != "darwin" else rss / 2**20}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["peak_gpu_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return peak
