"""WebDataset tar shards read as records, without unpacking them and without webdataset's pipeline.

A shard set (a brace pattern `train-{000000..000127}.tar`, a list of .tar paths or a directory of them)
holds samples as consecutive members `KEY.EXT` (`000123.jpg` + `000123.cls`), as webdataset's TarWriter
writes them. Opening it reads each shard's tar headers once (a seek per member, not the images) and its
label members (`.cls`: an integer; `.json`: an object with an integer "label" or "cls") into an index of
(shard, offset, size, label) per sample: the count is known up front and a sample is one `pread`. The
index is cached (`tar-index/`, plain JSON) while the shard's size and time are unchanged, and used only when
it checks out as data (an entry damaged or edited is read again from the shard): about 0.1 ms per sample at
the first open of a large set, a JSON read after. Labels are checked as every format's are (format_guard.py). JPEGs go to the loader's measured
decoder like a store's records; other image types (PNG, ...) are decoded by PIL.

Shuffling stays close to sequential reads, as webdataset's shard shuffle and sample buffer do, but is
deterministic (a resumed epoch is the same epoch): the shards in a seeded random order, their samples in
file order, each then moved by a seeded offset of at most `shuffle_buffer` places (a jittered sort), so
a batch draws from about `1 + shuffle_buffer / samples_per_shard` neighbouring shards. The loader splits
that order across ranks in contiguous blocks: each rank reads mostly its own shards.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import tarfile
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchspeed.atomic import atomic_write
from torchspeed.data.arrow import file_identity
from torchspeed.data.format_guard import (MAX_METADATA_BYTES, DatasetError, checked_labels, damage_named,
                                          label_problem)
from torchspeed.data.record import Record, encoded_record
from torchspeed.images import quoted
from torchspeed.runtime import cache_dir

log = logging.getLogger(__name__)

__all__ = ["TarShards", "expand_braces", "shard_paths", "looks_like_shards"]

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")
LABEL_EXTS = ("cls", "json")
SHUFFLE_BUFFER = 1000
MAX_LABEL_BYTES = 1 << 16  # a label member larger than this is not a class index: refused unread
INDEX_VERSION = 2  # of the cached index: 2 reads hard links, refuses duplicate members and labels past MAX_CLASSES
# Shards compressed as a whole: named and refused (a sample is one pread into an uncompressed tar)
COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst", ".tar.zstd", ".tar.lz4")
_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd",
          b"\x04\x22\x4d\x18": "lz4"}

_BRACE = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """A shell-style brace pattern expanded, as webdataset (braceexpand) reads shard lists:
    `a-{000..003}.tar` (zero-padded ranges keep their width), `{train,val}-{0..1}.tar`."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[:m.start()], pattern[m.end():]
    rng = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", body)
    if rng:
        lo, hi = rng.group(1), rng.group(2)
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        step = 1 if int(hi) >= int(lo) else -1
        parts = [str(v).zfill(width) for v in range(int(lo), int(hi) + step, step)]
    else:
        parts = body.split(",")
    return [out for part in parts for out in expand_braces(head + part + tail)]


def _is_shard_name(name: str) -> bool:
    """A .tar file, or one compressed as a whole (.tar.gz, ...: named as shards, then refused with the reason)."""
    return name.endswith(".tar") or name.endswith(COMPRESSED_SUFFIXES)


def looks_like_shards(data: Any) -> bool:
    """Whether `data` names tar shards: a pattern or path ending in .tar (or a compressed tar's suffix, refused
    later with the reason), a list of them, or a directory holding such files and no sub-directories (an
    ImageFolder has class sub-directories)."""
    if isinstance(data, (list, tuple)):
        return bool(data) and all(isinstance(p, (str, os.PathLike)) and _is_shard_name(os.fspath(p)) for p in data)
    if not isinstance(data, (str, os.PathLike)):
        return False
    path = os.fspath(data)
    if _is_shard_name(path):
        return True
    if os.path.isdir(path):
        entries = list(os.scandir(path))
        return any(_is_shard_name(e.name) and e.is_file() for e in entries) and not any(e.is_dir() for e in entries)
    return False


