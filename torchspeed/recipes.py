"""train_classifier(): an image classifier trained end to end, the recipe `torchspeed train` runs.

The data is an ImageFolder (class subfolders, or train/ and val/ splits; else a seeded share is held
out), a store from `torchspeed pack`, or a Dataset factory spec; the model a spec for
`torchspeed.models.create` (built with one output per class) or an nn.Module. The recipe: FastLoaders
sharded per rank, SGD with Nesterov momentum at a learning rate scaled to the global batch
(0.1 x batch x processes / 256 unless given), a cosine schedule over the run, label-smoothed
cross-entropy, EarlyStopping on val_loss, checkpoints in OUT/checkpoints (two kept) and metrics in
OUT/metrics.csv; then OUT/model.pt (the whole weights, gathered from every rank under FSDP) and
OUT/summary.json. It runs unchanged under torchrun. With a memory budget the batch is planned first
(`train.memory_plan.plan_batch` on a batch of the loader's shape): the loaders give micro-batches that fit
and the Trainer accumulates gradients over them, so each optimizer step still takes `batch_size` samples.

OUT is claimed through `torchspeed.outputs` before any data is read: it is new or torchspeed's own,
so a file of the user's there is never replaced; `resume` continues only a run OUT holds a checkpoint of.
A run refused before its first step (bad data, model or settings) leaves OUT as it found it.

`prepare_classifier` does everything before the first step (a bad input fails before any data is
read where it can) and returns a `ClassifierRun`, whose `fit()` trains; `train_classifier` is the two
in one call. A recipe stands on data and train together, so it sits a layer above both.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchspeed import ranks
from torchspeed.args import byte_size, positive_number, progress_fn
from torchspeed.atomic import write_json
from torchspeed.data import fast_loader, train_val_split
from torchspeed.models import build, is_factory_spec, load_weights
from torchspeed.outputs import MARKER, OutputDir, claim_output_dir, is_temporary
from torchspeed.runtime import resolve_device, seed_everything
from torchspeed.train import distributed
from torchspeed.train.acceleration import AccelerateOptions, AccelerateResult
from torchspeed.train.callbacks import Checkpoint, EarlyStopping
from torchspeed.train.checkpoint import RUN_FILE, holds_run, read_run, resumable, write_torch_file
from torchspeed.train.checkpointing import checkpoint_blocks
from torchspeed.train.loader_choice import LoaderStepResult
from torchspeed.train.memory_plan import MemoryPlanResult, plan_batch
from torchspeed.train.trainer import Trainer

__all__ = ["ClassifierOptions", "ClassifierResult", "ClassifierRun", "prepare_classifier", "train_classifier"]

Counts = int | str | list[int]  # "auto", a number, or counts to measure (fast_loader's num_workers / threads)

CHECKPOINTS = "checkpoints"
WRITES = ("model.pt", "summary.json", "metrics.csv")  # OUT's files besides its checkpoints/
PLAN_EXAMPLE = 32  # the most samples in the memory plan's example batch (its probes take a quarter and a half)


@dataclass(frozen=True)
class ClassifierOptions:
    """The recipe's settings, named as `torchspeed train`'s flags; checked when made.

    `batch_size` is per process; `lr` the peak learning rate (None: 0.1 x batch x processes / 256);
    `patience` counts validations; `num_workers`/`threads` as fast_loader takes them (validation uses
    the number given, else the main process); `model_kwargs`/`weights` apply to a model given by spec;
    `resume` continues the run in `out` (True or "last": refused when it holds no checkpoint of its run;
    "auto": continued when it does, else a new run: what a job restarted by torchrun or a scheduler
    wants), `overwrite` starts a new one there (replacing what an earlier run wrote: its checkpoints,
    weights, summary and metrics; never a file torchspeed did not write). `memory_budget` (bytes or
    "8GiB"): the micro-batch and gradient accumulation planned to fit it, `batch_size` kept as the
    samples of one optimizer step."""

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
    memory_budget: int | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {self.epochs!r}")
        if self.lr is not None:
            positive_number(self.lr, "--lr", None)  # nan or inf would train to nothing
        if self.resume not in (False, True, "last", "auto"):
            raise ValueError(f"resume must be False, True, 'last' or 'auto', got {self.resume!r}")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out and --overwrite deletes it: give one of them")
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", byte_size(self.memory_budget, "--memory-budget"))
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
    memory_plan: MemoryPlanResult | None = None  # with a memory budget: the micro-batch and accumulation

    def to_dict(self) -> dict[str, Any]:
        """summary.json: the metrics at the top level (their final "lr" over the peak one)."""
        d = {"model": self.model, "data": self.data, "classes": self.classes, "world_size": self.world_size,
             "lr": self.lr, "batch_size": self.batch_size, **self.metrics, "early_stopping": self.early_stopping,
             "accelerate": self.report.to_dict() if self.report is not None else None,
             "loader": self.loader.to_dict() if self.loader is not None else None,
             "memory_plan": self.memory_plan.to_dict() if self.memory_plan is not None else None,
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
    memory_plan: MemoryPlanResult | None = None  # with a memory budget: the loaders' micro-batch, the accumulation

    @property
    def is_main(self) -> bool:
        """Rank 0 (the process that writes and prints)."""
        return self.trainer.is_main

    @property
    def description(self) -> str:
        """One line: what is trained on what, where (`torchspeed train` prints it before training)."""
        return (f"training {self.model_name} on {self.train_samples} images ({len(self.classes)} classes), "
                f"validating on {self.val_samples}; {self.world_size} process(es), device {self.device}")

    @property
    def memory_line(self) -> str | None:
        """With a memory budget, one line: the plan, and that each optimizer step takes exactly the batch
        size asked for (`torchspeed train` prints it before training); None without one."""
        plan = self.memory_plan
        if plan is None:
            return None
        steps = "1 micro-batch" if plan.accumulation == 1 else f"{plan.accumulation} micro-batches accumulated"
        how = (f"measured {plan.measured}" if plan.probes else
               "planned by an earlier run on this machine (--refresh plans again)")
        return (f"memory plan: {plan.describe()}; each optimizer step takes {steps}, exactly --batch-size "
                f"{plan.effective_batch} samples per process; {how}")

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
            loader=self.loader_choice, memory_plan=self.memory_plan)
        weights = _full_state_dict(self.trainer.module)  # collective under FSDP: every rank takes part
        if self.is_main:
            result.weights = os.path.join(os.fspath(o.out), "model.pt")
            write_torch_file(result.weights, weights)  # a full disk: one line naming it
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
    With the loader's counts on "auto", accelerate() then runs and the training loader's setting is
    chosen with the training step in the loop (`Trainer.choose_loader`: the setting fast_loader
    measured fastest alone and the less parallel ones below it, each feeding a few real steps,
    interleaved; the model, optimizer and RNG are put back as they were; under torchrun rank 0's
    choice is every rank's), so the loader's threads do not compete with the step's for the cores;
    the choice is remembered like accelerate's. With `options.memory_budget` the batch is planned after
    the model is built and before the loaders are (`plan_batch` on a batch of the loaders' shape, the
    effective batch `batch_size`; under torchrun every rank takes the smallest micro-batch): the loaders
    give `plan.micro_batch` samples, the Trainer accumulates `plan.accumulation` of them, and the blocks the
    plan checkpoints are checkpointed.
    `progress` is the Trainer's (True: a progress bar and a summary table)."""
    data = os.fspath(data)
    if not os.path.exists(data) and not is_factory_spec(data.strip()):
        raise FileNotFoundError(f"--data {data!r} does not exist: give an ImageFolder directory, a packed store "
                                "or a Dataset factory (package.module:factory or path/file.py:factory)")
    out = os.fspath(options.out)
    try:
        before = set(os.listdir(out)) if os.path.isdir(out) else None
    except OSError:  # unreadable: claiming it says so
        before = set()
    output, ckdir = _claim_out(out, options.resume, options.overwrite)
    try:
        return _prepared(data, model, options, progress, output, ckdir)
    except BaseException:
        if output is not None:  # a run refused before its first step leaves OUT as it found it
            _unclaim(out, ckdir, before)
        raise


