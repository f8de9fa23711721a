"""Trainer: a small training loop that calls accelerate() and adds what every run needs: gradient
accumulation, clipping, LR scheduling, callbacks, progress with samples/s, metrics to CSV or JSONL,
NaN/inf detection, exact resume and torchrun (DDP / FSDP2). It takes a plain DataLoader (batches moved
to the device here) or any `loader_contract.DeviceBatches` loader (a FastLoader's are already there).

One concept, the loop, kept whole because its parts share one run's state; what it hands off lives
beside it: checkpoints and resume (`resume.py`), metrics and progress (`loop_metrics.py`), each rank's
shard (`data_order.py`), the loader's counts (`loader_choice.py`). The step is `Accelerated`'s
(`autocast()`, `backward()`, `queue_step()`). The loss, and under fp16 with a fused optimizer whether
the GradScaler skipped the step, stay on the device until a reading point (every
`log_every_n_steps` optimizer steps, an epoch's end, a checkpoint, the run's end): reading it every
step would make the host wait for the device each step.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from torchspeed import ranks
from torchspeed.batches import BatchFormat, to_device
from torchspeed.loader_contract import yields_device_batches
from torchspeed.metrics import correct_top1
from torchspeed.runtime import resolve_device
from torchspeed.tables import print_table
from torchspeed.train import checkpoint as ckpt
from torchspeed.train import distributed
from torchspeed.train.acceleration import accelerate_with, step_parts
from torchspeed.train.callbacks import Callback
from torchspeed.train.choices import AccelerateOptions, AccelerateResult
from torchspeed.train.data_order import shard_loader
from torchspeed.train.loader_choice import LoaderStepResult, alone_counts, choose_counts
from torchspeed.train.loop_metrics import LossMeter, MetricsLog, Progress, Span, epoch_line
from torchspeed.train.memory_plan import MemoryPlanResult, is_out_of_memory, oom_message
from torchspeed.train.mixed_precision import autocast_for
from torchspeed.train.prepared import Accelerated, forget_prepared, release_step_guard
from torchspeed.train.resume import ExactResume, Trained
from torchspeed.train.step_timer import check_class_outputs, loss_of
from torchspeed.train.strategy import resolve_strategy
from torchspeed.train.wrapping import class_count, example_batch_of

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

_MAX_UNREAD = 1024  # losses kept on the device before they are read anyway (a very long log interval)


def _check_agrees(acc: Accelerated, options: AccelerateOptions) -> None:
    """A prepared model comes with its settings: a Trainer setting that says otherwise is an error
    (silently ignoring it, or preparing the model twice, would both surprise)."""
    r = acc.report
    chosen = {"precision": r.precision, "channels_last": r.channels_last, "compile": r.compile_setting,
              "strategy": r.strategy, "device": acc.device}
    for name, got in chosen.items():
        want = getattr(options, name)
        if isinstance(want, str) and want == "auto":
            continue
        if name == "device":
            want = torch.device(want)
            if want.type == got.type and want.index is None:
                continue
        if want != got:
            raise ValueError(f"the model was prepared by accelerate() with {name}={got}; the Trainer was given "
                             f"{name}={want!r}. Leave {name} on 'auto' (the prepared choice is used), or pass "
                             "the plain model to let the Trainer prepare it")


def _take_prepared(model: Any, optimizer: Any, options: AccelerateOptions) -> tuple[Accelerated | None, Any, Any]:
    """(the preparation accelerate() made, the model, the optimizer): a model accelerate() returned (or
    the Accelerated itself) is trained as prepared, with its optimizer unless another is given."""
    prepared = Accelerated.of(model)
    if prepared is None:
        return None, model, optimizer
    if optimizer is None:
        optimizer = prepared.optimizer
    if optimizer is not prepared.optimizer:  # another optimizer for a prepared model: as given
        prepared = Accelerated(prepared.model, optimizer, prepared.report, prepared.device,
                               prepared.module, prepared.scaler, prepared.batch_format)
    _check_agrees(prepared, options)
    log.debug("Trainer: the model was prepared by accelerate() (%s); nothing is measured again",
              ", ".join(f"{k}={v}" for k, v in prepared.report.to_dict().items() if k != "candidates"))
    return prepared, prepared.model, optimizer


def _check_inputs(model: Any, optimizer: Any, loss_fn: Any, scheduler_interval: str, grad_accum_steps: Any,
                  max_grad_norm: float | None) -> None:
    """Refuse a Trainer that could not train, before anything runs."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not callable(loss_fn):
        raise ValueError("loss_fn must be callable as loss_fn(outputs, targets)")
    if scheduler_interval not in ("step", "epoch"):
        raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be a positive integer, got {grad_accum_steps!r}")
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")


