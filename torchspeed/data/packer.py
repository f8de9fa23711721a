"""pack(): an ImageFolder or a Dataset -> one packed LMDB store, with the fixed work done once.

Why: resizing to the training resolution, decoding (format="raw") and gathering thousands of small
files into one memory-mapped file are the same work every epoch; done once here, they leave the
training loop's critical path. Encoding runs in parallel processes, into a temporary directory beside
`dst` renamed into place only when complete: an interrupted pack never leaves a seemingly whole store.

Nothing of the user's is ever deleted: `overwrite=True` replaces `dst` only when it is a torchspeed store
(its manifest says so) holding nothing else, and a `dst` equal to, inside or around the source folder is
refused before anything is written. Temporaries are named `.NAME.partial-PID-HOST-*`; the next pack into
the same parent removes those whose process is gone (and puts back a previous store an interrupted
overwrite had moved aside).
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import multiprocessing as mp
import os
import re
import shutil
import socket
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from PIL import Image
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

from torchspeed.atomic import atomic_write, fsync_dir
from torchspeed.data.record import integer_label, to_hwc_uint8
from torchspeed.images import open_image, quoted, rgb_image, scan_folder, shown
from torchspeed.optional import optional
from torchspeed.data.store import (ENCODING_CODES, FORMAT_VERSION, HEADER, MAGIC, MANIFEST, STORE_KIND, key_of,
                                   lmdb_module)

__all__ = ["pack", "PackResult", "load_image_file", "clean_stale_partials"]

CHUNK = 32  # samples per task: big enough to amortise inter-process overhead, small for a smooth progress bar


@dataclass
class PackResult:
    """What pack() did: samples written, samples skipped (path or index, and why), bytes, seconds."""

    dst: str
    written: int
    skipped: list[dict[str, str]] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    encoding: str = "jpeg"
    short_side: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return (f"packed {self.written} samples into {self.dst} ({self.bytes / 2**20:.1f} MiB, {self.encoding}"
                f"{f', short side {self.short_side}' if self.short_side else ''}) in {self.seconds:.1f} s"
                + (f"; skipped {len(self.skipped)}" if self.skipped else ""))


def load_image_file(path: str, short_side: int | None) -> np.ndarray:
    """An image file as RGB HWC uint8, its shorter side shrunk to `short_side` (JPEGs DCT-scaled while
    decoding): what pack stores, and how the benchmarks resize their copies of the demo photos alike."""
    with open_image(path) as im:  # the pixel limit is checked from the header, before decoding
        if short_side and im.format == "JPEG":
            w, h = im.size
            s = short_side / min(w, h)
            if s < 1:
                im.draft("RGB", (int(w * s) + 1, int(h * s) + 1))  # DCT downscale, still >= the target size
        im = rgb_image(im)  # loads (truncated or corrupt data raises here); 16-bit and alpha converted faithfully
        return _resize_short(im, short_side)


def _resize_short(im: Any, short_side: int | None) -> np.ndarray:
    if not isinstance(im, Image.Image):
        im = Image.fromarray(im)
    w, h = im.size
    if short_side and min(w, h) > short_side:  # never upscale
        s = short_side / min(w, h)
        size = (short_side, max(1, round(h * s))) if w <= h else (max(1, round(w * s)), short_side)
        im = im.resize(size, Image.LANCZOS)
    return np.asarray(im)


def _encode(img: np.ndarray, label: int, encoding: str, quality: int) -> bytes:
    h, w, c = img.shape
    if encoding == "raw":
        payload = img.tobytes()
    else:
        try:  # 4:2:0 decodes ~1.5x faster than 4:4:4
            payload = optional("simplejpeg", "data", "JPEG encoding with simplejpeg").encode_jpeg(
                np.ascontiguousarray(img), quality=quality, colorspace="RGB", colorsubsampling="420")
        except ImportError:  # PIL encodes it instead
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, "JPEG", quality=quality, subsampling=2)
            payload = buf.getvalue()
    return HEADER.pack(MAGIC, ENCODING_CODES[encoding], c, h, w, label) + payload


# The source dataset for worker processes (inherited by fork: Datasets need not be picklable).
_DATASET: Any = None


def _work(task: tuple[list[tuple[int, Any, int]], str, int | None, int]) -> list[tuple[int, bytes | None, str]]:
    """Encode a chunk: (index, path-or-None, label) -> (index, record or None, error text)."""
    items, encoding, short_side, quality = task
    out = []
    for i, path, label in items:
        try:
            if path is not None:
                img = load_image_file(path, short_side)
            else:
                try:
                    x, label = _DATASET[i]
                except Exception as e:
                    raise ValueError(f"the Dataset raised {type(e).__name__}: {e}") from None
                img = _resize_short(to_hwc_uint8(x), short_side)
            out.append((i, _encode(img, integer_label(label), encoding, quality), ""))
        except Exception as e:  # reported per sample; on_error decides whether it is fatal
            text = str(e)  # torchspeed's own errors (ValueError) say what is wrong, the size guard's name the file
            named = isinstance(e, ValueError) or (path is not None and quoted(path) in text)
            out.append((i, None, text if named else f"{type(e).__name__}: {text}"))
    return out


def pack(
    src: Any,
    dst: str | os.PathLike,
    short_side: int | None = None,
    format: str = "jpeg",
    quality: int = 90,
    on_error: str = "fail",
    num_workers: int | None = None,
    overwrite: bool = False,
    progress: bool | Callable[[str], None] = True,
    classes: list[str] | None = None,
) -> PackResult:
    """Pack an ImageFolder directory or a map-style Dataset into the store at `dst`.

    `src` samples may be PIL images, HWC uint8 arrays or CHW uint8 tensors with an int label.
    `short_side` resizes (down only) so the shorter side is that many pixels; `format="raw"` stores
    decoded pixels (no decoding at train time, about 10x the bytes); `format="jpeg"` re-encodes at
    `quality` (4:2:0). `on_error="skip"` leaves out samples that fail to load and lists them in the
    result; `"fail"` stops at the first, naming it. `classes` names the labels of a Dataset source
    (default: its `.classes`, else "0", "1", ...). `num_workers` encoding processes (default: cores, at
    most 8). `progress`: True shows a progress bar, a callable is given a message after each chunk.
    `overwrite=True` replaces only a torchspeed store holding nothing else; a `dst` equal to, inside or
    around the source folder is refused either way. Images over `torchspeed.images.MAX_IMAGE_PIXELS` are
    refused from their header, before decoding; a folder's entries that are not regular files (a FIFO
    named x.jpg) are left out and listed in `skipped`. An unwritable `dst` fails before anything is
    read; a failed write (disk full) is one OSError naming `dst`, any previous store there untouched.
    """
    t0 = time.perf_counter()
    _check_pack_arguments(format, on_error, quality, short_side)
    dst = os.path.abspath(os.fspath(dst))
    src_path = os.path.abspath(os.fspath(src)) if isinstance(src, (str, os.PathLike)) else None
    _check_destination(src_path, dst, overwrite)  # before anything is written or deleted
    lmdb = lmdb_module()
    tmp = _partial_directory(dst)  # can the store be written there? known before any work
    global _DATASET
    try:
        result = PackResult(dst=dst, written=0, encoding=format, short_side=short_side)
        folder_classes, items, names = _samples(src, src_path, result)
        _DATASET = None if src_path is not None else src  # the workers read it by fork
        workers = _encoding_processes(num_workers, src_path)
        tasks = [(items[s:s + CHUNK], format, short_side, quality) for s in range(0, len(items), CHUNK)]
        with _write_errors_named(dst, lmdb):
            with closing(_run(tasks, workers, progress, len(items))) as chunks:  # the pool and the bar end here
                labels, crcs = _write_records(tmp, lmdb, chunks, names, on_error, result,
                                              what=src_path or "the Dataset")
            if folder_classes is not None:
                classes = folder_classes
            elif classes is None:
                classes = list(getattr(src, "classes", None) or [str(c) for c in range(max(labels, default=-1) + 1)])
            _check_labels(labels, list(classes), src_path or "the Dataset")
            result.seconds = time.perf_counter() - t0
            _write_manifest(tmp, result, list(classes), quality, src_path, labels, crcs)
            _check_destination(None, dst, overwrite)  # again: `dst` may have changed while packing
            _move_into_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _DATASET = None
    result.seconds = time.perf_counter() - t0
    return result


@contextmanager
def _write_errors_named(dst: str, lmdb: Any) -> Iterator[None]:
    """A failed write (disk full, quota, read-only, I/O error; LMDB's own errors too) as one OSError
    naming the store, saying that the previous store is untouched (it is replaced only by a rename)."""
    try:
        yield
    except (OSError, lmdb.Error) as e:
        reason = getattr(e, "strerror", None) or str(e)
        code = getattr(e, "errno", None)
        if code == errno.ENOSPC or "No space left" in reason:
            reason = "the disk is full (No space left on device)"
        kept = "the previous store there is untouched" if os.path.lexists(dst) else "nothing was left behind"
        raise OSError(code or errno.EIO, f"cannot write the store {dst!r}: {reason}; {kept}") from None


def _check_labels(labels: list[int], classes: list[str], what: str) -> None:
    """Every label must name one of `classes` (readers refuse a store whose labels do not)."""
    if labels and not 0 <= min(labels) <= max(labels) < len(classes):
        bad = min(labels) if min(labels) < 0 else max(labels)
        raise ValueError(f"a sample of {what} has label {bad}, but there are {len(classes)} classes (labels 0.."
                         f"{len(classes) - 1}): give classes= naming every label, or fix the Dataset's labels")


def _check_pack_arguments(format: str, on_error: str, quality: Any, short_side: Any) -> None:
    if format not in ENCODING_CODES:
        raise ValueError(f"format must be 'jpeg' or 'raw', got {format!r}")
    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error must be 'fail' or 'skip', got {on_error!r}")
    if not (isinstance(quality, int) and 1 <= quality <= 100):
        raise ValueError(f"quality must be an integer in 1..100, got {quality!r}")
    if short_side is not None and (not isinstance(short_side, int) or short_side < 1):
        raise ValueError(f"short_side must be a positive integer or None, got {short_side!r}")


def _samples(src: Any, src_path: str | None,
             result: PackResult) -> tuple[list[str] | None, list[tuple[int, str | None, int]], list[str]]:
    """(the folder's classes or None for a Dataset, the work items (index, file or None, label), how
    errors name each sample). A folder's entries that are not regular files go to `result.skipped`."""
    if src_path is not None:
        left_out: list[tuple[str, str]] = []
        classes, samples = scan_folder(src_path, skipped=left_out)
        result.skipped += [{"path": shown(p), "reason": f"{why}, not an image file"} for p, why in left_out]
        return classes, [(i, p, y) for i, (p, y) in enumerate(samples)], [shown(p) for p, _ in samples]
    if not hasattr(src, "__getitem__") or not hasattr(src, "__len__"):
        raise ValueError(f"src must be an ImageFolder path or a map-style Dataset, got {type(src).__name__}")
    n = len(src)
    if n == 0:
        raise ValueError("the source Dataset is empty")
    return None, [(i, None, -1) for i in range(n)], [f"sample {i}" for i in range(n)]


def _encoding_processes(num_workers: Any, src_path: str | None) -> int:
    if num_workers is not None and not (isinstance(num_workers, int) and num_workers >= 0):
        raise ValueError(f"num_workers must be None or a non-negative integer, got {num_workers!r}")
    if src_path is None and "fork" not in mp.get_all_start_methods():
        return 1  # without fork a Dataset would have to be pickled to the workers
    return max(1, num_workers if num_workers is not None else min(os.cpu_count() or 1, 8))


def _partial_directory(dst: str) -> str:
    """A new directory beside `dst` that the store is built in, named for this process; the leftovers
    of packs whose process is gone are removed first. OSError naming `dst` when it cannot be made, or
    when a previous store there could not be replaced (read-only)."""
    parent = os.path.dirname(dst)
    try:
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(dst) and not os.access(dst, os.W_OK):  # moving it aside needs its own write permission
            raise PermissionError(errno.EACCES, "the store there is read-only, so it cannot be replaced")
        clean_stale_partials(parent)
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(dst)}.partial-{_owner()}-")
    except OSError as e:
        raise OSError(e.errno, f"cannot write the store {dst!r}: {e.strerror or e}; choose a DST you can write "
                               "(nothing was read or written)") from None
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the store gets the usual permissions
    return tmp


