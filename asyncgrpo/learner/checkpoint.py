"""Sharded, atomic learner checkpoints (torch.distributed.checkpoint) and finding the newest one.

Layout of `<run_dir>/checkpoints/step_<N>/` (N = the policy version after step N):

    dcp/          model and optimizer, sharded: each rank writes its own shards (DCP); any world
                  size can load them
    meta.json     version, world size, model directory, the run's settings a resume must match
                  (`run`: generators, task, data hashes; asyncgrpo/learner/resume.py), and the JSON state of
                  each stateful part (learner counters, LR schedule, queue counters and the
                  dispatcher's state: the next step, the next prompt, the prompts to give again)
    rng/rank_<r>.json   each rank's RNG states
    model_files/  the model's config and tokenizer files (what `asyncgrpo export` needs besides weights)
    MANIFEST.json every other file's relative path, size and SHA-256 (not itself, not COMPLETE)
    COMPLETE      written last

Everything is written into `step_<N>.tmp`; once every rank's files are written, rank 0 hashes them
into MANIFEST.json, and only after every file is on disk (fsync) does it write COMPLETE and rename
the directory to `step_<N>`. A run killed mid-save leaves a `.tmp` directory, which `latest` never
returns; a directory without COMPLETE is ignored too. All ranks must see one filesystem (one node,
or a shared filesystem across nodes).

DCP's `.metadata` is a pickle, and unpickling runs code, so every reader (`load`, and
`asyncgrpo export` through `verify`) checks the whole directory against MANIFEST.json before it
reads anything but JSON: a file whose size or hash differs, a listed file that is missing, an
unlisted file or a symlink anywhere in the directory, or no manifest at all, is a CheckpointError
naming that file. Each rank checks for itself (hashing runs at disk speed, seconds for a few GB).
The manifest is not a signature: it catches corruption, a partial copy and a swapped or added file,
but whoever can rewrite MANIFEST.json can make any directory pass, so load checkpoints only from
where you trust the writers. Checkpoints of format 2 and older (before manifests) cannot be
checked and are refused, like any other format this code does not write.

Lineages. A run directory can hold checkpoints of more than one line of training: a run resumed
from an older checkpoint trains steps N+1.. again on another path, and the abandoned newer
checkpoints stay. So the step number alone cannot say which checkpoint continues the run. The
driver records, before each run starts, the lineage it continues in `checkpoints/LINEAGE.json`
(`start_lineage`): `id`, and `from` (the checkpoint it started from: path, version, its lineage's
id; null for a fresh start). Learner rank 0 copies it into each checkpoint's meta.json as
`lineage`. resume=auto, resume=RUN_DIR and `asyncgrpo export RUN_DIR` take the highest step of the
current lineage, or, if it has saved none yet, the checkpoint it started from (`newest`); pruning
(train.keep_checkpoints) counts and removes only the current lineage's checkpoints, so neither the
checkpoint a branch started from nor an abandoned line is ever pruned (remove those by hand). A
resume continues the lineage when it takes what resume=auto would (the current lineage's newest),
and starts a new one, branching from its checkpoint, otherwise; a run without resume starts a new
one. Checkpoints saved before lineages (no `lineage` in meta.json) load as before and form one
legacy lineage: in a directory without LINEAGE.json everything is as it was (highest step, pruned
by step); once a run has started a lineage there they are never pruned and resume=auto takes them
only as that lineage's starting point.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from asyncgrpo.runtime import faults
from asyncgrpo.runtime.files import write_atomic

MARKER = "COMPLETE"
META = "meta.json"
MANIFEST = "MANIFEST.json"
# In the checkpoints directory: the lineage the run directory's current run continues.
LINEAGE = "LINEAGE.json"
# 3: MANIFEST.json, checked before loading. 2: the parts' states under meta["states"] (1 had fixed
# fields for the learner's counters).
FORMAT = 3
# Files are hashed a buffer at a time: a checkpoint's shards can be many GB.
_HASH_CHUNK_BYTES = 4 * 2**20

log = logging.getLogger(__name__)


class ShardedState(Protocol):
    """What torch.distributed.checkpoint saves and loads (each rank its own shards): the policy."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Files of a Hugging Face model directory that are weights (everything else is config or tokenizer).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt")


