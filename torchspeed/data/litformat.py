"""A LitData optimized directory (what `litdata.optimize` writes) read as records, where its layout allows.

Its `index.json` lists the chunks and their item counts (the sample count is known up front). LitData
0.2.7x writes each chunk of dict items with an Arrow table of the rows after the item data (the "Arrow
footer"): an image stored as its file's bytes (a `bytes` field) is a binary column there, read
memory-mapped (data/arrow.py) and decoded by the loader's measured decoder. Other layouts (compressed or
encrypted chunks, PIL or tensor items, no Arrow table) are refused with the reason: reading them means
litdata's deserialisers (PIL per sample), which is what the pipeline avoids.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from torchspeed.data.arrow import ArrowImages, file_identity, label_values, pyarrow_module
from torchspeed.data.format_guard import MAX_METADATA_BYTES, DatasetError, damage_named, inside, read_json
from torchspeed.images import quoted

__all__ = ["is_litdata_dir", "litdata_images"]

_FOOTER_MAGIC = b"LDARW01\0"  # litdata's item_loader: ... IPC file, uint32 length, magic
LABEL_NAMES = ("label", "labels", "target", "targets", "cls", "class")
OPTIMIZE_AGAIN = "optimize the data again (litdata.optimize)"


def is_litdata_dir(path: str) -> bool:
    """Whether `path` is a LitData optimized directory: its index.json has chunks and a config, or, where that
    file is damaged, the folder holds chunk files or nothing an image folder would (no sub-directories): then
    the damage is named, not read as an image folder."""
    index = os.path.join(path, "index.json")
    if not os.path.isfile(index):
        return False
    try:
        if os.path.getsize(index) <= MAX_METADATA_BYTES:  # a larger one is named as damaged by litdata_images
            with open(index, encoding="utf-8") as f:
                doc = json.load(f)
            if isinstance(doc, dict) and "chunks" in doc and "config" in doc:
                return True
    except (OSError, ValueError, RecursionError, MemoryError):
        pass
    entries = list(os.scandir(path))
    return any(e.name.startswith("chunk-") and e.name.endswith(".bin") for e in entries) or not any(
        e.is_dir() for e in entries)


def _footer_table(path: str, where: str) -> Any:
    """The Arrow table at the end of one chunk file (memory-mapped, its buffers validated), or None when it has
    none; a damaged one is a DatasetError naming the chunk."""
    pa = pyarrow_module()
    with damage_named(f"{where}: its chunk {os.path.basename(path)!r}", OPTIMIZE_AGAIN):
        with pa.memory_map(path) as mm:
            buf = mm.read_buffer()
        if buf.size < 12 or bytes(buf[buf.size - 8:]) != _FOOTER_MAGIC:
            return None
        (length,) = struct.unpack("<I", bytes(buf[buf.size - 12:buf.size - 8]))
        start = buf.size - 12 - length
        if start < 0:
            return None
        table = pa.ipc.open_file(pa.BufferReader(buf.slice(start, length))).read_all()
        table.validate(full=True)
        return table


class _Chunks:
    """Loads the image and label columns of every chunk (picklable: reopened by each process)."""

    def __init__(self, folder: str, files: list[str], sizes: list[int], image: str, label: str, where: str):
        self.folder, self.files, self.sizes, self.image, self.label, self.where = folder, files, sizes, image, label, where

    def __call__(self) -> tuple[Any, list[int], None]:
        pa = pyarrow_module()
        tables = []
        for name, size in zip(self.files, self.sizes):  # every chunk checked, not only the first one read
            t = _footer_table(os.path.join(self.folder, name), self.where)
            missing = [c for c in (self.image, self.label) if t is not None and c not in t.column_names]
            if t is None or missing:
                why = "no Arrow table of the items" if t is None else f"no field {', '.join(map(repr, missing))}"
                raise DatasetError(f"{self.where}: its chunk {name!r} holds {why} (written by another litdata "
                                   "version or run?): optimize the data again, or read it with litdata")
            if t.num_rows != size:
                raise DatasetError(f"{self.where}: its chunk {name!r} holds {t.num_rows} items, index.json says "
                                   f"{size}; it is damaged, {OPTIMIZE_AGAIN}")
            tables.append(t.select([self.image, self.label]))
        with damage_named(f"{self.where}: the table its chunks make", OPTIMIZE_AGAIN):  # fields of different types
            table = pa.concat_tables(tables)
        return table.column(self.image), label_values(table, self.label, self.where), None


class _ItemName:
    """Names row i by its chunk file and item number there (picklable)."""

    def __init__(self, files: list[str], sizes: list[int]):
        self.files, self.starts = files, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __call__(self, row: int) -> str:
        chunk = int(np.searchsorted(self.starts, row, side="right")) - 1
        return f"item {row - int(self.starts[chunk])} of chunk {self.files[chunk]!r}"


def litdata_images(folder: str, image_column: str | None = None, label_column: str | None = None) -> ArrowImages:
    """A LitData optimized directory as a record source, or a ValueError saying why its layout cannot be read."""
    pa = pyarrow_module()
    folder = os.path.abspath(folder)
    where = f"LitData directory {quoted(folder)}"
    index = read_json(os.path.join(folder, "index.json"), where, repair=OPTIMIZE_AGAIN)  # a mapping, bounded
    config, chunks = index.get("config") or {}, index.get("chunks") or []
    if not isinstance(config, dict) or not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
        raise DatasetError(f"{where}: its index.json has no config object or list of chunks; it is damaged, "
                           f"{OPTIMIZE_AGAIN}")
    if not chunks:
        raise DatasetError(f"{where} has no chunks (an empty or unfinished litdata.optimize)")
    refuse = "; fast_loader reads LitData chunks whose dict items keep the image file's bytes, uncompressed " \
             "(litdata.optimize with fn returning {'image': open(path, 'rb').read(), 'label': y})"
    for key in ("compression", "encryption"):
        if config.get(key):
            raise ValueError(f"{where} has {key}={config[key]!r} chunks: their images are readable only through "
                             f"litdata's own deserialisers{refuse}")
    files = [c.get("filename") for c in chunks]
    sizes = [c.get("chunk_size") for c in chunks]
    bad = [n for n in sizes if type(n) is not int or n < 0]
    if bad:
        raise DatasetError(f"{where}: its index.json gives a chunk size that is not a count of items ({bad[0]!r}); "
                           f"it is damaged, {OPTIMIZE_AGAIN}")
    for name in files:
        if not os.path.isfile(inside(folder, name, where, "index.json", OPTIMIZE_AGAIN)):
            raise FileNotFoundError(f"{where} lacks its chunk {name!r} (index.json lists it)")
    first = _footer_table(os.path.join(folder, files[0]), where)
    if first is None:
        raise ValueError(f"{where}: its chunks hold no Arrow table of the items (written by another litdata "
                         f"version, or items that are not dicts){refuse}")
    names = first.column_names
    binary = [n for n in names if pa.types.is_binary(first.column(n).type) or pa.types.is_large_binary(first.column(n).type)]
    integer = [n for n in names if pa.types.is_integer(first.column(n).type)]
    for given, what in ((image_column, "image_column"), (label_column, "label_column")):
        if given is not None and given not in names:
            raise ValueError(f"{what}={given!r}: {where} has no such field (its fields: {', '.join(names)})")
    image = image_column or (binary[0] if len(binary) == 1 else next((n for n in binary if n in ("image", "jpeg", "jpg", "img")), None))
    if image is None:
        types = ", ".join(f"{n} ({first.column(n).type})" for n in names)
        raise ValueError(f"{where}: no field holds image bytes unambiguously (its fields: {types}); name it with "
                         f"image_column={refuse if not binary else ''}")
    label = label_column or next((n for n in LABEL_NAMES if n in integer), integer[0] if len(integer) == 1 else None)
    if label is None:
        raise ValueError(f"{where}: no integer label field found (its fields: {', '.join(names)}); name it with "
                         "label_column=")
    identity = {"litdata": folder, "n": sum(sizes), "columns": [image, label],
                "files": file_identity([os.path.join(folder, f) for f in ["index.json", *files]])}
    return ArrowImages(_Chunks(folder, files, sizes, image, label, where), [], where, identity,
                       row_name=_ItemName(files, sizes), repair=OPTIMIZE_AGAIN)
