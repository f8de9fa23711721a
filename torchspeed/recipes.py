"""train_classifier(): an image classifier trained end to end, the recipe `torchspeed train` runs.

The data is an ImageFolder (class subfolders, or train/ and val/ splits; else a seeded share is held
out), a store from `torchspeed pack`, or a Dataset factory spec; the model a spec for
`torchspeed.models.create` (built with one output per class) or an nn.Module. The recipe: FastLoaders
sharded per rank, SGD with Nesterov momentum at a learning rate scaled to the global batch
(0.1 x batch x processes / 256 unless given), a cosine schedule over the run, label-smoothed
cross-entropy, EarlyStopping on val_loss, checkpoints in OUT/checkpoints (two kept) and metrics in
OUT/metrics.csv; then OUT/model.pt (the whole weights, gathered from every rank under FSDP) and
OUT/summary.json. It runs unchanged under torchrun.

OUT is claimed through `torchspeed.outputs` before any data is read: it is new or torchspeed's own,
so a file of the user's there is never replaced; `resume` continues only a run OUT holds a checkpoint of.

`prepare_classifier` does everything before the first step (a bad input fails before any data is
read where it can) and returns a `ClassifierRun`, whose `fit()` trains; `train_classifier` is the two
in one call. A recipe stands on data and train together, so it sits a layer above both.
"""
from __future__ import annotations

import copy
import logging
import math
import os
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed.args import progress_fn
from torchspeed.atomic import atomic_write, write_json
from torchspeed.data import fast_loader, train_val_split
from torchspeed.data.tune import shutdown_workers
from torchspeed.measure import OthersLoad, busy_warning, wait_for_quiet_machine
from torchspeed.models import build, is_factory_spec, load_weights
from torchspeed.outputs import MARKER, OutputDir, claim_output_dir, is_temporary
from torchspeed.remembered import model_fingerprint, recall, remember
from torchspeed.runtime import resolve_device, rng_state, seed_everything, set_rng_state, usable_cores
from torchspeed.train import distributed
from torchspeed.train.acceleration import AccelerateOptions, AccelerateResult
from torchspeed.train.callbacks import Checkpoint, EarlyStopping
from torchspeed.train.checkpoint import RUN_FILE, holds_run, read_run, resumable
from torchspeed.train.trainer import Trainer

__all__ = ["ClassifierOptions", "ClassifierResult", "ClassifierRun", "LoaderStepResult", "LoaderStepRow",
           "choose_loader_with_step", "prepare_classifier", "step_candidates", "time_fed_steps", "train_classifier"]

log = logging.getLogger(__name__)

Counts = int | str | list[int]  # "auto", a number, or counts to measure (fast_loader's num_workers / threads)

CHECKPOINTS = "checkpoints"
WRITES = ("model.pt", "summary.json", "metrics.csv")  # OUT's files besides its checkpoints/


