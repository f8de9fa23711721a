"""Trainer: a small training loop that calls accelerate() and adds what every run needs.

Gradient accumulation, clipping, LR scheduling, callbacks, a progress bar with samples/s, metrics
to CSV or JSONL, NaN/inf detection, exact resume, and torchrun (DDP / FSDP2) support. It accepts a
plain DataLoader (batches are moved to the device here) or any loader whose class says
`yields_device_batches = True` (a FastLoader: batches arrive on the device, normalised).

The training step is the one `Accelerated` gives every plain loop (`autocast()`, `backward()`,
`step()`): no scaling code of its own. The loss stays on the device between reading points (every
`log_every_n_steps` optimizer steps, the end of an epoch, a checkpoint, the end of the run): reading
it every step would make the host wait for the device each step.
"""
from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from torchspeed.atomic import atomic_write
from torchspeed.batches import BatchFormat, to_device
from torchspeed.metrics import correct_top1
from torchspeed.runtime import resolve_device, rng_state, set_rng_state
from torchspeed.train import checkpoint as ckpt
from torchspeed.train import distributed
from torchspeed.train.acceleration import (
    AccelerateOptions,
    Accelerated,
    AccelerateResult,
    accelerate_with,
    autocast_for,
    check_class_outputs,
    forget_prepared,
    release_step_guard,
    step_parts,
)
from torchspeed.train.callbacks import Callback, Checkpoint
from torchspeed.train.loader_choice import LoaderStepResult, alone_counts, choose_counts
from torchspeed.train.wrapping import class_count, example_batch_of

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

_MAX_UNREAD = 1024  # losses kept on the device before they are read anyway (a very long log interval)

_LOG_COLUMNS = ("epoch", "step", "train_loss", "val_loss", "val_acc", "lr", "samples_per_s")


