"""The user's training step as the loop runs it, so that accelerate() times that step and no other: which
arguments the forward gets and which loss is backpropagated.

A loss_fn given means the loop computes `loss_fn(model(x), y)`. Without one, a model whose forward takes
the targets gets them as the loop passes them (a GPT's `model(idx, targets) -> (logits, loss)` is timed as
`model(x, y)`, a Hugging Face model as `model(**batch)` with its `labels`), and the loss the model returns
(`output.loss`, `output["loss"]`, the 0-d tensor of a tuple) is the one backpropagated. Where the step
cannot be read from the batch, the forward's signature and its output (a batch of more than two parts, no
loss given nor returned), `doubt` says so with what to pass.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from torchspeed.batches import DICT_KEY_PAIRS, LABEL_KEYS, BatchFormat, output_loss

__all__ = ["StepCall", "TARGET_NAMES", "default_loss", "loss_of"]

TARGET_NAMES = ("targets", "target", "labels", "label", "y")  # a forward parameter by these names takes the targets
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _class_logits(out: Any, y: Any) -> bool:
    """Whether `default_loss` reads (out, y) as class logits and labels (its cross-entropy: a real loss)."""
    return (isinstance(out, torch.Tensor) and out.dim() == 2 and isinstance(y, torch.Tensor)
            and y.dtype == torch.int64 and y.dim() == 1)


def default_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """For timing only: cross-entropy for class logits, else the mean output (same backward cost)."""
    if _class_logits(outputs, targets):
        return nn.functional.cross_entropy(outputs.float(), targets)
    out = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    return out.float().mean()


def loss_of(loss_fn: Callable[..., torch.Tensor], out: Any, y: Any, x: Any) -> torch.Tensor:
    """`loss_fn(out, y)`, or `loss_fn(out, y, x)` for a loss with `needs_inputs = True` (distillation)."""
    return loss_fn(out, y, x) if getattr(loss_fn, "needs_inputs", False) else loss_fn(out, y)


def _parameters(model: nn.Module) -> list[inspect.Parameter] | None:
    """The forward's parameters, or None where they cannot be read (a C function, a wrapper's *args)."""
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def _targets_into_forward(model: nn.Module, batch: Any, fmt: BatchFormat, x: Any) -> tuple[bool, str | None]:
    """(whether the forward takes the targets, the keyword they go in by, None: positionally after the
    inputs), read from the forward's signature: a second positional parameter named like targets for a
    single-tensor input (`forward(idx, targets=None)`), the batch's label key for Hugging Face-style dict
    inputs (`forward(input_ids, ..., labels=None)`, or `**kwargs` for `labels`)."""
    params = _parameters(model)
    if params is None or fmt.inputs is not None:
        return False, None
    if isinstance(x, torch.Tensor):
        positional = [p for p in params if p.kind in _POSITIONAL]
        return (len(positional) >= 2 and positional[1].name in TARGET_NAMES), None
    if isinstance(x, Mapping) and isinstance(batch, Mapping) and fmt.target is None:
        if any(a in batch and b in batch for a, b in DICT_KEY_PAIRS):
            return False, None
        label = next((k for k in LABEL_KEYS if k in batch), None)
        takes = label is not None and any(  # **kwargs: Hugging Face's `labels` only
            p.name == label and p.kind != inspect.Parameter.POSITIONAL_ONLY
            or p.kind == inspect.Parameter.VAR_KEYWORD and label == "labels" for p in params)
        return takes, label if takes else None
    return False, None


def _inputs_kind(x: Any) -> str:
    """How the inputs go into the forward: 'x' (one value), '**inputs' (keywords), '*inputs' (positional)."""
    return "**inputs" if isinstance(x, Mapping) else "*inputs" if isinstance(x, tuple) else "x"


@dataclass(frozen=True)
class StepCall:
    """One training step as the loop runs it: `forward(model, x, y)` calls the model, `loss(out, x, y)`
    gives the loss backpropagated. Made by `StepCall.of` from the model, a batch and the loss given."""

    fmt: BatchFormat
    loss_fn: Callable[..., torch.Tensor] | None = None  # the loop's loss on (logits, targets); None: the model's
    targets_in: bool = False                            # the forward gets the targets too
    targets_keyword: str | None = None                  # ... by this keyword (None: positionally, after x)
    inputs_kind: str = "x"                              # 'x', '**inputs' or '*inputs' (see _inputs_kind)
    doubt: str | None = None                            # why this step is a guess, and what to pass instead

    @classmethod
    def of(cls, model: nn.Module, batch: Any, fmt: BatchFormat | None = None,
           loss_fn: Callable[..., torch.Tensor] | None = None) -> StepCall:
        """The step the loop runs on batches like `batch` (see the module docstring)."""
        fmt = fmt or BatchFormat()
        x, _ = fmt.split(batch)
        targets_in, keyword = (False, None) if loss_fn is not None else _targets_into_forward(model, batch, fmt, x)
        call = cls(fmt, loss_fn, targets_in, keyword, _inputs_kind(x))
        if fmt.inputs is None and fmt.target is None and isinstance(batch, (tuple, list)) and len(batch) > 2:
            return replace(call, doubt=(
                f"the example batch has {len(batch)} parts, so what the forward gets is a guess: the trials time "
                f"{call.describe()} with x = batch[0] and y = batch[1]; if the loop calls the model otherwise, "
                "say so with batch_format=BatchFormat(inputs=..., target=...), e.g. BatchFormat(inputs=(0, 1), "
                "target=2) for model(batch[0], batch[1]) with targets batch[2]"))
        return call

    def forward(self, model: Callable[..., Any], x: Any, y: Any) -> Any:
        """The model called as the loop calls it."""
        if not self.targets_in:
            return self.fmt.forward(model, x)
        if self.targets_keyword is not None:
            return model(**x, **{self.targets_keyword: y})
        return model(x, y)

    def loss(self, out: Any, x: Any, y: Any) -> torch.Tensor:
        """The loss the loop backpropagates: loss_fn's on the logits, else the model's own, else a stand-in
        (`default_loss`: cross-entropy for class logits, the output's mean otherwise)."""
        if self.loss_fn is not None:
            return loss_of(self.loss_fn, self.fmt.logits_of(out), y, x)
        own = output_loss(out)
        return own if own is not None else default_loss(self.fmt.logits_of(out), y)

    def uses_logits(self, out: Any) -> bool:
        """Whether the loss is computed on the output's logits (loss_fn's or the stand-in), not returned by
        the model: then the logits' width is checked against the labels."""
        return self.loss_fn is not None or output_loss(out) is None

    def stand_in(self, out: Any, y: Any) -> str | None:
        """After one forward: why the loss timed is not the loop's (no loss given nor returned, and the output
        is not class logits with labels, whose cross-entropy is the stand-in), with what to pass; else None."""
        if not self.uses_logits(out) or self.loss_fn is not None or _class_logits(self.fmt.logits_of(out), y):
            return None
        return (f"no loss_fn was given and {self.describe(loss=False)} returns no loss, so the trials time a "
                "stand-in loss (the mean of its output): pass loss_fn= (the loss your loop computes from the "
                "model's output and the targets)")

    def arguments(self, x: Any) -> int:
        """How many arguments (not None) the forward gets in this step: what the prepared model compares
        with the loop's first training call."""
        if isinstance(x, Mapping):
            n = sum(v is not None for v in x.values())
        elif isinstance(x, tuple):
            n = sum(v is not None for v in x)
        else:
            n = 1
        return n + int(self.targets_in)

    def describe(self, loss: bool = True) -> str:
        """What the trials time: 'model(x, y), the loss it returns', 'model(x), cross_entropy(logits, y)',
        'model(**inputs, labels=y), the loss it returns' (in the report and the remembered decision's key)."""
        if self.targets_in and self.targets_keyword is not None:
            call = f"model({self.inputs_kind}, {self.targets_keyword}=y)"
        elif self.targets_in:
            call = f"model({self.inputs_kind}, y)"
        else:
            call = f"model({self.inputs_kind})"
        if not loss:
            return call
        if self.loss_fn is not None:
            named = getattr(self.loss_fn, "func", self.loss_fn)
            name = getattr(named, "__name__", type(named).__name__)
            return f"{call}, {name}(logits, y)"
        return f"{call}, the loss it returns" if self.targets_in else f"{call}, the loss it returns or a stand-in"
