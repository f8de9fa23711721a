"""What a batch is, in one place: splitting it into inputs and targets, moving it to a device, counting
its samples, and reading logits out of a model's output.

A batch is `(inputs, targets)` (a tuple or list; extra items are ignored) or a dict with a known pair
of keys (`image`/`label`, `images`/`labels`, `input`/`target`, `inputs`/`targets`).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["split_batch", "to_device", "batch_size", "logits_of", "DICT_KEY_PAIRS"]

DICT_KEY_PAIRS = (("image", "label"), ("images", "labels"), ("input", "target"), ("inputs", "targets"))


def split_batch(batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) of a batch; ValueError naming what the loader gave otherwise."""
    if isinstance(batch, dict):
        for xk, yk in DICT_KEY_PAIRS:
            if xk in batch and yk in batch:
                return batch[xk], batch[yk]
        raise ValueError(f"a dict batch needs one of the key pairs {DICT_KEY_PAIRS}; it has {sorted(batch)}")
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError(f"a batch must be (inputs, targets); the loader gave {type(batch).__name__}")
    return batch[0], batch[1]


def to_device(x: Any, device: torch.device | str, channels_last: bool | None = None) -> Any:
    """Move a tensor (or a tuple/list/dict of them) to `device`; 4-D float tensors to NHWC (True) or
    NCHW (False) memory format, left as they are with None (a no-op when already in that format)."""
    if isinstance(x, torch.Tensor):
        x = x.to(device, non_blocking=True)
        if channels_last is not None and x.dim() == 4 and x.is_floating_point():
            x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device, channels_last) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device, channels_last) for k, v in x.items()}
    return x


def batch_size(x: Any) -> int:
    """Samples in a batch part: the first dimension of a tensor (or of the first tensor inside)."""
    if isinstance(x, torch.Tensor):
        return int(x.shape[0]) if x.dim() > 0 else 1
    if isinstance(x, (list, tuple)) and x:
        return batch_size(x[0])
    if isinstance(x, dict) and x:
        return batch_size(next(iter(x.values())))
    return 1


def logits_of(output: Any) -> Any:
    """The logits in a model's output: the tensor itself, `output.logits` (Hugging Face style),
    `output["logits"]`, or the first element of a tuple. Numpy arrays (runtime outputs) become tensors."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output:
        return logits_of(output[0])
    try:
        import numpy as np

        return torch.from_numpy(np.asarray(output))
    except (TypeError, ValueError):
        raise ValueError(f"cannot find logits in a model output of type {type(output).__name__}") from None
