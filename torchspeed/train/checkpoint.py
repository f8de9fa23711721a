"""Checkpoint files: atomic, pickle-free, verified, and owned by one run.

A checkpoint is `torch.save` of tensors and plain types only, read back with `weights_only=True`
(`safeload`: no code runs from a checkpoint file). It is written to a temp file, fsynced and renamed
(`atomic`), so a crash mid-write leaves at most a hidden `.step-*.tmp` file, removed when the next run
takes the directory; a full disk is one OSError naming the file (not torch's "unexpected pos"), the
checkpoints before it whole.

**Verified.** Its bytes are hashed (sha256) while they are written, and the hash, size, step and run id
go into a record beside it, `step-NNNNNNNN.pt.json`. A checkpoint without its record, or of another
size, is incomplete and never listed (a record is read as data: bounded, checked, its file names inside
the checkpoint and its own file among them); `load_file` hashes it again and refuses one whose bytes
changed, naming it (`CheckpointError`).

**Owned by a run.** The run id is in every checkpoint, its record and the directory's `run.json`.
`claim()` gives a directory to a run: a new run refuses one holding another run's checkpoints (unless
`overwrite=True`, which deletes only torchspeed's own files), a resumed run continues its own. Listing,
"last" and pruning see only the directory's run, so a run never deletes, resumes or replaces another's
(`foreign`, `resumable`). A training run holds a flock on `DIR/.lock` (dropped by the kernel when the
process dies), so two live processes never write into one directory and any temp file found then is stale.

Under FSDP the model and optimizer go through `torch.distributed.checkpoint` (DCP) into a directory
`step-NNNNNNNN/` (a hidden temp directory renamed by rank 0 once every rank finished), whose record,
`checksums.json`, hashes every file of it. DCP's own `.metadata` is pickled by torch: load such
checkpoints only from sources you trust; the rest of the state (`state.pt`) is pickle-free.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import time
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from torchspeed.atomic import atomic_write, fsync_dir, write_json
from torchspeed.remembered import check, read_json
from torchspeed.safeload import load_torch_file

try:
    import fcntl
except ImportError:  # no flock on this platform: no lock, no cleaning of others' temp files
    fcntl = None  # type: ignore[assignment]

__all__ = ["checkpoint_name", "list_checkpoints", "candidates", "last_checkpoint", "save_file", "load_file", "verify",
           "load_newest", "claim", "holds_run", "read_run", "new_run_id", "prune", "foreign", "resumable",
           "CheckpointError", "FORMAT", "RUN_FILE", "write_torch_file"]

log = logging.getLogger(__name__)

FORMAT = "torchspeed-checkpoint-v1"
RECORD_FORMAT = "torchspeed-checkpoint-record-v1"
RUN_FORMAT = "torchspeed-run-v1"
RUN_FILE = "run.json"
_FILE_ENTRY = {"bytes": range(0, 1 << 62), "sha256": re.compile(r"[0-9a-f]{64}")}
_RECORD = {"format": frozenset({RECORD_FORMAT}), "run_id": (str, None), "step": (int, None),
           "files": {str: _FILE_ENTRY}, "previous?": {str: _FILE_ENTRY}}
_PLAIN_NAME = re.compile(r"(?!\.\.?(?:/|$))[^/\x00]+(?:/(?!\.\.?(?:/|$))[^/\x00]+)*")  # no '..', never absolute
LOCK_FILE = ".lock"
SHARDED_RECORD = "checksums.json"  # inside a sharded checkpoint directory
_NAME = re.compile(r"^step-(\d{8,})(\.pt)?$")
_OURS = re.compile(r"^step-\d{8,}(\.pt)?(\.json)?$")  # checkpoints and their records
_TEMP = re.compile(r"^\.(step-\d{8,}|run\.json).*\.tmp$")  # atomic_write's and save_sharded's temp names
_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, damaged or changed since it was written (it fails its check)."""


def checkpoint_name(step: int, sharded: bool = False) -> str:
    return f"step-{step:08d}" + ("" if sharded else ".pt")


def new_run_id() -> str:
    return secrets.token_hex(8)


def record_path(path: str | os.PathLike) -> str:
    """Where a checkpoint's record (hashes, size, step, run id) lives."""
    path = os.fspath(path)
    return os.path.join(path, SHARDED_RECORD) if os.path.isdir(path) else path + ".json"


