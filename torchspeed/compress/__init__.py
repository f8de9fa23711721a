"""Compression and model choice: structural pruning, knowledge distillation, backbone selection by latency,
BatchNorm statistics re-estimated on data.

Modules are named pruning / distillation / selection so that importing one never shadows the
function of the same name (`ts.compress.prune` is always the function).
"""
from __future__ import annotations

from torchspeed._lazy import lazy_getattr

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "prune": "pruning",
    "PruneResult": "pruning",
    "PruneReport": "pruning",
    "IMPORTANCES": "pruning",
    "save_pruned": "pruning",
    "load_pruned": "pruning",
    "distill": "distillation",
    "finetune": "distillation",
    "kd_loss": "distillation",
    "KDLoss": "distillation",
    "DistillResult": "distillation",
    "select_backbone": "selection",
    "SelectResult": "selection",
    "BackboneTiming": "selection",
    "recalibrate_bn": "batchnorm",
    "count_params": "cost",
    "count_macs": "cost",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
