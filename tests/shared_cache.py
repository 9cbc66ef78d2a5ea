"""The warm-start cache that the end-to-end runs of one pytest session share."""

from __future__ import annotations

from pathlib import Path


def warm_cache(tmp_path: Path) -> Path:
    """A cache directory beside the tests' own temporary directories (pytest's per-session base):
    every end-to-end run would otherwise spend about 9 s warm-starting the same tiny model into a
    private cache, and these runs test the plumbing, not learning. Two runs starting at once are
    safe: ensure_warm_model renames a finished entry into place and the first one stays."""
    return tmp_path.parent / "shared-warm-cache"
