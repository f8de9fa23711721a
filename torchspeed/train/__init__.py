"""Training: accelerate() (measured precision / channels_last / compile, whole or regional, DDP and FSDP2
wrapping), the Trainer, callbacks (EarlyStopping, Checkpoint), exact, atomic resume. The image-classification recipe
`torchspeed train` runs is `torchspeed.recipes.train_classifier`, a layer up (it stands on data too)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torchspeed._lazy import lazy_getattr

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time each loads on first use
    from torchspeed.train.acceleration import accelerate
    from torchspeed.train.callbacks import Callback, Checkpoint, EarlyStopping
    from torchspeed.train.checkpoint import CheckpointError, last_checkpoint, load_file
    from torchspeed.train.checkpointing import SavedByBlock, checkpoint_blocks, uncheckpoint_blocks
    from torchspeed.train.choices import AccelerateOptions, AccelerateResult, TrialRow
    from torchspeed.train.compiling import compile_regions
    from torchspeed.train.loader_choice import (
        LoaderStepResult,
        LoaderStepRow,
        choose_loader_with_step,
        step_candidates,
    )
    from torchspeed.train.memory_plan import MemoryPlanResult, plan_batch
    from torchspeed.train.prepared import Accelerated
    from torchspeed.train.trainer import Trainer

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "accelerate": "acceleration",
    "Accelerated": "prepared",
    "AccelerateOptions": "choices",
    "AccelerateResult": "choices",
    "TrialRow": "choices",
    "compile_regions": "compiling",
    "Trainer": "trainer",
    "Callback": "callbacks",
    "EarlyStopping": "callbacks",
    "Checkpoint": "callbacks",
    "last_checkpoint": "checkpoint",
    "load_file": "checkpoint",
    "CheckpointError": "checkpoint",
    "LoaderStepResult": "loader_choice",
    "LoaderStepRow": "loader_choice",
    "choose_loader_with_step": "loader_choice",
    "step_candidates": "loader_choice",
    "plan_batch": "memory_plan",
    "MemoryPlanResult": "memory_plan",
    "checkpoint_blocks": "checkpointing",
    "uncheckpoint_blocks": "checkpointing",
    "SavedByBlock": "checkpointing",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