# ---------------------------------------------------------------- hashing
class _HashingWriter:
    """A write-only file object that hashes what passes through it (torch.save only writes and flushes),
    keeping the OSError of a write that failed (torch reports it as "unexpected pos")."""

    def __init__(self, f: IO[bytes]):
        self.f, self.h, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, b: Any) -> int:
        self.h.update(b)
        try:
            n = self.f.write(b)
        except OSError as e:
            self.error = e
            raise
        self.size += memoryview(b).nbytes
        return n

    def flush(self) -> None:
        self.f.flush()

    def entry(self) -> dict[str, Any]:
        return {"bytes": self.size, "sha256": self.h.hexdigest()}


def _torch_save(obj: Any, w: _HashingWriter) -> None:
    """torch.save `obj` through `w`; a write that failed (a full disk) raises its own OSError, not torch's
    RuntimeError "[enforce fail at inline_container.cc] unexpected pos"."""
    try:
        torch.save(obj, w)
    except RuntimeError:
        if w.error is None:
            raise
        raise w.error from None


def _unwritten(path: str, e: OSError) -> OSError:
    """One line for a file that could not be written (a full disk): it, what the system said, and that
    what was written before stays."""
    return OSError(e.errno, f"{path!r} could not be written ({e.strerror or e}); the checkpoints written before "
                            "it are kept: free disk space, then continue with --resume (resume='last')")


def write_torch_file(path: str | os.PathLike, obj: Any) -> dict[str, Any]:
    """torch.save `obj` into `path` atomically (temp file, fsync, rename), hashed as it is written: its
    {"bytes", "sha256"}. A write that fails (a full disk) is one OSError naming `path`; the file that
    was there stays."""
    path = os.fspath(path)
    try:
        with atomic_write(path, "wb") as f:
            w = _HashingWriter(f)
            _torch_save(obj, w)
    except OSError as e:
        raise _unwritten(path, e) from None
    return w.entry()


def _hash_file(path: str) -> dict[str, Any]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def _read_record(path: str) -> dict[str, Any] | None:
    """The record of checkpoint `path`, or None when it is missing, unreadable or not one torchspeed
    writes (read as data: bounded, its fields checked, file names plain and inside the checkpoint, the
    checkpoint's own file among them, so that nothing is taken as verified without being hashed)."""
    try:
        rec = read_json(record_path(path))
        check(rec, _RECORD, where="the record")
    except (OSError, ValueError):
        return None
    own = "state.pt" if os.path.isdir(path) else os.path.basename(path)
    names = [*rec["files"], *rec.get("previous", {})]
    if own not in rec["files"] or not all(_PLAIN_NAME.fullmatch(n) for n in names):
        return None
    return rec


def _files_of(path: str) -> tuple[str, str]:
    """(base directory the record's file names are relative to, record file)."""
    return (path if os.path.isdir(path) else os.path.dirname(path)), record_path(path)


