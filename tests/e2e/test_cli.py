"""The real CLI end to end: vLLM, Ray, ZeroMQ and torch.distributed, tiny budgets."""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from metrics_doc import METRICS_DOC, STEP_SECTION, SUMMARY_SECTION, section_keys, undocumented
from process_tree import loopback
from shared_cache import warm_cache

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REQUIRED_STEP_KEYS = {
    "step", "samples", "reward/mean", "staleness/mean", "staleness/max", "time/step_s", "perf/samples_per_s",
    "queue/depth", "queue/dropped_stale", "loss/pg", "loss/clipfrac", "mismatch/kl", "staleness/min",
    "time/ack_wait_s", "time/gen_wait_s", "time/prepare_s", "time/train_s", "time/push_s", "time/gen_idle_s",
    "reward/errors", "reward/calls", "reward/error_rate",
}
SUMMARY_KEYS = {
    "steps", "samples", "wall_s", "samples_per_s", "eval_accuracy_start", "eval_accuracy_end",
    "groups_dropped_stale", "staleness_max",
}
RAY_PROCESS_MARKERS = ("raylet", "gcs_server", "ray::", "default_worker.py")


def cli(tmp_path: Path, *overrides: str, cache: Path | None = None) -> list[str]:
    return [
        sys.executable, "-m", "asyncgrpo.cli", "train",
        f"run_dir={tmp_path / 'run'}",
        # A short warm start, shared by the session's end-to-end runs (`cache`: another one): they
        # test the plumbing, not learning.
        f"model.cache_dir={cache or warm_cache(tmp_path)}",
        "model.warmstart_max_seconds=5",
        "progress=false",
        "train.steps_per_call=2",
        *overrides,
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in read_jsonl(path) if "loss/pg" in r] if path.exists() else []


