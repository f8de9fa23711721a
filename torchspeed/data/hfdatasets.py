"""Hugging Face `datasets` with an `Image` column, read as records (see data/arrow.py).

Two ways in: a `datasets.Dataset` object (its Arrow table and its row map after `select`/`shuffle`/
`filter`), or a folder written by `save_to_disk` (its `state.json`, `dataset_info.json` and Arrow files,
memory-mapped with pyarrow alone: `datasets` need not even be imported). The image column is the
`Image` feature and the label column the `ClassLabel` feature (whose names become `classes`), else an
integer column named label, labels, target or cls; `image_column=` / `label_column=` name others.
"""
from __future__ import annotations

import os
from typing import Any

from torchspeed.data.arrow import ArrowImages, file_identity, label_values, pyarrow_module
from torchspeed.data.format_guard import DatasetError, damage_named, inside, read_json
from torchspeed.images import quoted

__all__ = ["hf_images", "is_hf_dataset", "is_hf_folder"]

LABEL_NAMES = ("label", "labels", "target", "targets", "cls", "class", "fine_label")
SAVE_AGAIN = "save the dataset again (Dataset.save_to_disk)"
METADATA = ("dataset_dict.json", "state.json", "dataset_info.json")


def is_hf_dataset(data: Any) -> bool:
    """Whether `data` is a `datasets.Dataset` (known by its module, so `datasets` is never imported here)."""
    return type(data).__module__.startswith("datasets.") and hasattr(data, "features") and hasattr(data, "data")