def _record(run_id: str | None, step: int | None, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A checkpoint's record: its files' sizes and hashes (`_HashingWriter.entry`), its step and run."""
    return {"format": RECORD_FORMAT, "run_id": run_id, "step": step,
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}


def _accepted(rec: dict[str, Any], name: str) -> list[Any]:
    """The entries file `name` of a record may match: its own and, while `save_file` rewrites a
    checkpoint under the same name, the previous bytes' (either verifies until the rename)."""
    return [rec["files"][name]] + ([rec["previous"][name]] if name in rec.get("previous", {}) else [])


def _sizes_match(path: str, rec: dict[str, Any]) -> bool:
    base, _ = _files_of(path)
    for name in rec["files"]:
        try:
            size = os.path.getsize(os.path.join(base, name))
        except OSError:
            return False
        if not any(isinstance(e, dict) and e.get("bytes") == size for e in _accepted(rec, name)):
            return False
    return True


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Hash every file of checkpoint `path` and compare with its record; returns the record. CheckpointError
    (naming the file) when the record or a file is missing, or a file's size or bytes changed."""
    path = os.fspath(path)
    base, rec_file = _files_of(path)
    rec = _read_record(path)
    if rec is None:
        raise CheckpointError(
            f"checkpoint {path!r} cannot be verified: its record {rec_file!r} is missing or unreadable (a write "
            "that was interrupted, or the file was copied without it); it may be corrupt, truncated or not a "
            "torchspeed checkpoint: resume from another one")
    for name in rec["files"]:
        file = os.path.join(base, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {path!r} is incomplete: {file!r} is missing; resume from another one")
        got = _hash_file(file)
        ok = _accepted(rec, name)
        if got not in ok:
            what = ("is truncated or was extended" if all(got["bytes"] != e.get("bytes") for e in ok)
                    else "is corrupt: its sha256 differs from the one recorded when it was written")
            raise CheckpointError(f"checkpoint file {file!r} {what} ({rec_file!r}); resume from another one")
    return rec


# ---------------------------------------------------------------- listing
def read_run(directory: str | os.PathLike) -> str | None:
    """The run id in `directory`'s run file, or None when there is none."""
    path = os.path.join(os.fspath(directory), RUN_FILE)
    try:
        run = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"the run file {path!r} cannot be read ({e}); delete it, or start a new run in that "
                         "directory with overwrite") from None
    try:
        check(run, {"format": frozenset({RUN_FORMAT}), "run_id": re.compile(r"[^\x00-\x1f\x7f]{1,200}")})
    except ValueError:
        raise ValueError(f"{path!r} is not a torchspeed run file; delete it, or start a new run in that directory "
                         "with overwrite") from None
    return run["run_id"]


def list_checkpoints(directory: str | os.PathLike, run_id: str | None = None) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint (its record there, every file of the recorded size; the
    bytes are hashed when it is loaded) of run `run_id` in `directory`, oldest first; `run_id` None: the
    directory's run (its `run.json`; every run when it has none)."""
    return [(step, path) for step, path in candidates(directory, run_id)
            if (rec := _read_record(path)) is not None and _sizes_match(path, rec)]


def candidates(directory: str | os.PathLike, run_id: str | None = None) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint of one run in `directory` that has a record, oldest first,
    whether or not its files are whole (what resume tries, verifying each; see list_checkpoints)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    if run_id is None:
        run_id = read_run(directory)
    return [(step, path) for step, path, rec in _named(directory)
            if rec is not None and (run_id is None or rec.get("run_id") == run_id)]


def _named(directory: str) -> list[tuple[int, str, dict[str, Any] | None]]:
    """(step, path, record or None) of every file or directory in `directory` named as a checkpoint, oldest first."""
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in os.listdir(directory) if (m := _NAME.match(n))]
    return [(step, path, _read_record(path)) for step, path in sorted(found)]


def last_checkpoint(directory: str | os.PathLike, run_id: str | None = None) -> str | None:
    """The newest complete checkpoint of the directory's run (or of `run_id`), or None. Partial writes
    are never returned; a file damaged after it was written is found out when it is loaded."""
    found = list_checkpoints(directory, run_id)
    return found[-1][1] if found else None


def foreign(directory: str | os.PathLike, run_id: str | None) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints in `directory` that are not run `run_id`'s, oldest first: another
    run's (its record names another run), or no known run's (no readable record; every one when
    `run_id` is None). They are never resumed, and a save never replaces one."""
    try:
        named = _named(os.fspath(directory))
    except OSError:
        return []
    return [(step, path) for step, path, rec in named if run_id is None or rec is None or rec.get("run_id") != run_id]


def _whose(path: str) -> str:
    """Whose checkpoint `path` is, as its record says: "run ID", "no run id" or "no record"."""
    rec = _read_record(path)
    if rec is None:
        return "no record"
    return f"run {rec['run_id']}" if rec.get("run_id") else "no run id"


def resumable(directory: str | os.PathLike, asked: str, instead: str) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints of `directory`'s own run (its run.json) that resume may try. With
    nothing of the run to continue, never a new run silently: FileNotFoundError saying what `asked` (e.g.
    "--resume") found, naming any other run's checkpoints there (never resumed or overwritten), and `instead`."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{asked}: {directory!r} does not exist, so there is no checkpoint to continue "
                                f"from; {instead}")
    run = read_run(directory)
    found = candidates(directory, run) if run is not None else []
    if found:
        return found
    others = foreign(directory, run)
    what = f"no checkpoint of its run {run}" if run else "no checkpoint of a run of its own"
    msg = f"{asked}: {directory!r} holds {what}, so there is nothing to continue"
    if others:
        names = ", ".join(f"{os.path.basename(p)} ({_whose(p)})" for _, p in others[:3])
        msg += (f"; {names}{' ...' if len(others) > 3 else ''}: not of {f'run {run}' if run else 'a run of its own'}, "
                "so never resumed or overwritten here (to continue a run elsewhere, copy its whole checkpoint "
                "directory, run.json with it)")
    raise FileNotFoundError(f"{msg}; {instead}")


def holds_run(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds checkpoints of a torchspeed run (checkpoint files or their records). A
    run file alone, left by a run that ended before its first checkpoint, holds nothing to lose."""
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(_OURS.match(n) for n in names)


