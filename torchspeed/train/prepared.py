"""`Accelerated`: what accelerate() returns, the prepared model, optimizer and loader, and how to step them.

Under fp16 the GradScaler must see every step, so while a preparation holds an optimizer a step
pre-hook (`_StepGuard`) refuses a plain `optimizer.step()` (scaled, unchecked gradients: silently
wrong) before a weight changes. The preparation is found again from the model accelerate() returned
(`Accelerated.of`), held weakly: it goes with that model, or with `forget_prepared(model)`.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from torchspeed.batches import BatchFormat, to_device
from torchspeed.train.choices import AccelerateResult
from torchspeed.train.mixed_precision import autocast_for
from torchspeed.train.step_call import StepCall
from torchspeed.train.wrapping import AcceleratedModel

__all__ = ["Accelerated", "forget_prepared", "parameters_of", "release_step_guard", "training_step"]


class _StepGuard:
    """fp16: the pre-hook on one optimizer refusing a step outside Accelerated.step. One per optimizer,
    found through `_on` (weak: it goes with the optimizer; it holds no reference to it)."""

    _on: ClassVar[weakref.WeakKeyDictionary[torch.optim.Optimizer, _StepGuard]] = weakref.WeakKeyDictionary()

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.stepping = False  # inside Accelerated.step now
        self.hook = optimizer.register_step_pre_hook(self._refuse)

    def _refuse(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.stepping:
            raise RuntimeError("precision is fp16: optimizer.step() was called outside acc.step(optimizer); the "
                               "GradScaler must unscale the gradients and skip steps with inf/NaN, so use "
                               "acc.backward(loss) and acc.step(optimizer) in the loop (nothing was stepped)")

    @classmethod
    def on(cls, optimizer: torch.optim.Optimizer) -> _StepGuard:
        """The optimizer's guard, put on now if it has none."""
        if optimizer not in cls._on:
            cls._on[optimizer] = cls(optimizer)
        return cls._on[optimizer]


def release_step_guard(optimizer: torch.optim.Optimizer | None) -> None:
    """Remove the fp16 hook that refuses a plain `optimizer.step()`: once the preparation is forgotten or
    let go, the optimizer is the user's again (a later fp32 loop, or another preparation, steps it)."""
    guard = _StepGuard._on.pop(optimizer, None) if optimizer is not None else None
    if guard is not None:
        guard.hook.remove()