def _prepared(data: str, model: str | nn.Module, options: ClassifierOptions, progress: bool | Callable[[str], Any],
              output: OutputDir | None, ckdir: str) -> ClassifierRun:
    """`prepare_classifier` once OUT is claimed."""
    seed_everything(options.seed)
    # The process group first, so the loaders shard themselves per rank.
    denv, device = (distributed.setup(resolve_device("auto")) if options.strategy not in (None, "none")
                    else (ranks.env(), resolve_device("auto")))
    train_src, val_src = train_val_split(data, options.val_fraction, options.seed)
    classes = _class_names(data, train_src)
    if len(classes) < 2:
        raise ValueError(f"{data!r} has {len(classes)} class(es); classification needs at least 2")
    net = _build_model(model, len(classes), options)
    lr = options.lr or 0.1 * options.batch_size * denv.world_size / 256
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5, nesterov=True)
    plan = _memory_plan(net, opt, len(classes), device, options, progress if denv.is_main else False)
    micro, accumulation = (plan.micro_batch, plan.accumulation) if plan is not None else (options.batch_size, 1)
    train, val = _loaders(train_src, val_src, device, options, micro)
    stopper = EarlyStopping("val_loss", patience=options.patience)
    checkpoints = Checkpoint(ckdir, keep_last=2, overwrite=options.overwrite)
    steps_per_epoch = -(-len(train) // accumulation)  # optimizer steps: an epoch's last group may be short
    trainer = _trainer(net, opt, steps_per_epoch, len(classes), options, [stopper, checkpoints], progress, plan)
    train = trainer.choose_loader(train, options.max_steps or max(1, steps_per_epoch * options.epochs))
    choice = trainer.loader_choice
    return ClassifierRun(
        options=options, data=os.path.abspath(data) if os.path.exists(data) else data,
        model_name=model if isinstance(model, str) else type(model).__name__, classes=classes,
        train_samples=len(train_src), val_samples=len(val_src), train_loader=train, val_loader=val, trainer=trainer,
        early_stopping=stopper, checkpoints=checkpoints, lr=lr, world_size=denv.world_size, device=device,
        output=output, loader_choice=choice, memory_plan=plan)


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
    memory_budget: int | str | None = None,
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
        model_kwargs=dict(model_kwargs or {}), weights=weights, refresh=refresh, memory_budget=memory_budget)
    say = progress_fn(progress)
    run = prepare_classifier(data, model, options, progress=progress)
    if run.is_main:
        say(run.description)
        if run.memory_line:
            say(run.memory_line)
    return run.fit()


