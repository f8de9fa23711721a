"""Images kept as encoded bytes in Arrow columns, read as records without going through Python objects.

Hugging Face `datasets` (an `Image` column: a struct of `bytes` and `path`) and LitData's chunks (a
binary column in each chunk's Arrow footer) keep each image's file bytes in an Arrow binary array: one
buffer of offsets and one of data, memory-mapped from the files. Reading them as numpy views once makes
a sample's bytes one slice (no pyarrow call, no copy, no PIL) handed to the loader's measured decoder;
the labels are one integer column read once, so the count and the labels are known up front.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from torchspeed.data.format_guard import DatasetError, checked_labels, damage_named
from torchspeed.data.record import Record, encoded_record
from torchspeed.images import read_image_file
from torchspeed.optional import optional

__all__ = ["ArrowImages", "pyarrow_module", "binary_views", "file_identity", "label_values"]


def pyarrow_module() -> Any:
    return optional("pyarrow", "hf", "reading Hugging Face datasets and LitData chunks")


def binary_views(column: Any) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None, list | None]]:
    """Per chunk of an Arrow column of images: (offsets, data, nulls, paths) as numpy views of its
    buffers. The column is binary, or a struct with a binary `bytes` field (and a `path` field, read for
    the rows whose bytes are null: images kept as files beside the dataset)."""
    pa = pyarrow_module()
    chunks = column.chunks if hasattr(column, "chunks") else [column]
    out = []
    for chunk in chunks:
        paths = None
        if pa.types.is_struct(chunk.type):
            names = [chunk.type.field(i).name for i in range(chunk.type.num_fields)]
            if "bytes" not in names:
                raise ValueError(f"the image column is a struct of {names}, with no 'bytes' field")
            fields = dict(zip(names, chunk.flatten()))  # flatten() applies the struct's own offset
            binary = fields["bytes"]
            if "path" in fields and binary.null_count:
                paths = fields["path"].to_pylist()
        else:
            binary = chunk
        if not (pa.types.is_binary(binary.type) or pa.types.is_large_binary(binary.type)):
            raise ValueError(f"the image column holds {binary.type}, not encoded image bytes (binary)")
        width = np.int64 if pa.types.is_large_binary(binary.type) else np.int32
        buffers = binary.buffers()
        offsets = np.frombuffer(buffers[1], dtype=width)[binary.offset:binary.offset + len(binary) + 1]
        data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.empty(0, np.uint8)
        nulls = binary.is_null().to_numpy(zero_copy_only=False) if binary.null_count else None
        out.append((offsets, data, nulls, paths))
    return out


class ArrowImages:
    """A record source over Arrow columns: encoded image bytes and integer labels, one row per sample.

    `load()` returns (image column, label values, row map or None): it is called again in each process
    that unpickles the source (a spawned worker), so the memory-mapped files are opened there rather than
    copied through a pipe. `where` names the data in errors; `identity` is what remembered loader
    decisions know it by; `row_name(i)` names row i (a key, an original row number); `repair` says what to
    do about damage; `label_hint`, about a label that is not a class index. Labels are checked against
    `classes` (or a bound, where there are none) by the guard every format opens through (format_guard.py).
    """

    def __init__(self, load: Callable[[], tuple[Any, Sequence[int], Sequence[int] | None]], classes: Sequence[str],
                 where: str, identity: dict[str, Any], row_name: Callable[[int], str] | None = None,
                 repair: str = "write the dataset again", label_hint: str = ""):
        self._load, self.where, self._identity, self._row_name = load, where, identity, row_name
        self.repair = repair
        self._open()
        self.targets, self.classes = checked_labels(self.targets, classes, self.name, label_hint)

    def _open(self) -> None:
        with damage_named(self.where, self.repair):  # a library's error inside names the data, not a traceback
            column, labels, rows = self._load()
            self._views = binary_views(column)
            sizes = [len(o) - 1 for o, _, _, _ in self._views]
            self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            labels = np.asarray(labels)
            if len(labels) != int(self._starts[-1]):
                raise DatasetError(f"{self.where} has {int(self._starts[-1])} images but {len(labels)} labels; it is "
                                   f"damaged, {self.repair}")
            if rows is not None:  # sample -> table row, each checked to be a row of the table
                rows = np.asarray(rows)
                if rows.dtype.kind not in "iu":
                    raise DatasetError(f"{self.where}: its row map holds {rows.dtype}, not row numbers; it is "
                                       f"damaged, {self.repair}")
                outside = rows[(rows >= len(labels)) | (rows < 0 if rows.dtype.kind == "i" else False)]
                if len(outside):
                    raise DatasetError(f"{self.where}: its row map names row {outside[0]}, but the table has "
                                       f"{len(labels)} rows; it is damaged, {self.repair}")
                rows = rows.astype(np.int64)
            self._rows = rows
            self.targets = (labels if rows is None else labels[rows]).tolist()

    def __len__(self) -> int:
        return len(self.targets)

    def identity(self) -> dict[str, Any]:
        return dict(self._identity)

    def _row(self, index: int) -> int:
        return int(self._rows[index]) if self._rows is not None else index

    def name(self, index: int) -> str:
        """What sample `index` is, for error messages: its row (and key, where the format has one)."""
        row = self._row(index)
        return f"{self._row_name(row) if self._row_name else f'row {row}'} of {self.where}"

    def record(self, index: int) -> Record:
        """The row's image bytes (a view into the memory-mapped file) and label; a JPEG stays encoded."""
        row = self._row(index)
        chunk = int(np.searchsorted(self._starts, row, side="right")) - 1
        offsets, data, nulls, paths = self._views[chunk]
        local = row - int(self._starts[chunk])
        try:
            if nulls is not None and nulls[local]:
                path = paths[local] if paths is not None else None
                if not path:
                    raise ValueError("its image is missing (null)")
                payload: Any = read_image_file(path)  # a regular file: a FIFO there is refused, not waited on
            else:
                payload = memoryview(data[int(offsets[local]):int(offsets[local + 1])])
            return encoded_record(payload, self.targets[index], self.name(index))
        except Exception as e:
            raise ValueError(f"cannot read {self.name(index)}: {type(e).__name__}: {e}") from None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_views"]  # numpy views of memory-mapped Arrow buffers: reopened in the new process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    def __repr__(self) -> str:
        return f"ArrowImages({self.where}, {len(self)} samples, {len(self.classes)} classes)"


def file_identity(paths: Sequence[str]) -> str:
    """Files known by path, size and modification time (a rewritten file changes it), as a short hash."""
    stats = [(os.path.abspath(p), (st := os.stat(p)).st_size, st.st_mtime_ns) for p in paths]
    return hashlib.sha256(repr(stats).encode()).hexdigest()[:16]


def label_values(table: Any, column: str, where: str) -> np.ndarray:
    """An integer label column as a numpy array, checked: a clear error for names, floats or empty rows (the
    values themselves are checked against the classes by ArrowImages)."""
    pa = pyarrow_module()
    col = table.column(column)
    if not pa.types.is_integer(col.type):
        raise DatasetError(f"the label column {column!r} of {where} holds {col.type}, not integer class indices; "
                           "name the right one with label_column=")
    if col.null_count:
        raise DatasetError(f"the label column {column!r} of {where} has {col.null_count} empty rows")
    return col.to_numpy()
