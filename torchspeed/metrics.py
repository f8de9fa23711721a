"""Task metrics computed the same way everywhere (Trainer.evaluate, optimize's accuracy guard, the suites)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchspeed.batches import logits_of, split_batch

__all__ = ["correct_top1", "top1_accuracy"]


def correct_top1(output: Any, targets: torch.Tensor) -> int:
    """How many rows of `output`'s logits have their largest value at the target class."""
    logits = logits_of(output)
    return int((logits.float().argmax(1).cpu() == targets.cpu()).sum())


def top1_accuracy(predict: Callable[[Any], Any], batches: Iterable[Any], limit: int | None = None) -> float:
    """Top-1 accuracy of `predict(inputs) -> logits` (tensor, ndarray or HF-style output) over
    `(inputs, targets)` batches, under inference_mode; `limit` caps the samples counted."""
    correct = total = 0
    with torch.inference_mode():
        for batch in batches:
            x, y = split_batch(batch)
            if limit is not None and total + len(y) > limit:
                x, y = x[: limit - total], y[: limit - total]
            correct += correct_top1(predict(x), y)
            total += len(y)
            if limit is not None and total >= limit:
                break
    if total == 0:
        raise ValueError("top1_accuracy: no labelled samples to evaluate on")
    return correct / total
