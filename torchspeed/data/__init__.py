"""Data: demo images, the packed store, fast decoding, loaders that keep the model fed."""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "make_photo_folder": "demo",
    "demo_folder": "demo",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"torchspeed.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'torchspeed.data' has no attribute {name!r}")
