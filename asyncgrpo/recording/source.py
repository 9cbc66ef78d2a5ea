"""Reading a recording back: `open_recording` checks the directory and indexes its steps,
`RecordedSource` serves them to a learner as its `GroupSource` (asyncgrpo/queue/sources.py), one
recorded step per take."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.recording.stream import (
    CONFIG_FILE,
    STREAM_FILE,
    RecordedStep,
    RecordingError,
    StreamIndex,
    read_group,
    read_header,
    scan,
)
from asyncgrpo.queue.sources import OfflineSource, QueueTimeout
from asyncgrpo.wire import ScoredGroup


@dataclass
class Recording:
    directory: Path
    header: dict[str, Any]
    index: StreamIndex

    @property
    def stream(self) -> Path:
        return self.directory / STREAM_FILE

    @property
    def start_version(self) -> int:
        return int(self.header["start_version"])

    @property
    def groups_per_step(self) -> int:
        return len(self.index.steps[0].offsets)

    def starting_point(self) -> tuple[str, str | None]:
        """(model_dir, checkpoint or None): the recording run's starting weights, which must still be there."""
        from asyncgrpo.models.check import ModelDirError, check_model_dir, weights_error

        model_dir, checkpoint = self.header["model_dir"], self.header.get("checkpoint")
        if not model_dir or not Path(model_dir).is_dir():
            raise RecordingError(f"{self.directory}: the recording run's starting model {model_dir!r} is gone; "
                                 "a replay must start from the weights the recorded groups were trained from")
        try:  # its architecture was checked when the recording ran: vLLM's registry is not asked again
            check_model_dir(model_dir, None, supported_architectures=_declared_architectures(model_dir))
        except ModelDirError as err:
            raise RecordingError(f"{self.directory}: the recording run's starting model: {err}") from None
        missing = weights_error(model_dir)
        if missing:
            raise RecordingError(f"{self.directory}: the recording run's starting model {model_dir}: {missing}")
        if checkpoint and not Path(checkpoint).is_dir():
            raise RecordingError(f"{self.directory}: the recording starts from the checkpoint {checkpoint}, "
                                 "which is gone (train.keep_checkpoints may have pruned it)")
        return model_dir, checkpoint or None


def open_recording(directory: str | Path) -> Recording:
    """The recording in `directory`, indexed and every group decoded once; one-line `RecordingError`
    for a missing or empty directory, another format, or a corrupted record."""
    directory = Path(directory).expanduser()
    header = read_header(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise RecordingError(f"{directory}: {CONFIG_FILE} is missing")
    if not (directory / STREAM_FILE).is_file():
        raise RecordingError(f"{directory}: {STREAM_FILE} is missing (no step was recorded)")
    index = scan(directory / STREAM_FILE, int(header["start_version"]))
    if not index.steps:
        raise RecordingError(f"{directory}: no complete step was recorded")
    return Recording(directory, header, index)


class RecordedSource(OfflineSource):
    """Serves the recorded steps in order, each to the learner version that took it, so a replay's
    staleness (learner version minus a group's oldest token version) is the recording's. No
    generator feeds it, so it ignores their restarts; a checkpoint keeps nothing of it (a replay
    resumes no checkpoint, and one it starts from holds the recording run's queue, not this)."""

    def __init__(self, recording: Recording, steps: Sequence[RecordedStep]) -> None:
        self.name = str(recording.stream)
        self._file = recording.stream.open("rb")
        self._steps = deque(steps)
        self.consumed = 0

    @property
    def depth(self) -> int:
        return sum(len(step.offsets) for step in self._steps)

    def take(self, num_groups: int, learner_version: int, timeout_s: float) -> list[ScoredGroup]:
        if not self._steps:
            raise QueueTimeout("every recorded step has been taken")
        step = self._steps[0]
        if step.version != learner_version:
            raise RecordingError(f"{self.name}: the next recorded step was taken at version {step.version}, "
                                 f"the learner is at version {learner_version}")
        if num_groups != len(step.offsets):
            raise RecordingError(f"{self.name}: the step at version {step.version} took {len(step.offsets)} groups, "
                                 f"train.groups_per_step={num_groups}")
        self._steps.popleft()
        self.consumed += num_groups
        return [read_group(self._file, offset, self.name) for offset in step.offsets]

    def stats(self) -> dict[str, float]:
        return {"queue/depth": self.depth, "queue/consumed": self.consumed, "replay/steps_left": len(self._steps)}

    def close(self) -> None:
        self._file.close()


def _declared_architectures(model_dir: str) -> list[str]:
    """config.json's architectures ([] if it does not read: check_model_dir names why)."""
    try:
        architectures = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return []
    return [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