def _write_records(path: str, lmdb: Any, chunks: Iterable[list[Any]], names: list[str], on_error: str,
                   result: PackResult, what: str) -> tuple[list[int], list[int]]:
    """Write each chunk's records into a new LMDB environment at `path`, one transaction per chunk;
    a sample that failed is skipped (listed in `result`) or stops the pack, naming it. -> (labels, CRC32s)"""
    map_size = 1 << 30
    env = lmdb.open(path, map_size=map_size, subdir=True, readahead=False, meminit=False, sync=False,
                    metasync=False)  # one fsync at the end (env.sync) instead of one per commit
    labels: list[int] = []
    crcs: list[int] = []
    try:
        for chunk in chunks:
            batch = []
            for i, record, error in chunk:
                if record is None:
                    if on_error == "fail":
                        name = quoted(names[i]) if what != "the Dataset" else names[i]  # a file, or "sample 3"
                        said = error if name in error else f"cannot read {name}: {error}"
                        raise ValueError(f"{said}; fix or remove it, or pack with on_error='skip' (--on-error skip)")
                    result.skipped.append({"path": names[i], "reason": error})
                    continue
                batch.append((key_of(result.written + len(batch)), record))
            while batch:  # one transaction per chunk; grow the map when full (one writer: resizing is safe)
                try:
                    with env.begin(write=True) as txn:
                        for k, record in batch:
                            txn.put(k, record, append=True)
                    break
                except lmdb.MapFullError:
                    map_size *= 2
                    env.set_mapsize(map_size)
            for _, record in batch:
                labels.append(HEADER.unpack_from(record)[5])
                crcs.append(zlib.crc32(record))
                result.bytes += len(record)
            result.written += len(batch)
        if result.written == 0:
            raise ValueError(f"nothing was packed: every sample of {what} failed to load "
                             f"(first: {result.skipped[0]['reason'] if result.skipped else 'none'})")
        env.sync(True)
    finally:
        env.close()
    return labels, crcs