def shard_paths(data: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The shard files `data` names (pattern, list or directory), absolute, each checked to exist."""
    if isinstance(data, (list, tuple)):
        paths = [os.fspath(p) for p in data]
    elif os.path.isdir(path := os.fspath(data)):
        paths = sorted(p for p in glob.glob(os.path.join(glob.escape(path), "*")) if _is_shard_name(p))
    else:
        paths = expand_braces(path)
    compressed = [p for p in paths if p.endswith(COMPRESSED_SUFFIXES)]
    if compressed:
        more = f" and {len(compressed) - 1} more" if len(compressed) > 1 else ""
        raise DatasetError(f"{quoted(compressed[0])}{more}: compressed shards are not read (a sample is one read "
                           "from an uncompressed .tar); decompress them first (e.g. `gunzip -k`, `zstd -d`)")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FileNotFoundError(f"no tar shard at {quoted(missing[0])}{more} (of {len(paths)} named by {data!r}); "
                                "give a brace pattern such as 'train-{000000..000127}.tar', a list of .tar files or "
                                "a directory of them")
    if not paths:
        raise ValueError(f"{data!r} names no tar shards")
    return [os.path.abspath(p) for p in paths]


def _split_key(name: str) -> tuple[str, str]:
    """webdataset's key/extension split: the extension starts at the first dot of the file name."""
    directory, base = os.path.split(name)
    if "." not in base:
        return name, ""
    stem, ext = base.split(".", 1)
    return (os.path.join(directory, stem) if directory else stem), ext.lower()


def _label_of(raw: bytes, ext: str) -> int:
    """A label member's class index (`.cls`: the integer as text; `.json`: an object with "label", "cls" or
    "class", or the bare integer), checked as every format's labels are (format_guard.label_problem)."""
    text = raw.decode("utf-8").strip()
    if ext == "json":
        try:
            obj = json.loads(text)
        except RecursionError:
            raise ValueError("it is JSON nested too deeply") from None
        value = next((obj[k] for k in ("label", "cls", "class") if isinstance(obj, dict) and k in obj), obj)
    else:
        value = int(text) if text.lstrip("-").isdigit() else text
    if isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    why = label_problem(value, None)
    if why:
        raise ValueError(f"its label is {why if len(why) < 200 else why[:200] + '...'}")
    return int(value)


class _ShardIndex:
    """One shard's samples: keys, member offsets and sizes of the image, labels; and its problems, (sample key,
    what is wrong), the key None for the shard as a whole."""

    def __init__(self, keys: list[str], offsets: list[int], sizes: list[int], labels: list[int],
                 problems: list[tuple[str | None, str]]):
        self.keys, self.offsets, self.sizes, self.labels, self.problems = keys, offsets, sizes, labels, problems


# One index per (shard, size, mtime, member names) in this process: tune_loader and the train/val loaders
# open the same shards again and must not read every header again (nor parse the cached JSON).
_INDEX_CACHE: dict[tuple[str, int, int, str, str], _ShardIndex] = {}
_INDEX_LOCK = threading.Lock()


def _index_shard(path: str, image_ext: str | None, label_ext: str | None) -> _ShardIndex:
    """The shard's index: from this process's memory, else from torchspeed's cache (a JSON per shard, valid
    while the shard's size and time are unchanged), else read from its tar headers (then cached)."""
    st = os.stat(path)
    cache_key = (path, st.st_size, st.st_mtime_ns, image_ext or "", label_ext or "")
    with _INDEX_LOCK:
        hit = _INDEX_CACHE.get(cache_key)
    if hit is None:
        hit = _stored_index(cache_key)
    if hit is None:
        hit = _read_index(path, image_ext, label_ext)
        _store_index(cache_key, hit)
    with _INDEX_LOCK:
        _INDEX_CACHE[cache_key] = hit
    return hit


def _index_file(cache_key: tuple[str, int, int, str, str]) -> str:
    name = hashlib.sha256(repr((cache_key[0], cache_key[3], cache_key[4])).encode()).hexdigest()[:32]
    return os.path.join(cache_dir("tar-index"), f"{name}.json")


def _stored_index(cache_key: tuple[str, int, int, str, str]) -> _ShardIndex | None:
    """The index cached for this shard as it is now (same path, size, time and member names), or None: also
    when the cache entry is damaged or edited (checked as data: types, lengths, every member inside the shard,
    every label a class index), which costs a re-read of the shard's headers, nothing else."""
    path = _index_file(cache_key)
    try:
        if os.path.getsize(path) > MAX_METADATA_BYTES:
            raise ValueError("larger than an index can be")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        index = _checked_index(doc, cache_key)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError, MemoryError) as e:
        index, why = None, "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        log.debug("tar index of %s cached at %s is unreadable (%s): reading the shard again", cache_key[0], path, why)
        return None
    if index is None:
        log.debug("tar index of %s cached at %s is damaged or stale: reading the shard again", cache_key[0], path)
    return index