def _claim_out(out: str, resume: bool | str, overwrite: bool) -> tuple[OutputDir | None, str]:
    """Before any data is read: `out` is new or torchspeed's (a user's file there is never replaced) and
    writable; a new run does not land on an earlier one; a resume has a checkpoint of its run to go on
    from. Rank 0 claims `out`, the other ranks only check. Returns (`out` claimed, its checkpoint directory)."""
    ckdir = os.path.join(out, CHECKPOINTS)
    main = ranks.env().is_main
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


def _unclaim(out: str, ckdir: str, before: set[str] | None) -> None:
    """Put `out` back as it was before it was claimed (`before`: its entries then, None: no folder), for
    a run refused before its first step: the empty checkpoints/ and the marker the claim made removed,
    and the folder when the claim made it. Anything written there since stays, and so does the rest."""
    try:
        if CHECKPOINTS not in (before or ()):
            os.rmdir(ckdir)  # not empty: something was written, all stays
        if MARKER not in (before or ()):
            os.remove(os.path.join(out, MARKER))
        if before is None:
            os.rmdir(out)
    except OSError:
        pass


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


def _memory_plan(model: nn.Module, optimizer: torch.optim.Optimizer, classes: int, device: torch.device,
                 options: ClassifierOptions, progress: bool | Callable[[str], Any]) -> MemoryPlanResult | None:
    """With a memory budget, the micro-batch and accumulation whose step fits it (`plan_batch`), probed on a
    batch of the loaders' shape (images at the crop, labels of the classes: a step's memory depends on the
    shapes, not the pixels) of at most `PLAN_EXAMPLE` samples, so a batch size that does not fit is never
    run whole; the blocks the plan checkpoints are checkpointed in `model`. None without a budget."""
    o = options
    if o.memory_budget is None:
        return None
    model.to(device)
    n = max(2, min(o.batch_size, PLAN_EXAMPLE))
    g = torch.Generator().manual_seed(o.seed)
    example = (torch.randn(n, 3, o.crop, o.crop, generator=g), torch.randint(0, classes, (n,), generator=g))
    precision = o.precision if o.precision != "auto" else "fp32"  # fp32 plans the most memory
    plan = plan_batch(model, optimizer, example, budget=o.memory_budget, effective_batch=o.batch_size,
                      loss_fn=_ClassLoss(classes), device=device, precision=precision, refresh=o.refresh,
                      progress=progress)
    if plan.checkpointed:
        checkpoint_blocks(model, names=plan.checkpointed_names)
    return plan


def _loaders(train_src: Any, val_src: Any, device: torch.device, options: ClassifierOptions,
             batch: int) -> tuple[Any, Any]:
    """The training and validation FastLoaders at `batch` samples (the micro-batch under a memory budget);
    validation uses the counts given, else the main process (its batches are few)."""
    o = options
    train = fast_loader(train_src, batch, train=True, crop=o.crop, device=device, num_workers=o.num_workers,
                        threads=o.threads, seed=o.seed, refresh=o.refresh)
    val = fast_loader(val_src, batch, train=False, crop=o.crop, device=device,
                      num_workers=o.num_workers if isinstance(o.num_workers, int) else 0,
                      threads=o.threads if isinstance(o.threads, int) else 1, seed=o.seed)
    return train, val


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


def _trainer(model: nn.Module, opt: torch.optim.Optimizer, steps_per_epoch: int, classes: int,
             options: ClassifierOptions, callbacks: list[Any], progress: bool | Callable[[str], Any],
             plan: MemoryPlanResult | None = None) -> Trainer:
    """`opt` (SGD with Nesterov momentum) cosine-annealed to 0 over the run's optimizer steps,
    label-smoothed cross-entropy; with a memory plan, its accumulation of micro-batches a step."""
    o = options
    total = o.max_steps or max(1, steps_per_epoch * o.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    return Trainer(model, opt, _ClassLoss(classes), precision=o.precision,
                   channels_last=o.channels_last, compile=o.compile,
                   strategy=None if o.strategy == "none" else o.strategy, accelerate_kwargs={"refresh": o.refresh},
                   scheduler=sched, callbacks=callbacks, grad_accum_steps=plan.accumulation if plan is not None else 1,
                   memory_plan=plan,
                   log_path=os.path.join(os.fspath(o.out), "metrics.csv"), progress=progress)


def _full_state_dict(module: nn.Module) -> dict[str, Any]:
    """The model's whole state dict on the CPU (gathered from every rank under FSDP)."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
