"""Which code a run ran: the package version and, when the package is imported from a git checkout,
its commit and whether tracked files had changes. Written into summary.json (`code`) so a figure
taken from a run directory can name its commit even when the runs of one study span several."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # asyncgrpo/, this module's package
GIT_TIMEOUT_S = 10.0  # a git that hangs (a locked index on a network disk) costs a run no more


def code_identity(version: str, package_dir: Path = PACKAGE_DIR) -> dict[str, Any]:
    """{"version", "commit", "dirty"} of the package at `package_dir` (`version`: its __version__).
    commit and dirty are None when it is not the top of a git checkout's `asyncgrpo/` (an installed
    wheel) or git is missing or fails; dirty counts tracked files only (run directories are untracked)."""
    identity: dict[str, Any] = {"version": version, "commit": None, "dirty": None}
    checkout = Path(package_dir).resolve().parent
    top = _git(checkout, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != checkout:
        return identity
    commit = _git(checkout, "rev-parse", "HEAD")
    changes = _git(checkout, "status", "--porcelain", "--untracked-files=no")
    identity["commit"] = commit
    identity["dirty"] = None if changes is None else bool(changes)
    return identity


def short_commit(identity: dict[str, Any] | None) -> str:
    """A results.csv cell: the commit's first 7 hex digits, `+dirty` when tracked files had changes,
    "" when unknown."""
    if not identity or not identity.get("commit"):
        return ""
    return str(identity["commit"])[:7] + ("+dirty" if identity.get("dirty") else "")


def _git(cwd: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