class CheckpointError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------ finding


def is_complete(path: Path) -> bool:
    return path.is_dir() and _STEP_DIR.match(path.name) is not None and (path / MARKER).is_file()


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete `step_<N>` directories under `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def latest(path: str | Path) -> Path:
    """The checkpoint to resume from: `path` itself if it is a complete checkpoint, else the newest
    of the current lineage in `path` or in `path`/checkpoints (a run directory; `newest`)."""
    path = Path(path).expanduser().resolve()
    if is_complete(path):
        return path
    if _STEP_DIR.match(path.name) or path.name.endswith(".tmp"):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker: its save did not finish)")
    for directory in (path, path / "checkpoints"):
        found = newest(directory)
        if found is not None:
            return found
    raise CheckpointError(f"no complete checkpoint (step_<N>/{MARKER}) in {path} or {path / 'checkpoints'}")


# meta.json's keys every reader of a checkpoint relies on, and their types.
META_KEYS: dict[str, type] = {"version": int, "world_size": int, "model_dir": str, "states": dict}


def read_meta(checkpoint: str | Path) -> dict[str, Any]:
    """`checkpoint`'s meta.json, checked: a JSON object of this code's format with META_KEYS.
    Raises CheckpointError in one line otherwise (a hand-edited or foreign meta.json: the manifest
    only says the files are the ones the checkpoint was written with)."""
    path = Path(checkpoint) / META
    meta = _read_json_object(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint}: checkpoint format {meta.get('format')!r}, this code reads {FORMAT}")
    for key, kind in META_KEYS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{path}: {key!r} is {'missing' if value is None else repr(value)}, "
                                  f"not of type {kind.__name__}: not a checkpoint this code wrote")
    return meta


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable ({' '.join(str(err).split())})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return value


def lineage_of(checkpoint: Path) -> str | None:
    """The id of the lineage `checkpoint` belongs to; None: saved before lineages (or unreadable,
    which its manifest check reports when it is loaded)."""
    try:
        lineage = read_meta(checkpoint).get("lineage")
    except CheckpointError:
        return None
    return lineage.get("id") if isinstance(lineage, dict) else None


def read_lineage(directory: Path) -> dict[str, Any] | None:
    """The checkpoints directory's current lineage (LINEAGE.json), None if it has none (a directory
    written before lineages, or only by direct `save` calls)."""
    path = Path(directory) / LINEAGE
    if not path.is_file():
        return None
    try:
        lineage = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable ({' '.join(str(err).split())}); remove it to take the "
                              "highest step of every checkpoint there, or name one with resume=PATH") from None
    source = lineage.get("from") if isinstance(lineage, dict) else None
    if (not isinstance(lineage, dict) or not isinstance(lineage.get("id"), str)
            or not (source is None or isinstance(source, dict) and isinstance(source.get("path"), str))):
        raise CheckpointError(f"{path} is not a lineage record (an id and the checkpoint it started from); remove "
                              "it to take the highest step of every checkpoint there, or name one with resume=PATH")
    return lineage


def start_lineage(directory: Path, source: Path | None, continues: bool) -> dict[str, Any]:
    """Record the lineage the run about to start continues, before it saves anything: the current
    one if `continues` (and there is one), else a new one starting from checkpoint `source` (None:
    a fresh start). Returns the record."""
    directory = Path(directory).expanduser().resolve()
    current = read_lineage(directory)
    if continues and current is not None:
        return current
    origin = None
    if source is not None:
        origin = {"path": str(source), "version": int(read_meta(source)["version"]), "lineage": lineage_of(source)}
    lineage = {"id": secrets.token_hex(8), "from": origin, "started": time.time()}
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / LINEAGE, json.dumps(lineage, indent=1) + "\n", durable=True)
    return lineage


def newest(directory: Path) -> Path | None:
    """The checkpoint resume=auto takes in `directory`: the highest step of the current lineage,
    else the checkpoint that lineage started from; None if there is none (a fresh start). Without
    LINEAGE.json: the highest step of all (checkpoints from before lineages)."""
    found = complete_checkpoints(Path(directory))
    current = read_lineage(Path(directory))
    if current is None:
        return found[-1] if found else None
    mine = [path for path in found if lineage_of(path) == current["id"]]
    if mine:
        return mine[-1]
    if current["from"] is None:
        return None
    source = Path(current["from"]["path"])
    if not is_complete(source):
        raise CheckpointError(f"the run of {directory} (lineage {current['id']}) saved no checkpoint and the one it "
                              f"started from, {source}, is gone; name one with resume=PATH, or start without resume")
    return source


# ----------------------------------------------------------------------------------- manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def _files(checkpoint: Path) -> dict[str, Path]:
    """Every file in `checkpoint` by its relative POSIX path, except MANIFEST and MARKER. A symlink
    or any other non-regular entry raises: nothing outside the directory may be read as part of it."""
    found: dict[str, Path] = {}
    for root, dirs, names in os.walk(checkpoint, followlinks=False):
        base = Path(root)
        for name in sorted(dirs + names):
            path = base / name
            relative = path.relative_to(checkpoint).as_posix()
            if not relative.isprintable():  # the name goes into a one-line error message
                relative = ascii(relative)
            if path.is_symlink():
                raise CheckpointError(f"{checkpoint}: {relative} is a symlink; a checkpoint holds only regular files")
            if name in dirs:
                continue
            if not path.is_file():
                raise CheckpointError(f"{checkpoint}: {relative} is not a regular file")
            if base == checkpoint and name in (MANIFEST, MARKER):
                continue
            found[relative] = path
    return found


def write_manifest(checkpoint: Path) -> Path:
    """Hash every file of `checkpoint` into its MANIFEST (called by `save` once all of them are written)."""
    start = time.monotonic()
    files = {relative: {"size": path.stat().st_size, "sha256": _sha256(path)}
             for relative, path in sorted(_files(checkpoint).items())}
    target = checkpoint / MANIFEST
    _write_json(target, {"algorithm": "sha256", "files": files})
    log.info("checkpoint manifest %s: %d files, %.2f GB hashed in %.1f s", target, len(files),
             sum(f["size"] for f in files.values()) / 1e9, time.monotonic() - start)
    return target


def _read_manifest(checkpoint: Path) -> dict[str, dict[str, Any]]:
    path = checkpoint / MANIFEST
    if not path.is_file():
        try:
            written = _read_json_object(checkpoint / META).get("format")
        except CheckpointError:
            written = None
        if isinstance(written, int) and written < FORMAT:
            raise CheckpointError(f"{checkpoint}: checkpoint format {written} has no {MANIFEST} (written before "
                                  f"checkpoints were hashed; this code reads format {FORMAT}), so it cannot be "
                                  "verified and is not loaded")
        raise CheckpointError(f"{checkpoint}: no {MANIFEST}: the checkpoint cannot be verified and is not loaded")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{checkpoint}: {MANIFEST} is unreadable ({err})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    well_formed = (isinstance(manifest, dict) and manifest.get("algorithm") == "sha256" and isinstance(files, dict)
                   and all(isinstance(entry, dict) and isinstance(entry.get("size"), int)
                           and isinstance(entry.get("sha256"), str) for entry in files.values()))
    if not well_formed:
        raise CheckpointError(f"{checkpoint}: {MANIFEST} is unreadable (not a sha256 manifest of sizes and hashes)")
    return files


def verify(checkpoint: Path) -> None:
    """Raise CheckpointError unless every file of `checkpoint` is exactly what its MANIFEST lists:
    call it before anything in the directory is unpickled. Paths come from walking the directory,
    never from the manifest, so a crafted manifest cannot point the check outside it."""
    start = time.monotonic()
    checkpoint = Path(checkpoint)
    listed = _read_manifest(checkpoint)
    present = _files(checkpoint)
    why = "the checkpoint changed after it was saved; it is not loaded"
    for relative in sorted(listed):
        if relative not in present:
            raise CheckpointError(f"{checkpoint}: {relative} is listed in {MANIFEST} but missing; {why}")
    for relative in sorted(present):
        if relative not in listed:
            raise CheckpointError(f"{checkpoint}: {relative} is not listed in {MANIFEST}; {why}")
    # Sizes first: a truncated or grown file is found without reading anything.
    for relative, path in sorted(present.items()):
        size = path.stat().st_size
        if size != listed[relative]["size"]:
            raise CheckpointError(f"{checkpoint}: {relative} has {size} bytes, {MANIFEST} lists "
                                  f"{listed[relative]['size']}; {why}")
    for relative, path in sorted(present.items()):
        if _sha256(path) != listed[relative]["sha256"].lower():
            raise CheckpointError(f"{checkpoint}: {relative} does not match its SHA-256 in {MANIFEST}; {why}")
    log.info("checkpoint %s verified: %d files, %.2f GB in %.1f s", checkpoint, len(present),
             sum(entry["size"] for entry in listed.values()) / 1e9, time.monotonic() - start)


# ------------------------------------------------------------------------------------- saving


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, value: Any) -> None:
    with path.open("w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _encode_tensor(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _decode_tensor(text: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.uint8).copy())


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON (no pickle)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "torch": _encode_tensor(torch.get_rng_state()),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_encode_tensor(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_decode_tensor(state["torch"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode_tensor(s) for s in state["cuda"]])


def copy_model_files(source: Path, target: Path) -> None:
    """Config, generation config and tokenizer files of a Hugging Face model directory (not weights)."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and not path.name.endswith(".index.json"):
            shutil.copy2(path, target / path.name)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()  # bounded by the process group's timeout


def save(directory: Path, version: int, sharded: ShardedState, states: dict[str, Any], *, model_dir: str,
         rank: int, world_size: int, keep: int, run: dict[str, Any] | None = None) -> Path:
    """Every rank calls it with the same arguments but its own shards. `states`: each part's JSON
    state (rank 0's are written). `keep`: complete checkpoints kept, 0 = all. `run`: the settings a
    resume must match (asyncgrpo/learner/resume.py; rank 0's is written, None = not recorded). Returns the path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = directory.expanduser().resolve()
    final = directory / f"step_{version}"
    tmp = directory / f"step_{version}.tmp"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that was killed
        (tmp / "rng").mkdir(parents=True)
    _barrier(world_size)
    if delay_s := faults.value("checkpoint_save_delay_s"):
        time.sleep(float(delay_s))
    state = sharded.state_dict()
    try:
        _write_json(tmp / "rng" / f"rank_{rank}.json", rng_state())
        if (full_from := faults.value("checkpoint_enospc")) is not None and version >= int(full_from):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "dcp"))
        dcp.save(state, checkpoint_id=str(tmp / "dcp"))
    except (Exception, CheckpointException) as err:
        full = disk_full_error(err, tmp, needed_bytes=state_bytes(state))
        if full is None:
            raise
        raise full from None
    _barrier(world_size)
    if rank == 0:
        copy_model_files(Path(model_dir), tmp / "model_files")
        lineage = read_lineage(directory)  # written by the driver before the run started
        _write_json(tmp / META, {"format": FORMAT, "version": version, "world_size": world_size,
                                 "model_dir": str(model_dir), "torch": torch.__version__, "time": time.time(),
                                 "run": run, "lineage": lineage, "states": states})
        # Every rank's files are written (the barrier above follows their dcp.save and RNG files).
        write_manifest(tmp)
        _fsync_tree(tmp)
        _before_marker(tmp)
        _write_json(tmp / MARKER, {"version": version, "time": time.time()})
        _fsync_dir(tmp)
        if final.exists():  # an older save of the same step (a resumed run that went back)
            stale = directory / f"step_{version}.old"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            shutil.rmtree(stale)
        os.replace(tmp, final)
        _fsync_dir(directory)
        _prune(directory, keep, lineage["id"] if lineage is not None else None)
    _barrier(world_size)  # no rank goes on (and perhaps loads) before the checkpoint is complete
    return final


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict, this rank's shards only: what a save writes."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state  # a DTensor's own shard
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(value) for value in state)
    return 0


def _errors_in(err: BaseException) -> list[BaseException]:
    """`err`, what caused it, and each rank's failure that a DCP CheckpointException carries."""
    found: list[BaseException] = []
    stack: list[Any] = [err]
    while stack:
        current = stack.pop()
        if not isinstance(current, BaseException) or any(current is seen for seen in found):
            continue
        found.append(current)
        stack += [current.__cause__, current.__context__]
        for failure in (getattr(current, "failures", None) or {}).values():  # DCP: rank -> (exception, trace)
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    return found


def disk_full_error(err: BaseException, directory: Path, needed_bytes: int) -> OSError | None:
    """A failed save's full disk as one OSError(ENOSPC) naming where, or None if it was not that.

    The error itself rarely says so: DCP wraps each rank's failure in a CheckpointException whose
    message is a traceback, and torch's zip writer reports a short write as "unexpected pos", the
    OSError lost. So an ENOSPC (or EDQUOT) anywhere in the chain decides, and otherwise the free
    space left: less than the save's tensors need means the save could not have fit."""
    errors = _errors_in(err)
    for found in errors:
        if isinstance(found, OSError) and found.errno in (errno.ENOSPC, errno.EDQUOT):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), found.filename or str(directory))
    try:
        stat = os.statvfs(directory if directory.exists() else directory.parent)
    except OSError:
        return None
    free = stat.f_bavail * stat.f_frsize
    if free >= needed_bytes:
        return None
    root = errors[-1] if len(errors) > 1 else err  # the innermost: DCP's wrapper says nothing itself
    said = " ".join(f"{type(root).__name__}: {root}".split())[:160]
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (the save failed with {said!r}; {free} bytes free, "
                                 f"its tensors need {needed_bytes})", str(directory))


def _before_marker(tmp: Path) -> None:
    """Hook between writing the data and marking it complete (tests kill the process here)."""


def _prune(directory: Path, keep: int, lineage: str | None) -> None:
    """Keep the newest `keep` checkpoints of `lineage` (None: those saved before lineages); another
    lineage's are not this run's to remove (the one it started from, an abandoned line)."""
    if keep <= 0:
        return
    for old in [path for path in complete_checkpoints(directory) if lineage_of(path) == lineage][:-keep]:
        # Unmark first: a prune killed half-way leaves an incomplete directory, never a broken "complete" one.
        (old / MARKER).unlink()
        shutil.rmtree(old)


# ------------------------------------------------------------------------------------ loading


def load(path: Path, sharded: ShardedState, rank: int) -> dict[str, Any]:
    """Every rank calls it with the same path: loads `sharded` and this rank's RNG states; returns
    the checkpoint's meta (with `path`), whose `states` the caller hands to each part."""
    import torch.distributed.checkpoint as dcp

    checkpoint = latest(path)
    verify(checkpoint)  # before DCP unpickles .metadata
    meta = read_meta(checkpoint)
    # Templates with this run's sharding; DCP reshards whatever world size wrote the checkpoint.
    state = sharded.state_dict()
    dcp.load(state, checkpoint_id=str(checkpoint / "dcp"))
    sharded.load_state_dict(state)
    rng_file = checkpoint / "rng" / f"rank_{rank}.json"
    if not rng_file.exists():  # written by fewer ranks than this run has
        rng_file = checkpoint / "rng" / "rank_0.json"
    set_rng_state(json.loads(rng_file.read_text()))
    meta["path"] = str(checkpoint)
    return meta