def ray_processes_started_after(start: float) -> list[str]:
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.info["create_time"] >= start and any(m in cmdline for m in RAY_PROCESS_MARKERS):
                found.append(f"{proc.pid}: {cmdline[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def listening_sockets_started_after(start: float) -> list[tuple[int, str, str, int]]:
    """(pid, name, ip, port) of every listening TCP socket of the processes started since `start`."""
    found = []
    for proc in psutil.process_iter(["name", "create_time"]):
        try:
            if proc.info["create_time"] < start:
                continue
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((proc.pid, proc.info["name"], conn.laddr.ip, conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def private_dirs() -> set[Path]:
    """The Unix-socket directories and shared-memory weight slots on this machine whose creator has
    exited: those of the run under test once it has ended, never those of another run still going
    on the same machine (each is named after its creator, runtime/files.py `owned_private_dir`)."""
    from asyncgrpo.runtime.files import creator_alive
    from asyncgrpo.weights.shm import default_directory

    found = ([(path, "asyncgrpo-wire-") for path in Path(tempfile.gettempdir()).glob("asyncgrpo-wire-*")]
             + [(path, "asyncgrpo-weights-") for path in Path(default_directory()).glob("asyncgrpo-weights-*")])
    return {path for path, prefix in found if not creator_alive(path.name, prefix)}


def wait_for(predicate, timeout_s: float, what: str, detail=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} {detail()}")
        time.sleep(0.5)


def test_train_runs_end_to_end(tmp_path):
    steps = 6
    # Every sink on, and a sample table every 3 steps (logged at chunk ends 4 and 6: steps_per_call=2).
    log = ["log.tensorboard=true", "log.wandb=true", "log.samples_every_steps=3", "log.samples_per_log=2"]
    dirs_before = private_dirs()
    result = subprocess.run(cli(tmp_path, f"train.max_steps={steps}", "eval.every_steps=2", *log),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "run"
    # The learner's Unix-socket directories and weight slots are gone with the run.
    assert private_dirs() <= dirs_before

    assert f"max_steps: {steps}" in (run_dir / "config.yaml").read_text()
    records = step_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # the learner's version advanced
    for record in records:
        assert REQUIRED_STEP_KEYS <= record.keys()
        assert record["staleness/max"] <= 2
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    assert evals[0]["eval/when"] == "start" and evals[-1]["eval/when"] == "end"
    # eval.every_steps=2: generator 0 evaluated the first weights it loaded at or past version 2, 4, ...
    # (it holds version >= 3 before it may sample for step 6: max_staleness 2), once per multiple.
    periodic = [e["step"] for e in evals[1:-1]]
    assert [e["eval/when"] for e in evals[1:-1]] == ["periodic"] * len(periodic) and periodic
    assert all(step >= 2 * (i + 1) and step <= steps for i, step in enumerate(periodic))
    assert all(0.0 <= e["eval/accuracy"] <= 1.0 and 0.0 <= e["eval/greedy_accuracy"] <= 1.0 for e in evals)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    # Every key the run wrote has its row in docs/METRICS.md.
    doc = METRICS_DOC.read_text()
    written = set().union(*(r.keys() for r in read_jsonl(run_dir / "metrics.jsonl")))
    assert undocumented(written, section_keys(doc, STEP_SECTION)) == []
    assert undocumented(summary.keys(), section_keys(doc, SUMMARY_SECTION, "Top level")) == []
    assert summary["status"] == "finished"
    assert summary["steps"] == steps and summary["samples"] == steps * 16 * 8
    assert summary["staleness_max"] <= 2
    histogram = summary["learner"]["staleness_histogram"]
    assert sum(histogram.values()) == steps * 16 and max(int(k) for k in histogram) <= 2
    # The trained-vs-sampled audit: every group trained is accounted for, and judged (too few to say: null).
    assert summary["audit"]["audit/trained"] == steps * 16 and summary["audit"]["departure"] is None
    assert 0.0 <= summary["learner"]["idle_frac"] <= 1.0
    (generator,) = summary["generators"]
    assert 0.0 <= generator["gen/idle_frac"] <= 1.0
    # Peak memory of each actor: a tiny model, but a whole vLLM engine and torch runtime behind it.
    assert 100 < summary["learner"]["peak_rss_mib"] < 24 * 1024
    assert 100 < generator["gen/peak_rss_mib"] < 24 * 1024

    # The generator loaded the pushed weights: its vLLM log-probs moved away from the start and
    # equal the learner's forward at the final version.
    probe = summary["probe"]
    assert probe["generator_version"] == probe["learner_version"] == steps
    assert probe["max_abs_change_since_start"] > 1e-4
    assert probe["max_abs_diff_vs_learner"] < 1e-3

    # Observability: sample log, TensorBoard, offline W&B, and plots of the run.
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [4] * 16 + [6] * 16  # 2 prompts x 8 completions per log
    assert all(s["prompt"].endswith("=") and s["reward"] in (0.0, 1.0) for s in samples)
    assert "samples at step 4: 2 prompts, 16 completions" in result.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == list(range(1, steps + 1))
    assert len(list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    plot = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "plot", str(run_dir)], capture_output=True,
                          text=True, timeout=300)
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert len(list((run_dir / "plots").glob("*.png"))) == 6  # audit.png among them


def test_max_staleness_zero_is_on_policy_over_curve_authenticated_sockets_and_bf16_generation_shows_as_mismatch(
        tmp_path):
    # On-policy (max_staleness 0 in the first run, fixed staleness 0 in the second), so mismatch/*
    # measures the engines' numerics, not staleness: float32 generation against the float32 learner,
    # then bfloat16 generation.
    result = subprocess.run(
        cli(tmp_path / "f32", "train.max_steps=4", "train.max_staleness=0", "eval.at_start=false",
            "eval.at_end=false", "wire.curve=on"),
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = step_records(tmp_path / "f32" / "run")
    assert len(records) == 4
    assert all(r["staleness/max"] == 0 and r["queue/dropped_stale"] == 0 for r in records)
    result = subprocess.run(cli(tmp_path / "bf16", "train.fixed_staleness=0", "train.max_steps=3", "eval.at_start=false",
                                "eval.at_end=false", "rollout.dtype=bfloat16"),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    f32, bf16 = mean_k3(tmp_path / "f32" / "run"), mean_k3(tmp_path / "bf16" / "run")
    assert all(r["mismatch/k3_kl"] > 0 for r in step_records(tmp_path / "bf16" / "run"))
    # The probe's auto tolerance is the 16-bit one: 1e-3 would have failed this run at its end.
    probe = json.loads((tmp_path / "bf16" / "run" / "summary.json").read_text())["probe"]
    assert probe["tolerance"] == 0.2 and 1e-3 < probe["max_abs_diff_vs_learner"] <= 0.2, probe
    assert bf16 > 10 * f32, (bf16, f32)


def test_fixed_staleness_trains_every_step_after_the_warm_up_exactly_k_versions_stale_and_lora_pushes_adapters_only(
        tmp_path):
    k, steps = 2, 6
    # A LoRA run (rank 8, every linear layer; weights.lora_push=adapter, the default): the delayed
    # publication holds and sends adapters, and the generator merges them onto the base in place.
    result = subprocess.run(
        cli(tmp_path, f"train.fixed_staleness={k}", f"train.max_steps={steps}", "eval.at_start=false",
            "eval.at_end=false", "learner.lora.rank=8"),
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "run"
    assert "max_staleness: 2" in (run_dir / "config.yaml").read_text()
    records = step_records(run_dir)
    # Record N is the version after step N - 1: the warm-up steps 0..k-1 were sampled by version 0.
    assert [(r["step"], r["staleness/min"], r["staleness/max"]) for r in records] == [
        (n, min(n - 1, k), min(n - 1, k)) for n in range(1, steps + 1)]
    assert [r["weights/published_version"] for r in records] == [max(0, n - k) for n in range(1, steps + 1)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner"]["staleness_histogram"] == {"0": 16, "1": 16, "2": (steps - k) * 16}
    # The end of the run pushed the newest weights, not version steps - k: vLLM matches the learner.
    probe = summary["probe"]
    assert probe["generator_version"] == probe["learner_version"] == steps
    assert probe["max_abs_diff_vs_learner"] < 1e-3
    # ... and the merged adapters moved vLLM's log-probs well beyond that difference.
    assert probe["max_abs_change_since_start"] > 10 * max(probe["max_abs_diff_vs_learner"], 1e-4)
    # Each push carried the adapters (float32 on the wire), not the model.
    adapter_bytes, model_bytes = push_bytes(summary["model_dir"], lora_rank=8)
    assert [r["perf/push_bytes"] for r in records] == [0] * k + [adapter_bytes] * (steps - k)
    assert adapter_bytes < model_bytes


def push_bytes(model_dir: str, lora_rank: int) -> tuple[int, int]:
    """A float32 push's bytes: of the rank-`lora_rank` adapters on every linear layer, of the model."""
    from asyncgrpo.learner.lora import adapter_layout
    from asyncgrpo.schema import LoraConfig
    from asyncgrpo.weights.adapters import adapter_spec
    from asyncgrpo.weights.base import model_spec

    layout = adapter_layout(model_dir, LoraConfig(rank=lora_rank))
    return (sum(math.prod(shape) * 4 for _, shape, _ in adapter_spec(layout)),
            sum(math.prod(shape) * 4 for _, shape, _ in model_spec(model_dir)))


def test_lora_through_vllms_lora_path_serves_each_adapter_push_and_a_resumed_run_starts_at_its_adapter(tmp_path):
    # rollout.lora_apply=vllm: the generator's engine runs vLLM's LoRA path, each push replaces its
    # adapter (no merge, no base copy); sampling and the end-of-run probe go through the adapter.
    # On-policy in float32, so a step's mismatch is the engines' numerics alone: a resumed run's
    # generator that started from any adapter but the checkpoint's would show at the first step.
    lora = ("train.max_staleness=0", "eval.at_start=false", "eval.at_end=false", "learner.lora.rank=8",
            "learner.lr=1e-2", "rollout.lora_apply=vllm")
    first = subprocess.run(cli(tmp_path, "train.max_steps=2", "train.save_every_steps=2", *lora),
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-4000:]
    resumed = subprocess.run(cli(tmp_path, "resume=auto", "train.max_steps=4", *lora),
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    run_dir = tmp_path / "run"
    assert "lora_apply: vllm" in (run_dir / "config.yaml").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_at_step"] == 2
    records = step_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert max(r["mismatch/k3_kl"] for r in records) < 1e-6, [r["mismatch/k3_kl"] for r in records]
    probe = summary["probe"]
    assert probe["generator_version"] == probe["learner_version"] == 4
    assert probe["max_abs_diff_vs_learner"] < 1e-3
    assert probe["max_abs_change_since_start"] > 10 * max(probe["max_abs_diff_vs_learner"], 1e-4)
    adapter_bytes, _ = push_bytes(summary["model_dir"], lora_rank=8)
    assert all(r["perf/push_bytes"] == adapter_bytes for r in records)


def mean_k3(run_dir: Path) -> float:
    records = step_records(run_dir)
    return sum(r["mismatch/k3_kl"] for r in records) / len(records)


def test_drop_policy_without_throttle_bounds_staleness_by_dropping(tmp_path):
    # No throttle: the generator is granted whatever a one-step queue can hold, whatever its weights;
    # groups too stale when taken are dropped and counted.
    steps = 8
    result = subprocess.run(
        cli(tmp_path, f"train.max_steps={steps}", "train.max_staleness=1", "train.stale_policy=drop",
            "queue.capacity_groups=16", "eval.at_start=false", "eval.at_end=false", "wire.timeout_s=60"),
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = step_records(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["staleness/max"] <= 1 for r in records)
    last = records[-1]
    assert last["queue/received"] == (last["queue/consumed"] + last["queue/dropped_stale"]
                                      + last["queue/dropped_unheld"] + last["queue/depth"])
    assert last["queue/consumed"] == steps * 16
    # The audit's identity on a real stream with drops: sampled = trained + not trained by reason + queued.
    not_trained = sum(v for k, v in last.items() if k.startswith("audit/not_trained/"))
    assert last["audit/sampled"] == last["audit/trained"] + not_trained + last["audit/queued"]
    assert last["audit/not_trained/dropped_stale"] == last["queue/dropped_stale"]


def test_a_run_with_inflight_updates_over_the_collective_backend_loads_every_version_within_the_bound(tmp_path):
    # weights.backend=nccl runs its gloo stand-in on CPU: the same announce/broadcast protocol.
    steps = 8
    result = subprocess.run(
        cli(tmp_path, f"train.max_steps={steps}", "train.max_staleness=1", "eval.at_start=false",
            "eval.at_end=false", "weights.backend=nccl", "rollout.inflight_updates=true"),
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = step_records(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["staleness/max"] <= 1 for r in records)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    probe = summary["probe"]
    assert probe["generator_version"] == probe["learner_version"] == steps
    assert probe["max_abs_diff_vs_learner"] < 1e-3
    (generator,) = summary["generators"]
    assert generator["gen/weight_loads"] >= steps - 1  # the collective backend never skips a version
    # Whether a load lands while sequences run is timing here (5-token completions: 0 or 1 of 8 loads);
    # tests/unit/test_staleness_contract.py drives mid-sequence loads, this run the protocol around them.
    assert generator["gen/inflight_switches"] <= generator["gen/weight_loads"]


def test_prompts_from_a_file_with_weighted_rewards_stop_when_the_data_runs_out(tmp_path):
    import random

    rng = random.Random(0)
    data = tmp_path / "train.jsonl"
    lines = [json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)})
             for a, b in ((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(100))]
    data.write_text("\n".join([*lines, "{not json", json.dumps({"question": ""})]) + "\n")
    result = subprocess.run(
        cli(tmp_path, "task.name=files", f"data.train_files=[{data}]", "data.epochs=1", "train.max_steps=1000",
            "reward.terms=[{name:task,weight:1.0},{name:fmt,kind:format,weight:0.1}]", "eval.at_start=false"),
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # 100 good records, 20 held out for eval, 80 prompts = 5 steps of 16 groups; 2 bad lines skipped.
    assert summary["data"]["train"]["kept"] == 100 and sum(summary["data"]["train"]["skipped"].values()) == 2
    assert summary["steps"] == 5
    records = step_records(tmp_path / "run")
    assert len(records) == 5
    for record in records:
        assert 0.0 <= record["reward/task"] <= 1.0 and 0.0 <= record["reward/fmt"] <= 1.0
        assert record["reward/mean"] == pytest.approx(record["reward/task"] + 0.1 * record["reward/fmt"], abs=1e-5)


def test_two_generators_read_one_finite_stream_and_train_each_prompt_once_per_epoch(tmp_path):
    # data.epochs=2: the generators read the run's one stream at the positions granted, and grants
    # stop at the data's end and at the last step.
    from collections import Counter

    from asyncgrpo.recording.stream import STREAM_FILE, read_group, scan

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a, b in ((10 + k, 50 + 3 * k % 40) for k in range(100))))
    recording = tmp_path / "stream"
    result = subprocess.run(
        cli(tmp_path, "task.name=files", f"data.train_files=[{data}]", "data.epochs=2", "train.max_steps=1000",
            "rollout.num_generators=2", "eval.at_start=false", "eval.at_end=false",
            "train.export_at_end=false", f"wire.record_dir={recording}"),
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # 100 records, 20 held out for eval: 80 prompts x 2 epochs = 160 = 10 steps of 16, both generators.
    assert summary["steps"] == 10 and "train.max_steps 1000 -> 10" in result.stdout
    assert all(g["gen/groups_sent"] > 0 for g in summary["generators"])
    stream = recording / STREAM_FILE
    with stream.open("rb") as file:
        groups = [read_group(file, offset) for step in scan(stream, check_groups=False).steps for offset in step.offsets]
    assert sorted(g.pos for g in groups) == list(range(160))
    assert len(set(g.generator_id for g in groups)) == 2
    assert sorted(Counter(g.prompt_id for g in groups).values()) == [2] * 80
    last = step_records(tmp_path / "run")[-1]
    assert last["queue/consumed"] == last["queue/received"] == 160  # nothing granted past the last step


def test_a_reward_that_always_fails_stops_the_run_naming_its_first_error(tmp_path):
    # A reward that raises on every call: an outage (its service is gone), which reward.on_error=zero
    # alone would train through on zero rewards.
    (tmp_path / "outage_reward.py").write_text(
        "def reward(prompt, completion, answer=None, **extra):\n"
        "    raise TypeError('loads() takes 1 positional argument but 2 were given')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(cli(tmp_path, "reward.fn=outage_reward:reward", "train.max_steps=50", "eval.at_start=false"),
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 1, result.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] < 50
    error = summary["error"]
    assert error.startswith("TrainingFailed: reward error rate 1.00 (") and "\n" not in error
    assert "reward.error_window_steps=20" in error and "reward.max_error_rate=0.5" in error
    assert "[fn] TypeError: loads() takes 1 positional argument but 2 were given" in error
    # The generator logged the term's first error when it happened; the CLI's last line is the reason.
    assert "reward term 'fn' failed for the first time" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("asyncgrpo: training failed: TrainingFailed: reward error")


def stop(proc: subprocess.Popen) -> None:
    """A run a failed test leaves behind is interrupted (so it stops its actors and Ray), then killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_long_run(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict]:
    """A run that would go on for hours (unless `overrides` say otherwise), once its learner has
    taken two steps; and its actors. `env`: added to the run's environment."""
    # Output goes to a file: an unread pipe would fill up and block the run.
    with (tmp_path / "output.log").open("w") as output:
        proc = subprocess.Popen(cli(tmp_path, "train.max_steps=100000", "eval.at_start=false", *overrides),
                                stdout=output, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **env} if env else None)
    run_dir = tmp_path / "run"
    wait_for(lambda: len(step_records(run_dir)) >= 2 or proc.poll() is not None, 600, "two learner steps")
    assert proc.poll() is None, (tmp_path / "output.log").read_text()[-4000:]
    return proc, json.loads((run_dir / "actors.json").read_text())


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_an_interrupt_checkpoints_stops_everything_and_leaves_readable_files(tmp_path, signum):
    start = time.time()
    run_dir = tmp_path / "run"
    dirs_before = private_dirs()
    proc, actors = start_long_run(tmp_path)
    try:
        # A run on one machine listens on loopback only: Ray, torch.distributed's store, gloo, ZeroMQ.
        listening = listening_sockets_started_after(start)
        assert listening and all(loopback(ip) for _, _, ip, _ in listening), listening
        proc.send_signal(signum)
        proc.wait(timeout=60)  # the requirement: everything stops within 60 s, the checkpoint included
    finally:
        stop(proc)
    assert proc.returncode != 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    trained = len(step_records(run_dir))
    assert trained >= 2
    # The call in progress finished, its steps were logged, then a checkpoint of them was saved:
    # exactly what was logged.
    checkpoint = Path(summary["interrupt_checkpoint"])
    assert (checkpoint / "COMPLETE").is_file() and int(checkpoint.name.split("_")[1]) == trained
    wait_for(lambda: not any(psutil.pid_exists(p) for p in actors["generator_pids"] + actors["learner_pids"]),
             10, "actor processes to exit")
    wait_for(lambda: not ray_processes_started_after(start), 10, "Ray processes to exit",
             lambda: ray_processes_started_after(start))
    assert private_dirs() <= dirs_before  # no socket directory or weight slot left behind
    if signum == signal.SIGTERM:  # preempted, then restarted with resume=auto: it goes on in the same run_dir
        version = int(checkpoint.name.split("_")[1])
        resumed = subprocess.run(cli(tmp_path, "resume=auto", f"train.max_steps={version + 2}", "eval.at_start=false"),
                                 capture_output=True, text=True, timeout=900)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert f"[resume] auto: continuing from {checkpoint}" in resumed.stdout
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["resumed_at_step"] == version and summary["steps"] == version + 2
        assert json.loads((run_dir / "summary.1.json").read_text())["status"] == "interrupted"  # kept, not clobbered
        # metrics.jsonl is appended to: every step exactly once, the resumed run's from the checkpoint on.
        assert [r["step"] for r in step_records(run_dir)] == list(range(1, version + 3))


def ray_children(proc: subprocess.Popen) -> list[str]:
    """The Ray processes `proc` has started (ray.init starts gcs_server and raylet as its children)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            cmdline = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(marker in cmdline for marker in RAY_PROCESS_MARKERS):
            found.append(cmdline[:120])
    return found


@pytest.mark.parametrize("phase", ["warm_start", "ray_start"])
def test_sigterm_during_set_up_writes_an_interrupted_summary_and_leaves_no_ray_process(tmp_path, phase):
    # warm_start: as soon as config.yaml is written (then the model is warm-started into a fresh
    # cache); ray_start: once ray.init has started Ray's processes, while it installs its own
    # SIGTERM handler (which used to exit at once: status failed, "SystemExit: 15").
    start = time.time()
    run_dir = tmp_path / "run"
    with (tmp_path / "output.log").open("w") as output:
        # The warm start must happen: a private, empty cache.
        cache = tmp_path / "cache" if phase == "warm_start" else None
        proc = subprocess.Popen(cli(tmp_path, "train.max_steps=100000", cache=cache), stdout=output,
                                stderr=subprocess.STDOUT, text=True)
    reached = (lambda: (run_dir / "config.yaml").is_file()) if phase == "warm_start" else (lambda: ray_children(proc))
    try:
        wait_for(lambda: reached() or proc.poll() is not None, 600, f"the run's {phase}")
        assert proc.poll() is None, (tmp_path / "output.log").read_text()[-4000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)  # the requirement: everything stops within 60 s
    finally:
        stop(proc)
    output_text = (tmp_path / "output.log").read_text()
    assert proc.returncode == 130, output_text[-4000:]  # the CLI's exit status for an interrupt
    assert not step_records(run_dir)  # it was still setting up
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary.get("error")
    assert output_text.strip().splitlines()[-1].startswith("asyncgrpo: interrupted; metrics and summary are in")
    wait_for(lambda: not ray_processes_started_after(start), 10, "Ray processes to exit",
             lambda: ray_processes_started_after(start))


def test_a_dead_generator_beyond_max_restarts_fails_the_run_loudly(tmp_path):
    run_dir = tmp_path / "run"
    proc, actors = start_long_run(tmp_path, "rollout.max_restarts=0")
    try:
        os.kill(actors["generator_pids"][0], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        stop(proc)
    output = (tmp_path / "output.log").read_text()
    assert proc.returncode == 1
    last = output.strip().splitlines()[-1]
    assert "training failed" in last and "generator 0 died" in last and "rollout.max_restarts=0" in last, last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["generator_restarts"] == 0


def kill_generator_zero_and_finish(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None
                                   ) -> tuple[dict, dict]:
    """A long run with `overrides`, generator 0 SIGKILLed after two steps; it must be restarted and
    the run finish. The actors before the kill, and the summary."""
    proc, actors = start_long_run(tmp_path, *overrides, env=env)
    try:
        os.kill(actors["generator_pids"][0], signal.SIGKILL)
        proc.wait(timeout=900)
    finally:
        stop(proc)
    output = (tmp_path / "output.log").read_text()
    assert proc.returncode == 0, output[-4000:]
    assert "[restart] generator 0 died" in output and "[restart] generator 0 rejoined" in output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished"
    return actors, summary


def test_a_slowed_generator_makes_less_a_sigkilled_one_is_restarted_and_every_slot_is_trained_once_within_the_bound(
        tmp_path):
    # Two throttled generators, generator 1 three times slower (failpoint): whoever asks gets the next
    # slots within the bound of the weights it holds; generator 0's death gives its slots not arrived
    # to the next asker, and its next incarnation loads the newest weights (re-announced in the
    # shared-memory slots), then just asks; the final probe reads it at the learner's last version.
    steps, max_staleness = 24, 1
    run_dir = tmp_path / "run"
    _, summary = kill_generator_zero_and_finish(
        tmp_path, f"train.max_steps={steps}", f"train.max_staleness={max_staleness}", "rollout.num_generators=2",
        "train.stale_policy=throttle", "eval.at_end=false",
        env={"ASYNCGRPO_FAULTS": '{"generator_slowdown": {"1": 3}}'})
    assert summary["steps"] == steps and summary["generator_restarts"] == 1
    records = step_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["staleness/max"] <= max_staleness for r in records) and summary["staleness_max"] <= max_staleness
    last = records[-1]
    assert last["queue/dropped_stale"] == 0 and last["queue/consumed"] == steps * 16
    assert last["queue/received"] == (last["queue/consumed"] + last["queue/dropped_stale"]
                                      + last["queue/dropped_unheld"] + last["queue/depth"]), last
    assert last["dispatch/granted"] >= steps * 16
    # Both made groups; the slowed one fewer than an even share would have had it make.
    sent = [g["gen/groups_sent"] for g in summary["generators"]]
    assert 0 < sent[1] < 8 * steps, sent
    probe = summary["probe"]
    assert probe["generator_version"] == probe["learner_version"] == steps