class Trainer:
    """Train `model` with `optimizer` on `loss_fn(logits, targets)`; settings on "auto" are measured.

    Batches are `(x, y)` tuples, dict batches (`{"image", "label"}`..., or Hugging Face style
    `{"pixel_values": ..., "labels": ...}`: the label key is the target, every other key a keyword
    input) or what `batch_format` (a `torchspeed.batches.BatchFormat` or a dict of its fields) says;
    the model gets the inputs (a dict as keywords), the loss the logits of its output (the tensor,
    `.logits` or `["logits"]`; `BatchFormat(logits=lambda out: out)` passes the whole output).

    `model` may be a model `accelerate()` returned, or the `Accelerated` itself: its choices are used
    as they are (nothing measured again; `optimizer` may be left out); settings here that contradict
    them are an error. precision, channels_last, compile, strategy, device and `accelerate_kwargs`
    (accelerate()'s other keywords) make `options`, an `AccelerateOptions`. `loss_fn` may take
    `(outputs, targets, inputs)` when it has `needs_inputs = True` (distillation). `scheduler` steps
    every optimizer step (`scheduler_interval="step"`) or epoch; `grad_accum_steps` micro-batches make
    one optimizer step (an epoch's last, short group is averaged over its own micro-batches);
    `max_grad_norm` clips gradients. `memory_plan`: the plan (`plan_batch`) the batches were sized by, else
    accelerate()'s; an out-of-memory error in training is raised again as one line naming the phase
    (forward, backward, optimizer step) and what the planner suggests. `log_path` (.csv or .jsonl) gets train_loss
    (the mean since the previous row) / lr / samples_per_s every `log_every_n_steps` steps and
    val_loss / val_acc after each validation. `progress`: True for a bar and a summary table, a
    callable for short text lines ("epoch 1 step 50 loss 2.31 840 samples/s"), False for silence.
    Under torchrun the loaders are sharded, the model wrapped (DDP, or FSDP2 with `strategy="fsdp"`),
    metrics all-reduced, checkpoints written by rank 0 (sharded through DCP under FSDP).
    """

    def __init__(
        self,
        model: nn.Module | Accelerated,
        optimizer: torch.optim.Optimizer | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        precision: str = "auto",
        callbacks: Iterable[Callback] | None = None,
        device: str | torch.device = "auto",
        *,
        channels_last: bool | str = "auto",
        compile: bool | str = "auto",  # noqa: A002
        strategy: str | None = "auto",
        scheduler: Any = None,
        scheduler_interval: str = "step",
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        log_path: str | os.PathLike | None = None,
        log_every_n_steps: int = 50,
        progress: bool | Callable[[str], None] = True,
        accelerate_kwargs: dict[str, Any] | None = None,
        batch_format: BatchFormat | dict | None = None,
        memory_plan: MemoryPlanResult | None = None,
    ):
        self.options = AccelerateOptions(precision=precision, channels_last=channels_last, compile=compile,
                                         strategy=strategy, device=device, **(accelerate_kwargs or {}))
        prepared, model, optimizer = _take_prepared(model, optimizer, self.options)
        _check_inputs(model, optimizer, loss_fn, scheduler_interval, grad_accum_steps, max_grad_norm)
        self._raw_model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        # a prepared model is read the way accelerate() was told, unless the Trainer is told otherwise
        self.batch_format = BatchFormat.of(batch_format if batch_format is not None or prepared is None
                                           else prepared.batch_format)
        self.callbacks: list[Callback] = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise ValueError(f"callbacks must be torchspeed.train.Callback instances, got {type(cb).__name__}")
        self.scheduler, self.scheduler_interval = scheduler, scheduler_interval
        self.grad_accum_steps, self.max_grad_norm = grad_accum_steps, max_grad_norm
        self._memory_plan = memory_plan
        self.log = MetricsLog(log_path)
        self.log_every_n_steps = max(1, int(log_every_n_steps))
        if not (isinstance(progress, bool) or callable(progress)):
            raise ValueError(f"progress must be True, False or a callable taking a text line, got {progress!r}")
        self.progress = progress
        self.acc: Accelerated | None = prepared
        self.dist = ranks.env()
        self._losses = LossMeter()
        # loop state (all of it goes into a checkpoint)
        self.epoch = 0
        self.batches_done = 0       # batches consumed in the current epoch
        self.global_step = 0        # optimizer steps
        self.skipped_steps = 0      # optimizer steps GradScaler skipped (fp16 overflow), up to the last reading point
        self._unread_skips: list[torch.Tensor] = []  # fused fp16 steps' findings on the device, read with the losses
        self.should_stop = False
        self.history: list[dict[str, Any]] = []
        self.run_id: str | None = None  # this run's id: in every checkpoint and in the checkpoint directory
        self._resume = ExactResume(self.callbacks)  # checkpoints and resumes: the rest of the state
        self._loader: Any = None
        self._classes: int | None = None  # the classes the training data names, when it does
        self._outputs_checked = False  # the model's class outputs checked against the labels (first batch)
        self._own_preparation = False  # accelerate() run by this Trainer (not a prepared model given to it)
        # the training loader's counts chosen with the step in the loop (see choose_loader): the result,
        # and (the loader given, the loader trained with)
        self.loader_choice: LoaderStepResult | None = None
        self._chosen: tuple[weakref.ref[Any], Any] | None = None

    # ---------------------------------------------------------------- properties
    @property
    def model(self) -> nn.Module:
        """The model as trained (possibly DDP/FSDP-wrapped or compiled)."""
        return self.acc.model if self.acc else self._raw_model

    @property
    def module(self) -> nn.Module:
        """The plain nn.Module (no wrappers): its state_dict is the model's weights."""
        return self.acc.module if self.acc else self._raw_model

    @property
    def device(self) -> torch.device:
        return self.acc.device if self.acc else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    @property
    def memory_plan(self) -> MemoryPlanResult | None:
        """The memory plan the batches were sized by: the one given, else accelerate()'s (memory_budget=)."""
        if self._memory_plan is not None:
            return self._memory_plan
        return self.acc.report.memory_plan if self.acc is not None else None

    @contextlib.contextmanager
    def _named_oom(self, phase: str) -> Iterator[None]:
        """An out-of-memory error inside, raised again as one line: the phase and the planner's suggestion."""
        try:
            yield
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            raise torch.OutOfMemoryError(oom_message(phase, self.memory_plan, e)) from e

    @property
    def report(self) -> AccelerateResult | None:
        """accelerate()'s result: every candidate measured and the decisions (None before it ran)."""
        return self.acc.report if self.acc else None

    # ---------------------------------------------------------------- set-up
    def _prepare(self, loader: Any, expected_steps: int | None) -> None:
        if self.acc is not None:
            return
        options = self.options
        if options.expected_steps is None:
            options = replace(options, expected_steps=expected_steps)
        # under torchrun this rank's GPU is set first (the process group formed once): the example batch is
        # then made on it, by the loader's helper threads too (accelerate_with finds the group formed)
        _, device, _, _ = resolve_strategy(options, resolve_device(options.device))
        measured = options.measures_step or options.measures_cuda_switches(device)
        example = example_batch_of(loader) if measured else None
        self.acc = accelerate_with(options, self._raw_model, self.optimizer, example_batch=example,
                                   loss_fn=self.loss_fn, batch_format=self.batch_format, classes=self._classes,
                                   progress=self._say_progress())
        forget_prepared(self.acc.model)
        self._own_preparation = True
        self.dist = ranks.env()

    def _say_progress(self) -> bool | Callable[[str], Any]:
        """progress= for what the Trainer measures before training: lines to a callable on rank 0 only."""
        return self.progress if self.is_main and callable(self.progress) else False

    def prepare(self, loader: Iterable[Any], expected_steps: int | None = None) -> Accelerated:
        """Run accelerate() now (fit does it on first use): measure the "auto" settings on one batch."""
        self._prepare(self._shard(loader), expected_steps)
        return self.acc

    def choose_loader(self, loader: Iterable[Any], expected_steps: int | None = None) -> Any:
        """accelerate() (as `prepare`), then a FastLoader's counts chosen with this Trainer's training
        step in the loop (fit does it before its first epoch): the loader to train with (`loader_choice`
        says what was timed). Counts measured alone can take cores the step needs; counts the user fixed
        are kept, as is any other loader. Remembered like accelerate()'s choices."""
        loader = self._shard(loader)
        self._prepare(loader, expected_steps)
        return self._with_chosen_counts(loader)

    def _with_chosen_counts(self, loader: Any) -> Any:
        """The loader with its counts chosen with the step in the loop, once per loader given (the
        model, optimizer and RNG as they were; the choice recorded on `report` and `loader_choice`)."""
        if self._chosen is not None and (loader is self._chosen[0]() or loader is self._chosen[1]):
            return self._chosen[1]
        if alone_counts(loader) is None:
            return loader
        example = example_batch_of(loader)
        previous, self._loader = self._loader, loader  # how _split reads the batches

        def step(batch: Any) -> None:
            x, y = self._split(batch)
            with self.acc.autocast():
                loss = loss_of(self.loss_fn, self._forward(self.model, x), y, x)
            self.acc.backward(loss)
            self.acc.queue_step(self.optimizer, max_grad_norm=self.max_grad_norm)  # timed as the loop steps

        parts = {**step_parts(self.acc, self.loss_fn, example), "loop": "Trainer",
                 "max_grad_norm": self.max_grad_norm is not None}
        try:
            chosen, result = choose_counts(loader, step, parts, model=self.model, optimizer=self.optimizer,
                                           scaler=self.acc.scaler, device=self.device, refresh=self.options.refresh,
                                           progress=self._say_progress())
        finally:
            self._loader = previous
        self.acc.report.record_loader(result)
        self.loader_choice = result
        self._chosen = (weakref.ref(loader), chosen)
        return chosen

    def _shard(self, loader: Any) -> Any:
        return shard_loader(loader, self.dist) if self.dist.distributed else loader

    # ---------------------------------------------------------------- batches
    def _split(self, batch: Any) -> tuple[Any, Any]:
        x, y = self.batch_format.split(batch)
        if y is None:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(f"the batch has no target to train or evaluate on (it has {keys}); name the label "
                             "with batch_format=BatchFormat(target=KEY)")
        if not yields_device_batches(self._loader):
            x = to_device(x, self.device, self.acc.channels_last)
            y = to_device(y, self.device)
        elif isinstance(x, torch.Tensor) and x.dim() == 4:  # on the device already: only the chosen layout
            x = x.contiguous(memory_format=torch.channels_last if self.acc.channels_last else torch.contiguous_format)
        return x, y

    @staticmethod
    def _count(y: Any) -> int:
        return int(y.shape[0]) if isinstance(y, torch.Tensor) and y.dim() > 0 else 1

    def _forward(self, model: nn.Module, x: Any) -> Any:
        """The model called on the inputs as the batch format says; its logits."""
        return self.batch_format.logits_of(self.batch_format.forward(model, x))

    def _no_sync(self, syncing: bool) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient all-reduce on accumulation micro-steps (DDP's no_sync, FSDP2's flag)."""
        m = self.acc.module if self.acc.report.strategy == "fsdp" else self.acc.wrapped
        if not syncing and hasattr(m, "no_sync"):
            return m.no_sync()
        if hasattr(m, "set_requires_gradient_sync"):
            m.set_requires_gradient_sync(syncing)
        return contextlib.nullcontext()

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, loader: Iterable[Any]) -> dict[str, float]:
        """Validation loss (and top-1 accuracy for class logits) under autocast, without autograd:
        `inference_mode`, or `no_grad` under FSDP (whose parameters inference_mode would turn into
        inference tensors that a later backward refuses, e.g. when evaluating before fit)."""
        self._prepare(loader, None) if self.acc is None else None
        prev_loader, self._loader = self._loader, self._shard(loader)
        model = self.model
        was_training = model.training
        model.eval()
        # Read per batch (correct_top1 reads anyway) and summed in float64 on the host: the result does
        # not depend on the batches' order, as a float32 sum on the device would.
        loss_sum, correct, n, classify = 0.0, 0.0, 0.0, True
        try:
            no_autograd = torch.no_grad() if self.acc.report.strategy == "fsdp" else torch.inference_mode()
            with no_autograd, autocast_for(self.device, self.acc.precision):
                for i, batch in enumerate(self._loader):
                    x, y = self._split(batch)
                    out = self._forward(model, x)
                    if i == 0:
                        check_class_outputs(out, y, self.loss_fn, class_count(loader))
                    k = self._count(y)
                    loss_sum += float(loss_of(self.loss_fn, out, y, x).float()) * k
                    if classify and isinstance(out, torch.Tensor) and out.dim() == 2 and isinstance(y, torch.Tensor) \
                            and y.dim() == 1 and not y.is_floating_point():
                        correct += correct_top1(out, y)
                    else:
                        classify = False
                    n += k
        finally:
            model.train(was_training)
            self._loader = prev_loader
        loss_sum, correct, n, cls = distributed.all_reduce_sums([loss_sum, correct, n, float(classify)])
        if n == 0:
            raise ValueError("the validation loader is empty")
        metrics = {"val_loss": loss_sum / n}
        if cls >= self.dist.world_size:
            metrics["val_acc"] = correct / n
        return metrics

    # ---------------------------------------------------------------- checkpoints (see resume.py)
    def _trained(self) -> Trained:
        return Trained(self.module, self.optimizer, self.acc.scaler, self.scheduler, self.acc.report.strategy == "fsdp")

    def _position(self) -> dict[str, Any]:
        """The loop's counters as a checkpoint holds them."""
        self._read_skips()
        return {"epoch": self.epoch, "batches_done": self.batches_done, "global_step": self.global_step,
                "skipped_steps": self.skipped_steps, "history": self.history, "run_id": self.run_id}

    def _continue_from(self, state: dict[str, Any]) -> None:
        """The loop's counters (and the metrics rows up to its step) from a restored checkpoint's state."""
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]
        self.global_step, self.skipped_steps = state["global_step"], state["skipped_steps"]
        self.history = list(state.get("history") or [])
        self.run_id = state.get("run_id") or self.run_id
        self.log.restore(self.global_step)

    def state_dict(self, include_model: bool = True, rng_ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Everything needed to continue exactly: tensors and plain types only.

        `rng_ranks`: every rank's generators, now and at the epoch's start, one entry per rank (the
        only place they are kept; `save_checkpoint` gathers them from all ranks); by default this
        process's only."""
        return self._resume.state(self._position(), self._loader, self._trained(), include_model, rng_ranks)

    def save_checkpoint(self, directory: str | os.PathLike) -> str:
        """Write a full checkpoint into `directory` (rank 0; every rank under FSDP). Returns its path.

        The pending losses are read first, so a checkpoint never holds weights trained past a NaN loss."""
        self._read_losses()
        if self.run_id is None:
            self.run_id = ckpt.new_run_id()
        return self._resume.save(os.fspath(directory), self._position(), self._loader, self._trained())

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by save_checkpoint; training continues from it.

        It is verified against its record first (CheckpointError naming the file when its bytes changed
        or it is incomplete) and read with weights_only=True (pickled objects refused)."""
        path = os.fspath(path)
        self._continue_from(self._resume.restore(path, ckpt.load_file(path), self._trained()))

    # ---------------------------------------------------------------- training
    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _read_losses(self) -> None:
        """Read the losses kept on the device (a NaN/inf one is an error unless a GradScaler skips those) and
        the skipped steps' findings kept with them."""
        self._losses.read(nonfinite_is_error=self.acc is None or self.acc.scaler is None)
        self._read_skips()

    def _read_skips(self) -> None:
        """Count the skipped steps whose findings were left on the device (one host read for all of them)."""
        if self._unread_skips:
            self.skipped_steps += int(torch.stack(self._unread_skips).sum())
            self._unread_skips.clear()

    def _optimizer_step(self) -> None:
        """Accelerated's step (unscale, clip, step, scaler update, zero_grad), a step the GradScaler skipped
        (inf/NaN gradients) counted, and the per-step scheduler, which steps on taken steps only. Under fp16
        a fused optimizer's finding stays on the device until the next reading point (`queue_step`: no host
        wait per step), unless a per-step scheduler needs it now."""
        if self.scheduler is not None and self.scheduler_interval == "step":
            if self.acc.step(self.optimizer, max_grad_norm=self.max_grad_norm):
                self.scheduler.step()
            else:
                self.skipped_steps += 1
            return
        taken = self.acc.queue_step(self.optimizer, max_grad_norm=self.max_grad_norm)
        if isinstance(taken, torch.Tensor):
            self._unread_skips.append(~taken)
        elif not taken:
            self.skipped_steps += 1

    def fit(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None = None, epochs: int = 1,
            max_steps: int | None = None, resume: str | os.PathLike | None = None) -> dict[str, Any]:
        """Train for `epochs` (or until `max_steps` optimizer steps / a callback stops); returns final metrics.

        `resume`: a checkpoint path, a directory of checkpoints, "last" (the newest complete one of the
        run in the Checkpoint callback's directory; FileNotFoundError when it holds none: a resume never
        silently becomes a new run), or "auto" ("last" when the directory holds a checkpoint of its run,
        else a new run, logged at INFO: one script starts or continues, as torchrun restarts it). A
        directory or "last" skips a checkpoint that fails its check (bit flip, torn write) with a warning
        and loads the one before (CheckpointError when none passes); an explicit path is loaded or
        refused, never replaced. Another number of ranks may resume: DDP's state is whole, FSDP's is
        resharded, an epoch begun by the other world is continued with each unread sample read once (a
        DataLoader under torchrun or a FastLoader; docs/train.md says what cannot be exact).

        Without `resume` this is a new run (unless this Trainer has run before): a Checkpoint directory
        holding another run's checkpoints is refused before any data is read (unless `overwrite=True`).
        Another run's checkpoint is never loaded or overwritten: one under a step this run would write
        refuses the run first.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive integer or None, got {max_steps!r}")
        if resume is not None and os.fspath(resume) == "auto":
            resume = self._resume.auto()
        try:
            return self._fit(train_loader, val_loader, epochs, max_steps, resume)
        finally:
            self._resume.release()
            if self._own_preparation and self.acc is not None and self.acc.scaler is not None:
                release_step_guard(self.optimizer)  # fp16: the optimizer steps plainly again after the run

    def _fit(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int,
             max_steps: int | None, resume: str | os.PathLike | None) -> dict[str, Any]:
        loader, n_batches = self._start_run(train_loader, epochs, max_steps, resume)
        bar = Progress(self.progress if self.is_main else False)
        run = Span()
        last: dict[str, Any] = {}
        self._call("on_train_start")
        try:
            while self.epoch < epochs and not self.should_stop and not self._reached(max_steps):
                epoch, stopped_mid_epoch = self._train_epoch(loader, n_batches, epochs, max_steps, bar)
                run.samples += epoch.samples
                if stopped_mid_epoch:
                    break  # no validation, the position stays mid-epoch
                last = self._end_epoch(val_loader, epoch, bar)
            self._read_losses()  # what a stop mid-epoch left unread
        finally:
            bar.close()
        return self._end_run(run, last, bar)

    def _reached(self, max_steps: int | None) -> bool:
        return bool(max_steps) and self.global_step >= max_steps

    def _start_run(self, train_loader: Iterable[Any], epochs: int, max_steps: int | None,
                   resume: str | os.PathLike | None) -> tuple[Any, int | None]:
        """Before the first batch: a new run's checkpoint directories claimed, or a resume's checked
        (both before any data is read), the loader sharded, accelerate() run on one batch, the
        checkpoint `resume` names loaded, another run's checkpoints in the way refused.
        Returns (the loader, its batches per epoch or None)."""
        self.dist = ranks.env()
        new_id = resume is None and self.run_id is None
        if resume is None:  # a new run, or this Trainer's own run going on: the directory is checked now
            if new_id:
                self.run_id = ckpt.new_run_id()
            self._resume.claim(self.run_id, resuming=False)
        elif os.fspath(resume) == "last":
            self._resume.last_of_run()  # nothing of the run to continue: refused before any data is read
        loader = self._shard(train_loader)
        try:
            n_batches = len(loader)  # type: ignore[arg-type]
        except TypeError:
            n_batches = None
        self._classes = class_count(train_loader)
        self._outputs_checked = False
        self._prepare(loader, max_steps or (n_batches * epochs // self.grad_accum_steps if n_batches else None))
        loader = self._with_chosen_counts(loader)  # before the first epoch: counts measured alone, with the step
        if new_id and self.dist.distributed:  # one run id on every rank: rank 0's, which claimed the directory
            hi, lo = ranks.broadcast_ints([int(self.run_id[:8], 16), int(self.run_id[8:], 16)])
            self.run_id = f"{hi:08x}{lo:08x}"
        planned = -(-n_batches // self.grad_accum_steps) * epochs if n_batches else None  # optimizer steps
        self._resume.loaded = self._resume.rest = None
        if resume is not None:
            self._continue_from(self._resume.load(resume, self._trained())[1])
            if self._resume.rest is not None:
                self.batches_done = self._resume.continue_elsewhere(loader, n_batches, self.epoch)
            if self.run_id is None:
                self.run_id = ckpt.new_run_id()
            self._resume.claim(self.run_id, resuming=True)
        self._resume.refuse_foreign_ahead(self.run_id, self.global_step,
                                          min(s for s in (max_steps, planned, math.inf) if s))
        self.should_stop = False
        self._loader = loader
        self._losses = LossMeter()
        return loader, n_batches

    def _train_epoch(self, loader: Any, n_batches: int | None, epochs: int, max_steps: int | None,
                     bar: Progress) -> tuple[Span, bool]:
        """One pass over the loader (a mid-epoch resume continues with the next unseen batch). Returns
        the samples it trained on and whether it stopped mid-epoch at `max_steps`."""
        self._resume.finished = False
        self._call("on_epoch_start")
        self.model.train()
        it, self.batches_done = self._resume.epoch_iterator(loader, self.epoch, self.batches_done)
        bar.epoch(f"epoch {self.epoch + 1}/{epochs}", n_batches, self.batches_done)
        self._losses.start_epoch()
        epoch, step = Span(), Span()
        row = Span(t0=step.t0)
        micro, exhausted = 0, True
        for batch in it:
            micro += 1
            loss, samples, sync = self._train_batch(batch, micro, n_batches)
            step.samples += samples
            epoch.samples += samples
            if not sync:
                continue
            micro = 0
            self._step(loss, step, row, bar)
            if self.should_stop or self._reached(max_steps):
                exhausted = False
                break
        if micro:  # a last, partial accumulation group (a loader without len)
            with self._named_oom("optimizer step"):
                self._optimizer_step()
            self.global_step += 1
        if self._reached(max_steps) and n_batches is not None and self.batches_done < n_batches:
            return epoch, True
        if not exhausted and n_batches is not None and self.batches_done >= n_batches:
            next(it, None)  # end the pass as an uninterrupted run does (a sampler may draw RNG there)
        return epoch, False

    def _train_batch(self, batch: Any, micro: int, n_batches: int | None) -> tuple[torch.Tensor, int, bool]:
        """Forward, loss and backward of micro-batch `micro` of an accumulation group, gradients synced
        across ranks only on the group's last. Returns (its loss, its samples, whether it ends the group)."""
        x, y = self._split(batch)
        samples = self._count(y)
        sync = micro == self.grad_accum_steps or (n_batches is not None and self.batches_done + 1 == n_batches)
        group = self._group_size(n_batches)
        with self._no_sync(sync):
            with self._named_oom("forward"), self.acc.autocast():
                out = self._forward(self.model, x)
                if not self._outputs_checked:  # once per run: it reads the largest label
                    check_class_outputs(out, y, self.loss_fn, self._classes)
                    self._outputs_checked = True
                loss = loss_of(self.loss_fn, out, y, x)
            with self._named_oom("backward"):
                self.acc.backward(loss / group if group > 1 else loss)
        self.batches_done += 1
        self._losses.add(loss, samples, (self.global_step + 1, self.epoch + 1, self.batches_done))
        if len(self._losses.pending) >= _MAX_UNREAD:
            self._read_losses()
        return loss, samples, sync

    def _group_size(self, n_batches: int | None) -> int:
        """The micro-batches of the accumulation group the next batch belongs to: `grad_accum_steps`, or
        the fewer left at an epoch's end (its gradient then the mean over those, as a short last batch's is)."""
        every = self.grad_accum_steps
        short = n_batches % every if n_batches else 0
        return short if short and self.batches_done >= n_batches - short else every

    def _step(self, loss: torch.Tensor, step: Span, row: Span, bar: Progress) -> None:
        """The optimizer step that ends an accumulation group, then a metrics row at a reading point,
        the progress bar and the callbacks' on_step_end."""
        with self._named_oom("optimizer step"):
            self._optimizer_step()
        self.global_step += 1
        world = self.dist.world_size
        now = time.perf_counter()
        rate = step.rate(world, now)  # as the host saw it (no device wait)
        row.samples += step.samples
        step.samples, step.t0 = 0, now
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.global_step % self.log_every_n_steps == 0:  # a reading point
            self._read_losses()
            now = time.perf_counter()
            metrics = {"train_loss": self._losses.interval_mean(), "lr": lr, "samples_per_s": row.rate(world, now)}
            row.samples, row.t0 = 0, now
            self.log.add({"epoch": self.epoch + 1, "step": self.global_step, **metrics})
            bar.report(self.epoch + 1, self.global_step, metrics["train_loss"], metrics["samples_per_s"])
        bar.advance()
        # train_loss: this step's loss as a 0-d tensor on the device (float() it to read it)
        self._call("on_step_end", self.global_step, {"train_loss": loss.detach(), "lr": lr, "samples_per_s": rate})

    def _end_epoch(self, val_loader: Iterable[Any] | None, epoch: Span, bar: Progress) -> dict[str, Any]:
        """After a full pass: the epoch's row (mean training loss of the epoch over every rank, then
        validation), the epoch-wise scheduler, one stop decision for all ranks, on_epoch_end; the
        position moves to the next epoch. Returns the row."""
        self._read_losses()
        self._resume.finished = True
        rate = epoch.rate(self.dist.world_size, time.perf_counter())
        s, n = distributed.all_reduce_sums([self._losses.epoch_sum, float(self._losses.epoch_n)])
        row = {"epoch": self.epoch + 1, "step": self.global_step, "train_loss": s / n if n else math.nan,
               "lr": float(self.optimizer.param_groups[0]["lr"]), "samples_per_s": rate}
        if val_loader is not None:
            val = self.evaluate(val_loader)
            row.update(val)
            self._call("on_validation_end", val)
        self.log.add(dict(row))
        self.history.append(dict(row))
        bar.line(epoch_line(row))
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            self.scheduler.step()
        self.should_stop = distributed.any_rank(self.should_stop)
        self._call("on_epoch_end")
        if self.is_main:
            self.log.flush()
        self.epoch += 1
        self.batches_done = 0
        self._resume.finished = False
        self._resume.rest = None
        return row

    def _end_run(self, run: Span, last: dict[str, Any], bar: Progress) -> dict[str, Any]:
        """on_train_end, the metrics file, and the run's final metrics (also shown as a summary)."""
        self._call("on_train_end")
        if self.is_main:
            self.log.flush()
        now = time.perf_counter()
        seconds = now - run.t0
        result = {**(self.history[-1] if self.history else last), "epochs": self.epoch, "step": self.global_step,
                  "stopped_early": bool(self.should_stop), "skipped_steps": self.skipped_steps,
                  "seconds": seconds, "run_samples_per_s": run.rate(self.dist.world_size, now)}
        if self.progress is True and self.is_main:
            self._summary(result)
        bar.line(f"done: {self.global_step} steps in {seconds:.1f} s, "
                 f"{result['run_samples_per_s']:,.0f} samples/s")
        return result

    def _summary(self, result: dict[str, Any]) -> None:
        rows = [(k, v) for k, v in result.items() if isinstance(v, (int, float, bool))]
        r = self.acc.report
        rows.append(("setup", f"{r.precision}, channels_last={r.channels_last}, compile={r.compile_setting}, "
                              f"strategy={r.strategy}, optimizer={r.optimizer}"))
        print_table("training summary", ["metric", "value"], rows)
