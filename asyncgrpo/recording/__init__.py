"""Recorded streams: every group a learner consumed, kept on disk (`wire.record_dir`), and trained
on again by `asyncgrpo replay DIR` with any algo settings and no generators.

    stream     the file format: records, a torn tail, corruption (no torch)
    recorder   the writer, on learner rank 0
    source     the reader: `open_recording`, `RecordedSource` (a `queue.sources.GroupSource`)

The replay command itself, which builds a learner on a `RecordedSource`, is asyncgrpo/driver/replay.py.
"""

from asyncgrpo.recording.recorder import StreamRecorder, recording_config
from asyncgrpo.recording.source import RecordedSource, Recording, open_recording
from asyncgrpo.recording.stream import FORMAT_VERSION, RecordingError, scan

__all__ = ["FORMAT_VERSION", "RecordedSource", "Recording", "RecordingError", "StreamRecorder", "open_recording",
           "recording_config", "scan"]
