"""Metrics sinks: every record goes to run_dir/metrics.jsonl, and optionally TensorBoard and W&B.

A record is a flat dict such as the learner's step metrics or an eval result; its `step` is the
learner version it belongs to. JSONL keeps everything (strings included); TensorBoard and W&B get
the numeric values only, since both plot scalars over the step axis.
"""

from __future__ import annotations

import importlib.util
import json
import numbers
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from asyncgrpo.runtime.files import write_atomic
from asyncgrpo.schema import Config, ConfigError, LogConfig

# log.wandb_mode: offline needs no network or account (`wandb sync` uploads later); online.
WANDB_MODES = ("offline", "online")


class SinkUnavailable(ConfigError):
    """An enabled sink whose optional package is not installed; the message names key and package."""


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        """Record `record` at learner step `step` (default: the record's own `step`, else 0)."""

    def close(self) -> None: ...


def record_step(record: dict[str, Any], step: int | None) -> int:
    if step is not None:
        return int(step)
    return int(record.get("step", 0))


def numeric_items(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """The record's scalar numbers except `step` itself (it is the x axis, not a series)."""
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        yield key, float(value)


class JsonlSink:
    """One JSON object per line, line-buffered so a crash or Ctrl-C loses at most the line in flight."""

    def __init__(self, run_dir: str | Path, filename: str = "metrics.jsonl") -> None:
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a", buffering=1)

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        # numpy scalars are not JSON-serializable; float() is exact for the values we log.
        self.file.write(json.dumps(record, default=float) + "\n")

    def close(self) -> None:
        self.file.close()


def set_aside_steps_after(path: Path, last_step: int) -> int:
    """Move the records of `path` (a metrics.jsonl) whose step is past `last_step` to
    <name>.abandoned.jsonl beside it (appended), keeping the rest in order; returns how many moved.

    A run resumed from the checkpoint at version `last_step` trains steps last_step + 1, ... again:
    the records a crashed run (or the line a branch leaves) logged for them would otherwise appear
    twice. Records without a step stay. A line that is not JSON stays where it is."""
    if not path.is_file():
        return 0
    kept, moved = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            step = None
        past = isinstance(step, (int, float)) and not isinstance(step, bool) and step > last_step
        (moved if past else kept).append(line if line.endswith("\n") else line + "\n")
    if moved:
        with path.with_name(f"{path.stem}.abandoned.jsonl").open("a") as abandoned:
            abandoned.writelines(moved)
        write_atomic(path, "".join(kept))
    return len(moved)


class TensorBoardSink:
    """Scalars into run_dir/tensorboard (`tensorboard --logdir run_dir/tensorboard`)."""

    def __init__(self, run_dir: str | Path, subdir: str = "tensorboard") -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / subdir
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        global_step = record_step(record, step)
        for key, value in numeric_items(record):
            self.writer.add_scalar(key, value, global_step=global_step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink:
    """A W&B run under run_dir/wandb. `project` and `mode` are log.wandb_project and log.wandb_mode
    (no defaults here: config's are the only ones; its offline mode needs neither network nor account)."""

    def __init__(self, run_dir: str | Path, *, project: str, mode: str,
                 config: dict[str, Any] | None = None, name: str | None = None) -> None:
        if mode not in WANDB_MODES:
            raise ValueError(f"log.wandb_mode must be one of {', '.join(WANDB_MODES)}, got {mode!r}")
        import wandb

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # console="off": W&B's stdout capture would wrap the driver's progress bar.
        settings = wandb.Settings(silent=True, console="off")
        self.run = wandb.init(project=project, mode=mode, dir=str(run_dir), name=name or run_dir.name,
                              config=config or {}, settings=settings)
        self.last_step = -1

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        values = dict(numeric_items(record))
        if not values:
            return
        # W&B ignores (with a warning) any step below one it has already seen; an eval record of
        # step 0 after training began is then kept under the latest step instead of being lost.
        self.last_step = max(self.last_step, record_step(record, step))
        self.run.log(values, step=self.last_step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before the W&B service has written the run file; tearing the service
        # down waits for it. Skipped if the process has another W&B run of its own still open.
        if wandb.run is None:
            wandb.teardown()


class MultiSink:
    """Fans every record out to several sinks; closing closes them all even if one fails."""

    def __init__(self, sinks: Iterable[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        for sink in self.sinks:
            sink.write(record, step)

    def close(self) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001 - the others must still be closed
                errors.append(err)
        if errors:
            raise errors[0]


# The optional package each enabled sink needs: (config key, importable module, pip requirement).
_SINK_PACKAGES = (
    ("tensorboard", "log.tensorboard", "tensorboard", "tensorboard"),
    ("wandb", "log.wandb", "wandb", "wandb"),
)


def require_sink_packages(log: LogConfig) -> None:
    """Fail before anything starts if an enabled sink's package is missing (one line, names both)."""
    for attribute, key, module, requirement in _SINK_PACKAGES:
        if getattr(log, attribute) and importlib.util.find_spec(module) is None:
            raise SinkUnavailable(
                f"{key}=true needs the '{requirement}' package, which is not installed: "
                f"pip install {requirement}  (or: pip install 'asyncgrpo[track]'), or set {key}=false"
            )


def open_sinks(cfg: Config, run_dir: str | Path) -> MultiSink:
    """metrics.jsonl always, plus the sinks enabled under `log.*`."""
    require_sink_packages(cfg.log)
    sinks: list[MetricsSink] = [JsonlSink(run_dir)]
    try:
        if cfg.log.tensorboard:
            sinks.append(TensorBoardSink(run_dir))
        if cfg.log.wandb:
            from omegaconf import OmegaConf

            os.environ.setdefault("WANDB_SILENT", "true")
            config = OmegaConf.to_container(OmegaConf.structured(cfg))
            sinks.append(WandbSink(run_dir, project=cfg.log.wandb_project, mode=cfg.log.wandb_mode,
                                   config=config))  # type: ignore[arg-type]
    except BaseException:
        MultiSink(sinks).close()
        raise
    return MultiSink(sinks)