@dataclass(frozen=True)
class ClassifierOptions:
    """The recipe's settings, named as `torchspeed train`'s flags; checked when made.

    `batch_size` is per process; `lr` the peak learning rate (None: 0.1 x batch x processes / 256);
    `patience` counts validations; `num_workers`/`threads` as fast_loader takes them (validation uses
    the number given, else the main process); `model_kwargs`/`weights` apply to a model given by spec;
    `resume` continues the run in `out` (True or "last": refused when it holds no checkpoint of its run;
    "auto": continued when it does, else a new run: what a job restarted by torchrun or a scheduler
    wants), `overwrite` starts a new one there (replacing what an earlier run wrote: its checkpoints,
    weights, summary and metrics; never a file torchspeed did not write)."""

    epochs: int
    batch_size: int = 64
    lr: float | None = None
    crop: int = 224
    val_fraction: float = 0.1
    patience: int = 10
    precision: str = "auto"
    channels_last: bool | str = "auto"
    compile: bool | str = "auto"  # noqa: A003 (the public name of the setting)
    strategy: str | None = "auto"
    num_workers: Counts = "auto"
    threads: Counts = "auto"
    max_steps: int | None = None
    seed: int = 0
    out: str | os.PathLike = "torchspeed-train"
    resume: bool | str = False
    overwrite: bool = False
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    weights: str | None = None
    refresh: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {self.epochs!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.resume not in (False, True, "last", "auto"):
            raise ValueError(f"resume must be False, True, 'last' or 'auto', got {self.resume!r}")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out and --overwrite deletes it: give one of them")
        self.accelerate_options()  # precision, channels_last, compile and strategy are checked there

    def accelerate_options(self) -> AccelerateOptions:
        """The Trainer's accelerate() settings these options ask for."""
        return AccelerateOptions(precision=self.precision, channels_last=self.channels_last, compile=self.compile,
                                 strategy=self.strategy, refresh=self.refresh)


@dataclass
class ClassifierResult:
    """What a run gives: the fields of OUT/summary.json (`to_dict()` is that file's contents)."""

    model: str                      # the spec given (or the model's class name)
    data: str                       # the data given (a path made absolute)
    classes: list[str]
    world_size: int                 # processes that trained
    lr: float                       # the peak learning rate
    batch_size: int                 # per process
    metrics: dict[str, Any]         # Trainer.fit's final metrics: epochs, step, val_loss, val_acc, seconds, ...
    early_stopping: dict[str, Any]  # stopped, best_val_loss, reason
    report: AccelerateResult | None  # what accelerate() chose and measured
    checkpoint: str | None          # the run's newest checkpoint
    run_id: str | None
    weights: str | None = None      # OUT/model.pt, written by rank 0 (None on the other ranks)
    loader: LoaderStepResult | None = None  # the training loader's setting chosen with the step in the loop

    def to_dict(self) -> dict[str, Any]:
        """summary.json: the metrics at the top level (their final "lr" over the peak one)."""
        d = {"model": self.model, "data": self.data, "classes": self.classes, "world_size": self.world_size,
             "lr": self.lr, "batch_size": self.batch_size, **self.metrics, "early_stopping": self.early_stopping,
             "accelerate": self.report.to_dict() if self.report is not None else None,
             "loader": self.loader.to_dict() if self.loader is not None else None,
             "checkpoint": self.checkpoint, "run_id": self.run_id}
        if self.weights is not None:
            d["weights"] = self.weights
        return d


@dataclass
class ClassifierRun:
    """A prepared run: the process group up, the data split, the model, loaders and Trainer built."""

    options: ClassifierOptions
    data: str
    model_name: str
    classes: list[str]
    train_samples: int
    val_samples: int
    train_loader: Any
    val_loader: Any
    trainer: Trainer
    early_stopping: EarlyStopping
    checkpoints: Checkpoint
    lr: float
    world_size: int
    device: torch.device
    output: OutputDir | None = None  # OUT, claimed by rank 0 (None on the other ranks)
    loader_choice: LoaderStepResult | None = None  # the training loader's setting, chosen with the step

    @property
    def is_main(self) -> bool:
        """Rank 0 (the process that writes and prints)."""
        return self.trainer.is_main

    @property
    def description(self) -> str:
        """One line: what is trained on what, where (`torchspeed train` prints it before training)."""
        return (f"training {self.model_name} on {self.train_samples} images ({len(self.classes)} classes), "
                f"validating on {self.val_samples}; {self.world_size} process(es), device {self.device}")

    def fit(self) -> ClassifierResult:
        """Train; then rank 0 writes OUT/model.pt and OUT/summary.json (every rank takes part in
        gathering the weights under FSDP). A NaN/inf loss raises FloatingPointError."""
        o = self.options
        try:
            metrics = self.trainer.fit(self.train_loader, self.val_loader, epochs=o.epochs, max_steps=o.max_steps,
                                       resume=("auto" if o.resume == "auto" else "last") if o.resume else None)
        finally:  # however the run ends, OUT's marker lists what it wrote there
            self._record(CHECKPOINTS, "metrics.csv")
        stopper = self.early_stopping
        result = ClassifierResult(
            model=self.model_name, data=self.data, classes=self.classes, world_size=self.world_size, lr=self.lr,
            batch_size=o.batch_size, metrics=metrics,
            early_stopping={"stopped": metrics["stopped_early"], "best_val_loss": stopper.best,
                            "reason": stopper.reason},
            report=self.trainer.report, checkpoint=self.checkpoints.last(), run_id=self.trainer.run_id,
            loader=self.loader_choice)
        weights = _full_state_dict(self.trainer.module)  # collective under FSDP: every rank takes part
        if self.is_main:
            result.weights = os.path.join(os.fspath(o.out), "model.pt")
            with atomic_write(result.weights, "wb") as f:
                torch.save(weights, f)
            self._record("model.pt")
            write_json(os.path.join(os.fspath(o.out), "summary.json"), result.to_dict())
            self._record("summary.json")
        return result

    def _record(self, *names: str) -> None:
        """Mark what this run wrote in OUT as torchspeed's (rank 0)."""
        if self.output is not None:
            self.output.record(*(n for n in names if self.output.holds(n)))


def prepare_classifier(data: str | os.PathLike, model: str | nn.Module, options: ClassifierOptions, *,
                       progress: bool | Callable[[str], Any] = True) -> ClassifierRun:
    """Everything before the first training step, in an order that keeps a mistake cheap: the data is
    named, `options.out` checked before the process group and any data, then the split, the classes,
    the model (a bad name fails before the loaders are made), the loaders and the Trainer.
    With `num_workers` and `threads` both "auto" (one process), accelerate() then runs and the training
    loader's setting is chosen with the training step in the loop (`choose_loader_with_step`: the
    setting fast_loader measured fastest alone and the less parallel ones below it, each feeding a few
    real steps, interleaved; the model, optimizer and RNG are put back as they were), so the loader's
    threads do not compete with the step's for the cores; the choice is remembered like accelerate's.
    `progress` is the Trainer's (True: a progress bar and a summary table)."""
    data = os.fspath(data)
    if not os.path.exists(data) and not is_factory_spec(data.strip()):
        raise FileNotFoundError(f"--data {data!r} does not exist: give an ImageFolder directory, a packed store "
                                "or a Dataset factory (package.module:factory or path/file.py:factory)")
    output, ckdir = _claim_out(os.fspath(options.out), options.resume, options.overwrite)
    seed_everything(options.seed)
    # The process group first, so the loaders shard themselves per rank.
    denv, device = (distributed.setup(resolve_device("auto")) if options.strategy not in (None, "none")
                    else (distributed.env(), resolve_device("auto")))
    train_src, val_src = train_val_split(data, options.val_fraction, options.seed)
    classes = _class_names(data, train_src)
    if len(classes) < 2:
        raise ValueError(f"{data!r} has {len(classes)} class(es); classification needs at least 2")
    net = _build_model(model, len(classes), options)
    train, val = _loaders(train_src, val_src, device, options)
    lr = options.lr or 0.1 * options.batch_size * denv.world_size / 256
    stopper = EarlyStopping("val_loss", patience=options.patience)
    checkpoints = Checkpoint(ckdir, keep_last=2, overwrite=options.overwrite)
    trainer = _trainer(net, lr, len(train), len(classes), options, [stopper, checkpoints], progress)
    choice = None
    if options.num_workers == "auto" and options.threads == "auto":
        if denv.world_size > 1:
            log.info("loader: under torchrun each rank's loader keeps the setting it measured alone (%s)",
                     _setting_of(train))
        else:
            train, choice = _loader_with_step(data, train, train_src, trainer, options, device, progress)
    return ClassifierRun(
        options=options, data=os.path.abspath(data) if os.path.exists(data) else data,
        model_name=model if isinstance(model, str) else type(model).__name__, classes=classes,
        train_samples=len(train_src), val_samples=len(val_src), train_loader=train, val_loader=val, trainer=trainer,
        early_stopping=stopper, checkpoints=checkpoints, lr=lr, world_size=denv.world_size, device=device,
        output=output, loader_choice=choice)


def train_classifier(
    data: str | os.PathLike,
    model: str | nn.Module,
    *,
    epochs: int,
    batch_size: int = 64,
    lr: float | None = None,
    crop: int = 224,
    val_fraction: float = 0.1,
    patience: int = 10,
    precision: str = "auto",
    channels_last: bool | str = "auto",
    compile: bool | str = "auto",  # noqa: A002 (the public name of the setting)
    strategy: str | None = "auto",
    num_workers: Counts = "auto",
    threads: Counts = "auto",
    max_steps: int | None = None,
    seed: int = 0,
    out: str | os.PathLike = "torchspeed-train",
    resume: bool | str = False,
    overwrite: bool = False,
    model_kwargs: Mapping[str, Any] | None = None,
    weights: str | None = None,
    refresh: bool = False,
    progress: bool | Callable[[str], Any] = True,
) -> ClassifierResult:
    """Train an image classifier on `data` end to end and write OUT/model.pt and OUT/summary.json.

    The arguments are `ClassifierOptions`' (the flags of `torchspeed train`); `progress` says where
    the run is (True: a line on stderr, a progress bar and a summary table; a callable gets text lines;
    False: nothing). Bad input is a ValueError or FileNotFoundError naming it; a NaN/inf loss a
    FloatingPointError.
    """
    options = ClassifierOptions(
        epochs=epochs, batch_size=batch_size, lr=lr, crop=crop, val_fraction=val_fraction, patience=patience,
        precision=precision, channels_last=channels_last, compile=compile, strategy=strategy, num_workers=num_workers,
        threads=threads, max_steps=max_steps, seed=seed, out=out, resume=resume, overwrite=overwrite,
        model_kwargs=dict(model_kwargs or {}), weights=weights, refresh=refresh)
    say = progress_fn(progress)
    run = prepare_classifier(data, model, options, progress=progress)
    if run.is_main:
        say(run.description)
    return run.fit()


def _claim_out(out: str, resume: bool | str, overwrite: bool) -> tuple[OutputDir | None, str]:
    """Before any data is read: `out` is new or torchspeed's (a user's file there is never replaced) and
    writable; a new run does not land on an earlier one; a resume has a checkpoint of its run to go on
    from. Rank 0 claims `out`, the other ranks only check. Returns (`out` claimed, its checkpoint directory)."""
    ckdir = os.path.join(out, CHECKPOINTS)
    main = distributed.env().is_main
    if main:
        _adopt(out, ckdir)
    if resume == "auto":
        pass  # the Trainer continues the run in `out` when it holds a checkpoint of it, else starts one
    elif resume:
        if not os.path.isdir(out):
            raise FileNotFoundError(f"--resume: --out {out!r} does not exist, so there is no run to continue (a "
                                    "mistyped path?): check it, or drop --resume to start a new run there")
        resumable(ckdir, f"--resume (--out {out!r})", "drop --resume to start a new run (with --overwrite, which "
                  "deletes the checkpoints there, if it holds any)")
    elif not overwrite and holds_run(ckdir):
        run = read_run(ckdir)
        raise ValueError(f"--out {out!r} already holds checkpoints of an earlier run{f' (run {run})' if run else ''} "
                         f"in {ckdir!r}: continue it with --resume, or start a new run there with --overwrite "
                         "(deletes those checkpoints), or give another --out")
    if not main:
        return None, ckdir
    output = claim_output_dir(out, "train", overwrite=resume or overwrite, replaces=WRITES)
    try:
        os.makedirs(ckdir, exist_ok=True)
    except OSError as e:
        raise OSError(f"--out {out!r}: its checkpoint folder {ckdir!r} cannot be made: {e.strerror or e}") from None
    output.record(CHECKPOINTS)
    return output, ckdir


def _adopt(out: str, ckdir: str) -> None:
    """A folder `torchspeed train` wrote without recording it (before output folders were marked, or
    killed between a write and its record) is torchspeed's: its checkpoints/ holds a torchspeed run (its
    checkpoints or its run file) and nothing else is there but the train command's files, which are
    then recorded as torchspeed's."""
    try:
        names = {n for n in os.listdir(out) if n != MARKER and not is_temporary(n)}
    except OSError:
        return
    folder = OutputDir(out, "train")
    unrecorded = names - set(folder.written())
    ran = holds_run(ckdir) or os.path.isfile(os.path.join(ckdir, RUN_FILE))
    if unrecorded and unrecorded <= {CHECKPOINTS, *WRITES} and ran:
        folder.record(*sorted(unrecorded))


def _class_names(data: str, source: object) -> list[str]:
    """The classes of the training data: a folder's or store's; a Dataset's `classes` (torchvision's
    convention), else the distinct values of its `targets`."""
    classes = list(getattr(source, "classes", []) or [])
    if classes:
        return [str(c) for c in classes]
    dataset = getattr(getattr(source, "source", source), "dataset", None)
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        return [str(c) for c in sorted({int(t) for t in targets})]
    raise ValueError(f"--data {data!r}: the Dataset has no `classes` list (nor `targets`) to count the classes by; "
                     "give it a `classes` attribute with the class names, as torchvision's ImageFolder has")


def _build_model(model: str | nn.Module, num_classes: int, options: ClassifierOptions) -> nn.Module:
    """The model: a spec through the one factory (a torchvision/timm model gets `num_classes`, which
    `model_kwargs` may override; the user's own factory gets `model_kwargs` only), or the module given."""
    if isinstance(model, nn.Module):
        return load_weights(model, options.weights) if options.weights is not None else model
    return build(model, weights=options.weights, model_kwargs=options.model_kwargs, num_classes=num_classes)


def _loaders(train_src: Any, val_src: Any, device: torch.device, options: ClassifierOptions) -> tuple[Any, Any]:
    """The training and validation FastLoaders; validation uses the counts given, else the main process
    (its batches are few)."""
    o = options
    train = fast_loader(train_src, o.batch_size, train=True, crop=o.crop, device=device, num_workers=o.num_workers,
                        threads=o.threads, seed=o.seed, refresh=o.refresh)
    val = fast_loader(val_src, o.batch_size, train=False, crop=o.crop, device=device,
                      num_workers=o.num_workers if isinstance(o.num_workers, int) else 0,
                      threads=o.threads if isinstance(o.threads, int) else 1, seed=o.seed)
    return train, val


def _setting_of(loader: Any) -> str:
    workers = getattr(loader, "num_workers", 0)
    return f"num_workers={workers}" + (f", threads={getattr(loader, 'threads', 1)}" if workers == 0 else "")


def _possible(setting: Any) -> bool:
    """Whether a remembered (num_workers, threads) can still run here (no more than the cores allow)."""
    return (isinstance(setting, list) and len(setting) == 2 and all(isinstance(v, int) for v in setting)
            and 0 <= setting[0] <= usable_cores() + 1 and 1 <= setting[1] <= usable_cores() + 1)


def _loader_with_step(data: str, train: Any, train_src: Any, trainer: Trainer, options: ClassifierOptions,
                      device: torch.device, progress: bool | Callable[[str], Any]) -> tuple[Any, LoaderStepResult]:
    """The training loader re-chosen with the training step in the loop (accelerate() runs first, so the
    step timed is the one training will run); recalled when this machine measured it for the same model,
    data and settings, unless `options.refresh`. Training starts from the state it had before."""
    o = options
    acc = trainer.prepare(train, o.max_steps or max(1, len(train) * o.epochs))
    alone = (train.num_workers, train.threads)
    # timing needs steps + 1 batches per pass (choose_loader_with_step's default 2 steps): a shorter epoch keeps
    # the setting measured alone
    candidates = step_candidates(*alone) if len(train) > 3 else [alone]

    def make(num_workers: int, threads: int) -> Any:
        return fast_loader(train_src, o.batch_size, train=True, crop=o.crop, device=device, num_workers=num_workers,
                           threads=threads, seed=o.seed)

    parts = {"model": model_fingerprint(acc.module), "data": os.path.abspath(data) if os.path.exists(data) else data,
             "samples": len(train_src), "batch_size": o.batch_size, "crop": o.crop, "decoder": train.decoder,
             "precision": acc.precision, "channels_last": acc.channels_last,
             "compile": bool(acc.report.compile), "device": device.type}
    memory = None if o.refresh or len(candidates) == 1 else recall("loader_step", parts)
    if memory is not None and _possible(memory.decision.get("setting")):
        chosen = tuple(memory.decision["setting"])
        log.info("loader with the step in the loop: %s", memory.describe())
        if chosen == alone:
            return train, LoaderStepResult(*chosen, remembered=memory.describe())
        shutdown_workers(train)
        return make(*chosen), LoaderStepResult(*chosen, remembered=memory.describe())
    model, optimizer, scaler = acc.model, trainer.optimizer, acc.scaler
    loss_fn = trainer.loss_fn

    def step(batch: Any) -> None:
        x, y = batch
        with acc.autocast():
            loss = loss_fn(model(acc.prepare_input(x)), y)
        acc.backward(loss)
        acc.step(optimizer)

    saved = (copy.deepcopy(acc.module.state_dict()), copy.deepcopy(optimizer.state_dict()),
             scaler.state_dict() if scaler is not None else None, rng_state())
    model.train()
    try:
        loader, result = choose_loader_with_step(make, step, candidates, device=device, built={alone: train},
                                                 progress=progress)
    finally:
        acc.module.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        if scaler is not None:
            scaler.load_state_dict(saved[2])
        set_rng_state(saved[3])
    if len(candidates) > 1:
        best = next(r for r in result.table if (r.num_workers, r.threads) == (result.num_workers, result.threads))
        remember("loader_step", parts, {"setting": [result.num_workers, result.threads]},
                 f"{result.setting}, {best.step_s:.3g} s/step")
    return loader, result


class _ClassLoss(nn.CrossEntropyLoss):
    """The recipe's label-smoothed cross-entropy, which first checks that the model gives one output
    per class: with more, training would go on against classes that do not exist; with fewer, it
    would fail inside the loss. Checked on the first batch of the trials and of training."""

    def __init__(self, classes: int, label_smoothing: float = 0.1):
        super().__init__(label_smoothing=label_smoothing)
        self.classes = classes

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 2 and logits.shape[1] != self.classes:
            raise ValueError(f"the model gives {logits.shape[1]} output(s) per sample (its logits' width) but the "
                             f"data has {self.classes} classes: give it one output per class (a factory of your "
                             f"own: e.g. --model-kwargs '{{\"num_classes\": {self.classes}}}')")
        return super().forward(logits, target)


def _trainer(model: nn.Module, lr: float, batches_per_epoch: int, classes: int, options: ClassifierOptions,
             callbacks: list[Any], progress: bool | Callable[[str], Any]) -> Trainer:
    """SGD with Nesterov momentum at `lr`, cosine-annealed to 0 over the run, label-smoothed cross-entropy."""
    o = options
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5, nesterov=True)
    total = o.max_steps or max(1, batches_per_epoch * o.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    return Trainer(model, opt, _ClassLoss(classes), precision=o.precision,
                   channels_last=o.channels_last, compile=o.compile,
                   strategy=None if o.strategy == "none" else o.strategy, accelerate_kwargs={"refresh": o.refresh},
                   scheduler=sched, callbacks=callbacks,
                   log_path=os.path.join(os.fspath(o.out), "metrics.csv"), progress=progress)


def _full_state_dict(module: nn.Module) -> dict[str, Any]:
    """The model's whole state dict on the CPU (gathered from every rank under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---------------------------------------------------------------- the loader chosen with the step in the loop

@dataclass
class LoaderStepRow:
    """One loader setting timed feeding real training steps: seconds per step (median of the rounds)."""

    num_workers: int
    threads: int
    step_s: float | None           # median seconds per training step fed by this loader (None: remembered)
    rounds_s: list[float] = field(default_factory=list)  # seconds per step in each interleaved round
    decision: str = ""

    @property
    def setting(self) -> str:
        return f"num_workers={self.num_workers}" + (f", threads={self.threads}" if self.num_workers == 0 else "")

    def to_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "threads": self.threads, "setting": self.setting,
                "step_s": self.step_s, "rounds_s": self.rounds_s, "decision": self.decision}


@dataclass
class LoaderStepResult:
    """The loader setting chosen with the training step in the loop, and every candidate's step time.

    A loader tuned alone takes every core it can; beside a training step that needs the same cores,
    fewer loader threads can make the step faster. `remembered` holds the "remembered from ..." line
    when the choice was recalled instead of measured."""

    num_workers: int
    threads: int
    table: list[LoaderStepRow] = field(default_factory=list)
    others_cores: float | None = None  # cores other processes used while the candidates were timed
    remembered: str | None = None

    @property
    def busy_warning(self) -> str | None:
        return busy_warning(self.others_cores)

    @property
    def setting(self) -> str:
        return f"num_workers={self.num_workers}" + (f", threads={self.threads}" if self.num_workers == 0 else "")

    def describe(self) -> str:
        """'num_workers=0, threads=1 (0.412 s/step with the step in the loop; 2 settings timed)'."""
        if self.remembered:
            return f"{self.setting} ({self.remembered})"
        best = next((r for r in self.table if (r.num_workers, r.threads) == (self.num_workers, self.threads)), None)
        figure = f"{best.step_s:.3g} s/step with the step in the loop; " if best and best.step_s else ""
        return f"{self.setting} ({figure}{len(self.table)} setting(s) timed)"

    def to_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "threads": self.threads, "setting": self.setting,
                "table": [r.to_dict() for r in self.table], "others_cores": self.others_cores,
                "remembered": self.remembered}


def step_candidates(num_workers: int, threads: int) -> list[tuple[int, int]]:
    """The loader settings worth timing with the step in the loop, least parallel first: from the setting
    that measured fastest alone (`num_workers`, `threads`) down to one thread of this process, halving
    (more parallelism than the loader alone can use only takes cores from the step)."""
    def ladder(n: int) -> list[int]:
        out = {n}
        while n > 1:
            n //= 2
            out.add(n)
        return sorted(out)

    if num_workers == 0:
        return [(0, t) for t in ladder(max(1, threads))]
    return [(0, 1)] + [(w, 1) for w in ladder(num_workers)]


def time_fed_steps(contenders: Mapping[str, tuple[Any, Callable[[Any], Any]]], *, steps: int = 2, rounds: int = 2,
                   device: Any = None) -> tuple[dict[str, list[float]], float | None]:
    """Seconds per training step of each contender, a (loader, step) pair, timed interleaved.

    Each round runs every contender in turn (the order rotated round by round) on a fresh pass of its
    loader: its first batch is taken untimed (the pipeline starting), then `steps` steps are timed, each
    followed by taking the loader's next batch (the wait for data the step did not hide); the pass is then closed, so a paused loader's threads or workers
    never run while another contender is timed (a loader left running would fill its queue on the next
    contender's cores and start its own next round with batches made for free). Returns the seconds
    per step of each contender in each round, and the cores other processes used meanwhile."""
    import time

    from torchspeed.runtime import synchronize

    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    others = OthersLoad()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            loader, step = contenders[name]
            it = iter(loader)
            try:
                batch = next(it)
                if device is not None:
                    synchronize(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(batch)
                    batch = next(it)  # the batch after each step: what the loader made while it ran
                if device is not None:
                    synchronize(device)
                times[name].append((time.perf_counter() - t0) / steps)
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
                del it
    return times, others.cores()


def choose_loader_with_step(make_loader: Callable[[int, int], Any], step: Callable[[Any], Any],
                            candidates: list[tuple[int, int]], *, steps: int = 2, rounds: int = 2,
                            margin: float = 0.03, device: Any = None, built: Mapping[tuple[int, int], Any] | None = None,
                            progress: bool | Callable[[str], Any] = False) -> tuple[Any, LoaderStepResult]:
    """The loader setting under which `step(batch)` (one real training step) runs fastest, timed with
    `time_fed_steps` (candidates interleaved, each `rounds` x `steps` steps).

    `candidates`: (num_workers, threads) pairs, least parallel first (`step_candidates`); a more
    parallel one is kept only when its steps are faster by more than `margin`, so noise never buys
    threads that compete with the step. `make_loader(num_workers, threads)` builds a candidate unless
    `built` has it. Returns (the chosen loader, the result); the other loaders' workers are stopped."""
    say = progress_fn(progress)
    built = built or {}
    loaders = {c: built[c] if c in built else make_loader(*c) for c in candidates}
    rows = [LoaderStepRow(w, t, None) for w, t in candidates]
    if len(candidates) == 1:
        rows[0].decision = "chosen (the only candidate)"
        return loaders[candidates[0]], LoaderStepResult(*candidates[0], table=rows)
    wait_for_quiet_machine(max_s=3.0)
    say(f"choosing the loader with the training step in the loop ({len(candidates)} settings, "
        f"{rounds} x {steps} steps each, interleaved)")
    times, others = time_fed_steps({r.setting: (loaders[c], step) for r, c in zip(rows, candidates)},
                                   steps=steps, rounds=rounds, device=device)
    for r in rows:
        r.rounds_s = times[r.setting]
        r.step_s = float(statistics.median(r.rounds_s))
    best = rows[0]
    for r in rows[1:]:
        if r.step_s < best.step_s * (1 - margin):
            best = r
    for r in rows:
        r.decision = ("chosen" if r is best else
                      f"{r.step_s / best.step_s:.2f}x the chosen step time" if r.step_s >= best.step_s else
                      f"within {100 * margin:.0f}% of a less parallel setting: not worth its cores")
    for c, loader in loaders.items():
        if c != (best.num_workers, best.threads):
            shutdown_workers(loader)
    result = LoaderStepResult(best.num_workers, best.threads, table=rows, others_cores=others)
    log.info("loader with the step in the loop: %s; %s", result.describe(),
             "; ".join(f"{r.setting} {r.step_s:.3g} s/step" for r in rows))
    if result.busy_warning:
        log.warning("loader with the step in the loop: %s", result.busy_warning)
    return loaders[(best.num_workers, best.threads)], result
