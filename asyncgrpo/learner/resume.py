"""What a checkpoint records about the run that wrote it, and whether a resume may continue it.

A resumed generator skips the prompts the checkpointed run's generator had used: its stream is
rebuilt from the task, the seed and the data, and position k must still mean the same prompt. So a
checkpoint records, under `run` in its meta.json, the settings that define each generator's stream
(`composition.run_record`, which reads them from their sections): rollout.num_generators, the task and
its parameters, the seed, and the SHA-256 of every training data file. A resume whose settings
differ is refused before Ray starts, in one line naming each difference, unless
`resume_allow_changes=true`. A checkpoint without the record (written
before checkpoints carried it) cannot be checked and is refused the same way: a silent mismatch would
train on other prompts than the run believes, which no later metric reveals.

A checkpoint written under the removed shares dispatch is refused whatever `resume_allow_changes`
says: its prompts' positions are each generator's, and tickets continue only from a dispatcher's
state, so resuming it would skip prompts. Its record says `rollout.dispatch: shares`; a record from
before it carried the dispatch is judged by its queue's state (a dispatcher's or none), and a
checkpoint without a record predates tickets.

Plain Python (no torch, unlike the rest of the learner), so the driver checks a resume before
anything heavy starts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

# resume=auto: the newest complete checkpoint in run_dir/checkpoints, else a fresh start.
RESUME_AUTO = "auto"
# The config key that lets a resume go on despite differences (schema.py documents it).
ALLOW_KEY = "resume_allow_changes"
# Files are hashed a buffer at a time: a Parquet file can be many GB.
_HASH_CHUNK_BYTES = 4 * 2**20


def _print(line: str) -> None:
    print(line, flush=True)


class ResumeRefused(ValueError):
    """The checkpoint was written by a run whose prompt streams this run cannot continue."""


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# The run-record key of the dispatch (a config key until tickets became the only dispatch).
DISPATCH_KEY = "rollout.dispatch"


def _short(sha256: str) -> str:
    return sha256[:12]


def _file_differences(saved: list[dict[str, str]], current: list[dict[str, str]]) -> list[str]:
    if len(saved) != len(current):
        return [f"data.train_files has {len(current)} file(s), the checkpoint's run had {len(saved)}"]
    found = []
    for i, (was, now) in enumerate(zip(saved, current)):
        if was.get("sha256") != now["sha256"]:
            found.append(f"data.train_files[{i}] {now['path']} has other contents than the checkpoint's run's "
                         f"{was.get('path')} (sha256 {_short(now['sha256'])}..., was {_short(str(was.get('sha256')))}...)")
    return found


def record_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each setting of `current` that differs from the checkpoint's `saved` record, as a phrase
    naming its config key, this run's value and the checkpoint run's."""
    found = []
    other_task = saved.get("task.name") != current.get("task.name")
    for key in sorted(set(saved) | set(current)):
        was, now = saved.get(key), current.get(key)
        if was == now:
            continue
        if other_task and (key.startswith("task.") or key.startswith("data.")) and key != "task.name":
            continue  # another task: its parameters and data differ as a matter of course
        if key == "data.train_files" and isinstance(was, list) and isinstance(now, list):
            found += _file_differences(was, now)
        elif key == "data.train_files":
            found.append("data.train_files: " + ("this run reads no data files" if now is None
                                                 else "the checkpoint's run read no data files"))
        else:
            found.append(f"{key}={now!r} (the checkpoint's run: {was!r})")
    return found


def written_under_shares(meta: dict[str, Any]) -> bool:
    """Whether the checkpoint was written under the removed shares dispatch: its record says so,
    or (a record from before it carried the dispatch, or none) its queue state has no dispatcher's."""
    saved = meta.get("run")
    if isinstance(saved, dict) and isinstance(saved.get(DISPATCH_KEY), str):
        return saved[DISPATCH_KEY] == "shares"
    queue = (meta.get("states") or {}).get("queue") or {}
    return not (isinstance(queue, dict) and "dispatch" in queue)


def check_compatible(meta: dict[str, Any], current: Callable[[], dict[str, Any]], allow: bool,
                     checkpoint: str | Path, log: Callable[[str], None] = _print) -> list[str]:
    """Raise ResumeRefused, in one line, unless the checkpoint's run record matches this run's
    (`current()`, `composition.run_record`: called only when there is a record to compare, since it hashes
    the data files) or `allow` (`resume_allow_changes`) is set: then the differences are logged; and
    unless it was written under the shares dispatch (no setting allows that). Returns the differences."""
    if written_under_shares(meta):
        raise ResumeRefused(f"{checkpoint} was written under the shares dispatch, which was removed: its prompt "
                            "positions are each generator's, and tickets is the only dispatch, which continues only "
                            "from its own state, so resuming it would skip prompts; start a new run")
    saved = meta.get("run")
    if isinstance(saved, dict):  # a record from before it carried the dispatch: tickets, as checked above
        saved = {**saved, DISPATCH_KEY: "tickets"}
    if not isinstance(saved, dict):
        why = (f"{checkpoint} records no run settings (written before checkpoints did), so its "
               "rollout.num_generators, task and data cannot be checked against this run's")
        if not allow:
            raise ResumeRefused(f"{why}; set {ALLOW_KEY}=true to resume it unchecked")
        log(f"[resume] warning: {why}; resuming unchecked ({ALLOW_KEY}=true)")
        return ["no run record"]
    now = current()
    # A task key the checkpoint's run did not record yet (tasks.TASK_PARAMETERS grew: multiply and
    # guess before 2026-12-07): nothing to compare it with, so it is named, not refused.
    unrecorded = [key for key in now if key.startswith("task.") and key not in saved
                  and saved.get("task.name") == now.get("task.name")]
    if unrecorded:
        log(f"[resume] warning: {checkpoint}'s run record predates {', '.join(unrecorded)}: not checked")
        saved = {**saved, **{key: now[key] for key in unrecorded}}
    differences = record_differences(saved, now)
    if differences and not allow:
        raise ResumeRefused(f"{checkpoint} was written by a run with other prompt streams: {'; '.join(differences)}. "
                            f"Its generators' prompt positions would not mean the same prompts here; set "
                            f"{ALLOW_KEY}=true to resume anyway")
    if differences:
        log(f"[resume] warning: resuming {checkpoint} despite changes ({ALLOW_KEY}=true): {'; '.join(differences)}")
    return differences
