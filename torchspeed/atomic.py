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

__all__ = ["atomic_write", "build_directory", "write_json", "fsync_dir"]


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

    `build(tmp)` fills a temporary directory beside `final`, which is renamed into place only when
    complete, so an interrupted build never leaves a directory that looks whole. If another process
    finished the same directory first, its result is kept and this one's discarded.
    """
    final = os.fspath(final)
    if os.path.isdir(final):
        return final
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(final)}.partial-")
    try:
        build(tmp)
        os.rename(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (isinstance(e, OSError) and os.path.isdir(final)):  # lost a race: the winner's copy stands
            raise
    return final
