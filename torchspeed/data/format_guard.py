"""What every dataset format is held to when it opens (tar shards, Hugging Face folders and Datasets, LitData
directories), checked here once for all of them.

Why one guard: each format reads files a user was handed (a crafted or damaged `state.json`, `index.json`, Arrow
file, tar member), and each used to fail its own way: a library's traceback naming no file, a label of 2**40
turned into a list of 2**40 class names, a file name with `../` read from outside the dataset. Here:

- damage is one `DatasetError` (a ValueError) naming the file (and the shard, key, row or chunk): whatever a
  reader raises inside `damage_named(...)` becomes one, with the reader's own words and what to do;
- a label is a class index, checked before anything is allocated from it: from 0 to the number of class names
  less one, or below `MAX_CLASSES` where the format names no classes (the classes are then 0..max);
- a JSON file of metadata is read with a size and depth bound and must hold the type expected;
- a file that metadata names (a data file, a chunk) stays inside the dataset folder: a plain relative name,
  never absolute, never through `..`.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["DatasetError", "MAX_CLASSES", "MAX_METADATA_BYTES", "label_problem", "checked_labels", "read_json",
           "inside", "damage_named"]

# The most classes a label may number when a format names none: a classifier's last layer over a million classes
# is already gigabytes; a label beyond it is an id (or damage), and `classes` would be built from it.
MAX_CLASSES = 1_000_000
# The largest metadata file (state.json, index.json, a cached tar index) read whole: far above any real one.
MAX_METADATA_BYTES = 256 << 20


class DatasetError(ValueError):
    """A dataset that cannot be read as it is, named with its file and what to do (one line on the command line)."""


def label_problem(label: Any, n_classes: int | None) -> str | None:
    """Why `label` is not a class index among `n_classes` (None: the format names no classes, so any index
    below MAX_CLASSES), worded to follow "its label is ..."; None when it is one."""
    if isinstance(label, bool) or not isinstance(label, (int, np.integer)):
        return f"{label!r}, not an integer class index"
    if label < 0:
        return f"{label}, not a class index (they count from 0)"
    if n_classes is not None and label >= n_classes:
        return f"{label}, outside its {n_classes} classes (0..{n_classes - 1})"
    if label >= MAX_CLASSES:
        return (f"{label}, more than the {MAX_CLASSES:,} classes a label may number (a class index counts from 0; "
                "an id or a hash is not one)")
    return None


def checked_labels(labels: Sequence[int] | np.ndarray, classes: Sequence[str], name_of: Callable[[int], str],
                   hint: str = "") -> tuple[list[int], list[str]]:
    """(labels as ints, class names): each label checked to be a class index of `classes` (when the format
    names them) or below MAX_CLASSES (the classes are then "0".."max"), vectorised, before the class list is
    made from them. The first label that is not is a DatasetError naming its sample (`name_of(i)`), with how
    many others are wrong, and `hint` (what to do)."""
    n = len(classes) if classes else None
    values = np.asarray(labels)  # int64 when the labels fit, objects for Python ints that do not
    if values.dtype.kind in "iu":
        high = n if n is not None else MAX_CLASSES
        bad = np.flatnonzero((values < 0) | (values >= high)) if values.dtype.kind == "i" else np.flatnonzero(values >= high)
    else:  # Python ints of any size (tar labels, cached indexes), or something that is no integer at all
        bad = np.asarray([i for i, y in enumerate(values.tolist()) if label_problem(y, n) is not None], dtype=np.int64)
    if len(bad):
        i = int(bad[0])
        more = f" ({len(bad) - 1} more such labels)" if len(bad) > 1 else ""
        y = values[i].item() if isinstance(values[i], np.generic) else values[i]
        raise DatasetError(f"{name_of(i)} has label {label_problem(y, n)}{more}{'; ' + hint if hint else ''}")
    out = values.tolist()
    names = list(classes) if classes else [str(c) for c in range(max(out, default=-1) + 1)]
    return out, names


def read_json(path: str, what: str, expect: type = dict, repair: str = "write the dataset again") -> Any:
    """The JSON file `path` (a dataset's metadata, described by `what` in errors: "Hugging Face dataset
    '/d/x.hf'"), checked to be no larger than MAX_METADATA_BYTES, nested no deeper than Python's parser
    allows, and of type `expect`; otherwise one DatasetError naming the file and `repair`, what to do."""
    name = os.path.basename(path)
    try:
        size = os.path.getsize(path)
        if size > MAX_METADATA_BYTES:
            raise DatasetError(f"{what}: its {name} is {size:,} bytes, more than metadata can be "
                               f"({MAX_METADATA_BYTES:,}): damaged, or not the file the format writes; {repair}")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except DatasetError:
        raise
    except FileNotFoundError:
        raise DatasetError(f"{what} has no {name}: it is incomplete; {repair}") from None
    except (OSError, ValueError, RecursionError, MemoryError) as e:  # UnicodeDecodeError and JSON errors are ValueErrors
        why = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {_one_line(str(e))}"
        raise DatasetError(f"{what}: its {name} is not readable JSON ({why}); it is damaged, {repair}") from None
    if not isinstance(doc, expect):
        raise DatasetError(f"{what}: its {name} holds a JSON {type(doc).__name__}, not the {expect.__name__} the "
                           f"format writes; it is damaged, {repair}")
    return doc


def inside(folder: str, name: Any, what: str, listed_in: str, repair: str = "write the dataset again") -> str:
    """The path of the file `name` that `listed_in` (a metadata file of the dataset folder `folder`) lists: a
    plain relative name inside the folder. An absolute name, one through `..`, or not a string is a
    DatasetError: metadata must never make a reader open a file outside the dataset it describes."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise DatasetError(f"{what}: its {listed_in} lists a file named {name!r}, which is not a file name; it "
                           f"is damaged, {repair}")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts:
        raise DatasetError(f"{what}: its {listed_in} lists the file {name!r}, outside the dataset folder; only "
                           "files inside it are read (a crafted or damaged listing)")
    return os.path.join(folder, name)


@contextlib.contextmanager
def damage_named(what: str, hint: str) -> Iterator[None]:
    """Whatever the block raises (a library's own error: pyarrow's "Invalid flatbuffers message", an
    AttributeError on a list where a mapping was due, a RecursionError) becomes one DatasetError: "`what` is
    damaged or not what the format writes (<the error>); `hint`". A DatasetError raised inside passes as it is."""
    try:
        yield
    except DatasetError:
        raise
    except FileNotFoundError as e:
        raise DatasetError(f"{what} is missing ({e.strerror or e}); {hint}") from None
    except Exception as e:  # noqa: BLE001 -- any failure of a reader here is damage to name, not a traceback
        text = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {_one_line(str(e))}"
        raise DatasetError(f"{what} is damaged or not what the format writes ({text}); {hint}") from None


def _one_line(text: str, most: int = 300) -> str:
    """A library's message as one line of at most `most` characters (pyarrow's span lines: a schema, say)."""
    text = " ".join(text.split())
    return text if len(text) <= most else text[:most - 3] + "..."