def _write_manifest(path: str, result: PackResult, classes: list[str], quality: int, src_path: str | None,
                    labels: list[int], crcs: list[int]) -> None:
    """manifest.json beside the data (what readers check the store by), then the directory made durable."""
    short_side = result.short_side
    manifest = {
        "kind": STORE_KIND, "format_version": FORMAT_VERSION, "count": result.written, "classes": classes,
        "encoding": result.encoding, "quality": quality if result.encoding == "jpeg" else None,
        "short_side": short_side,
        "resolution": f"shorter side resized to {short_side} (never upscaled)" if short_side else "as stored in the source",
        "source": src_path, "bytes": result.bytes, "pack_seconds": round(result.seconds, 3),
        "skipped": len(result.skipped), "labels": labels, "crc32": crcs,
    }
    with atomic_write(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)  # ASCII (non-UTF-8 names escaped), so the locale's encoding cannot matter
    lock = os.path.join(path, "lock.mdb")
    if os.path.exists(lock):
        os.unlink(lock)  # readers open without locking
    fsync_dir(path)


def _move_into_place(tmp: str, dst: str) -> None:
    """The whole new store renamed to `dst`; a previous store is moved aside only now, and removed after."""
    parent = os.path.dirname(dst)
    if os.path.lexists(dst):
        old = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(dst)}.old-{_owner()}-")
        os.rename(dst, os.path.join(old, "store"))
        try:
            os.rename(tmp, dst)
        except BaseException:
            os.rename(os.path.join(old, "store"), dst)  # the previous store back at its name
            os.rmdir(old)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dst)
    fsync_dir(parent)


