"""The packed store: one LMDB environment of (fixed binary header + encoded bytes) records.

Why: a folder of small JPEGs costs one open/stat/read per sample; one memory-mapped LMDB file costs a
B-tree lookup. The layout has no pickle anywhere (untrusted stores cannot run code):

    STORE/data.mdb       LMDB; key = index as 8-byte big-endian, value = HEADER + payload
    STORE/manifest.json  count, classes, labels, encoding, resolution policy, format version, CRC32s

`HEADER` is `<4sBBxxIIq`: magic b"TSR1", encoding (0 raw HWC uint8, 1 JPEG), channels, height,
width, label. The manifest is a plain file so `len()` and `classes` never open the environment in
the parent process (an LMDB handle must not cross a fork); each process opens its own read-only,
lock-free handle on first access, shared by its threads; each thread reads through its own
long-lived read transaction, so decoding threads can read side by side.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
import zlib
from typing import Any

import numpy as np

from torchspeed.data.record import Record, decode_record
from torchspeed.images import image_size_error
from torchspeed.optional import optional

__all__ = ["PackedDataset", "FORMAT_VERSION", "MANIFEST", "HEADER", "is_store", "read_manifest", "looks_damaged",
           "check_data_file"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STORE_KIND = "torchspeed-packed-store"
HEADER = struct.Struct("<4sBBxxIIq")
MAGIC = b"TSR1"
ENCODINGS = {0: "raw", 1: "jpeg"}
ENCODING_CODES = {v: k for k, v in ENCODINGS.items()}


def key_of(index: int) -> bytes:
    return index.to_bytes(8, "big")


def lmdb_module() -> Any:
    return optional("lmdb", "data", "the packed store")


def is_store(path: str | os.PathLike) -> bool:
    """True when `path` is a directory holding a packed store (manifest + data file)."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, MANIFEST)) and os.path.isfile(os.path.join(path, "data.mdb"))


def looks_damaged(path: str | os.PathLike) -> str | None:
    """Why the directory `path` is a broken store (one of its two files missing), or None: it was a store,
    to be reported as a damaged one, not read as an image folder with "no class sub-directories"."""
    path = os.fspath(path)
    has_manifest = os.path.isfile(os.path.join(path, MANIFEST))
    has_data = os.path.isfile(os.path.join(path, "data.mdb"))
    if has_data and not has_manifest:
        return f"its {MANIFEST} is missing (data.mdb is there)"
    if has_manifest and not has_data:
        try:
            with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
                kind = json.load(f).get("kind")
        except (OSError, ValueError, AttributeError, RecursionError):
            kind = None
        if kind == STORE_KIND:
            return "its data.mdb is missing (the manifest is there)"
    return None


# LMDB's meta pages (pages 0 and 1, 64-bit build): after a 16-byte page header, MDB_meta holds magic,
# version, address, mapsize, two MDB_db records (the free DB's first field is the page size), the last
# page number used and the transaction id. The newer of the two metas is the current one.
_LMDB_META = struct.Struct("<IIQQ I4x40x 48x QQ")
_LMDB_MAGIC = 0xBEEFC0DE


