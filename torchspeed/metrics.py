"""Task metrics computed the same way everywhere (Trainer.evaluate, optimize's accuracy guard, the suites)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchspeed.batches import BatchFormat, logits_of, map_tensors

__all__ = ["correct_top1", "top1_accuracy"]


def correct_top1(output: Any, targets: torch.Tensor) -> int:
    """How many rows of `output`'s logits have their largest value at the target class."""
    logits = logits_of(output)
    return int((logits.float().argmax(1).cpu() == targets.cpu()).sum())


def top1_accuracy(predict: Callable[[Any], Any], batches: Iterable[Any], limit: int | None = None,
                  batch_format: BatchFormat | dict | None = None) -> float:
    """Top-1 accuracy of `predict(inputs) -> logits` (tensor, ndarray or HF-style output) over labelled
    batches split by `batch_format` (auto: `(inputs, targets)`), under inference_mode; `limit` caps the
    samples counted."""
    fmt = BatchFormat.of(batch_format)
    correct = total = 0
    with torch.inference_mode():
        for batch in batches:
            x, y = fmt.split(batch)
            if y is None:
                raise ValueError("top1_accuracy needs labelled batches; this batch has no label "
                                 "(say which key is the label with batch_format=BatchFormat(target=...))")
            if limit is not None and total + len(y) > limit:
                x, y = _head(x, limit - total), y[: limit - total]
            correct += correct_top1(fmt.logits_of(predict(x)), y)
            total += len(y)
            if limit is not None and total >= limit:
                break
    if total == 0:
        raise ValueError("top1_accuracy: no labelled samples to evaluate on")
    return correct / total


def _head(x: Any, n: int) -> Any:
    """The first n samples of a batch part (a tensor, or a tuple/list/dict of them)."""
    return map_tensors(lambda v: v[:n], x, leaf=object)
