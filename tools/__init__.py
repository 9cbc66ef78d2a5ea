"""Benchmarks, studies and fault drills around asyncgrpo, run from the repository root as modules,
`python -m tools.NAME` (tools that use another import it as `from tools import NAME`):

    bench_async         async vs sync throughput, interleaved repeats
    bench_dispatch      uneven generators under tickets against each alone, measured
    bench_learner       learner step time and memory at world size 1 and 2
    bench_peer          asyncgrpo against TRL's GRPOTrainer, side by side
    bench_push          weight-push latency, zmq and shm
    bench_lora          a LoRA run's generators: adapters merged vs vLLM's LoRA path, beside full FT
    bench_real          a step's anatomy at real model shapes
    bench_tail          the continuous generator against the call-batched one and sync, long completions
    bench_env           environment latency hidden: the calculator tool with 0-200 ms per call, sync vs async
    bench_wire          the group stream against a Ray queue and memcpy
    chaos               each fault injected into a real run, checked (docs/RELIABILITY.md)
    soak                a long run with a generator killed every few minutes
    validate_simulator  simulator predictions against real runs
    predict_cluster     the simulator on GPU clusters no one here can run
    dispatch_study      uneven generators under tickets against each alone, simulated
    probe_vllm_lora     vLLM's LoRA path vs merging adapters in place, measured (docs/LORA.md)
    study_pairs         any two cells of finished studies paired by seed, within one study or across two

gpu_check.sh, beside them, is the checks that need an NVIDIA GPU as one shell script.
"""