class _MetricsLog:
    """Rows of metrics kept in memory and rewritten atomically to CSV or JSONL (by the extension)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = os.fspath(path) if path else None
        if self.path and not self.path.endswith((".csv", ".jsonl")):
            raise ValueError(f"log_path {self.path!r} must end in .csv or .jsonl")
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def restore(self, up_to_step: int) -> None:
        """On resume: keep the rows already logged up to the checkpoint's step."""
        if not self.path or not os.path.isfile(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            if self.path.endswith(".jsonl"):
                rows = [json.loads(line) for line in f if line.strip()]
            else:
                rows = [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(f)]
        self.rows = [r for r in rows if r.get("step") is not None and r["step"] <= up_to_step]

    def flush(self) -> None:
        if not self.path:
            return
        with atomic_write(self.path, "w") as f:
            if self.path.endswith(".jsonl"):
                for r in self.rows:
                    f.write(json.dumps(r) + "\n")
            else:
                w = csv.DictWriter(f, fieldnames=_LOG_COLUMNS, extrasaction="ignore")
                w.writeheader()
                w.writerows(self.rows)


def _number(text: str | None) -> int | float | None:
    """A CSV cell as it was written: an int stays an int (epoch, step), a float a float, empty is None."""
    if text in ("", None):
        return None
    try:
        return int(text)
    except ValueError:
        return float(text)


class _LossMeter:
    """Training losses kept on the device, read to the host in one transfer at reading points.

    Each micro-batch's loss is kept (detached, 0-d) with where it happened; `read()` stacks the
    pending ones, reads them at once, raises FloatingPointError naming the first NaN/inf one (unless
    a GradScaler handles those: then they are skipped and left out of the means), and adds the rest
    to the epoch's and the log interval's sample-weighted sums.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, int, tuple[int, int, int]]] = []
        self.epoch_sum = self.since_sum = 0.0
        self.epoch_n = self.since_n = 0

    def add(self, loss: torch.Tensor, samples: int, where: tuple[int, int, int]) -> None:
        """`where` = (optimizer step, epoch, batch), 1-based, for the error message."""
        self.pending.append((loss.detach().float().reshape(()), samples, where))

    def read(self, nonfinite_is_error: bool) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        values = torch.stack([t for t, _, _ in pending]).tolist()
        for v, (_, k, (step, epoch, batch)) in zip(values, pending):
            if not math.isfinite(v):
                if nonfinite_is_error:
                    raise FloatingPointError(
                        f"loss is {v} at step {step} (epoch {epoch}, batch {batch}); lower the learning rate, "
                        "clip gradients (max_grad_norm=...), or check the inputs for NaN/inf (the loss is read "
                        "every log_every_n_steps steps and at epoch ends, so training went on until then)")
                continue
            self.epoch_sum += v * k
            self.since_sum += v * k
            self.epoch_n += k
            self.since_n += k

    def interval_mean(self) -> float:
        """Mean loss since the previous call (NaN when every loss since was skipped); restarts the interval."""
        mean = self.since_sum / self.since_n if self.since_n else math.nan
        self.since_sum, self.since_n = 0.0, 0
        return mean

    def start_epoch(self) -> None:
        """A new epoch: its sums and the first log interval start at zero (the epoch's row was the last)."""
        self.epoch_sum, self.epoch_n = 0.0, 0
        self.since_sum, self.since_n = 0.0, 0


class _Progress:
    """Progress on rank 0: a rich bar (progress=True), short text lines to a callable, or nothing."""

    def __init__(self, progress: bool | Callable[[str], None]):
        self.bar = None
        self.say = progress if callable(progress) else None
        if progress is True:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False)
            self.bar.start()
        self.task = None

    def epoch(self, description: str, total: int | None, done: int) -> None:
        if self.bar is not None:
            self.task = self.bar.add_task(description, total=total, completed=done, info="")

    def advance(self) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, advance=1)

    def report(self, epoch: int, step: int, loss: float, rate: float) -> None:
        """At a reading point: the loss and samples/s since the previous one."""
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, info=f"loss {loss:.4f}  {rate:,.0f} samples/s")
        if self.say is not None:
            self.say(f"epoch {epoch} step {step} loss {loss:.4g} {rate:,.0f} samples/s")

    def line(self, text: str) -> None:
        if self.say is not None:
            self.say(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@dataclass
class _Span:
    """Samples trained on since `t0` (an epoch, an optimizer step, a metrics row) and their rate."""

    samples: int = 0
    t0: float = field(default_factory=time.perf_counter)

    def rate(self, world_size: int, now: float) -> float:
        """Samples per second over every rank (each rank trains as many)."""
        return self.samples * world_size / max(now - self.t0, 1e-9)


def _epoch_line(row: dict[str, Any]) -> str:
    """'epoch 1 step 8 train_loss 0.693 val_loss 0.65 val_acc 0.75 ...': an epoch's row as one line."""
    return " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())


def _generator_of(loader: Any) -> torch.Generator | None:
    """The loader's own torch.Generator (a DataLoader's shuffling draws from it), if it has one."""
    gen = getattr(loader, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def _own_rng(state: dict[str, Any], e: distributed.DistEnv) -> dict[str, Any]:
    """The checkpoint's state with this rank's generators where resuming reads them (`rng`, and
    `epoch_start["rng"]` mid-epoch).

    A checkpoint holds each rank's generators once, in `rng_ranks`; a world of the size that wrote it
    takes its own entry, any other world rank 0's (only an epoch-end checkpoint may be resumed by
    another number of ranks). Checkpoints of older versions also kept rank 0's at the top level:
    those are used as written when the world differs."""
    ranks = state.get("rng_ranks") or []
    if len(ranks) != e.world_size:
        if "rng" in state or not ranks:
            return state
        ranks = ranks[:1] * e.world_size
    mine = ranks[e.rank]
    start = state.get("epoch_start")
    if start is not None and mine.get("epoch_start_rng") is not None:
        start = dict(start, rng=mine["epoch_start_rng"])
    return dict(state, rng=mine["rng"], epoch_start=start)


def _check_agrees(acc: Accelerated, options: AccelerateOptions) -> None:
    """A prepared model comes with its settings: a Trainer setting that says otherwise is an error
    (silently ignoring it, or preparing the model twice, would both surprise)."""
    r = acc.report
    chosen = {"precision": r.precision, "channels_last": r.channels_last, "compile": r.compile,
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
    input) or whatever `batch_format` (`torchspeed.batches.BatchFormat` or a dict of its fields) says;
    the model is called with the inputs (a dict as keyword arguments) and the loss gets the logits of
    its output (the tensor, `.logits` or `["logits"]`; `BatchFormat(logits=lambda out: out)` passes
    the whole output).

    `model` may be a model `accelerate()` returned, or the `Accelerated` itself: its choices are used
    as they are (nothing is measured again; `optimizer` may then be left out). Settings given here
    that contradict them are an error; "auto" ones follow them. precision, channels_last, compile,
    strategy, device and `accelerate_kwargs` (accelerate()'s other keywords) make the Trainer's
    `options`, an `AccelerateOptions`.
    `loss_fn` may instead take `(outputs, targets, inputs)` when it has `needs_inputs = True`
    (distillation). `scheduler` steps every optimizer step (`scheduler_interval="step"`) or epoch.
    `grad_accum_steps` micro-batches make one optimizer step; `max_grad_norm` clips gradients.
    `log_path` (.csv or .jsonl) receives train_loss / lr / samples_per_s every `log_every_n_steps`
    steps and val_loss / val_acc after each validation; the train_loss of a row is the mean over the
    batches since the previous row. `progress`: True for a progress bar and a summary table, a
    callable to receive short text lines ("epoch 1 step 50 loss 2.31 840 samples/s") at the same
    points, False for silence. Under torchrun the loaders are sharded, the
    model wrapped (DDP, or FSDP2 with `strategy="fsdp"`), metrics all-reduced, checkpoints written
    by rank 0 (sharded through torch.distributed.checkpoint under FSDP).
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
        self.log = _MetricsLog(log_path)
        self.log_every_n_steps = max(1, int(log_every_n_steps))
        if not (isinstance(progress, bool) or callable(progress)):
            raise ValueError(f"progress must be True, False or a callable taking a text line, got {progress!r}")
        self.progress = progress
        self.acc: Accelerated | None = prepared
        self.dist = distributed.env()
        self._losses = _LossMeter()
        # loop state (all of it goes into a checkpoint)
        self.epoch = 0
        self.batches_done = 0       # batches consumed in the current epoch
        self.global_step = 0        # optimizer steps
        self.skipped_steps = 0      # optimizer steps GradScaler skipped (fp16 overflow)
        self.should_stop = False
        self.history: list[dict[str, Any]] = []
        self.run_id: str | None = None  # this run's id: in every checkpoint and in the checkpoint directory
        self._epoch_start: dict[str, Any] | None = None
        self._epoch_finished = False
        self._loader: Any = None
        self._resume_state: dict[str, Any] | None = None  # the loaded checkpoint's state, this rank's generators
        # an epoch continued by another number of ranks than began it: its order, what was read, where
        # this world's count of batches starts, the loader of this rank's part (see _continue_elsewhere)
        self._rest: dict[str, Any] | None = None
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
        measured = options.measures_step or options.measures_cuda_switches(resolve_device(options.device))
        example = example_batch_of(loader) if measured else None
        self.acc = accelerate_with(options, self._raw_model, self.optimizer, example_batch=example,
                                   loss_fn=self.loss_fn, batch_format=self.batch_format, classes=self._classes,
                                   progress=self._say_progress())
        forget_prepared(self.acc.model)
        self._own_preparation = True
        self.dist = distributed.env()

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
                loss = self._loss(self._forward(self.model, x), y, x)
            self.acc.backward(loss)
            self.acc.step(self.optimizer, max_grad_norm=self.max_grad_norm)

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
        return distributed.shard_loader(loader, self.dist) if self.dist.distributed else loader

    # ---------------------------------------------------------------- batches
    def _split(self, batch: Any) -> tuple[Any, Any]:
        x, y = self.batch_format.split(batch)
        if y is None:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(f"the batch has no target to train or evaluate on (it has {keys}); name the label "
                             "with batch_format=BatchFormat(target=KEY)")
        if not getattr(self._loader, "yields_device_batches", False):
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

    def _loss(self, out: Any, y: Any, x: Any) -> torch.Tensor:
        return self.loss_fn(out, y, x) if getattr(self.loss_fn, "needs_inputs", False) else self.loss_fn(out, y)

    def _no_sync(self, syncing: bool) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient all-reduce on accumulation micro-steps (DDP's no_sync, FSDP2's flag)."""
        m = self.acc.module if self.acc.report.strategy == "fsdp" else self.acc.wrapped
        if syncing:
            if hasattr(m, "set_requires_gradient_sync"):
                m.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if hasattr(m, "no_sync"):
            return m.no_sync()
        if hasattr(m, "set_requires_gradient_sync"):
            m.set_requires_gradient_sync(False)
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
                    loss_sum += float(self._loss(out, y, x).float()) * k
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

    # ---------------------------------------------------------------- checkpoints
    def _position(self) -> tuple[int, int]:
        return (self.epoch + 1, 0) if self._epoch_finished else (self.epoch, self.batches_done)

    def _rng_of_this_rank(self) -> dict[str, Any]:
        """This process's generators now and at the start of the epoch (each rank has its own: under
        DDP, rank r's dropout draws from cuda:r's generator, which only rank r's process holds)."""
        start = None if self._epoch_finished or self._epoch_start is None else self._epoch_start["rng"]
        return {"rng": rng_state(), "epoch_start_rng": start}

    def state_dict(self, include_model: bool = True, rng_ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Everything needed to continue exactly: tensors and plain types only.

        `rng_ranks`: every rank's generators, now and at the epoch's start, one entry per rank (the
        only place they are kept; `save_checkpoint` gathers them from all ranks); by default this
        process's only."""
        epoch, done = self._position()
        loader = self._loader
        state: dict[str, Any] = {
            "format": ckpt.FORMAT,
            "epoch": epoch,
            "batches_done": done,
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "rng_ranks": rng_ranks if rng_ranks is not None else [self._rng_of_this_rank()],
            "generator": gen.get_state() if (gen := _generator_of(loader)) is not None else None,
            # the loader's generator when this epoch's iterator was made (the RNG's: rng_ranks)
            "epoch_start": None if self._epoch_finished or self._epoch_start is None
            else {"generator": self._epoch_start["generator"]},
            "loader": loader.state_dict() if (loader is not None and not self._epoch_finished
                                               and hasattr(loader, "load_state_dict")) else None,
            "scaler": self.acc.scaler.state_dict() if self.acc.scaler is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "callbacks": [cb.state_dict() for cb in self.callbacks],
            "history": self.history,
            "world_size": self.dist.world_size,
            # how this epoch's samples are ordered and how many of them were read: another number of
            # ranks continues the epoch from it (None at an epoch's end, or for an order it cannot map)
            "order": None if self._epoch_finished else self._order_now(),
            "run_id": self.run_id,
        }
        if include_model:
            state["model"] = self.module.state_dict()
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def _order_now(self) -> dict[str, Any] | None:
        """This epoch's order (`distributed.sampler_order`) with the samples of it read so far."""
        if self._rest is not None:
            r = self._rest
            read = self.dist.world_size * (self.batches_done - r["first"]) * r["batch_size"]
            return {**r["order"], "consumed": r["consumed"] + read, "remapped": True}
        order = distributed.sampler_order(self._loader)
        if order is None:
            return None
        return {**order, "consumed": order["world_size"] * self.batches_done * order["batch_size"]}

    def _continue_elsewhere(self, loader: Any, n_batches: int | None) -> None:
        """A checkpoint written mid-epoch by another number of ranks (or during such an epoch): this
        rank reads its part of the samples nobody had read (`distributed.remaining_share`), through
        the loader's settings, and the epoch's batch count is this world's (its first batches counted
        as done). Its last batch may be smaller, drop_last or not: no remaining sample is left out."""
        from torch.utils.data import DataLoader

        order, path = self._rest["order"], self._rest["path"]
        takes_rest = hasattr(getattr(loader, "sampler", None), "rest") and hasattr(loader, "load_state_dict")
        if not (takes_rest or isinstance(loader, DataLoader) and loader.batch_size) or n_batches is None:
            raise ValueError(
                f"checkpoint {path!r} was written by {order['world_size']} processes mid-epoch; continuing that "
                f"epoch with {self.dist.world_size} maps the samples left to the ranks through a torch DataLoader "
                f"or a FastLoader, and this loader is a {type(loader).__name__}: resume with {order['world_size']} "
                "processes, or from an epoch-end checkpoint")
        share = distributed.remaining_share(order, order["consumed"], self.dist.world_size, self.dist.rank)
        b = loader.batch_size
        left = -(-len(share) // b)  # a last, smaller batch rather than samples left out (even under drop_last)
        self.batches_done = max(0, n_batches - left)
        self._rest = {"order": order, "consumed": order["consumed"], "first": self.batches_done, "batch_size": b,
                      "share": share, "left": left}
        if not takes_rest:  # a DataLoader: one with its settings reads this rank's part
            self._rest["loader"] = distributed.with_sampler(loader, share, drop_last=False)
        log.info("continuing epoch %d (begun by %d process(es)) with %d: %d of its samples read, %d batch(es) left "
                 "on each rank", self.epoch + 1, order["world_size"], self.dist.world_size,
                 min(order["consumed"], order["n"]), left)

    def save_checkpoint(self, directory: str | os.PathLike) -> str:
        """Write a full checkpoint into `directory` (rank 0; every rank under FSDP). Returns its path.

        The pending losses are read first, so a checkpoint never holds weights trained past a NaN loss."""
        directory = os.fspath(directory)
        self._read_losses()
        if self.run_id is None:
            self.run_id = ckpt.new_run_id()
        ranks = distributed.gather_states(self._rng_of_this_rank())  # every rank takes part
        if self.acc.report.strategy == "fsdp":
            return ckpt.save_sharded(directory, self.global_step, self.module, self.optimizer,
                                     self.state_dict(include_model=False, rng_ranks=ranks), self.is_main)
        path = os.path.join(directory, ckpt.checkpoint_name(self.global_step))
        if self.is_main:
            ckpt.save_file(path, self.state_dict(rng_ranks=ranks))
        distributed.barrier()
        return path

    def _checkpoint_callbacks(self) -> list[Checkpoint]:
        return [cb for cb in self.callbacks if isinstance(cb, Checkpoint)]

    def _claim(self, resuming: bool) -> None:
        """Rank 0 takes every Checkpoint directory for this run (refusing another run's, see Checkpoint)."""
        if self.is_main:
            for cb in self._checkpoint_callbacks():
                cb.claim(self.run_id, resuming=resuming)

    def _refuse_foreign_ahead(self, last_step: float) -> None:
        """Before the first batch: a checkpoint of another run under a step this run may save
        (after its current step, up to `last_step`) is named and refused, never overwritten."""
        if not self.is_main:
            return
        for cb in self._checkpoint_callbacks():
            ahead = [p for s, p in ckpt.foreign(cb.directory, self.run_id) if self.global_step < s <= last_step]
            if ahead:
                raise ValueError(
                    f"checkpoint directory {cb.directory!r} holds {os.path.basename(ahead[0])}, which is not this "
                    f"run's (run {self.run_id}), under a step this run would write: it is never overwritten; move "
                    "it out of that directory, or write this run's checkpoints elsewhere")

    def _release(self) -> None:
        for cb in self._checkpoint_callbacks():
            cb.release()

    def _resume(self, resume: str | os.PathLike) -> str:
        """Load the checkpoint `resume` names; returns its path.

        A directory or "last": its run's newest checkpoint that passes its check; one that fails
        (damaged, torn) is skipped with a warning naming it, and the previous one is loaded; when none
        passes, CheckpointError lists them. "last" with no checkpoint of the directory's run is refused
        (FileNotFoundError naming any other run's checkpoints there). An explicit file is loaded or
        refused, never replaced."""
        resume = os.fspath(resume)
        if resume == "last":
            directory, found = self._last_of_run()
            candidates = [p for _, p in reversed(found)]
        elif os.path.isdir(resume) and not os.path.isfile(os.path.join(resume, ".metadata")):
            directory = resume
            candidates = [p for _, p in reversed(ckpt.candidates(resume))]
            if not candidates:
                raise FileNotFoundError(f"no complete checkpoint (step-*.pt with its record) in {resume!r}")
        else:
            if not os.path.exists(resume):
                raise FileNotFoundError(f"checkpoint {resume!r} does not exist")
            self.load_checkpoint(resume)
            return resume
        failed = []
        for path in candidates:
            try:
                state = ckpt.load_file(path)
            except ckpt.CheckpointError as e:
                failed.append(str(e))
                log.warning("%s; resuming from the checkpoint before it instead", e)
                continue
            if failed:
                log.warning("resuming from %s (%d newer checkpoint(s) failed their check)", path, len(failed))
            self._restore(path, state)
            return path
        raise ckpt.CheckpointError(f"no checkpoint in {directory!r} passes its check, so there is nothing to resume "
                                   f"from: {'; '.join(failed)}")

    def _last_of_run(self) -> tuple[str, list[tuple[int, str]]]:
        """resume='last': (the Checkpoint callback's directory, its run's checkpoints); refused when
        there is none (see checkpoint.resumable)."""
        dirs = [cb.directory for cb in self._checkpoint_callbacks()]
        if not dirs:
            raise ValueError("resume='last' needs a Checkpoint callback (its directory is searched); "
                             "or pass the checkpoint's path")
        return dirs[0], ckpt.resumable(dirs[0], "resume='last'", "fit without resume to start a new run there "
                                       "(Checkpoint(..., overwrite=True) deletes the checkpoints it holds)")

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by save_checkpoint; training continues from it.

        It is verified against its record first (CheckpointError naming the file when its bytes changed
        or it is incomplete) and read with weights_only=True (pickled objects refused)."""
        path = os.fspath(path)
        self._restore(path, ckpt.load_file(path))

    def _restore(self, path: str, state: dict[str, Any]) -> None:
        if not state.get("rng_ranks") and "rng" not in state:
            raise ValueError(f"checkpoint {path!r} holds no RNG state, so training cannot continue exactly from it "
                             "(written by another version of torchspeed?); start a new run")
        order = state.get("order")
        self._rest = None
        if state.get("epoch_start") is not None and (state.get("world_size", 1) != self.dist.world_size
                                                     or (order or {}).get("remapped")):
            if order is None:
                raise ValueError(f"checkpoint {path!r} was written by {state['world_size']} processes mid-epoch, "
                                 "by a loader whose order cannot be mapped to another number of processes (a "
                                 "DistributedSampler's can: a DataLoader under torchrun); resume it with the same "
                                 f"number ({self.dist.world_size} now), or from an epoch-end checkpoint")
            self._rest = {"order": order, "path": path}
        if self.acc.report.strategy == "fsdp" or "model" not in state:
            # sharded: DCP reshards for this world (any number of ranks, FSDP or not, or one process)
            ckpt.load_sharded(path, self.module, self.optimizer)
        else:
            try:
                self.module.load_state_dict(state["model"])
            except RuntimeError as e:
                raise ValueError(f"checkpoint {path!r} does not fit this model: {str(e)[:300]}") from None
            self.optimizer.load_state_dict(state["optimizer"])
        if state["scaler"] is not None and self.acc.scaler is not None:
            self.acc.scaler.load_state_dict(state["scaler"])
        if state["scheduler"] is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if len(state["callbacks"]) == len(self.callbacks):
            for cb, s in zip(self.callbacks, state["callbacks"]):
                cb.load_state_dict(s)
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]
        self.global_step, self.skipped_steps = state["global_step"], state["skipped_steps"]
        self.history = list(state.get("history") or [])
        self.run_id = state.get("run_id") or self.run_id
        self._resume_state = _own_rng(state, self.dist)
        self.log.restore(self.global_step)

    # ---------------------------------------------------------------- training
    def _epoch_iterator(self, loader: Any, epoch: int, resume: dict[str, Any] | None) -> Iterator[Any]:
        """This epoch's batches; on a mid-epoch resume, continue with the next unseen batch."""
        skip = self.batches_done if resume else 0
        gen = _generator_of(loader)
        if resume and self._rest is not None:  # another number of ranks: this rank's part of what is left
            self._set_epoch(loader, epoch)
            set_rng_state(resume["rng"])
            self._epoch_start = {"rng": rng_state(), "generator": gen.get_state() if gen is not None else None}
            if "loader" in self._rest:
                return iter(self._rest["loader"])
            if not self._rest["left"]:
                return iter(())
            # a loader that reads a given part itself (a FastLoader: its sampler's `rest`, from batch `first` on)
            loader.load_state_dict({**loader.state_dict(), "epoch": self._rest["order"]["epoch"],
                                    "batches_done": self._rest["first"]})
            loader.sampler.rest = self._rest["share"]
            return iter(loader)
        if resume:
            if resume.get("loader") is not None and hasattr(loader, "load_state_dict"):
                loader.load_state_dict(resume["loader"])  # a FastLoader knows its own position
                self._epoch_start = resume.get("epoch_start")
                set_rng_state(resume["rng"])
                n = len(loader) if hasattr(loader, "__len__") else None
                return iter(()) if n is not None and skip >= n else iter(loader)  # done: validate next
            if skip and resume.get("epoch_start") is not None:
                start = resume["epoch_start"]  # generators as they were when this epoch's iterator was made
                set_rng_state(start["rng"])
                if start.get("generator") is not None and gen is not None:
                    gen.set_state(start["generator"])
            else:  # at an epoch boundary the checkpoint's generators are this epoch's starting point
                set_rng_state(resume["rng"])
                if resume.get("generator") is not None and gen is not None:
                    gen.set_state(resume["generator"])
        self._set_epoch(loader, epoch)
        self._epoch_start = {"rng": rng_state(), "generator": gen.get_state() if gen is not None else None}
        it = iter(loader)
        for i in range(skip):  # replay the batches already trained on (same order, same augmentation)
            try:
                next(it)
            except StopIteration:
                raise ValueError(f"cannot resume at batch {skip} of epoch {epoch}: the loader has only {i}") from None
        if resume and skip:
            set_rng_state(resume["rng"])  # then every generator exactly as at the checkpoint
            if resume.get("generator") is not None and gen is not None:
                gen.set_state(resume["generator"])
        return it

    @staticmethod
    def _set_epoch(loader: Any, epoch: int) -> None:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _read_losses(self) -> None:
        """Read the losses kept on the device; a NaN/inf one is an error unless a GradScaler skips those."""
        self._losses.read(nonfinite_is_error=self.acc is None or self.acc.scaler is None)

    def _optimizer_step(self) -> bool:
        """Accelerated.step (unscale, clip, step, scaler update, zero_grad) and the per-step scheduler;
        False when the GradScaler skipped the step (inf/NaN gradients)."""
        stepped = self.acc.step(self.optimizer, max_grad_norm=self.max_grad_norm)
        if self.scheduler is not None and self.scheduler_interval == "step" and stepped:
            self.scheduler.step()
        return stepped

    def fit(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None = None, epochs: int = 1,
            max_steps: int | None = None, resume: str | os.PathLike | None = None) -> dict[str, Any]:
        """Train for `epochs` (or until `max_steps` optimizer steps / a callback stops); returns final metrics.

        `resume`: a checkpoint path, a directory of checkpoints, "last" (the newest complete one
        of the run in the Checkpoint callback's directory; FileNotFoundError when that directory holds
        none of its run: a resume never silently becomes a new run), or "auto" ("last" when the
        directory holds a checkpoint of its run, else a new run, logged at INFO: one script that
        starts or continues, as every attempt torchrun restarts runs it). A directory or "last" skips a
        checkpoint that fails its check (bit flip, torn write) with a warning naming it and loads the
        one before; CheckpointError when none passes. A checkpoint path given explicitly is loaded or
        refused (CheckpointError naming it), never replaced. Another number of ranks than wrote the
        checkpoint may resume it: DDP's state is whole, FSDP's is resharded, and an epoch begun by the
        other world is continued with each unread sample read once (for a DataLoader under torchrun or
        a FastLoader; docs/train.md says what cannot be exact). Another run's checkpoint in the directory
        is never loaded or overwritten: one under a step this run would write refuses the run first.

        Without `resume` this is a new run (unless this Trainer has run before): a Checkpoint
        directory holding another run's checkpoints is refused before any data is read, unless the
        callback has `overwrite=True`.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive integer or None, got {max_steps!r}")
        if resume is not None and os.fspath(resume) == "auto":
            resume = self._auto_resume()
        try:
            return self._fit(train_loader, val_loader, epochs, max_steps, resume)
        finally:
            self._release()
            if self._own_preparation and self.acc is not None and self.acc.scaler is not None:
                release_step_guard(self.optimizer)  # fp16: the optimizer steps plainly again after the run

    def _auto_resume(self) -> str | None:
        """resume='auto': "last" when the Checkpoint directory holds a checkpoint of its run, else None
        (a new run, which still refuses another run's checkpoints there), saying which."""
        dirs = [cb.directory for cb in self._checkpoint_callbacks()]
        if not dirs:
            raise ValueError("resume='auto' needs a Checkpoint callback (its directory is searched)")
        try:
            ckpt.resumable(dirs[0], "resume='auto'", "starting a new run")
        except FileNotFoundError as e:
            log.info("%s", e)
            return None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        log.info("resume='auto': continuing the run in %s (run %s) from its newest checkpoint%s", dirs[0],
                 ckpt.read_run(dirs[0]), f" (torchrun restart {restart} of job {os.environ.get('TORCHELASTIC_RUN_ID')})"
                 if restart and restart != "0" else "")
        return "last"

    def _fit(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int,
             max_steps: int | None, resume: str | os.PathLike | None) -> dict[str, Any]:
        loader, n_batches, resume_state = self._start_run(train_loader, epochs, max_steps, resume)
        bar = _Progress(self.progress if self.is_main else False)
        run = _Span()
        last: dict[str, Any] = {}
        self._call("on_train_start")
        try:
            while self.epoch < epochs and not self.should_stop and not self._reached(max_steps):
                epoch, stopped_mid_epoch = self._train_epoch(loader, n_batches, epochs, max_steps, resume_state, bar)
                resume_state = None
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
                   resume: str | os.PathLike | None) -> tuple[Any, int | None, dict[str, Any] | None]:
        """Before the first batch: a new run's checkpoint directories claimed, or a resume's checked
        (both before any data is read), the loader sharded, accelerate() run on one batch, the
        checkpoint `resume` names loaded, another run's checkpoints in the way refused.
        Returns (the loader, its batches per epoch or None, the state to resume from or None)."""
        self.dist = distributed.env()
        new_id = resume is None and self.run_id is None
        if resume is None:  # a new run, or this Trainer's own run going on: the directory is checked now
            if new_id:
                self.run_id = ckpt.new_run_id()
            self._claim(resuming=False)
        elif os.fspath(resume) == "last":
            self._last_of_run()  # nothing of the run to continue: refused before any data is read
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
            hi, lo = distributed.broadcast_ints([int(self.run_id[:8], 16), int(self.run_id[8:], 16)])
            self.run_id = f"{hi:08x}{lo:08x}"
        planned = -(-n_batches // self.grad_accum_steps) * epochs if n_batches else None  # optimizer steps
        self._resume_state = None
        self._rest = None
        if resume is not None:
            self._resume(resume)
            if self._rest is not None:
                self._continue_elsewhere(loader, n_batches)
            if self.run_id is None:
                self.run_id = ckpt.new_run_id()
            self._claim(resuming=True)
        self._refuse_foreign_ahead(min(s for s in (max_steps, planned, math.inf) if s))
        self.should_stop = False
        self._loader = loader
        self._losses = _LossMeter()
        return loader, n_batches, self._resume_state

    def _train_epoch(self, loader: Any, n_batches: int | None, epochs: int, max_steps: int | None,
                     resume_state: dict[str, Any] | None, bar: _Progress) -> tuple[_Span, bool]:
        """One pass over the loader (a mid-epoch resume continues with the next unseen batch). Returns
        the samples it trained on and whether it stopped mid-epoch at `max_steps`."""
        self._epoch_finished = False
        self._call("on_epoch_start")
        self.model.train()
        done_before = self.batches_done if resume_state else 0
        it = self._epoch_iterator(loader, self.epoch, resume_state)
        bar.epoch(f"epoch {self.epoch + 1}/{epochs}", n_batches, done_before)
        self.batches_done = done_before
        self._losses.start_epoch()
        epoch, step = _Span(), _Span()
        row = _Span(t0=step.t0)
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
        with self._no_sync(sync):
            with self.acc.autocast():
                out = self._forward(self.model, x)
                if not self._outputs_checked:  # once per run: it reads the largest label
                    check_class_outputs(out, y, self.loss_fn, self._classes)
                    self._outputs_checked = True
                loss = self._loss(out, y, x)
            self.acc.backward(loss / self.grad_accum_steps if self.grad_accum_steps > 1 else loss)
        self.batches_done += 1
        self._losses.add(loss, samples, (self.global_step + 1, self.epoch + 1, self.batches_done))
        if len(self._losses.pending) >= _MAX_UNREAD:
            self._read_losses()
        return loss, samples, sync

    def _step(self, loss: torch.Tensor, step: _Span, row: _Span, bar: _Progress) -> None:
        """The optimizer step that ends an accumulation group, then a metrics row at a reading point,
        the progress bar and the callbacks' on_step_end."""
        if not self._optimizer_step():
            self.skipped_steps += 1
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

    def _end_epoch(self, val_loader: Iterable[Any] | None, epoch: _Span, bar: _Progress) -> dict[str, Any]:
        """After a full pass: the epoch's row (mean training loss of the epoch over every rank, then
        validation), the epoch-wise scheduler, one stop decision for all ranks, on_epoch_end; the
        position moves to the next epoch. Returns the row."""
        self._read_losses()
        self._epoch_finished = True
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
        bar.line(_epoch_line(row))
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            self.scheduler.step()
        self.should_stop = distributed.any_rank(self.should_stop)
        self._call("on_epoch_end")
        if self.is_main:
            self.log.flush()
        self.epoch += 1
        self.batches_done = 0
        self._epoch_finished = False
        self._rest = None
        return row

    def _end_run(self, run: _Span, last: dict[str, Any], bar: _Progress) -> dict[str, Any]:
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
        from torchspeed.tables import print_table

        rows = [(k, v) for k, v in result.items() if isinstance(v, (int, float, bool))]
        r = self.acc.report
        rows.append(("setup", f"{r.precision}, channels_last={r.channels_last}, compile={r.compile}, "
                              f"strategy={r.strategy}, optimizer={r.optimizer}"))
        print_table("training summary", ["metric", "value"], rows)