def _checked_index(doc: Any, cache_key: tuple[str, int, int, str, str]) -> _ShardIndex | None:
    """`doc` (a cached index read back) as a _ShardIndex, or None where anything in it is not what
    `_store_index` writes for this shard."""
    fields = ("keys", "offsets", "sizes", "labels", "problems")
    if not isinstance(doc, dict) or doc.get("version") != INDEX_VERSION or doc.get("shard") != list(cache_key):
        return None
    if not all(isinstance(doc.get(k), list) for k in fields):
        return None
    keys, offsets, sizes, labels, problems = (doc[k] for k in fields)
    shard_size = cache_key[1]
    if not (len(keys) == len(offsets) == len(sizes) == len(labels)) or not all(isinstance(k, str) for k in keys):
        return None
    if not all(type(v) is int for c in (offsets, sizes, labels) for v in c):
        return None
    if not all(0 <= o and 0 <= n and o + n <= shard_size for o, n in zip(offsets, sizes)):
        return None
    if any(label_problem(y, None) for y in labels):
        return None
    if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], (str, type(None))) and isinstance(p[1], str)
               for p in problems):
        return None
    return _ShardIndex(keys, offsets, sizes, labels, [(p[0], p[1]) for p in problems])


def _store_index(cache_key: tuple[str, int, int, str, str], index: _ShardIndex) -> None:
    doc = {"version": INDEX_VERSION, "shard": list(cache_key), "keys": index.keys, "offsets": index.offsets,
           "sizes": index.sizes, "labels": index.labels, "problems": [list(p) for p in index.problems]}
    try:
        with atomic_write(_index_file(cache_key), "w") as f:
            json.dump(doc, f)
    except OSError as e:  # a read-only cache costs the next open a re-read, nothing else
        log.debug("tar index of %s not cached: %s", cache_key[0], e)


class _Bounded:
    """A shard file as tarfile reads it, no read larger than what is left of the file: a crafted header (a pax
    record or long name claiming terabytes) costs at most the shard's own size, never an allocation of what it
    claims."""

    mode = "rb"

    def __init__(self, f: Any, size: int):
        self._f, self._size, self.name = f, size, f.name

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self._size - self._f.tell())
        return self._f.read(left if n is None or n < 0 else min(n, left))

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