# ---------------------------------------------------------------- writing
def save_file(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """torch.save `state` atomically (temp file beside `path`, fsync, rename), hashed as it is written,
    with its record beside it (`path` + ".json"). Rewriting the same name (a step saved again at the
    epoch's end) keeps the old bytes valid in the record until the rename: a crash leaves a pair that verifies."""
    path = os.fspath(path)
    name = os.path.basename(path)
    _refuse_foreign(path, state.get("run_id"))
    old = _read_record(path) if os.path.isfile(path) else None
    try:
        with atomic_write(path, "wb") as f:
            w = _HashingWriter(f)
            _torch_save(state, w)
            record = _record(state.get("run_id"), state.get("global_step"), {name: w.entry()})
            both = old is not None and old["files"].get(name) not in (None, record["files"][name])
            # before the rename: old bytes and new both verify; with no file under the name yet, the record
            # alone lists nothing
            write_json(path + ".json", {**record, "previous": {name: old["files"][name]}} if both else record)
        if both:
            write_json(path + ".json", record)  # after the rename: only the new bytes
    except OSError as e:  # a full disk: one line naming the checkpoint (the ones before it are intact)
        raise _unwritten(path, e) from None


def _refuse_foreign(path: str, run_id: str | None) -> None:
    """A checkpoint under `path` that is not run `run_id`'s is never replaced by that run's save."""
    if not os.path.lexists(path):
        return
    rec = _read_record(path)
    if rec is None or rec.get("run_id") != run_id:
        raise CheckpointError(f"checkpoint {path!r} is not this run's ({_whose(path)}; this is run {run_id}), so it "
                              "is never overwritten: move it out of that directory, or write this run's checkpoints "
                              "elsewhere")


def _load_state(path: str) -> dict[str, Any]:
    state = load_torch_file(path, what="checkpoint")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a torchspeed checkpoint (no format tag {FORMAT!r})")
    return state


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    """Verify a checkpoint against its record (CheckpointError naming the file if it fails), then load it
    through safeload (weights_only=True: tensors and plain types only; pickled objects refused)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    verify(path)
    return _load_state(os.path.join(path, "state.pt") if os.path.isdir(path) else path)


def load_newest(found: list[tuple[int, str]], directory: str) -> tuple[str, dict[str, Any]]:
    """(path, state) of the newest of `found` ((step, path), oldest first) that passes its check: one
    that fails (damaged, torn) is skipped with a warning naming it and the one before is loaded;
    CheckpointError listing them when none of `directory`'s passes."""
    failed = []
    for _, path in reversed(found):
        try:
            state = load_file(path)
        except CheckpointError as e:
            failed.append(str(e))
            log.warning("%s; resuming from the checkpoint before it instead", e)
            continue
        if failed:
            log.warning("resuming from %s (%d newer checkpoint(s) failed their check)", path, len(failed))
        return path, state
    raise CheckpointError(f"no checkpoint in {directory!r} passes its check, so there is nothing to resume "
                          f"from: {'; '.join(failed)}")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def prune(directory: str, keep_last: int, run_id: str | None = None) -> None:
    """Delete all but the newest `keep_last` complete checkpoints of one run (the directory's run when
    `run_id` is None), and that run's older leftovers of interrupted writes; other runs' checkpoints
    are never touched. A kill mid-way leaves nothing that is listed or that the next prune misses."""
    complete = list_checkpoints(directory, run_id)
    if keep_last < 1 or len(complete) <= keep_last:
        return
    keep = {p for _, p in complete[-keep_last:]}
    newest = complete[-1][0]
    for step, path in candidates(directory, run_id):
        if path in keep or step >= newest:
            continue
        if os.path.isdir(path):  # renamed out of the way first: a kill mid-rmtree leaves a temp dir
            tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp")
            _remove(tmp)
            os.replace(path, tmp)
            _remove(tmp)
        else:
            _remove(path)  # then its record: a record without its file is not listed, and goes next time
            _remove(path + ".json")
    fsync_dir(directory)


def save_sharded(directory: str, step: int, model: torch.nn.Module, optimizer: Any, state: dict[str, Any],
                 is_main: bool) -> str:
    """FSDP: every rank writes its shards with DCP into a temp dir; rank 0 adds state.pt and the record
    (hashes of every file) and renames."""
    final = os.path.join(directory, checkpoint_name(step, sharded=True))
    tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp")
    if is_main:
        _refuse_foreign(final, state.get("run_id"))
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
    except Exception as e:  # noqa: BLE001 - DCP wraps each rank's failure in its own exception
        if "No space left on device" not in str(e):
            raise
        raise _unwritten(final, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))) from None
    dist.barrier()
    if is_main:
        files = {}
        files["state.pt"] = write_torch_file(os.path.join(tmp, "state.pt"), state)
        for root, _, names in os.walk(tmp):
            for n in names:
                rel = os.path.relpath(os.path.join(root, n), tmp)
                if rel not in files:
                    files[rel] = _hash_file(os.path.join(root, n))
        write_json(os.path.join(tmp, SHARDED_RECORD), _record(state.get("run_id"), step, files))
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(directory)
    dist.barrier()
    return final


