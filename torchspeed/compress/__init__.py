"""Compression and model choice: structural pruning, knowledge distillation, backbone selection by latency."""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "prune": "prune",
    "PruneResult": "prune",
    "PruneReport": "prune",
    "IMPORTANCES": "prune",
    "distill": "distill",
    "finetune": "distill",
    "kd_loss": "distill",
    "KDLoss": "distill",
    "DistillResult": "distill",
    "select_backbone": "select",
    "SelectResult": "select",
    "build_model": "select",
    "count_params": "measure",
    "count_macs": "measure",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"torchspeed.compress.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'torchspeed.compress' has no attribute {name!r}")
