"""Atomic file writes: temp file beside the target, fsync, rename. A crash never leaves a half-written
file under the final name."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["atomic_write", "build_directory", "write_json", "fsync_dir", "publish_files", "published_set",
           "recover_published", "scratch_dir"]


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
_PREVIOUS_PREFIX = ".torchspeed-save.previous-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _left_by_dead_process(name: str, prefix: str) -> bool:
    """`name` is prefix + PID + ... and that process no longer runs (never this one)."""
    if not name.startswith(prefix):
        return False
    pid = name[len(prefix):].split("-", 1)[0]
    return pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))


def _clean_stale_partials(directory: str, prefix: str = _PUBLISH_PREFIX) -> None:
    """Remove temp dirs named `prefix` + PID + ... in `directory` left by a process that no longer runs."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if _left_by_dead_process(name, prefix):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def scratch_dir(parent: str | os.PathLike, prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary directory in `parent` named `prefix` + this process's id, removed when dropped.

    The system's temp dir keeps what a killed process left there for ever; here the next call removes
    the scratch dirs of `prefix` whose process is gone (a live one's are left alone)."""
    parent = os.fspath(parent)
    os.makedirs(parent, exist_ok=True)
    _clean_stale_partials(parent, prefix)
    return tempfile.TemporaryDirectory(dir=parent, prefix=f"{prefix}{os.getpid()}-")


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_or_copy(src: str, dst: str) -> None:
    """A second name for `src` (a hard link: no data copied), or a fsynced copy where links are not allowed."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
        _fsync_file(dst)


def published_set(directory: str | os.PathLike, last: str) -> str:
    """The folder holding the whole set `publish_files` wrote into `directory`: `directory` itself when its
    `last` file is there; while a publish is under way, or after one was killed, the backup of the
    previous set (a folder inside `directory` that loads as it is)."""
    directory = os.fspath(directory)
    if os.path.lexists(os.path.join(directory, last)):
        return directory
    try:
        names = os.listdir(directory)
    except OSError:
        return directory
    backups = [os.path.join(directory, n) for n in names
               if n.startswith(_PREVIOUS_PREFIX) and os.path.isfile(os.path.join(directory, n, last))]
    return max(backups, key=os.path.getmtime, default=directory)


def publish_files(directory: str | os.PathLike, build: Callable[[str], None], last: str | None = None,
                  replaces: Iterable[str] = ()) -> str:
    """Write a set of files into `directory` so that, at every instant, the old set or the new one is whole.

    `build(tmp)` writes the files into a temporary directory inside `directory` (any writer: a
    library's own `save`, a copy); each is fsynced. `last` (e.g. the manifest that says the set is
    complete) is the commit point: before it leaves `directory`, every file of the set there
    (`replaces`, plus any name the new set reuses) is hard-linked into a backup folder beside it, so
    the previous set stays whole there (`published_set` finds it) until the new files, `last` after
    the others, have been renamed in; then the backup and the files of `replaces` the new set lacks
    are removed. An exception puts the previous set back; a kill leaves the backup, which still loads
    and which the next call (or `recover_published`) removes or puts back. Other files in
    `directory` are left alone. Temporaries of processes that died are removed.
    """
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"cannot create directory {directory!r}: {e.strerror}") from None
    _clean_stale_partials(directory)
    if last is not None and os.path.lexists(os.path.join(directory, last)):
        _clean_stale_partials(directory, _PREVIOUS_PREFIX)  # the set there is whole: old backups are no longer needed
    tmp = tempfile.mkdtemp(dir=directory, prefix=f"{_PUBLISH_PREFIX}{os.getpid()}-")
    try:
        build(tmp)
        names = _ready_files(tmp, last)
        if last is None:
            for name in names:
                os.replace(os.path.join(tmp, name), os.path.join(directory, name))
            fsync_dir(directory)
        else:
            _swap_sets(directory, tmp, names, last, [n for n in replaces if n != last])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _ready_files(tmp: str, last: str | None) -> list[str]:
    """The names `build` wrote into `tmp`, fsynced, `last` at the end; ValueError for a directory or a missing `last`."""
    names = sorted(os.listdir(tmp))
    for name in names:
        src = os.path.join(tmp, name)
        if os.path.isdir(src):
            raise ValueError(f"publish_files moves files only; {name!r} is a directory")
        _fsync_file(src)
    if last is not None:
        if last not in names:
            raise ValueError(f"the files written hold no {last!r}")
        names.remove(last)
        names.append(last)
    return names


def _swap_sets(directory: str, tmp: str, names: list[str], last: str, replaces: list[str]) -> None:
    """`publish_files`' commit: back up the old set, move the new one in (`last` last), drop the backup."""
    def here(name: str) -> str:
        return os.path.join(directory, name)

    old = [n for n in dict.fromkeys([*replaces, *names]) if n != last and os.path.isfile(here(n))]
    backup = None
    if os.path.isfile(here(last)):
        backup = tempfile.mkdtemp(dir=directory, prefix=f"{_PREVIOUS_PREFIX}{os.getpid()}-")
        for name in [*old, last]:  # `last` linked last: a backup that holds it is whole
            _link_or_copy(here(name), os.path.join(backup, name))
        fsync_dir(backup)
        os.unlink(here(last))  # from here until the new `last` is in, the previous set loads from the backup
        fsync_dir(directory)
    try:
        for name in replaces:
            if name not in names and os.path.isfile(here(name)):
                os.unlink(here(name))  # a file of the previous set that the new one does not have
        for name in names:
            if name == last:
                fsync_dir(directory)  # the others are in place before `last` says the set is complete
            os.replace(os.path.join(tmp, name), here(name))
        fsync_dir(directory)
    except BaseException:
        if backup is not None:
            _restore(backup, directory, tmp, last, added=[n for n in names if n not in old and n != last])
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    _clean_stale_partials(directory, _PREVIOUS_PREFIX)


def _restore(backup: str, directory: str, tmp: str, last: str, added: Iterable[str] = ()) -> None:
    """Put the set in `backup` back into `directory` (`last` last) and remove the files `added` there.

    Each file is linked to a staging name in `tmp` and renamed over the one in `directory`, so the
    backup keeps every file until the end: an interruption here still leaves it whole. Best effort:
    a failure leaves the backup, which `published_set` still finds."""
    try:
        for name in added:
            if os.path.isfile(os.path.join(directory, name)):
                os.unlink(os.path.join(directory, name))
        names = sorted(n for n in os.listdir(backup) if n != last) + [last]
        for name in names:
            if name == last:
                fsync_dir(directory)
            staged = os.path.join(tmp, f".restore-{name}")
            _link_or_copy(os.path.join(backup, name), staged)
            os.replace(staged, os.path.join(directory, name))
        fsync_dir(directory)
        shutil.rmtree(backup, ignore_errors=True)
    except Exception:  # noqa: BLE001 - the backup stays and still loads; the caller's own error is raised
        pass


def recover_published(directory: str | os.PathLike, last: str) -> None:
    """Tidy what a killed `publish_files` left in `directory`: when the set there lacks `last`, the backup
    of the previous set is put back; then the temporaries of processes that died are removed. A live
    process's temporaries are left alone."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return
    source = published_set(directory, last)
    if source != directory and _left_by_dead_process(os.path.basename(source), _PREVIOUS_PREFIX):
        tmp = tempfile.mkdtemp(dir=directory, prefix=f"{_PUBLISH_PREFIX}{os.getpid()}-")
        try:
            _restore(source, directory, tmp, last)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _clean_stale_partials(directory)
    if os.path.lexists(os.path.join(directory, last)):
        _clean_stale_partials(directory, _PREVIOUS_PREFIX)
