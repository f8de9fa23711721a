"""What `accelerate()` measured, applied to a Lightning run.

`import torchspeed.train` never imports Lightning; this module does (it needs the `lightning`
package: `pip install lightning`). Lightning owns its own loop, so of accelerate's choices it takes
the precision (as Lightning's precision plugin) and channels_last (the LightningModule converted);
TF32 / cudnn.benchmark are process-wide switches accelerate() has already set in this process
(under DDP, rank 0's are set on every rank).
torch.compile, DDP and FSDP stay Lightning's to do (`Trainer(strategy=...)`, `torch.compile` on the
module); measure with `accelerate(model, strategy=None, compile=False, ...)`.

    acc = ts.train.accelerate(model, strategy=None, compile=False, example_batch=batch, loss_fn=loss)
    trainer = lightning.Trainer(callbacks=[AcceleratedCallback(acc)], ...)
    # or, without the callback: lightning.Trainer(**trainer_kwargs(acc), ...)
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

try:
    from lightning.pytorch import Callback as _LightningCallback
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
except ImportError:  # the standalone package of older set-ups
    try:
        from pytorch_lightning import Callback as _LightningCallback
        from pytorch_lightning.plugins.precision import MixedPrecision, Precision
    except ImportError:
        raise ImportError("torchspeed.train.lightning needs Lightning: pip install lightning") from None

from torchspeed.train.acceleration import Accelerated, AccelerateResult, apply_cudnn_benchmark, apply_tf32
from torchspeed.train.wrapping import inputs_in_layout

__all__ = ["AcceleratedCallback", "lightning_precision", "trainer_kwargs"]

log = logging.getLogger(__name__)

_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def _report(acc: Accelerated | AccelerateResult) -> AccelerateResult:
    if isinstance(acc, Accelerated):
        return acc.report
    if isinstance(acc, AccelerateResult):
        return acc
    raise TypeError(f"expected what torchspeed.train.accelerate() returned (or its .report), got {type(acc).__name__}")


def lightning_precision(precision: str) -> str:
    """Lightning's name for a torchspeed precision: fp32 -> "32-true", bf16 -> "bf16-mixed" (autocast,
    fp32 weights, as torchspeed's bf16), fp16 -> "16-mixed" (autocast + GradScaler)."""
    try:
        return _PRECISION[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {sorted(_PRECISION)}, got {precision!r}") from None


def trainer_kwargs(acc: Accelerated | AccelerateResult) -> dict[str, Any]:
    """The `lightning.Trainer` arguments that follow accelerate()'s measurement: `precision` (and
    `accelerator`, from the device it measured on)."""
    r = _report(acc)
    return {"precision": lightning_precision(r.precision), "accelerator": "gpu" if r.device.startswith("cuda")
            else "cpu"}


class AcceleratedCallback(_LightningCallback):
    """Applies accelerate()'s precision and channels_last to a Lightning run.

    At `setup` (before Lightning moves and wraps the module): the LightningModule goes to
    channels_last when that was measured faster (convolutions then run NHWC), the inputs entering the
    model accelerate() measured (given as the `Accelerated`, and part of the LightningModule) are put
    in the chosen memory format where they enter it, as the model accelerate() returns does, and the
    measured mixed precision becomes the precision plugin, unless the
    Trainer was given a precision of its own (anything but the default "32-true"): the user's is kept,
    with a warning when it differs. Under DDP every rank takes rank 0's choices (timings may differ
    between ranks; the model must not). Strategies with their own precision plugins (FSDP, DeepSpeed)
    keep theirs: pass `**trainer_kwargs(acc)` to the Trainer there.
    """

    def __init__(self, acc: Accelerated | AccelerateResult):
        r = _report(acc)
        self.precision, self.channels_last, self.device = r.precision, bool(r.channels_last), r.device
        self.switches = (r.tf32, r.cudnn_benchmark)
        self.measured = acc.module if isinstance(acc, Accelerated) else None
        self._hook: Any = None

    def setup(self, trainer: Any, pl_module: torch.nn.Module, stage: str) -> None:
        self.precision, self.channels_last, self.switches = trainer.strategy.broadcast(
            (self.precision, self.channels_last, self.switches), src=0)
        apply_tf32(self.switches[0])  # rank 0's process-wide switches on every rank (None: left as they are)
        apply_cudnn_benchmark(self.switches[1])
        if self.channels_last:
            pl_module.to(memory_format=torch.channels_last)
        if self._hook is None and self.measured is not None and any(m is self.measured for m in pl_module.modules()):
            self._hook = self.measured.register_forward_pre_hook(
                functools.partial(inputs_in_layout, channels_last=self.channels_last), with_kwargs=True)
        want = lightning_precision(self.precision)
        plugin = trainer.strategy.precision_plugin
        have = getattr(plugin, "precision", None)
        if have == want:
            return
        if type(plugin) is not Precision:  # the user's choice (or a strategy's own plugin): kept
            log.warning("accelerate() measured %s fastest (Lightning precision=%r); this Trainer uses %r, kept",
                        self.precision, want, have)
            return
        device = "cuda" if self.device.startswith("cuda") else "cpu"
        scaler = torch.amp.GradScaler("cuda") if want == "16-mixed" else None
        trainer.strategy.precision_plugin = MixedPrecision(want, device, scaler=scaler)
        log.info("Lightning precision set to %r, as accelerate() measured", want)

    def teardown(self, trainer: Any, pl_module: torch.nn.Module, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