def is_hf_folder(path: str) -> bool:
    """Whether `path` is a folder written by `Dataset.save_to_disk` (or `DatasetDict.save_to_disk`): it holds one
    of their metadata files (one missing or damaged is then named, not read as an image folder)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, name)) for name in METADATA)


def _feature_types(features: Any, where: str) -> dict[str, tuple[str, list[str]]]:
    """column -> (feature type name, class names) from a `Features` object or dataset_info.json's dict (checked:
    a mapping of columns, class names a list of strings)."""
    if not hasattr(features, "items"):
        raise DatasetError(f"{where}: its features are a {type(features).__name__}, not a mapping of columns; it is "
                           f"damaged, {SAVE_AGAIN}")
    out = {}
    for name, f in features.items():
        kind, names = (f.get("_type", ""), f.get("names")) if isinstance(f, dict) else (type(f).__name__,
                                                                                        getattr(f, "names", None))
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise DatasetError(f"{where}: the class names of its column {name!r} are not a list of strings; it is "
                               f"damaged, {SAVE_AGAIN}")
        out[str(name)] = (str(kind), list(names or []))
    return out


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


def _read_table(folder: str, files: list[str], where: str) -> Any:
    """The Arrow files of a save_to_disk folder as one table (memory-mapped; each file's buffers validated, so
    damage is found here, naming the file, not as a crash or garbage later)."""
    pa = pyarrow_module()
    tables = []
    for name in files:
        with damage_named(f"{where}: its file {name!r}", SAVE_AGAIN):
            with pa.memory_map(os.path.join(folder, name)) as source:
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:
                    table = pa.ipc.open_file(source).read_all()
            table.validate(full=True)
            tables.append(table)
    with damage_named(f"{where}: the table its files {', '.join(map(repr, files))} make", SAVE_AGAIN):
        return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


class _FromFolder:
    """Loads the columns of a `save_to_disk` folder (memory-mapped; reopened by each process)."""

    def __init__(self, folder: str, files: list[str], indices: list[str], image: str, label: str, where: str):
        self.folder, self.files, self.indices, self.image, self.label, self.where = folder, files, indices, image, label, where

    def __call__(self) -> tuple[Any, list[int], Any]:
        table = _read_table(self.folder, self.files, self.where)
        rows = _read_table(self.folder, self.indices, self.where).column(0).to_numpy() if self.indices else None
        return table.column(self.image), label_values(table, self.label, self.where), rows


def _folder_state(folder: str) -> tuple[list[str], list[str], dict[str, Any]]:
    """(data files, row-map files, features) of a save_to_disk folder, with one clear error for each problem:
    each metadata file read as data (format_guard.read_json), each file it lists kept inside the folder."""
    where = f"Hugging Face dataset {quoted(folder)}"
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        splits = read_json(os.path.join(folder, "dataset_dict.json"), where, repair=SAVE_AGAIN).get("splits")
        splits = [str(s) for s in splits] if isinstance(splits, list) else []
        raise DatasetError(f"{quoted(folder)} holds a DatasetDict (splits: {', '.join(splits)}); give one split's "
                           f"folder, e.g. {quoted(os.path.join(folder, splits[0] if splits else 'train'))}")
    state = read_json(os.path.join(folder, "state.json"), where, repair=SAVE_AGAIN)
    info = read_json(os.path.join(folder, "dataset_info.json"), where, repair=SAVE_AGAIN)
    listed = {}
    for key in ("_data_files", "_indices_data_files"):
        entries = state.get(key) or []
        if not isinstance(entries, list) or not all(isinstance(d, dict) and "filename" in d for d in entries):
            raise DatasetError(f"{where}: the {key!r} of its state.json is not a list of files; it is damaged, "
                               f"{SAVE_AGAIN}")
        listed[key] = [d["filename"] for d in entries]
        for name in listed[key]:
            if not os.path.isfile(inside(folder, name, where, "state.json", SAVE_AGAIN)):
                raise DatasetError(f"{where} lacks its file {name!r} (state.json lists it); {SAVE_AGAIN}")
    if not listed["_data_files"]:
        raise DatasetError(f"{where}: its state.json lists no data files; it is damaged, {SAVE_AGAIN}")
    if "features" not in info:
        raise DatasetError(f"{where}: its dataset_info.json has no features; it is damaged, {SAVE_AGAIN}")
    return listed["_data_files"], listed["_indices_data_files"], info["features"]


def hf_images(data: Any, image_column: str | None = None, label_column: str | None = None) -> ArrowImages:
    """A `datasets.Dataset` or a `save_to_disk` folder as a record source (ArrowImages)."""
    if is_hf_dataset(data):
        table = getattr(data.data, "table", data.data)
        where = f"the dataset with {len(data)} rows" + (f" ({data.info.dataset_name})" if getattr(
            getattr(data, "info", None), "dataset_name", None) else "")
        image, label, classes = _columns(_feature_types(data.features, where), table, image_column, label_column,
                                         where)
        cache = [f["filename"] for f in (getattr(data, "cache_files", None) or [])]
        identity = {"hf_dataset": len(data), "columns": [image, label],
                    "fingerprint": getattr(data, "_fingerprint", None),
                    "files": file_identity(cache) if cache else None}
        return ArrowImages(_FromDataset(data, image, label, where), classes, where, identity,
                           repair="build the dataset again", label_hint=_label_hint(label))
    folder = os.path.abspath(os.fspath(data))
    files, indices, features = _folder_state(folder)
    where = f"Hugging Face dataset {quoted(folder)}"
    table = _read_table(folder, files, where)
    image, label, classes = _columns(_feature_types(features, where), table, image_column, label_column, where)
    identity = {"hf_folder": folder, "columns": [image, label],
                "files": file_identity([os.path.join(folder, f) for f in files + indices])}
    return ArrowImages(_FromFolder(folder, files, indices, image, label, where), classes, where, identity,
                       repair=SAVE_AGAIN, label_hint=_label_hint(label))


def _label_hint(column: str) -> str:
    """What to do about a label that is not a class index: a ClassLabel of -1 is datasets' "no label"."""
    return (f"a label of -1 is a row without one: leave such rows out first (dataset.filter(lambda y: y >= 0, "
            f"input_columns={column!r})), or name the right column with label_column=")
