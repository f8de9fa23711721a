"""What a batch is, in one place: splitting it into inputs and targets, walking the tensors inside it,
moving it to a device, counting its samples, and reading logits (and a loss the model computed) out of a
model's output.

A batch is `(inputs, targets)` (a tuple or list; extra items are ignored) or a dict with a known pair
of keys (`image`/`label`, `images`/`labels`, `input`/`target`, `inputs`/`targets`). `BatchFormat` says
otherwise for a model that takes several or named inputs (Hugging Face style) or returns a dict.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchspeed.runtime import free_memory

__all__ = ["random_input", "BatchFormat", "split_batch", "map_tensors", "to_device", "batch_size", "logits_of",
           "output_loss", "DICT_KEY_PAIRS", "LABEL_KEYS"]

DICT_KEY_PAIRS = (("image", "label"), ("images", "labels"), ("input", "target"), ("inputs", "targets"))


def split_batch(batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) of a batch by the auto rules of `BatchFormat`; ValueError naming what the
    loader gave otherwise (a dict batch without a label is an error here)."""
    x, y = BatchFormat().split(batch)
    if y is None:
        raise ValueError(f"a dict batch needs one of the key pairs {DICT_KEY_PAIRS} or a label key {LABEL_KEYS}; "
                         f"it has {sorted(batch)}")
    return x, y


def map_tensors(fn: Callable[[Any], Any], obj: Any, leaf: type | tuple[type, ...] = torch.Tensor) -> Any:
    """`fn` applied to every tensor in `obj` (a tensor, or dicts / tuples / lists of them, nested): the one
    walker of batch parts, so each caller says only what happens to a tensor. Containers come back as
    the same kind (a dict as a plain dict, a named tuple as its own type); other values as they are.
    `leaf`: what `fn` applies to, e.g. `(torch.Tensor, np.ndarray)`, or `object` for every non-container."""
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v, leaf) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [map_tensors(fn, v, leaf) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return fn(obj) if isinstance(obj, leaf) else obj


def to_device(x: Any, device: torch.device | str, channels_last: bool | None = None) -> Any:
    """Move a tensor (or a tuple/list/dict of them) to `device`; 4-D float tensors to NHWC (True) or
    NCHW (False) memory format, left as they are with None (a no-op when already in that format)."""
    layout = None if channels_last is None else torch.channels_last if channels_last else torch.contiguous_format

    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device, non_blocking=True)
        if layout is not None and t.dim() == 4 and t.is_floating_point():
            t = t.contiguous(memory_format=layout)
        return t

    return map_tensors(move, x)


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
        return torch.from_numpy(np.asarray(output))
    except (TypeError, ValueError):
        raise ValueError(f"cannot find logits in a model output of type {type(output).__name__}") from None


def output_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed and returned with its output, else None: the output itself when it is a
    0-d float tensor, `output.loss` / `output["loss"]` (Hugging Face style), or the first 0-d float tensor of
    a tuple or list (a GPT's `(logits, loss)`; `(logits, None)` has none)."""
    def scalar(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()

    if scalar(output):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if scalar(t)), None)
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if scalar(loss) else None


LABEL_KEYS = ("labels", "label", "targets", "target")


def _pick(batch: Any, key: str | int) -> Any:
    try:
        return batch[key]
    except (KeyError, IndexError, TypeError):
        have = sorted(batch) if isinstance(batch, dict) else f"{type(batch).__name__} of {len(batch)}"
        raise ValueError(f"batch_format names {key!r}, which the batch does not have (it has {have})") from None


