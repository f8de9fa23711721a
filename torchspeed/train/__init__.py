"""Training: accelerate() (measured precision / channels_last / compile, DDP and FSDP2 wrapping), the
Trainer, callbacks (EarlyStopping, Checkpoint) and exact, atomic resume."""
from __future__ import annotations

from torchspeed._lazy import lazy_getattr

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
    "CheckpointError": "checkpoint",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
