"""What `accelerate()` measured, applied to a Lightning run (this module imports Lightning; `import
torchspeed.train` does not). Lightning owns its loop, so it takes the precision (as Lightning's
precision plugin), channels_last (the LightningModule converted) and rank 0's TF32 / cudnn.benchmark
switches; torch.compile, DDP and FSDP stay Lightning's: measure with `accelerate(model, strategy=None,
compile=False, ...)`.

    acc = ts.train.accelerate(model, strategy=None, compile=False, example_batch=batch, loss_fn=loss)
    trainer = lightning.Trainer(callbacks=[AcceleratedCallback(acc)], ...)
    # or, without the callback: lightning.Trainer(**trainer_kwargs(acc), ...)
"""
from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

import torch

from torchspeed.optional import optional
from torchspeed.train.choices import AccelerateResult
from torchspeed.train.mixed_precision import grad_scaler
from torchspeed.train.prepared import Accelerated
from torchspeed.train.trials import apply_cudnn_benchmark, apply_tf32
from torchspeed.train.wrapping import inputs_in_layout


def _lightning(submodule: str) -> ModuleType:
    """`lightning.pytorch.<submodule>`, else the standalone pytorch_lightning's (older set-ups)."""
    try:
        return optional(f"lightning.pytorch.{submodule}", "pip install lightning", "torchspeed.train.lightning")
    except ImportError:
        return optional(f"pytorch_lightning.{submodule}", "pip install lightning", "torchspeed.train.lightning")


_Callback, _plugins = _lightning("callbacks").Callback, _lightning("plugins.precision")

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


class AcceleratedCallback(_Callback):  # type: ignore[misc]
    """Applies accelerate()'s precision and channels_last to a Lightning run, at `setup` (before
    Lightning moves and wraps the module), every rank taking rank 0's choices: the LightningModule in
    channels_last when measured faster (inputs entering the model accelerate() measured, when given the
    `Accelerated`, put in that format), and the measured precision as the precision plugin unless the
    Trainer has one of its own (not "32-true": kept, with a warning when it differs). Strategies with
    their own plugins (FSDP, DeepSpeed) keep theirs: pass `**trainer_kwargs(acc)` to the Trainer there.
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
        if type(plugin) is not _plugins.Precision:  # the user's choice (or a strategy's own plugin): kept
            log.warning("accelerate() measured %s fastest (Lightning precision=%r); this Trainer uses %r, kept",
                        self.precision, want, have)
            return
        device = "cuda" if self.device.startswith("cuda") else "cpu"
        trainer.strategy.precision_plugin = _plugins.MixedPrecision(want, device, scaler=grad_scaler(self.precision))
        log.info("Lightning precision set to %r, as accelerate() measured", want)

    def teardown(self, trainer: Any, pl_module: torch.nn.Module, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
