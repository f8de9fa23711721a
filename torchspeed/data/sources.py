"""Where samples come from: a packed store, an ImageFolder or any map-style Dataset, read as records
(`record(i)` -> encoded or decoded image + label), and subsets of them (train/val splits, evenly spread
samples for calibration and evaluation)."""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchspeed.batches import BatchFormat
from torchspeed.data.format_guard import label_problem
from torchspeed.data.hfdatasets import hf_images, is_hf_dataset, is_hf_folder
from torchspeed.data.litformat import is_litdata_dir, litdata_images
from torchspeed.data.record import (Record, UnsupportedSample, decode_record, encoded_record, integer_label,
                                     to_hwc_uint8)
from torchspeed.data.shards import TarShards, looks_like_shards
from torchspeed.data.store import PackedDataset, is_store, looks_damaged
from torchspeed.images import IMAGE_EXTENSIONS, quoted, read_image_file, scan_folder
from torchspeed.models import is_factory_spec, load_callable

log = logging.getLogger(__name__)

__all__ = ["FolderSource", "DatasetSource", "Subset", "as_source", "sample_name", "source_name", "train_val_split",
           "evenly_spread", "is_dataset_spec", "dataset_from_spec", "spec_for_tuning", "source_identity"]


class FolderSource:
    """An ImageFolder read as records: JPEG files stay encoded (decoded cropped, DCT-scaled) in workers."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.classes, self.samples = scan_folder(self.root, IMAGE_EXTENSIONS)
        self.targets = [y for _, y in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def record(self, index: int) -> Record:
        """The file's bytes (a JPEG stays encoded; its size is read from the header and checked against the
        pixel limit before anything is decoded) or, for other formats, its decoded pixels."""
        path, label = self.samples[index]
        try:
            data = read_image_file(path)  # a FIFO put there since the scan is refused, not waited on
            return encoded_record(data, label, path)
        except Exception as e:  # corrupt, truncated, not an image, a bomb: one error naming the file
            raise ValueError(self._error(index, e)) from None

    def name(self, index: int) -> str:
        """What sample `index` is, for error messages: its file."""
        return f"image {quoted(self.samples[index][0])}"

    def _error(self, index: int, e: Exception) -> str:
        text = str(e)
        if quoted(self.samples[index][0]) not in text:
            text = f"cannot read {self.name(index)}: {type(e).__name__}: {text}"
        return f"{text}; remove it, or pack the folder with --on-error skip to leave such files out"

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        rec = self.record(index)
        try:
            return decode_record(rec), rec.label
        except Exception as e:
            raise ValueError(self._error(index, e)) from None


class DatasetSource:
    """Any map-style Dataset read as decoded records: samples `(image, label)` or dicts (`image`/`label`,
    `pixel_values`/`labels`, ...: the keys `torchspeed.batches.BatchFormat` knows), the image a PIL image,
    an HWC uint8 array or a CHW uint8 tensor. `spec`: the factory it came from, named in errors."""

    def __init__(self, dataset: Any, spec: str | None = None):
        self.dataset, self.spec = dataset, spec
        self.classes = list(getattr(dataset, "classes", []) or [])

    def __len__(self) -> int:
        return len(self.dataset)

    def name(self, index: int) -> str:
        """What sample `index` is, for error messages."""
        return f"sample {index} of {self.spec or type(self.dataset).__name__}"

    def record(self, index: int) -> Record:
        """The sample as a decoded record. Whatever goes wrong is one ValueError naming the sample: the
        Dataset raising, a label that is not a class index, an image over the pixel limit;
        UnsupportedSample for a sample the pipeline does not take (see `spec_for_tuning`)."""
        try:
            sample = self.dataset[index]
        except Exception as e:
            raise ValueError(f"{self.name(index)}: the Dataset raised {type(e).__name__}: {e}") from None
        try:
            x, y = BatchFormat().split(sample)
        except ValueError:
            x, y = None, None
        if isinstance(x, dict) and len(x) == 1:  # {"pixel_values": image, "labels": y}: the one key left is the image
            (x,) = x.values()
        if x is None or y is None or isinstance(x, dict):
            what = f"a dict with keys {sorted(sample)}" if isinstance(sample, dict) else f"a {type(sample).__name__}"
            raise UnsupportedSample(f"{self.name(index)} is {what}: fast_loader takes (image, label) samples or dicts "
                                    "of one image and a label (image/label, pixel_values/labels, ...)")
        try:
            img = to_hwc_uint8(x)
            label = integer_label(y)
            why = label_problem(label, len(self.classes) or None)  # as every format's labels are checked
            if why:
                raise ValueError(f"its label is {why}")
            return Record("array", img, img.shape[0], img.shape[1], label)
        except UnsupportedSample as e:
            raise UnsupportedSample(f"{self.name(index)}: {e}") from None
        except Exception as e:
            raise ValueError(f"{self.name(index)}: {e}") from None

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]


class Subset:
    """Part of a record source, by index (a train/val split, or samples spread over a source)."""

    def __init__(self, source: Any, indices: Sequence[int]):
        self.source, self.indices = source, list(indices)
        self.classes = list(getattr(source, "classes", []))
        # names the subset in errors (a Dataset's by identity)
        whole = getattr(source, "root", getattr(source, "path", None)) or f"{getattr(source, 'spec', None) or 'data'}" \
            f"@{id(source):x}"
        self.root = f"{whole}#{len(self.indices)}"

    def __len__(self) -> int:
        return len(self.indices)

    def record(self, i: int) -> Any:
        return self.source.record(self.indices[i])

    def name(self, i: int) -> str:
        return sample_name(self.source, self.indices[i])

    def __getitem__(self, i: int) -> Any:
        return self.source[self.indices[i]]


def source_identity(source: Any) -> dict[str, Any]:
    """What a remembered loader decision knows the data by (plain JSON), cheap to compute on every call:
    a store's path, count and its files' sizes and times; a folder's path, count, classes, its
    directories' latest change and the size and time of up to 64 files spread over it (a file added,
    removed or rewritten there changes it); a Dataset's class, spec and length; a subset's whole and
    indices."""
    if isinstance(source, Subset):
        digest = hashlib.sha256(np.asarray(source.indices, dtype=np.int64).tobytes()).hexdigest()[:16]
        return {"subset_of": source_identity(source.source), "n": len(source), "indices": digest}
    if isinstance(source, PackedDataset):
        files = sorted(os.listdir(source.path))
        return {"store": source.path, "n": len(source),
                "files": [[f, *_size_and_time(os.path.join(source.path, f))] for f in files]}
    if isinstance(source, FolderSource):
        dirs = [source.root] + [os.path.join(source.root, c) for c in source.classes]
        step = max(1, len(source.samples) // 64)
        spread = [_size_and_time(path) for path, _ in source.samples[::step]]
        return {"folder": source.root, "n": len(source), "classes": len(source.classes),
                "changed": max(_size_and_time(d)[1] for d in dirs),
                "files": hashlib.sha256(repr(spread).encode()).hexdigest()[:16]}
    if callable(getattr(source, "identity", None)):  # tar shards, Arrow columns: they know their files
        return source.identity()
    inner = source.dataset if isinstance(source, DatasetSource) else source
    return {"dataset": f"{type(inner).__module__}.{type(inner).__qualname__}", "n": len(source),
            "spec": getattr(source, "spec", None)}


def _size_and_time(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return -1, -1
    return st.st_size, st.st_mtime_ns


def sample_name(source: Any, index: int) -> str:
    """How errors name sample `index` of a source: its file, its record in a store, or its index."""
    name = getattr(source, "name", None)
    return name(index) if callable(name) else f"sample {index} of {getattr(source, 'root', type(source).__name__)}"


def source_name(source: Any) -> str:
    """How errors name a whole source: its files (a store, a folder, tar shards, a dataset folder) or its Dataset."""
    if getattr(source, "where", None):  # tar shards, Arrow columns
        return str(source.where)
    if isinstance(source, PackedDataset):
        return f"the store {quoted(source.path)}"
    if isinstance(source, FolderSource):
        return f"the folder {quoted(source.root)}"
    if isinstance(source, DatasetSource):
        return source.spec or f"the {type(source.dataset).__name__} Dataset"
    if isinstance(source, Subset):
        return f"a part of {source_name(source.source)}"
    return f"the {type(source).__name__}"


def is_dataset_spec(data: Any) -> bool:
    """Whether `data` names a Dataset factory (`package.module:factory` or `path/file.py:factory`) rather
    than a folder or store (an existing path is always a path)."""
    return isinstance(data, str) and not os.path.exists(data) and is_factory_spec(data.strip())


def dataset_from_spec(spec: str) -> Any:
    """The Dataset a factory spec builds: `package.module:factory` (importable: installed or on
    PYTHONPATH) or `path/file.py:factory`, called with no arguments; it must return a
    map-style Dataset (`__getitem__` and `__len__`). Loaded the way `torchspeed.models` loads a model
    factory; every failure is one error naming the spec."""
    spec = spec.strip()
    try:
        factory = load_callable(spec, what="dataset")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"dataset factory {spec!r}: {str(e).replace('model file', 'file')}") from None
    except Exception as e:  # the module cannot be imported, raised while importing, or has no such factory
        kind = "" if isinstance(e, ValueError) else f"{type(e).__name__}: "  # the loader's own messages need no type
        raise ValueError(f"cannot load the dataset factory {spec!r}: {kind}{e}") from None
    try:
        dataset = factory()
    except Exception as e:
        raise ValueError(f"the dataset factory {spec!r} failed: {type(e).__name__}: {e}") from None
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ValueError(f"the dataset factory {spec!r} returned a {type(dataset).__name__}, not a map-style "
                         "Dataset (an object with __getitem__ and __len__, such as a torch.utils.data.Dataset)")
    return dataset


def spec_for_tuning(spec: str) -> Any:
    """What `tune_loader` times for a Dataset factory spec: a DatasetSource (the torchspeed pipeline) when
    its samples are images the pipeline takes, else the Dataset itself (its samples are already tensors
    from its own transforms: timed as a plain DataLoader; logged at INFO). A broken first sample (the
    Dataset raising, a label that is no class index) is an error naming it."""
    source = DatasetSource(dataset_from_spec(spec), spec=spec.strip())
    try:
        source.record(0)
    except UnsupportedSample as e:
        log.info("%s; timing %s as a plain DataLoader with its own transforms", e, source.spec)
        return source.dataset
    return source


def as_source(data: Any, in_memory: bool = False, image_column: str | None = None, label_column: str | None = None,
              on_error: str = "fail") -> Any:
    """The record source `data` names: a store path -> PackedDataset; WebDataset tar shards (a brace
    pattern, a list of .tar paths, a directory of them) -> TarShards; a Hugging Face `datasets.Dataset`
    or `save_to_disk` folder, or a LitData optimized directory -> ArrowImages; a Dataset factory spec
    (`package.module:factory`, `path/file.py:factory`) -> a DatasetSource over what it returns; an
    ImageFolder path -> FolderSource; a Dataset -> itself (when it has records) or a DatasetSource.
    `image_column` / `label_column` name the image and label of the shards' members or the columns;
    `on_error` is what a shard sample without an image or label does ("fail" or "skip")."""
    columns = {"image_column": image_column, "label_column": label_column}
    if looks_like_shards(data):
        return TarShards(data, on_error=on_error, **columns)
    if isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        if is_store(path) or looks_damaged(path):  # a broken store says so (not "no class sub-directories")
            return PackedDataset(path, in_memory=in_memory)
        if is_hf_folder(path):
            return hf_images(path, **columns)
        if is_litdata_dir(path):
            return litdata_images(path, **columns)
        if is_dataset_spec(path):
            return DatasetSource(dataset_from_spec(path), spec=path.strip())
        if not os.path.exists(path):
            raise FileNotFoundError(f"no data at {path!r}: give an ImageFolder directory, a packed store, WebDataset "
                                    "tar shards (a .tar pattern, list or directory), a Hugging Face dataset folder, "
                                    "a LitData directory or a Dataset factory (package.module:factory or "
                                    "path/file.py:factory)")
        return FolderSource(path)
    if is_hf_dataset(data):
        return hf_images(data, **columns)
    if hasattr(data, "record") and hasattr(data, "__len__"):
        return data
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return DatasetSource(data)
    raise ValueError(f"data must be an ImageFolder path, a store path, tar shards, a Hugging Face dataset or a "
                     f"map-style Dataset, got {type(data).__name__}")


def train_val_split(data: Any, val_fraction: float = 0.1, seed: int = 0) -> tuple[Any, Any]:
    """(train, val) sources: DATA/train and DATA/val when a folder has both (their classes must be the
    same: labels are numbered by class, so any difference makes validation meaningless), else a seeded
    random split holding out `val_fraction` of the samples."""
    if isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        if os.path.isdir(os.path.join(path, "train")) and os.path.isdir(os.path.join(path, "val")):
            train, val = as_source(os.path.join(path, "train")), as_source(os.path.join(path, "val"))
            _check_same_classes(path, list(train.classes), list(val.classes))
            return train, val
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    source = as_source(data)
    n = len(source)
    n_val = max(1, int(round(n * val_fraction)))
    if n - n_val < 1:
        raise ValueError(f"{getattr(source, 'root', data)!r} has only {n} samples: too few to hold out a validation split")
    order = np.random.default_rng(seed).permutation(n).tolist()
    return Subset(source, sorted(order[n_val:])), Subset(source, sorted(order[:n_val]))


def _check_same_classes(path: str, train: list[str], val: list[str]) -> None:
    """ValueError naming the classes that train/ and val/ of `path` do not share (or order alike)."""
    if train == val:
        return
    only_train = [c for c in train if c not in val]
    only_val = [c for c in val if c not in train]
    differences = ([f"{_listed(only_train)} only in train/"] if only_train else []) + \
        ([f"{_listed(only_val)} only in val/"] if only_val else []) or ["the same names in another order"]
    raise ValueError(f"{os.path.join(path, 'train')!r} and {os.path.join(path, 'val')!r} have different classes "
                     f"({'; '.join(differences)}): labels are numbered by class, so validation would compare "
                     "different classes; give both the same class folders (an empty one is allowed)")


def _listed(names: list[str], most: int = 5) -> str:
    return ", ".join(map(repr, names[:most])) + (f" and {len(names) - most} more" if len(names) > most else "")


def evenly_spread(data: Any, n: int) -> Any:
    """At most `n` samples taken at even steps over a source, so every class of a sorted folder or store
    is represented (calibration and evaluation sets)."""
    source = as_source(data)
    step = max(1, len(source) // max(n, 1))
    return Subset(source, list(range(0, len(source), step))[:n])
