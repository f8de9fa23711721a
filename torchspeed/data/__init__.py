"""Data: demo images, the packed store, fast decoding, loaders that keep the model fed."""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "make_photo_folder": "demo",
    "demo_folder": "demo",
    "pack": "packer",
    "PackReport": "packer",
    "PackedDataset": "store",
    "fast_loader": "loader",
    "FastLoader": "loader",
    "tune_loader": "tune",
    "LoaderSettings": "tune",
    "DevicePrefetcher": "prefetch",
    "normalize_batch": "prefetch",
    "IMAGENET_MEAN": "prefetch",
    "IMAGENET_STD": "prefetch",
    "available_backends": "decode",
    "measure_backends": "decode",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"torchspeed.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'torchspeed.data' has no attribute {name!r}")
