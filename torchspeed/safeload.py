"""The one way torchspeed reads a torch file a user hands in (weights, checkpoints, artifacts):
`torch.load(weights_only=True)`, so nothing in the file can run code, with one clear error naming the
file when it is missing, empty, truncated, not a torch file, or holds pickled Python objects.

The message never suggests `weights_only=False`: a file that needs it is refused, not opened unsafely.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch

__all__ = ["load_torch_file", "UnsafeFileError"]


class UnsafeFileError(ValueError):
    """A file holds pickled Python objects (code could run on load), so it is not read."""


def load_torch_file(path: str | os.PathLike, *, what: str = "file", map_location: Any = "cpu") -> Any:
    """Read a `torch.save`d file of tensors and plain types; ValueError naming `what` and `path` otherwise."""

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what} {path!r} is a directory, not a file")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{what} {path!r} is empty (0 bytes): it was not written completely; re-create it")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = str(e).strip().splitlines()
        # torch's message suggests weights_only=False; report only what the file holds
        culprit = next((line.strip() for line in detail if "GLOBAL" in line or "Unsupported" in line), "")
        raise UnsafeFileError(
            f"{what} {path!r} holds pickled Python objects, which torchspeed never loads because they could "
            f"run code{f' ({culprit[:160]})' if culprit else ''}: save tensors and plain types only "
            "(e.g. model.state_dict())") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{what} {path!r} cannot be read as a torch file (damaged or truncated?): "
                         f"{first[:200]}") from None