def parameters_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, each once."""
    seen: dict[int, torch.Tensor] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


@dataclass
class Accelerated:
    """The prepared model, optimizer and loader (unpack: `model, optimizer, loader = acc`, or
    `model, optimizer = acc` when no loader was given) plus how to run a step.

    The model runs its forward at the chosen precision and memory format by itself, so a plain loop
    needs nothing more::

        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()          # under fp16: acc.backward(loss)
            optimizer.step()         # under fp16: acc.step(optimizer)
            optimizer.zero_grad()

    The explicit form does the same (the model then does not enter autocast twice)::

        with acc.autocast():
            loss = loss_fn(model(acc.prepare_input(x)), y)
        acc.backward(loss)      # scaled by the GradScaler under fp16
        acc.step(optimizer)     # unscale, optional clipping, step, scaler update, zero_grad
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    report: AccelerateResult
    device: torch.device
    module: nn.Module             # the user's model (no wrapper): state_dict lives here
    scaler: Any = None            # torch.amp.GradScaler for fp16, else None
    batch_format: BatchFormat | None = None  # how the batches were read (the Trainer's default for this model)
    loader: Any = None            # the loader accelerate() was given, yielding device batches (a DeviceLoader)
    step_call: StepCall | None = None  # the step accelerate()'s trials ran (the forward's arguments, the loss)
    _scaled: bool = field(default=False, init=False, repr=False, compare=False)  # a backward() since the last step

    # model accelerate() returned -> (its preparation less model and optimizer, the optimizer held weakly)
    _held: ClassVar[weakref.WeakKeyDictionary[nn.Module, tuple[Accelerated, Any]]] = weakref.WeakKeyDictionary()

    def __post_init__(self) -> None:
        if self.scaler is not None and self.optimizer is not None:
            _StepGuard.on(self.optimizer)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.optimizer) + (() if self.loader is None else (self.loader,)))

    @property
    def precision(self) -> str:
        return self.report.precision

    @property
    def channels_last(self) -> bool:
        return self.report.channels_last

    @property
    def wrapped(self) -> nn.Module:
        """What runs the forward: the user's model or its DDP / FSDP / torch.compile wrapper."""
        return self.model.wrapped if isinstance(self.model, AcceleratedModel) else self.model

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context for forward passes at the chosen precision (fp32 weights are kept)."""
        return autocast_for(self.device, self.report.precision)

    def prepare_input(self, x: Any) -> Any:
        """Inputs moved to the device, 4-D float tensors in the chosen memory format."""
        return to_device(x, self.device, self.report.channels_last)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, with the loss scaled by the GradScaler under fp16 (small fp16 gradients
        would underflow to zero otherwise). For gradient accumulation, divide the loss by the number
        of micro-batches and call backward on each; then one `step()`."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self._scaled = True
        else:
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer | None = None, max_grad_norm: float | None = None) -> bool:
        """One optimizer step on the gradients `backward()` left, then clear them (set to None); True
        when taken, False when the GradScaler skipped it. `max_grad_norm` clips the total norm of the
        optimizer's parameters' gradients (unscaled first under fp16). Under fp16 the scaler skips a
        step with inf/NaN gradients and adjusts its scale, and a step with no `backward()` since the
        last is refused before any weight changes (a plain `loss.backward()` left unscaled gradients).

        Host reads: none outside fp16. Under fp16 one per step: the scaler's inf/NaN finding, read once
        after unscaling (a non-fused optimizer steps on it, where GradScaler.step would read it again);
        never the scale. `queue_step` leaves a fused optimizer's finding unread.
        """
        return bool(self.queue_step(optimizer, max_grad_norm))

    def queue_step(self, optimizer: torch.optim.Optimizer | None = None,
                   max_grad_norm: float | None = None) -> bool | torch.Tensor:
        """`step`, without making the host wait for the device where nothing needs it: under fp16 with a
        fused optimizer (its kernels take the scaler's inf/NaN finding on the device and skip the update
        there) whether the step was taken comes back as a 0-d bool tensor on the device, to be read when
        the caller reads its losses; otherwise as a bool, as `step` returns it."""
        opt = optimizer if optimizer is not None else self.optimizer
        if opt is None:
            raise ValueError("Accelerated.step() needs the optimizer (none was given to accelerate())")
        scaler = self.scaler
        if scaler is None:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(parameters_of(opt), max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return True
        if not self._scaled:
            raise RuntimeError("precision is fp16: acc.step() found no acc.backward(loss) since the last step; the "
                               "GradScaler needs the loss scaled, so call acc.backward(loss) instead of "
                               "loss.backward() (nothing was stepped)")
        guard = _StepGuard.on(opt)
        scaler.unscale_(opt)  # what scaler.step would do first; now the finding can be read once
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(parameters_of(opt), max_grad_norm)
        found = list(scaler._found_inf_per_device(opt).values())
        found_sum = sum(v.to(found[0].device) for v in found) if found else None
        fused = getattr(opt, "_step_supports_amp_scaling", False)
        taken: bool | torch.Tensor = True
        if found_sum is not None:
            taken = found_sum == 0 if fused else not bool(found_sum)  # the one host read: non-fused only
        guard.stepping = True
        try:
            if fused:
                scaler.step(opt)  # the kernel skips the update itself on the device's finding
            elif taken:
                opt.step()  # the gradients are unscaled already; update() below reads the same finding
        finally:
            guard.stepping = False
        scaler.update()
        self._scaled = False
        opt.zero_grad(set_to_none=True)
        return taken

    def hold(self) -> None:
        """Keep this preparation for its model (`Accelerated.of(self.model)` finds it) until the model
        is let go or `forget_prepared(self.model)`; under fp16 the optimizer steps plainly again then."""
        opt = self.optimizer
        Accelerated._held[self.model] = (replace(self, model=None, optimizer=None, loader=None),
                                         weakref.ref(opt) if opt is not None else None)
        if self.scaler is not None and opt is not None:
            weakref.finalize(self.model, lambda ref: release_step_guard(ref()), weakref.ref(opt))

    @classmethod
    def of(cls, model: Any) -> Accelerated | None:
        """The preparation of `model` when accelerate() returned it, else None (the Trainer's way to take a
        prepared model as it is instead of measuring again)."""
        if isinstance(model, Accelerated):
            return model
        try:
            held, opt = cls._held.get(model, (None, None))
        except TypeError:  # not weak-referenceable: not ours
            return None
        return None if held is None else replace(held, model=model, optimizer=opt() if opt is not None else None)


def forget_prepared(model: nn.Module) -> None:
    """Stop treating `model` as one accelerate() returned, and under fp16 let its optimizer step plainly
    again (the refusing hook removed; `Accelerated.step` puts it back while that preparation steps).
    The Trainer calls it on its own preparation, so a later Trainer given the same model prepares it
    afresh with its own settings."""
    held, opt = Accelerated._held.pop(model, (None, None))
    if held is not None and held.scaler is not None and opt is not None:
        release_step_guard(opt())


def training_step(acc: Accelerated, loss_fn: Callable[..., torch.Tensor] | None) -> Callable[[Any], None]:
    """One real training step of the prepared model on a batch, as a plain loop runs it: the forward
    under the chosen precision and the loss as the trials ran them (`acc.step_call` when made with this
    `loss_fn`; else `loss_fn`, or the model's own loss or a stand-in when None), backward and optimizer
    step through `acc` (the GradScaler under fp16)."""
    fmt = acc.batch_format or BatchFormat()
    same = acc.step_call is not None and acc.step_call.loss_fn is loss_fn and acc.step_call.fmt == fmt
    call = acc.step_call if same else StepCall(fmt, loss_fn)

    def step(batch: Any) -> None:
        x, y = fmt.split(batch)
        y = to_device(y, acc.device)
        with acc.autocast():
            value = call.loss(call.forward(acc.model, x, y), x, y)
        acc.backward(value)
        acc.queue_step(acc.optimizer)  # no host wait per step (a fused optimizer under fp16)
    return step