STORE_FILES = frozenset({MANIFEST, "data.mdb", "lock.mdb"})
_MANIFEST_TMP = re.compile(r"^\.manifest\.json\..*\.tmp$")  # atomic_write's temporary, if killed mid-write
STALE_AFTER_S = 24 * 3600  # a temporary of another machine (or of no recorded process) is stale after this
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?:(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-)?[^-]+$")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _host() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _owner() -> str:
    """This process, as written into the names of its temporary directories: PID-HOST."""
    return f"{os.getpid()}-{_host()}"


def _only_store_files(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return all(n in STORE_FILES or _MANIFEST_TMP.match(n) for n in names)


def _is_own_store(path: str) -> bool:
    """True when `path` is a directory that torchspeed's pack made and holds nothing else: safe to replace."""
    if not os.path.isdir(path) or not _only_store_files(path):
        return False
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("kind") == STORE_KIND


def _check_destination(src_path: str | None, dst: str, overwrite: bool) -> None:
    """Refuse a destination that would write into the source or replace anything but a torchspeed store."""
    if src_path is not None:
        real_src, real_dst = os.path.realpath(src_path), os.path.realpath(dst)
        where = ("is the source folder itself" if real_dst == real_src else
                 "is inside the source folder" if real_dst.startswith(real_src.rstrip(os.sep) + os.sep) else
                 "contains the source folder" if real_src.startswith(real_dst.rstrip(os.sep) + os.sep) else None)
        if where:
            raise ValueError(f"refusing to pack {src_path!r} into {dst!r}: the destination {where}; "
                             f"choose a DST outside SRC (nothing was written or deleted)")
    if os.path.lexists(dst):
        if not overwrite:
            raise ValueError(f"{dst!r} already exists; remove it or pass overwrite=True (--overwrite)")
        if not _is_own_store(dst):
            raise ValueError(f"refusing to overwrite {dst!r}: it is not a torchspeed store (overwrite replaces only "
                             f"a directory holding a store's {MANIFEST} and data.mdb and nothing else); remove it "
                             f"yourself or choose another DST (nothing was written or deleted)")


def _owner_gone(match: re.Match, path: str) -> bool:
    """Is the process that made this temporary gone? Unknown (another machine, no pid): untouched for a day."""
    pid, host = match.group("pid"), match.group("host")
    if pid is not None and host == _host():
        if int(pid) == os.getpid():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:  # exists, another user's
            pass
        return False
    try:
        newest = max([os.path.getmtime(path)] + [os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)])
    except OSError:
        return False
    return time.time() - newest > STALE_AFTER_S


