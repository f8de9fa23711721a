"""Atomic file writes: temp file beside the target, fsync, rename. A crash never leaves a half-written
file under the final name."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["atomic_write", "build_directory", "write_json", "fsync_dir", "publish_files"]


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory entry (after a rename) so the rename itself survives a power cut."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp file beside `path`; on success fsync and rename it onto `path`, else delete it."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create directory {directory!r} for {path!r}: {e.strerror}") from None
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the result should get the usual permissions
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "item"):  # numpy / torch scalars
        return o.item()
    return str(o)


def _finite(o: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def write_json(path: str | os.PathLike, payload: Any) -> None:
    """Write `payload` as indented JSON, atomically (objects with `to_dict()` are expanded)."""
    text = json.dumps(_finite(json.loads(json.dumps(payload, default=_json_default))), indent=2)
    with atomic_write(path, "w") as f:
        f.write(text + "\n")


def build_directory(final: str | os.PathLike, build: Callable[[str], None]) -> str:
    """Return the directory `final`, building it first if it is missing.

    `build(tmp)` fills a temporary directory beside `final` (named with this process's id), whose files
    are fsynced before it is renamed into place, so an interrupted build (or a power cut) never leaves a
    directory that looks whole. Temporaries of the same `final` left by processes that died are removed
    first. If another process finished the same directory first, its result is kept and this one's
    discarded.
    """
    final = os.fspath(final)
    if os.path.isdir(final):
        return final
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    prefix = f".{os.path.basename(final)}.build-"
    _clean_stale_partials(parent, prefix)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f"{prefix}{os.getpid()}-")
    try:
        build(tmp)
        for dirpath, _, files in os.walk(tmp):
            for name in files:
                _fsync_file(os.path.join(dirpath, name))
            fsync_dir(dirpath)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would make a shared cache private
        os.rename(tmp, final)
        fsync_dir(parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (isinstance(e, OSError) and os.path.isdir(final)):  # lost a race: the winner's copy stands
            raise
    return final


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_PUBLISH_PREFIX = ".torchspeed-save.partial-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _clean_stale_partials(directory: str, prefix: str = _PUBLISH_PREFIX) -> None:
    """Remove temp dirs named `prefix` + PID + ... in `directory` left by a process that no longer runs."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_files(directory: str | os.PathLike, build: Callable[[str], None], last: str | None = None) -> str:
    """Write a set of files into `directory` so that a crash never leaves a mix that looks whole.

    `build(tmp)` writes the files into a temporary directory inside `directory` (any writer: a
    library's own `save`, a copy). Then each file is fsynced and renamed into `directory` (each rename
    atomic), `last` (e.g. the manifest that says the set is complete) after the others, and it is
    removed from `directory` before the others move in, so an interruption leaves either the old
    complete set, no `last` file (an incomplete set that says so), or the new complete set. Other
    files in `directory` are left alone. Temp dirs of processes that died are removed on the next call.
    """
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create directory {directory!r}: {e.strerror}") from None
    _clean_stale_partials(directory)
    tmp = tempfile.mkdtemp(dir=directory, prefix=f"{_PUBLISH_PREFIX}{os.getpid()}-")
    try:
        build(tmp)
        names = sorted(os.listdir(tmp))
        for name in names:
            src = os.path.join(tmp, name)
            if os.path.isdir(src):
                raise ValueError(f"publish_files moves files only; {name!r} is a directory")
            _fsync_file(src)
        if last is not None:
            if last not in names:
                raise ValueError(f"the files written hold no {last!r}")
            if os.path.lexists(os.path.join(directory, last)):
                os.unlink(os.path.join(directory, last))  # the old set stops claiming to be complete
                fsync_dir(directory)
            names.remove(last)
            names.append(last)
        for name in names:
            if name == last:
                fsync_dir(directory)  # the others are in place before `last` says the set is complete
            os.replace(os.path.join(tmp, name), os.path.join(directory, name))
        fsync_dir(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
