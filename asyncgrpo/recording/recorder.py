"""The writer of a recorded stream (`wire.record_dir`; the format is in `recording.stream`).

Learner rank 0 hands it each step's groups right after taking them, with its version at that
moment. Each step is written in one go and flushed, so a killed process loses nothing it had
recorded (the data is in the operating system's cache); every `wire.record_fsync_every_steps`
steps it is also fsync'd, which bounds what a crash of the machine itself can lose to that many
steps. A reader ignores a torn tail either way.

The recording opens at the first step, when the learner's starting version is known (after a
resume). A run that resumes from a checkpoint at version v into a directory that already holds a
recording of the same starting model continues it, if the recording reaches v: the steps recorded
from v on were taken by a learner whose progress the run has gone back on, so they are cut and the
stream stays the one the surviving run consumed. A fresh recording in a resumed run starts from
that checkpoint (recorded in recording.json, so a replay starts there too).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from asyncgrpo.runtime.files import private_dir, write_atomic
from asyncgrpo.recording.stream import (
    CONFIG_DEFAULTS,
    CONFIG_FILE,
    FORMAT_VERSION,
    HEADER_FILE,
    PREAMBLE,
    STREAM_FILE,
    RecordingError,
    pack_record,
    read_header,
    scan,
)
from asyncgrpo.schema import Config, to_yaml
from asyncgrpo.wire import SCHEMA_VERSION, ScoredGroup, encode_group


def recording_config(cfg: Config) -> str:
    """config.yaml of a recording: the resolved config, composable by `config.load` as a preset."""
    return CONFIG_DEFAULTS + to_yaml(cfg)


def _fsync_directory(directory: Path) -> None:
    """Make a file's creation (its directory entry) durable too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StreamRecorder:
    def __init__(self, directory: str | Path, config_yaml: str, model_dir: str, fsync_every_steps: int) -> None:
        if fsync_every_steps < 1:
            raise ValueError(f"fsync_every_steps must be >= 1, got {fsync_every_steps}")
        self.directory = Path(directory).expanduser()
        self.config_yaml, self.model_dir = config_yaml, str(Path(model_dir).expanduser().resolve())
        self.fsync_every_steps = fsync_every_steps
        # The checkpoint the learner resumed from (set by `Learner.load_checkpoint`): a fresh
        # recording then starts from it rather than from model_dir's weights.
        self.checkpoint: str | None = None
        self.steps = self.bytes = 0
        self._file: BinaryIO | None = None

    def record_step(self, version: int, groups: Sequence[ScoredGroup]) -> None:
        """Append the groups the learner took at `version`, in batch order, as one step."""
        if self._file is None:
            self._file = self._open(version)
        data = b"".join(pack_record(version, i, len(groups), encode_group(group)) for i, group in enumerate(groups))
        self._file.write(data)
        self._file.flush()
        self.steps += 1
        self.bytes += len(data)
        if self.steps % self.fsync_every_steps == 0:
            os.fsync(self._file.fileno())

    def _open(self, version: int) -> BinaryIO:
        private_dir(self.directory)  # a replay trusts what is in it
        stream = self.directory / STREAM_FILE
        cut = self._continue_at(version) if (self.directory / HEADER_FILE).exists() else None
        write_atomic(self.directory / CONFIG_FILE, self.config_yaml, durable=True)  # this run's: it records from here on
        if cut is None:
            header = {"format": FORMAT_VERSION, "wire_schema": SCHEMA_VERSION, "model_dir": self.model_dir,
                      "checkpoint": str(Path(self.checkpoint).resolve()) if self.checkpoint else None,
                      "start_version": version,
                      "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stream": STREAM_FILE,
                      "fsync_every_steps": self.fsync_every_steps}
            write_atomic(self.directory / HEADER_FILE, json.dumps(header, indent=2) + "\n", durable=True)
            cut = 0
        if cut < len(PREAMBLE):  # a new stream, or one whose preamble a crash cut short
            file = stream.open("wb")
            file.write(PREAMBLE)
        else:
            file = stream.open("r+b")
            file.truncate(cut)
            file.seek(cut)
        file.flush()
        os.fsync(file.fileno())
        _fsync_directory(self.directory)
        return file

    def _continue_at(self, version: int) -> int:
        """The byte offset to continue the existing recording from at `version`, or refuse."""
        header = read_header(self.directory)
        where = f"wire.record_dir={self.directory}"
        if str(Path(header["model_dir"]).resolve()) != self.model_dir:
            raise RecordingError(f"{where} holds a recording from the model {header['model_dir']}, this run starts "
                                 f"from {self.model_dir}: use another record_dir")
        start = header["start_version"]
        stream = self.directory / STREAM_FILE
        index = scan(stream, start, check_groups=False) if stream.exists() else None
        steps = index.steps if index is not None else []
        if not start <= version <= start + len(steps):
            raise RecordingError(f"{where} holds steps at versions {start}..{start + len(steps) - 1}; this learner "
                                 f"starts at version {version}, which would leave a gap: use another record_dir")
        if index is None:
            return 0
        return steps[version - start].offsets[0] if version < start + len(steps) else index.end

    def stats(self) -> dict[str, Any]:
        return {"record/steps": self.steps, "record/bytes": self.bytes}

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