def check_data_file(path: str | os.PathLike) -> None:
    """Refuse a store whose data.mdb is shorter than its own LMDB meta page says it is: a truncated one is
    memory-mapped without complaint, then kills the reading process with SIGBUS at the first record past
    the end. Checked at open time against (last page + 1) x page size, it is a ValueError naming the store.
    """
    path = os.fspath(path)
    data = os.path.join(path, "data.mdb")
    hint = f"re-pack it (`torchspeed pack SRC {path} --overwrite`)"
    metas: list[tuple[int, int, int]] = []
    try:
        size = os.path.getsize(data)
        with open(data, "rb") as f:
            for _ in range(2):  # meta pages 0 and 1 (page 1 starts at the page size that page 0 gives)
                f.seek(metas[0][2] if metas else 0)
                head = f.read(16 + _LMDB_META.size)
                if len(head) < 16 + _LMDB_META.size:
                    break
                magic, _, _, _, page_size, last_page, txnid = _LMDB_META.unpack_from(head, 16)
                allowed = [metas[0][2]] if metas else [2 ** k for k in range(9, 17)]  # page 1: page 0's size
                if magic != _LMDB_MAGIC or page_size not in allowed:
                    break
                metas.append((txnid, last_page, page_size))
    except OSError as e:
        raise ValueError(f"cannot read the data file of store {path!r} ({e.strerror}); {hint}") from None
    if not metas:
        raise ValueError(f"store {path!r} is damaged: its data.mdb ({size:,} bytes) has no valid LMDB header; {hint}")
    _, last_page, page_size = max(metas)
    needed = (last_page + 1) * page_size
    if size < needed:
        raise ValueError(f"store {path!r} is damaged: its data.mdb is truncated ({size:,} bytes, LMDB needs "
                         f"{needed:,}); {hint}")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The store's manifest, checked: a clear error for a non-store or an unknown format version."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no packed store at {path!r}: create one with `torchspeed pack SRC {path}`")
    damaged = looks_damaged(path)
    if damaged:
        raise ValueError(f"store {path!r} is damaged: {damaged}; re-pack it (`torchspeed pack SRC {path} --overwrite`)")
    if not is_store(path):
        raise ValueError(f"{path!r} is not a torchspeed packed store (no {MANIFEST} and data.mdb); "
                         f"create one with `torchspeed pack SRC DST`")
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError, MemoryError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else e
        raise ValueError(f"the manifest of store {path!r} is unreadable ({why}); re-pack the store") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != STORE_KIND:
        raise ValueError(f"{path!r} is not a torchspeed packed store (its manifest has no kind {STORE_KIND!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"store {path!r} has format version {version!r}, this torchspeed reads version "
                         f"{FORMAT_VERSION}; re-pack it with this version (`torchspeed pack`)")
    for k in ("count", "classes", "labels", "crc32", "encoding"):
        if k not in manifest:
            raise ValueError(f"the manifest of store {path!r} lacks {k!r}; re-pack the store")
    why = _manifest_problem(manifest)
    if why:
        raise ValueError(f"the manifest of store {path!r} is damaged: {why}; re-pack the store")
    return manifest


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with the types and sizes of the manifest's fields that readers use, or None."""
    count, classes = manifest["count"], manifest["classes"]
    if type(count) is not int or count < 0:
        return f"'count' is {count!r}, not a number of samples"
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        return "'classes' is not a list of class names"
    if manifest["encoding"] not in ENCODING_CODES:
        return f"'encoding' is {manifest['encoding']!r}, not one of {', '.join(ENCODING_CODES)}"
    for key, high in (("labels", len(classes) - 1), ("crc32", 2 ** 32 - 1)):
        values = manifest[key]
        if not isinstance(values, list) or len(values) != count:
            return f"{key!r} is not a list of {count} numbers (one per sample)"
        if any(type(v) is not int for v in values):
            bad = next(v for v in values if type(v) is not int)
            return f"{key!r} holds {bad!r}, not an integer"
        if values and not 0 <= min(values) <= max(values) <= high:
            return f"{key!r} holds {min(values) if min(values) < 0 else max(values)}, outside 0..{high}"
    return None


# One LMDB environment per (path, process): py-lmdb refuses to open a path twice in a process, and a
# handle inherited through fork must never be used by the child (hence the pid in the key).
_ENVS: dict[tuple[str, int], list[Any]] = {}
# Two threads' first reads must not both open the environment. Re-entrant: a dataset collected while
# this thread opens another (its __del__ runs inside the open) releases its handle under the same lock.
_ENVS_LOCK = threading.RLock()


def _acquire_env(path: str) -> Any:
    key = (path, os.getpid())
    with _ENVS_LOCK:
        entry = _ENVS.get(key)
        if entry is None:
            lmdb = lmdb_module()
            check_data_file(path)  # also in workers that never ran __init__ (spawn): no SIGBUS on a truncated file
            try:
                env = lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False, subdir=True)
            except lmdb.Error as e:
                raise ValueError(f"cannot open the LMDB data of store {path!r}: {e}; re-pack it "
                                 f"(`torchspeed pack SRC {path} --overwrite`)") from None
            entry = _ENVS[key] = [env, 0]
        entry[1] += 1
        return entry[0]


def _close_inherited_envs() -> None:
    """In a forked child: close the parent's handles (py-lmdb's already-open guard survives fork)."""
    for key in [k for k in _ENVS if k[1] != os.getpid()]:
        with contextlib.suppress(Exception):
            _ENVS.pop(key)[0].close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_envs)


def _release_env(path: str) -> None:
    with _ENVS_LOCK:
        entry = _ENVS.get((path, os.getpid()))
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                entry[0].close()
                del _ENVS[(path, os.getpid())]