def _compression(path: str) -> str | None:
    """The compressor whose magic number starts the file (a .tar that is really a .tar.gz), or None."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((name for magic, name in _MAGIC.items() if head.startswith(magic)), None)


def _read_index(path: str, image_ext: str | None, label_ext: str | None) -> _ShardIndex:
    """One pass over the shard's tar headers (a seek per member); the label members are read.

    A sample is consecutive members of one key (webdataset's grouping). What is wrong with one sample is a
    problem of that sample (named; left out under on_error="skip"): no image or label, an unreadable label
    or one that is no class index, two members of one name (webdataset refuses those too), a member whose
    data runs past the end of the shard, a sparse member. Where a truncated or damaged shard stops being
    readable is a problem of the shard (key None; the samples before it are kept). A hard link (GNU tar
    stores a second copy of a file that way) reads the data of the member it names, earlier in the shard."""
    index = _ShardIndex([], [], [], [], [])
    images = (image_ext,) if image_ext else IMAGE_EXTS
    label_exts = (label_ext,) if label_ext else LABEL_EXTS
    hint = "; is it a (complete) tar file?"
    with damage_named(f"tar shard {quoted(path)}", "write the shard again" + hint[1:]):
        compressed = _compression(path)
        if compressed:
            raise DatasetError(f"tar shard {quoted(path)} is {compressed}-compressed: compressed shards are not read "
                               "(a sample is one read from an uncompressed .tar); decompress it first")
        size = os.path.getsize(path)
        with open(path, "rb") as raw:
            f = _Bounded(raw, size)
            try:
                tar = tarfile.open(fileobj=f, mode="r:")  # type: ignore[call-overload]
            except (tarfile.TarError, EOFError) as e:
                raise DatasetError(f"cannot read tar shard {quoted(path)}: {type(e).__name__}: {e}{hint}") from None
            current: str | None = None
            found: dict[str, tuple[int, int]] = {}
            wrong: list[str] = []  # what is wrong with the current sample's members
            regular: dict[str, tuple[int, int]] = {}  # member name -> its data, for hard links to it

            def close_sample() -> None:
                if current is None:
                    return
                image = next((found[e] for e in images if e in found), None)
                label_at = next(((e, found[e]) for e in label_exts if e in found), None)
                if wrong:
                    index.problems.append((current, wrong[0]))
                    return
                if image is None:
                    index.problems.append((current, f"has no image ({', '.join('.' + e for e in images)}); "
                                                    f"its members: {', '.join(sorted('.' + e for e in found))}"))
                    return
                if label_at is None:
                    index.problems.append((current, f"has no label ({', '.join('.' + e for e in label_exts)})"))
                    return
                ext, (off, n) = label_at
                if n > MAX_LABEL_BYTES:
                    index.problems.append((current, f"has a .{ext} label of {n:,} bytes: not a class index"))
                    return
                raw.seek(off)
                try:
                    label = _label_of(raw.read(n), ext)
                except (ValueError, UnicodeDecodeError) as e:
                    index.problems.append((current, f"has a bad .{ext} label: {e}"))
                    return
                index.keys.append(current)
                index.offsets.append(image[0])
                index.sizes.append(image[1])
                index.labels.append(label)

            stop = None  # why the shard cannot be read past its last sample read, if it cannot
            try:
                for member in tar:
                    if member.islnk():  # a hard link: the data of the member it names
                        data = regular.get(member.linkname)
                    elif member.isfile():
                        data = (member.offset_data, member.size)
                        regular[member.name] = data
                    else:
                        continue
                    key, ext = _split_key(member.name)
                    if key != current:
                        close_sample()
                        current, found, wrong = key, {}, []
                    if data is None:
                        wrong.append(f"has a hard link {member.name!r} to {member.linkname!r}, which the shard does "
                                     "not hold before it")
                    elif member.issparse():
                        wrong.append(f"has a sparse member {member.name!r} (its bytes are not stored in one piece)")
                    elif data[0] + data[1] > size:
                        wrong.append(f"has a member {member.name!r} of {data[1]:,} bytes that runs past the end of "
                                     "the shard (a truncated shard?)")
                    elif ext in found:
                        wrong.append(f"has two members named {member.name!r} (webdataset refuses such a sample too)")
                    else:
                        found[ext] = data
            except (tarfile.TarError, EOFError) as e:  # cut short or damaged past the samples read so far
                stop = f"{type(e).__name__}: {e}"
            close_sample()
            stop = stop or _damage_after(raw, tar.offset, size)  # tarfile ends quietly at a bad or cut-short header
            if stop:
                if current is None:
                    raise DatasetError(f"cannot read tar shard {quoted(path)}: {stop}{hint}")
                index.problems.append((None, f"cannot be read past its sample {current!r} ({stop}; a truncated or "
                                             "damaged shard?): the samples after it are lost"))
    return index


def _damage_after(f: Any, offset: int, size: int) -> str | None:
    """What is at `offset`, where tarfile stopped reading members, when it is not the end of the archive (zero
    blocks, or the end of the file): a header it could not read, or a header cut short."""
    if offset >= size:
        return None
    f.seek(offset)
    block = f.read(512)
    if not block.strip(b"\0"):
        return None
    return "what follows is not a readable tar header" if len(block) == 512 else "it ends inside a tar header"


class TarShards:
    """WebDataset tar shards as a record source (see the module docstring): `len`, `classes`, `targets`,
    `record(i)`, `name(i)` (shard and key), and `epoch_order`, the shard-order shuffle the loader uses.

    `image_column` / `label_column`: the member extensions of the image and the label (default: the
    first of jpg, jpeg, png, webp, ppm, bmp; cls, json). A sample without either, or with an unreadable
    label, is refused naming its shard and key (`on_error="fail"`) or left out with a warning ("skip").
    """

    def __init__(self, data: str | os.PathLike | Sequence[str | os.PathLike], image_column: str | None = None,
                 label_column: str | None = None, on_error: str = "fail", shuffle_buffer: int = SHUFFLE_BUFFER):
        if on_error not in ("fail", "skip"):
            raise ValueError(f"on_error must be 'fail' or 'skip', got {on_error!r}")
        if not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be a non-negative integer, got {shuffle_buffer!r}")
        self.paths = shard_paths(data)
        self.root = os.fspath(data) if not isinstance(data, (list, tuple)) else os.path.dirname(self.paths[0])
        self.where = f"the tar shards {quoted(self.root)} ({len(self.paths)} shard{'s' if len(self.paths) > 1 else ''})"
        self.shuffle_buffer = shuffle_buffer
        image_ext = image_column.lstrip(".").lower() if image_column else None
        label_ext = label_column.lstrip(".").lower() if label_column else None
        indexes = [_index_shard(p, image_ext, label_ext) for p in self.paths]
        problems = [(p, key, why) for p, ix in zip(self.paths, indexes) for key, why in ix.problems]
        self.left_out = sum(key is not None for _, key, _ in problems)  # samples left out under on_error="skip"
        if problems:  # (shard, sample key or None for the shard as a whole, what is wrong)
            path, key, why = problems[0]
            more = f" ({len(problems) - 1} more such problems)" if len(problems) > 1 else ""
            what = f"sample {key!r} of shard {quoted(path)}" if key is not None else f"shard {quoted(path)}"
            if on_error == "fail":
                raise ValueError(f"{what} {why}{more}; fix the shard, name the members with image_column=/"
                                 "label_column=, or pass on_error='skip' to leave such samples out")
            for path, key, why in problems:
                if key is None:
                    log.warning("shard %s %s", quoted(path), why)
                else:
                    log.warning("left out sample %r of shard %s: it %s", key, quoted(path), why)
        counts = [len(ix.keys) for ix in indexes]
        self.shard_sizes = counts
        self.shard_of = np.repeat(np.arange(len(indexes), dtype=np.int32), counts)
        self.first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # first sample of each shard
        self.offsets = np.asarray([o for ix in indexes for o in ix.offsets], dtype=np.int64)
        self.sizes = np.asarray([s for ix in indexes for s in ix.sizes], dtype=np.int64)
        self.keys = [k for ix in indexes for k in ix.keys]
        # each label was checked as it was read (or its cached index was): the one guard every format opens through
        self.targets, self.classes = checked_labels([y for ix in indexes for y in ix.labels], [], self.name)
        self._fds: dict[tuple[int, int], int] = {}  # (pid, shard) -> file descriptor, opened on first read
        self._fd_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.keys)

    def name(self, index: int) -> str:
        """What sample `index` is, for error messages: its key in its shard."""
        return f"sample {self.keys[index]!r} of shard {quoted(self.paths[int(self.shard_of[index])])}"

    def identity(self) -> dict[str, Any]:
        """What a remembered loader decision knows these shards by: their paths, sizes and times."""
        return {"tar_shards": len(self.paths), "n": len(self), "files": file_identity(self.paths)}

    def _fd(self, shard: int) -> int:
        key = (os.getpid(), shard)  # a descriptor inherited through fork shares its offset: pread needs none
        fd = self._fds.get(key)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(key)
                if fd is None:
                    fd = self._fds[key] = os.open(self.paths[shard], os.O_RDONLY)
        return fd

    def record(self, index: int) -> Record:
        """The sample's image bytes (one pread) and label; a JPEG stays encoded."""
        shard = int(self.shard_of[index])
        size = int(self.sizes[index])
        try:
            data = os.pread(self._fd(shard), size, int(self.offsets[index]))
            if len(data) != size:
                raise ValueError(f"the shard is shorter than its tar header says ({len(data)} of {size} bytes read)")
            return encoded_record(data, self.targets[index], f"{self.paths[shard]}:{self.keys[index]}")
        except Exception as e:
            raise ValueError(f"cannot read {self.name(index)}: {type(e).__name__}: {e}") from None

    def epoch_order(self, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """The samples of epoch `epoch` in reading order: shards in a seeded random order, each sample then
        moved by at most `shuffle_buffer` places (module docstring); in file order when not shuffling."""
        n = len(self)
        if not shuffle:
            return np.arange(n, dtype=np.int64)
        rng = np.random.default_rng([seed, epoch])
        shards = rng.permutation(len(self.paths))
        stream = np.concatenate([np.arange(self.first[s], self.first[s + 1]) for s in shards]).astype(np.int64)
        jitter = rng.uniform(0, self.shuffle_buffer + 1, size=n) if self.shuffle_buffer else np.zeros(n)
        return stream[np.argsort(np.arange(n) + jitter, kind="stable")]

    def close(self) -> None:
        """Close this process's shard files (they reopen on the next read)."""
        with self._fd_lock:
            for key in [k for k in self._fds if k[0] == os.getpid()]:
                with contextlib.suppress(OSError):
                    os.close(self._fds.pop(key))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fds"] = {}  # each process opens its own descriptors
        del state["_fd_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fd_lock = threading.Lock()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"TarShards({len(self.paths)} shards, {len(self)} samples, {len(self.classes)} classes)"
