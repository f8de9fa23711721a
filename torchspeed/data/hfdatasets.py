"""Hugging Face `datasets` with an `Image` column, read as records (see data/arrow.py).

Two ways in: a `datasets.Dataset` object (its Arrow table and its row map after `select`/`shuffle`/
`filter`), or a folder written by `save_to_disk` (its `state.json`, `dataset_info.json` and Arrow files,
memory-mapped with pyarrow alone: `datasets` need not even be imported). The image column is the
`Image` feature and the label column the `ClassLabel` feature (whose names become `classes`), else an
integer column named label, labels, target or cls; `image_column=` / `label_column=` name others.
"""
from __future__ import annotations

import json
import os
from typing import Any

from torchspeed.data.arrow import ArrowImages, file_identity, label_values, pyarrow_module
from torchspeed.images import quoted

__all__ = ["hf_images", "is_hf_dataset", "is_hf_folder"]

LABEL_NAMES = ("label", "labels", "target", "targets", "cls", "class", "fine_label")


def is_hf_dataset(data: Any) -> bool:
    """Whether `data` is a `datasets.Dataset` (known by its module, so `datasets` is never imported here)."""
    return type(data).__module__.startswith("datasets.") and hasattr(data, "features") and hasattr(data, "data")


def is_hf_folder(path: str) -> bool:
    """Whether `path` is a folder written by `Dataset.save_to_disk` (or `DatasetDict.save_to_disk`)."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json"))))


def _feature_types(features: Any) -> dict[str, tuple[str, list[str]]]:
    """column -> (feature type name, class names) from a `Features` object or dataset_info.json's dict."""
    return {name: (str(f.get("_type", "")), list(f.get("names") or [])) if isinstance(f, dict)
            else (type(f).__name__, list(getattr(f, "names", None) or [])) for name, f in features.items()}


def _columns(types: dict[str, tuple[str, list[str]]], table: Any, image_column: str | None, label_column: str | None,
             where: str) -> tuple[str, str, list[str]]:
    """(image column, label column, class names): detected, or the names given, checked."""
    pa = pyarrow_module()
    names = list(table.column_names)
    for given, what in ((image_column, "image_column"), (label_column, "label_column")):
        if given is not None and given not in names:
            raise ValueError(f"{what}={given!r}: {where} has no such column (its columns: {', '.join(names)})")
    image = image_column or next((n for n, (t, _) in types.items() if t == "Image"), None)
    if image is None:
        listed = ", ".join(f"{n} ({types[n][0] if n in types else '?'})" for n in names)
        raise ValueError(f"{where} has no Image column (its columns: {listed}); name the column of encoded image "
                         "bytes with image_column=")
    label = label_column or next((n for n, (t, _) in types.items() if t == "ClassLabel"), None) or next(
        (n for n in LABEL_NAMES if n in names and pa.types.is_integer(table.column(n).type)), None)
    if label is None:
        raise ValueError(f"{where} has no label column (no ClassLabel, nor an integer column named "
                         f"{'/'.join(LABEL_NAMES)}; its columns: {', '.join(names)}); name it with label_column=")
    return image, label, types.get(label, ("", []))[1]


class _FromDataset:
    """Loads the columns of a `datasets.Dataset` (picklable: datasets pickles a memory-mapped Dataset
    by its files)."""

    def __init__(self, dataset: Any, image: str, label: str, where: str):
        self.dataset, self.image, self.label, self.where = dataset, image, label, where

    def __call__(self) -> tuple[Any, list[int], Any]:
        table = getattr(self.dataset.data, "table", self.dataset.data)
        indices = getattr(self.dataset, "_indices", None)  # the row map select/shuffle/filter leave
        rows = None if indices is None else getattr(indices, "table", indices).column(0).to_numpy()
        return table.column(self.image), label_values(table, self.label, self.where), rows


def _read_table(folder: str, files: list[str]) -> Any:
    pa = pyarrow_module()
    tables = []
    for name in files:
        with pa.memory_map(os.path.join(folder, name)) as source:
            try:
                tables.append(pa.ipc.open_stream(source).read_all())
            except pa.ArrowInvalid:
                tables.append(pa.ipc.open_file(source).read_all())
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


class _FromFolder:
    """Loads the columns of a `save_to_disk` folder (memory-mapped; reopened by each process)."""

    def __init__(self, folder: str, files: list[str], indices: list[str], image: str, label: str, where: str):
        self.folder, self.files, self.indices, self.image, self.label, self.where = folder, files, indices, image, label, where

    def __call__(self) -> tuple[Any, list[int], Any]:
        table = _read_table(self.folder, self.files)
        rows = _read_table(self.folder, self.indices).column(0).to_numpy() if self.indices else None
        return table.column(self.image), label_values(table, self.label, self.where), rows


def _folder_state(folder: str) -> tuple[list[str], list[str], dict[str, Any]]:
    """(data files, row-map files, features) of a save_to_disk folder, with one clear error for each problem."""
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        with open(os.path.join(folder, "dataset_dict.json"), encoding="utf-8") as f:
            splits = json.load(f).get("splits", [])
        raise ValueError(f"{quoted(folder)} holds a DatasetDict (splits: {', '.join(splits)}); give one split's "
                         f"folder, e.g. {quoted(os.path.join(folder, splits[0] if splits else 'train'))}")
    try:
        with open(os.path.join(folder, "state.json"), encoding="utf-8") as f:
            state = json.load(f)
        with open(os.path.join(folder, "dataset_info.json"), encoding="utf-8") as f:
            info = json.load(f)
        files = [d["filename"] for d in state["_data_files"]]
        indices = [d["filename"] for d in (state.get("_indices_data_files") or [])]
        features = info["features"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{quoted(folder)} is not a readable Hugging Face dataset folder (state.json and "
                         f"dataset_info.json as save_to_disk writes them): {type(e).__name__}: {e}") from None
    for name in files + indices:
        if not os.path.isfile(os.path.join(folder, name)):
            raise FileNotFoundError(f"the Hugging Face dataset {quoted(folder)} lacks its file {name!r} (state.json "
                                    "lists it); save the dataset again")
    return files, indices, features


def hf_images(data: Any, image_column: str | None = None, label_column: str | None = None) -> ArrowImages:
    """A `datasets.Dataset` or a `save_to_disk` folder as a record source (ArrowImages)."""
    if is_hf_dataset(data):
        table = getattr(data.data, "table", data.data)
        where = f"the dataset with {len(data)} rows" + (f" ({data.info.dataset_name})" if getattr(
            getattr(data, "info", None), "dataset_name", None) else "")
        image, label, classes = _columns(_feature_types(data.features), table, image_column, label_column, where)
        cache = [f["filename"] for f in (getattr(data, "cache_files", None) or [])]
        identity = {"hf_dataset": len(data), "columns": [image, label],
                    "fingerprint": getattr(data, "_fingerprint", None),
                    "files": file_identity(cache) if cache else None}
        return ArrowImages(_FromDataset(data, image, label, where), classes, where, identity)
    folder = os.path.abspath(os.fspath(data))
    files, indices, features = _folder_state(folder)
    where = f"Hugging Face dataset {quoted(folder)}"
    table = _read_table(folder, files)
    image, label, classes = _columns(_feature_types(features), table, image_column, label_column, where)
    identity = {"hf_folder": folder, "columns": [image, label],
                "files": file_identity([os.path.join(folder, f) for f in files + indices])}
    return ArrowImages(_FromFolder(folder, files, indices, image, label, where), classes, where, identity)