def clean_stale_partials(parent: str) -> list[str]:
    """Remove the temporaries that interrupted packs left in `parent`; return what was removed or restored.

    Only directories named as pack names them, whose process is gone, and that hold nothing but store
    files are touched. A previous store that an interrupted overwrite had moved aside (`.NAME.old-*`)
    is put back at NAME when NAME is missing, else removed.
    """
    done = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return done
    for entry in entries:
        m = _TEMPORARY.match(entry.name)
        if not m or not entry.is_dir(follow_symlinks=False) or not _owner_gone(m, entry.path):
            continue
        try:
            if m.group("kind") == "partial":
                if _only_store_files(entry.path):
                    shutil.rmtree(entry.path)
                    done.append(entry.path)
            else:
                inner = os.path.join(entry.path, "store")
                if os.listdir(entry.path) != ["store"] or not _is_own_store(inner):
                    continue
                final = os.path.join(parent, m.group("name"))
                if not os.path.lexists(final):
                    os.rename(inner, final)  # the overwrite died between its two renames: the old store returns
                    os.rmdir(entry.path)
                    done.append(final)
                else:
                    shutil.rmtree(entry.path)
                    done.append(entry.path)
        except OSError:
            continue
    if done:
        fsync_dir(parent)
    return done


def _run(tasks: list[Any], num_workers: int, progress: bool | Callable[[str], None], total: int) -> Iterator[list[Any]]:
    """Yield each chunk's results in order, from a fork pool (or in-process), with a progress bar or messages."""
    pool = ProcessPoolExecutor(num_workers, mp_context=mp.get_context("fork")) \
        if num_workers > 1 and len(tasks) > 1 else None  # fork before any progress-bar thread exists
    bar, done = None, 0
    if progress is True:
        bar = Progress("packing", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True)
        bar.start()
        job = bar.add_task("pack", total=total)
    try:
        results: Iterator[Any] = pool.map(_work, tasks) if pool is not None else map(_work, tasks)
        for r in results:
            done += len(r)
            if bar is not None:
                bar.advance(job, len(r))
            elif callable(progress):
                progress(f"packed {done}/{total} samples")
            yield r
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.stop()
