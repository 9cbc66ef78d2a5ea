"""Process-level plumbing every role uses: placement on nodes and cores, fault injection, deferred
interrupts, private files, peak memory, timed phases. Nothing here imports torch, vLLM or Ray."""