class PackedDataset:
    """Map-style dataset over a packed store: `ds[i] -> (uint8 HWC ndarray, int label)`.

    Random access, `len`, `classes`, `targets`. `in_memory=True` reads the whole store once into one
    numpy buffer plus an offset index: forked workers then share those pages (a list of Python bytes
    objects would be copied page by page as reference counts change). Every read checks the record's
    CRC32 against the manifest (`verify=False` skips it).
    """

    def __init__(self, path: str | os.PathLike, in_memory: bool = False, verify: bool = True):
        self.path = os.path.abspath(os.fspath(path))
        self.manifest = read_manifest(self.path)
        check_data_file(self.path)  # a truncated data.mdb would kill every reader with SIGBUS
        self.classes: list[str] = list(self.manifest["classes"])
        self.targets: list[int] = [int(t) for t in self.manifest["labels"]]
        self.encoding: str = self.manifest["encoding"]
        self.verify = verify
        self._crc = np.asarray(self.manifest["crc32"], dtype=np.uint32)
        self._env: Any = None
        self._pid = os.getpid()
        self._open_lock = threading.Lock()
        self._local = threading.local()  # per thread: a read transaction
        self._blob: np.ndarray | None = None
        self._offsets: np.ndarray | None = None
        if in_memory:
            self._load_into_memory()

    def __len__(self) -> int:
        return int(self.manifest["count"])

    @property
    def in_memory(self) -> bool:
        return self._blob is not None

    def _environment(self) -> Any:
        """This process's LMDB handle (opened on first access; one inherited through fork is dropped)."""
        env = self._env
        if env is not None and self._pid == os.getpid():
            return env
        with self._open_lock:
            if self._env is None or self._pid != os.getpid():
                self._env = _acquire_env(self.path)
                self._pid = os.getpid()
            return self._env

    def _transaction(self) -> Any:
        """This thread's read transaction, kept open: begin/abort per read would hand the GIL over
        twice more per record, and with several decoding threads every hand-over is a wait."""
        env = self._environment()
        local = self._local
        if getattr(local, "env", None) is not env:  # first read in this thread, or the store was reopened
            local.txn, local.env = env.begin(), env
        return local.txn

    def _drop_transaction(self) -> None:
        """End this thread's read transaction; the next read begins a new one."""
        txn, self._local.txn, self._local.env = getattr(self._local, "txn", None), None, None
        if txn is not None:
            with contextlib.suppress(Exception):
                txn.abort()

    def _load_into_memory(self) -> None:
        """Copy every record into one contiguous buffer (offsets[i]:offsets[i+1] is record i)."""
        try:
            sizes = [len(self._raw(i)) for i in range(len(self))]
            offsets = np.zeros(len(self) + 1, np.int64)
            np.cumsum(sizes, out=offsets[1:])
            blob = np.empty(int(offsets[-1]), np.uint8)
            for i in range(len(self)):
                blob[offsets[i]:offsets[i + 1]] = np.frombuffer(self._raw(i), np.uint8)
        finally:
            self.close()
        self._blob, self._offsets = blob, offsets

    def _raw(self, index: int) -> Any:
        if self._blob is not None:
            return memoryview(self._blob[self._offsets[index]:self._offsets[index + 1]])
        try:
            value = self._transaction().get(key_of(index))  # bytes (a copy): no tie to the transaction
        except lmdb_module().Error as e:  # a corrupted page: MDB_CORRUPTED, MDB_PAGE_NOTFOUND
            self._drop_transaction()  # a failed read leaves it unusable (MDB_BAD_TXN) for every later record
            raise ValueError(f"store {self.path!r} is damaged: reading record {index} failed ({e}); re-pack it "
                             f"(`torchspeed pack SRC {self.path} --overwrite`)") from None
        if value is None:
            raise ValueError(f"store {self.path!r} has no record {index} although its manifest counts "
                             f"{len(self)}; the store is damaged, re-pack it")
        return value

    def record(self, index: int) -> Record:
        """The sample's header and still-encoded payload (what the loader decodes, cropped)."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a store of {n} samples")
        index %= n
        raw = self._raw(index)
        if self.verify and zlib.crc32(raw) != int(self._crc[index]):
            raise ValueError(f"record {index} of store {self.path!r} is corrupt (CRC32 mismatch); re-pack the store")
        if len(raw) < HEADER.size:
            raise ValueError(f"record {index} of store {self.path!r} is shorter than its header; re-pack the store")
        magic, code, channels, height, width, label = HEADER.unpack_from(raw)
        if magic != MAGIC or code not in ENCODINGS:
            raise ValueError(f"record {index} of store {self.path!r} has an unknown header; re-pack the store")
        why = image_size_error(width, height)  # before a decoder or a reshape trusts the size
        if why:
            raise ValueError(f"{self.name(index)} {why}; pack refuses such images: the store is damaged or was "
                             "not made by pack, re-pack it")
        payload = memoryview(raw)[HEADER.size:]  # no copy of the JPEG bytes (the decoders take any buffer)
        if ENCODINGS[code] == "raw":
            if channels != 3 or len(payload) != height * width * channels:
                raise ValueError(f"{self.name(index)} holds {len(payload):,} bytes, not the {height}x{width}x"
                                 f"{channels} pixels its header says; re-pack the store")
            payload = np.frombuffer(payload, np.uint8).reshape(height, width, channels)
        return Record(ENCODINGS[code], payload, height, width, label)

    def name(self, index: int) -> str:
        """What sample `index` is, for error messages: its record in this store."""
        return f"record {index} of store {self.path!r}"

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        rec = self.record(index)
        try:
            return decode_record(rec), rec.label
        except Exception as e:
            raise ValueError(f"cannot decode {self.name(index)}: {type(e).__name__}: {e}; re-pack the store") from None

    def close(self) -> None:
        """Drop this process's read handle (it reopens on the next access)."""
        with self._open_lock:
            if self._env is not None and self._pid == os.getpid():
                _release_env(self.path)
            self._env = None

    def __getstate__(self) -> dict[str, Any]:
        # The LMDB handle must not travel to a worker (fork or spawn): each process opens its own.
        state = self.__dict__.copy()
        state["_env"] = None
        del state["_open_lock"], state["_local"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open_lock, self._local = threading.Lock(), threading.local()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return (f"PackedDataset({self.path!r}, {len(self)} samples, {len(self.classes)} classes, "
                f"{self.encoding}{', in memory' if self.in_memory else ''})")
