"""Compression and model choice: structural pruning, knowledge distillation, backbone selection by latency,
BatchNorm statistics re-estimated on data.

Modules are named pruning / distillation / selection so that importing one never shadows the
function of the same name (`ts.compress.prune` is always the function).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torchspeed._lazy import lazy_getattr

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time each loads on first use
    from torchspeed.compress.batchnorm import recalibrate_bn
    from torchspeed.compress.cost import count_macs, count_params
    from torchspeed.compress.distillation import DistillResult, KDLoss, distill, finetune, kd_loss
    from torchspeed.compress.pruning import IMPORTANCES, PruneResult, load_pruned, prune, save_pruned
    from torchspeed.compress.selection import BackboneRow, SelectResult, select_backbone

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "prune": "pruning",
    "PruneResult": "pruning",
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
    "BackboneRow": "selection",
    "recalibrate_bn": "batchnorm",
    "count_params": "cost",
    "count_macs": "cost",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