@dataclass(frozen=True)
class BatchFormat:
    """Which part of a batch is the model's input, which the label, and where the logits are in the
    model's output: the one adapter that lets Trainer, profile and optimize run models that do not
    take `(x, y)` and return a tensor (Hugging Face-style dict batches and outputs, multi-input models).

    `inputs`: a key or index (the model gets that one value), or a tuple of them (a tuple of keys
    becomes keyword arguments, a tuple of indices positional ones); None reads the batch by the auto
    rules below. `target`: a key or index, None for auto. `logits`: an attribute/key of the output or a
    function of it, None for `logits_of`.

    Auto rules: a tuple/list batch is `(inputs, target, ...)`; a dict with a known pair of keys
    (`DICT_KEY_PAIRS`) gives those two; any other dict with a label key (`labels`, `label`, `targets`,
    `target`) gives that label and every other key as keyword inputs (`model(**inputs)`, the Hugging
    Face convention); a dict without a label key is all inputs, target None.
    """

    inputs: str | int | tuple[str | int, ...] | None = None
    target: str | int | None = None
    logits: str | Callable[[Any], Any] | None = None

    @classmethod
    def of(cls, value: BatchFormat | dict | None) -> BatchFormat:
        """Normalise a `batch_format=` argument: None (auto), a BatchFormat, or a dict of its fields."""
        if value is None:
            return cls()
        if isinstance(value, BatchFormat):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"inputs", "target", "logits"}
            if unknown:
                raise ValueError(f"batch_format: unknown fields {sorted(unknown)}; use inputs, target, logits")
            return cls(**value)
        raise TypeError(f"batch_format must be a BatchFormat, a dict or None, not {type(value).__name__}")

    def split(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, target) of a batch; target is None for an unlabelled dict batch."""
        if self.inputs is None and self.target is None:
            return self._auto_split(batch)
        auto_x, auto_y = self._auto_split(batch) if (self.inputs is None or self.target is None) else (None, None)
        if self.inputs is None:
            x = auto_x
        elif isinstance(self.inputs, tuple):
            picked = [(k, _pick(batch, k)) for k in self.inputs]
            x = dict(picked) if all(isinstance(k, str) for k, _ in picked) else tuple(v for _, v in picked)
        else:
            x = _pick(batch, self.inputs)
        y = auto_y if self.target is None else _pick(batch, self.target)
        return x, y

    @staticmethod
    def _auto_split(batch: Any) -> tuple[Any, Any]:
        if isinstance(batch, dict):
            for xk, yk in DICT_KEY_PAIRS:
                if xk in batch and yk in batch:
                    return batch[xk], batch[yk]
            label = next((k for k in LABEL_KEYS if k in batch), None)
            return {k: v for k, v in batch.items() if k != label}, (batch[label] if label else None)
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise ValueError(f"a batch must be (inputs, targets) or a dict; the loader gave {type(batch).__name__} "
                             "(pass batch_format=BatchFormat(inputs=..., target=...) to say which part is which)")
        return batch[0], batch[1]

    def forward(self, model: Callable[..., Any], inputs: Any) -> Any:
        """Call the model on split inputs: a dict as keyword arguments, a tuple as positional ones."""
        if isinstance(inputs, dict):
            return model(**inputs)
        if isinstance(inputs, tuple):
            return model(*inputs)
        return model(inputs)

    def logits_of(self, output: Any) -> Any:
        """The logits in a model output, by this format's `logits` rule."""
        if self.logits is None:
            return logits_of(output)
        if callable(self.logits):
            return self.logits(output)
        if isinstance(output, dict):
            return _pick(output, self.logits)
        if not hasattr(output, self.logits):
            raise ValueError(f"batch_format logits={self.logits!r}: the model output "
                             f"({type(output).__name__}) has no such attribute or key")
        return getattr(output, self.logits)


def random_input(shape: tuple[int, ...], device: str | torch.device = "cpu", *,
                 name: str = "input_shape") -> torch.Tensor:
    """A random fp32 input of `shape` on `device`. A shape whose tensor alone exceeds the memory free
    there is refused in one line naming `name`, before allocating: the allocation would fail with a
    traceback, or the kernel would kill the process."""
    device = torch.device(device)
    text = ",".join(map(str, shape))
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"{name} {text}: every dimension must be >= 1 (e.g. 1,3,224,224)")
    needed = math.prod(shape) * 4
    free = free_memory(device)
    if free is not None and needed > free:
        raise ValueError(f"{name} {text}: the input alone needs {needed / 2**30:,.1f} GiB and {device} has "
                         f"{free / 2**30:,.1f} GiB free: give a smaller shape")
    try:
        return torch.randn(*shape, device=device)
    except (RuntimeError, MemoryError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{name} {text}: cannot allocate the input on {device} ({first[:160]}): give a smaller "
                         "shape") from None
