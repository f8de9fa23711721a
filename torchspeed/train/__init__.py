"""Training: accelerate() (measured precision / channels_last / compile, DDP and FSDP2 wrapping), the
Trainer, callbacks (EarlyStopping, Checkpoint) and exact, atomic resume."""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "accelerate": "acceleration",
    "Accelerated": "acceleration",
    "AccelerateReport": "acceleration",
    "Trainer": "trainer",
    "Callback": "callbacks",
    "EarlyStopping": "callbacks",
    "Checkpoint": "callbacks",
    "last_checkpoint": "checkpoint",
    "load_file": "checkpoint",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"torchspeed.train.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'torchspeed.train' has no attribute {name!r}")