def load_sharded(path: str, model: torch.nn.Module, optimizer: Any) -> None:
    """FSDP: load this rank's shards of model and optimizer from a DCP checkpoint directory."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"{path!r} is not a sharded (FSDP) checkpoint directory; it has no DCP .metadata")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# ---------------------------------------------------------------- a run's directory
class RunLock:
    """An exclusive flock on `DIR/.lock` for as long as a run trains there (the kernel drops it when the
    process dies, however it dies)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self.fd: int | None = None
        if fcntl is None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):  # no flock on this file system
                os.close(fd)
                return
            try:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise ValueError(f"checkpoint directory {directory!r} is in use by another training process (pid "
                             f"{holder}); wait for it to end, or write this run's checkpoints elsewhere") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the message above
        self.fd = fd

    @property
    def exclusive(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def clean_stale(directory: str) -> list[str]:
    """Remove the hidden temp files and directories of interrupted checkpoint writes in `directory`; returns
    their names. Only while holding its RunLock: then every temp file is a dead process's or this one's."""
    removed = []
    for name in os.listdir(directory):
        if _TEMP.match(name):
            _remove(os.path.join(directory, name))
            removed.append(name)
    if removed:
        log.info("removed %d temp file(s) of interrupted checkpoint writes from %s", len(removed), directory)
        fsync_dir(directory)
    return removed


def claim(directory: str | os.PathLike, run_id: str, overwrite: bool = False, resuming: bool = False) -> RunLock:
    """Give `directory` to run `run_id` while it trains; returns the lock (release() it at the end). Locked,
    stale temp files removed, then: one whose run file names `run_id` is continued; one with no checkpoints
    (empty, or only a run file) becomes this run's; one holding another run's checkpoints is a ValueError
    naming it, unless `overwrite` (its `step-*` files, their records and `run.json` deleted, nothing else)."""
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create checkpoint directory {directory!r}: {e.strerror}") from None
    lock = RunLock(directory)
    try:
        if lock.exclusive:
            clean_stale(directory)
        try:
            current = read_run(directory)
        except ValueError:
            if not overwrite:
                raise
            current = None
        if current != run_id and holds_run(directory):
            if not overwrite:
                whose = f"run {current}" if current else "an earlier run (or an older torchspeed)"
                raise ValueError(
                    f"checkpoint directory {directory!r} already holds checkpoints of {whose}"
                    + (", not of the checkpoint being resumed" if resuming else "")
                    + ": continue that run with resume='last' (`torchspeed train --resume`), or start a new run "
                    "there with Checkpoint(..., overwrite=True) (`--overwrite`), which deletes them; or use "
                    "another directory")
            for name in os.listdir(directory):
                if name == RUN_FILE or _OURS.match(name):
                    _remove(os.path.join(directory, name))
            fsync_dir(directory)
            log.warning("overwrite: deleted the checkpoints of %s in %s", f"run {current}" if current else
                        "an earlier run", directory)
        if current != run_id:
            job = os.environ.get("TORCHELASTIC_RUN_ID")  # torchrun's job, for whoever reads the directory
            write_json(os.path.join(directory, RUN_FILE),
                       {"format": RUN_FORMAT, "run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        **({"torchrun_job": job} if job else {})})
    except BaseException:
        lock.release()
        raise
    return lock
