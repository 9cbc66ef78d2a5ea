"""`asyncgrpo replay DIR [key=value ...]`: train a learner on a recorded stream, with no generators.

For paired comparisons of corrections on identical stale data (the same groups, taken at the same
learner versions, with the same behaviour log-probs) and for deterministic re-runs.

The config is the recording's config.yaml with the command line's overrides on top (algo.*,
learner.lr, seed, ...; `config.replay_config`). The recording fixes the starting weights (its
model_dir, or the checkpoint the recording run resumed from), each step's groups and the version
that took them, and so train.groups_per_step (another value is refused), and which groups were
filtered (algo.filter_groups cannot be set). A replay runs one learner rank, pushes no weights
and starts no generator, Ray or socket; it stops at the recording's last complete step or at
train.max_steps, whichever comes first, and writes a run directory of its own (run_dir, default
DIR/replay-<timestamp>): config.yaml, metrics.jsonl, summary.json, which `asyncgrpo plot` reads.

Staleness in a replay: the learner's version starts at the recording's first version and goes up by
one per step, and `RecordedSource` serves each step only to the version that took it, so
`staleness/*` is the recorded learner version at consumption minus each group's oldest token
version: the staleness the recording run trained with, whatever the replay's settings. It counts
versions; how far the replayed policy has actually moved from the behaviour policy differs between
settings, and `mismatch/*` and `is/*` measure that.

Determinism: on CPU the same recording, config and seed give identical losses at every step: the
groups are the same bytes, the learner is one rank with `learner.torch_threads` threads, torch's
deterministic algorithms are on, and nothing in an update draws random numbers. It also repeats the
recording run's own losses when that run had one learner rank on CPU (tests/e2e/test_record_replay.py);
a recording made with several ranks replays on one: the same data, sums in another order. On GPU,
kernels may still differ in the last bits.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from asyncgrpo import __version__
from asyncgrpo.config import replay_config
from asyncgrpo.driver.replay_evaluation import ReplayEvaluator, evaluates
from asyncgrpo.runtime.files import private_dir, write_atomic
from asyncgrpo.runtime.provenance import code_identity
from asyncgrpo.recording.source import RecordedSource, open_recording
from asyncgrpo.recording.stream import RecordingError
from asyncgrpo.schema import Config, ConfigError, to_yaml


def replay(directory: str | Path, overrides: Sequence[str], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train on the recording in `directory`; returns the summary also written to run_dir/summary.json.
    Raises `RecordingError` or `ConfigError` (one line) before anything heavy starts."""
    recording = open_recording(directory)
    cfg = replay_config(recording, overrides)
    model_dir, checkpoint = recording.starting_point()
    steps = [step for step in recording.index.steps if step.version < cfg.train.max_steps]
    if not steps:
        raise ConfigError(f"train.max_steps={cfg.train.max_steps} ends before the recording's first step "
                          f"(version {recording.start_version})")
    run_dir = Path(cfg.run_dir).expanduser()
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run_dir={run_dir} already holds metrics.jsonl: a replay writes a run directory of its own")
    index = recording.index
    if index.torn_records or index.torn_bytes:
        log(f"[replay] ignored a torn tail: {index.torn_records} records, {index.torn_bytes} bytes after byte "
            f"{index.end} of {recording.stream} (the recording run stopped while writing)")
    from asyncgrpo.learner.learner import Learner
    from asyncgrpo.learner.parts import offline_learner_parts, stream_recorder
    from asyncgrpo.metrics import open_sinks

    private_dir(run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    summary: dict[str, Any] = {
        "status": "starting", "run_dir": str(run_dir), "recording": str(recording.directory),
        "overrides": list(overrides), "model_dir": model_dir, "checkpoint": checkpoint,
        "recorded_steps": len(index.steps), "torn_tail_records": index.torn_records,
        "torn_tail_bytes": index.torn_bytes, "code": code_identity(__version__),
    }
    wall_start = time.monotonic()
    metrics = open_sinks(cfg, run_dir)
    source = RecordedSource(recording, steps)
    learner = evaluator = None
    stack = ExitStack()
    try:
        stack.enter_context(_deterministic())
        recorder = stream_recorder(cfg, model_dir)
        learner = Learner(**offline_learner_parts(cfg, model_dir, source, recorder).arguments)
        if checkpoint:
            learner.load_checkpoint(checkpoint)
        if learner.version != recording.start_version:
            raise RecordingError(f"{recording.directory}: the recording starts at version {recording.start_version}, "
                                 f"its starting point is at version {learner.version}")
        evaluator = ReplayEvaluator(cfg, model_dir, learner.version) if evaluates(cfg) else None
        summary.update(_train(cfg, learner, len(steps), evaluator, metrics, wall_start))
        summary.update(learner.summary())
        summary.update(status="finished", steps=len(steps))
    except KeyboardInterrupt:
        summary["status"] = "interrupted"
        raise
    except BaseException as err:
        summary.update(status="failed", error=f"{type(err).__name__}: {err}")
        raise
    finally:
        if evaluator is not None:
            evaluator.close()  # before the learner's process group goes
        if learner is not None:
            learner.close()  # closes the source too
        else:
            source.close()
        metrics.close()
        stack.close()
        summary["wall_s"] = time.monotonic() - wall_start
        write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2, default=float) + "\n")
    return summary


def _train(cfg: Config, learner: Any, num_steps: int, evaluator: ReplayEvaluator | None, metrics: Any,
           wall_start: float) -> dict[str, Any]:
    """`num_steps` learner steps, each step's record to `metrics`, with the held-out evaluations
    eval.at_start, eval.every_steps and eval.at_end ask for; returns their summary entries."""
    from tqdm import tqdm

    entries: dict[str, Any] = {}
    if evaluator is not None and cfg.eval.at_start:
        entries.update(evaluator.evaluate(learner, "start", learner.version, metrics))
    loop_start = time.monotonic()
    for step in tqdm(range(1, num_steps + 1), desc="replay", unit="step", disable=not cfg.progress):
        for record in learner.train_steps(1):
            record["time/wall_s"] = time.monotonic() - wall_start
            metrics.write(record)
        # The last step's weights: once, as the end's evaluation, when eval.at_end asks for one.
        if evaluator is not None and not (step == num_steps and cfg.eval.at_end):
            evaluator.after_step(learner, metrics)
    entries["train_s"] = time.monotonic() - loop_start  # the training loop's, without evaluations at its ends
    if evaluator is not None and cfg.eval.at_end:
        entries.update(evaluator.evaluate(learner, "end", learner.version, metrics))
    return entries


@contextmanager
def _deterministic() -> Iterator[None]:
    """torch's deterministic algorithms for the replay, then the caller's setting again (a test or
    a notebook may replay in-process)."""
    import torch

    # cuBLAS reads this when it starts; deterministic algorithms on CUDA require it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
