"""Directories only this user can change, and small files a reader never sees half written.

A run directory, the warm-start cache, a study's or a recording's directory hold what a later run
loads (a checkpoint that `resume=auto` picks, a cached model): one that another local user created
first (the examples' paths under /tmp) or can write would let them plant it. `private_dir` refuses
such a directory in one line and creates missing ones with mode 0700."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from asyncgrpo.schema import ConfigError

PRIVATE_MODE = 0o700


class UnsafeDirectory(ConfigError):
    """A directory a run would read from or write to that another user could change. A ConfigError:
    the path is a setting (run_dir, model.cache_dir, ...), and the CLI prints it as one line, exit 2."""


def private_dir(path: str | os.PathLike[str]) -> Path:
    """`path` as a directory that only this user can change, created (and missing parents) with
    mode 0700 if it does not exist. An existing one is refused (UnsafeDirectory) when it is a
    symlink or not a directory, is not owned by this user, or is group- or other-writable (0755
    is fine). An existing ancestor is refused when another user (root aside) owns it, or anyone
    may write it without the sticky bit (/tmp has it): its owner could swap the directory."""
    path = Path(path).expanduser().absolute()
    _check_ancestors(path)
    try:
        # Parents too: a fresh tree under a shared directory is private from its first level.
        path.parent.mkdir(mode=PRIVATE_MODE, parents=True, exist_ok=True)
        path.mkdir(mode=PRIVATE_MODE)
    except FileExistsError:
        pass  # checked below, whoever created it (another of our processes may have, just now)
    except OSError as err:
        raise UnsafeDirectory(f"cannot create directory {path}: {err.strerror}") from None
    _check_own(path)
    return path


def _check_own(path: Path) -> None:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeDirectory(f"{path} is a symlink: refusing to use it as a run's directory "
                              "(give the real path, or a new directory)")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} exists and is not a directory")
    uid = os.geteuid()
    if info.st_uid != uid:
        raise UnsafeDirectory(f"{path} is owned by uid {info.st_uid}, not by this user (uid {uid}): another user "
                              "could have planted files in it; use a directory of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}): "
                              f"another user could plant files in it; chmod go-w {path} or use another directory")


def _check_ancestors(path: Path) -> None:
    uid = os.geteuid()
    for ancestor in reversed(path.parents):
        try:
            link = os.lstat(ancestor)
            info = os.stat(ancestor)  # a symlinked ancestor: its target's permissions too
        except FileNotFoundError:
            return  # created by us below here
        except OSError:
            continue  # not readable: the mkdir below says so if it matters
        for entry in (link, info):
            if entry.st_uid not in (uid, 0):
                raise UnsafeDirectory(f"{ancestor} (above {path}) is owned by uid {entry.st_uid}, neither this user "
                                      f"(uid {uid}) nor root: its owner could replace what is below it; "
                                      "use a directory of your own")
        if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
            raise UnsafeDirectory(f"{ancestor} (above {path}) is writable by anyone and not sticky: another user "
                                  "could replace what is below it; use a directory of your own")


def write_atomic(path: Path, text: str, durable: bool = False) -> None:
    """Write `text` to a temporary file beside `path` and rename it over `path`: a reader (a test
    polling run_dir, a study reading a run's summary, a resume) sees the old file or the new one,
    never a torn one. `durable` also fsyncs, for files a crash must not lose.

    The temporary file is a new name opened with O_EXCL | O_NOFOLLOW, mode 0600: a symlink planted
    at a guessable name cannot redirect the write, and two writers never share a temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------ directories named after their owner
# Shared-memory weight slots and the wire's Unix-socket directories are private directories that
# their creator removes when it stops; a process killed with SIGKILL (or its whole job) runs no
# clean-up. Each is named <prefix><pid>-<start time>-<random>, so a later run can tell its creator
# is gone and remove it (`remove_stale_owned_dirs`); a name that records no process is left alone.


def process_start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot, /proc/<pid>/stat field 22): with the
    pid it names one process, whatever reused the pid since. None: no such process; 0: alive but
    unknown (no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
        return int(fields[19])
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def process_alive(pid: int, start: int) -> bool:
    """Whether the process that had `pid` and `start` (process_start_time) still runs."""
    now = process_start_time(pid)
    return now is not None and (now == start or 0 in (now, start))


def owned_private_dir(prefix: str, parent: str | None = None) -> str:
    """A fresh mode-0700 directory (mkdtemp) named after this process: <prefix><pid>-<start>-<random>."""
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"{prefix}{pid}-{process_start_time(pid) or 0}-", dir=parent)


def creator_alive(name: str, prefix: str) -> bool | None:
    """Whether the process a name made by `owned_private_dir(prefix)` records is still running; None
    for a name that records no process."""
    match = re.match(rf"{re.escape(prefix)}(\d+)-(\d+)-", name)
    return None if match is None else process_alive(int(match.group(1)), int(match.group(2)))


def remove_stale_owned_dirs(directory: str, prefix: str) -> list[str]:
    """Remove the directories in `directory` named by `owned_private_dir(prefix)` whose creator is
    gone; the ones removed. Never another user's, a live process's, or a name that records no process."""
    removed = []
    uid = os.geteuid()
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return removed
    for name in names:
        if creator_alive(name, prefix) is not False:
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
