"""Writing a small file so that a reader never sees it half written."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str, durable: bool = False) -> None:
    """Write `text` to a temporary file beside `path` and rename it over `path`: a reader (a test
    polling run_dir, a study reading a run's summary, a resume) sees the old file or the new one,
    never a torn one. `durable` also fsyncs, for files a crash must not lose."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as file:
        file.write(text)
        if durable:
            file.flush()
            os.fsync(file.fileno())
    os.replace(tmp, path)
