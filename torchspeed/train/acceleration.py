"""accelerate(): precision, memory format, compilation and the distributed wrapper, chosen by measuring.
(Named acceleration: a submodule called accelerate would shadow the public function once imported.)

The order of it: the user's step read from the model and the batch (`step_call`: the forward's arguments,
the loss backpropagated); the step settings remembered for this machine, model, batch, step and settings
(`remembered`), else measured by `trials` and remembered; every rank takes rank 0's; the strategy's
wrapper and the optimizer's implementation (`strategy`), then the compile kept (whole, or the repeated
blocks in place: `compiling`); then a loader whose counts were measured alone has them chosen again with
the prepared step in the loop (`loader_choice`). Under DDP the whole-model compile is of the model
DDP wraps (as torch's documentation advises), so the graph the compile trial compiled is the one that
trains: compiled once, not again around the wrapper. Each setting's outcome is one INFO line on this module's
logger; a step that is a guess (`StepCall.doubt`) one WARNING. The names that moved to `choices`,
`prepared` and the modules beside it are re-exported here where they are public, so imports from this
module keep working.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from torchspeed import measure, ranks, remembered
from torchspeed.args import progress_fn
from torchspeed.batches import BatchFormat, batch_size
from torchspeed.runtime import ensure_cublas_workspace, resolve_device
from torchspeed.train.checkpointing import checkpoint_blocks
from torchspeed.train.choices import DECIDED, AccelerateOptions, AccelerateResult, TrialRow
from torchspeed.train.compile_choice import Horizon, horizon_of
from torchspeed.train.compiling import compile_regions, compiled_regions, decompile_regions
from torchspeed.train.loader_choice import alone_counts, choose_counts
from torchspeed.train.memory_plan import plan_batch, slice_batch
from torchspeed.train.mixed_precision import SCALED, grad_scaler
from torchspeed.train.prepared import Accelerated, forget_prepared, parameters_of, release_step_guard, training_step
from torchspeed.train.step_timer import StepTimer, check_class_width, trial_state_kept
from torchspeed.train.strategy import choose_optimizer_implementation, resolve_strategy, wrap_for_strategy
from torchspeed.train.trials import apply_cudnn_benchmark, apply_tf32, choose_step_settings, switches_now
from torchspeed.train.wrapping import AcceleratedModel, DeviceLoader, class_count, example_batch_of, warn_if_unsharded

__all__ = ["accelerate", "accelerate_with", "step_parts", "AccelerateOptions", "Accelerated", "AccelerateResult",
           "TrialRow", "forget_prepared", "release_step_guard"]

log = logging.getLogger(__name__)

def accelerate(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, loader: Iterable[Any] | None = None, *,
               precision: str = "auto", channels_last: bool | str = "auto",
               compile: bool | str = "auto",  # noqa: A002 (the public name of the setting)
               strategy: str | None = "auto", example_batch: Any = None,
               loss_fn: Callable[..., torch.Tensor] | None = None, device: str | torch.device = "auto",
               expected_steps: int | None = None, epochs: int | None = None, trial_steps: int = 3,
               margin: float = 0.05,
               min_compile_cost_s: float = 20.0, untried: dict[str, str] | None = None, fused_optimizer: bool = True,
               tf32: bool | str = "auto", cudnn_benchmark: bool | str = "auto",
               batch_format: BatchFormat | dict | None = None, refresh: bool = False,
               memory_budget: int | str | None = None,
               progress: bool | Callable[[str], Any] = False) -> Accelerated:
    """Prepare `model`, `optimizer` and `loader` for fast training here; decisions are measured,
    reported and remembered (docs/train.md).

        model, optimizer, loader = ts.train.accelerate(model, optimizer, loader)

    The model returned runs its forward at the chosen precision and memory format (inputs moved to
    the device where they enter, autocast, fp32 outputs), so the loop stays plain; the loader
    returned yields batches on the device. Under fp16 (CUDA) step with `acc.backward(loss)` and
    `acc.step(optimizer)` (the GradScaler; a plain `optimizer.step()` is refused).

    precision: "auto" | "bf16" | "fp16" | "fp32" (mixed: fp32 weights, autocast). channels_last /
    tf32 / cudnn_benchmark (the last two CUDA's process-wide switches): "auto" | True | False. compile:
    "auto" | True (the whole model) | "regional" (its repeated blocks, in place) | False. strategy:
    "auto" (DDP under torchrun, else none) | "ddp" | "fsdp" | None. "auto" is measured on the loader's
    first batch (taken without moving any RNG or the loader's position) or `example_batch`, read by
    `batch_format`, running the loop's own step: `loss_fn(logits, target)` when given, else the forward
    with the targets where it takes them (`model(idx, targets)`, `model(**batch)` with `labels`) and the
    loss the model returns; a step that cannot be read so is one WARNING saying what to pass. An option
    must beat the current choice by `margin` (fraction of step time). Compile "auto" tries regional and
    whole-model compilation and keeps the one that makes the run shortest when its compile seconds are
    repaid within the run: `expected_steps`, else len(loader) x `epochs`, else 1000 steps (or one epoch
    when longer); a run shorter than `min_compile_cost_s` does not try. `untried` maps a setting to why it
    is not tried (e.g. {"compile": "quick mode budget"}).

    A batch the model or loss cannot take, too few class outputs for the labels, or an optimizer not
    holding the model's parameters is a ValueError before any trial. The next call on the same
    machine, model structure, batch shapes and settings decides at once ("remembered from <date>
    (<figure>)"); `refresh=True` measures again. `progress`: True prints one line per trial on
    stderr, a callable receives them. A loader whose counts were measured alone
    (`fast_loader(..., num_workers="auto")`) has them chosen again with the prepared step in the loop
    (`report.loader`). The model returned (or the `Accelerated`) can be given to `Trainer` as it is.

    `memory_budget` (bytes or "8GiB"): before the trials, the micro-batch and gradient accumulation whose
    step fits it are planned on the example batch (`plan_batch`, the example's size the effective batch;
    `report.memory_plan`), and the trials run on the micro-batch; train with batches of
    `report.memory_plan.micro_batch` and `accumulation` of them per optimizer step. The blocks the plan
    checkpoints (`report.memory_plan.checkpointed_names`) are checkpointed in the model.
    """
    if isinstance(loader, str):
        raise TypeError(f"accelerate()'s third argument is the training loader, got the string {loader!r}; pass "
                        f"the settings by keyword, e.g. precision={loader!r}")
    options = AccelerateOptions(
        precision=precision, channels_last=channels_last, compile=compile, strategy=strategy, device=device,
        tf32=tf32, cudnn_benchmark=cudnn_benchmark, expected_steps=expected_steps, epochs=epochs,
        trial_steps=trial_steps,
        margin=margin, min_compile_cost_s=min_compile_cost_s, untried=untried or {}, fused_optimizer=fused_optimizer,
        refresh=refresh, memory_budget=memory_budget)
    return accelerate_with(options, model, optimizer, loader=loader, example_batch=example_batch, loss_fn=loss_fn,
                           batch_format=batch_format, progress=progress)


def accelerate_with(options: AccelerateOptions, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    loader: Iterable[Any] | None = None, example_batch: Any = None,
                    loss_fn: Callable[..., torch.Tensor] | None = None, batch_format: BatchFormat | dict | None = None,
                    classes: int | None = None, progress: bool | Callable[[str], Any] = False) -> Accelerated:
    """accelerate() with its settings given as one `AccelerateOptions` (how the Trainer calls it);
    `classes`: how many classes the training data names, when known (else the loader's dataset's
    `classes`; class logits are checked against it before any trial)."""
    say = progress_fn(progress)
    _check_model(model)
    _check_optimizer(model, optimizer)
    fmt = BatchFormat.of(batch_format)
    dev = resolve_device(options.device)
    if dev.type == "cuda":
        _cublas_workspace_for_determinism(torch.cuda.is_initialized())
    denv, dev, strategy, options = resolve_strategy(options, dev)
    horizon = horizon_of(options.expected_steps, _length(loader), options.epochs)
    if loader is not None:
        warn_if_unsharded(loader, denv.world_size)
        classes = classes if classes is not None else class_count(loader)
        if example_batch is None and (options.measures_step or options.measures_cuda_switches(dev)):
            example_batch = example_batch_of(loader)
    model.to(dev)
    report = AccelerateResult(device=str(dev), strategy=strategy)
    if options.memory_budget is not None:
        example_batch = _plan_memory(options, model, optimizer, example_batch, loader, loss_fn, fmt, dev, report,
                                     progress)
    timer = _trial_timer(options, dev, example_batch, loss_fn, fmt, classes, model)
    compiled, memory = None, None
    if timer is None:
        choose_step_settings(model, None, options, report, dev, say, horizon)
    else:
        compiled, memory = _decide(model, timer, options, report, loss_fn, say, horizon)
        report.timed_step = timer.call.describe()
        if timer.doubt:
            log.warning("accelerate(): %s", timer.doubt)
    if denv.distributed:  # every rank makes rank 0's choices, whatever its own timings said
        report.take(ranks.broadcast_json(report.decided()))
        _apply(report, model)
    regional_here = compiled is model  # this rank's trial compiled the regions in place
    if regional_here and report.compile_mode != "regional":
        decompile_regions(model)
    if report.compile_mode == "regional" and not compiled_regions(model):
        compile_regions(model)  # before the wrapper: DDP / FSDP run the compiled blocks
    runs = model  # what the wrapper runs: under DDP the whole model compiled, the trial's compile reused
    if report.compile_mode == "whole" and strategy == "ddp":
        runs = compiled if compiled is not None and not regional_here else torch.compile(model)
    wrapped = wrap_for_strategy(model, optimizer, strategy, options, report, dev, timer=timer, runs=runs)
    if optimizer is not None and options.fused_optimizer:
        report.optimizer = choose_optimizer_implementation(optimizer, dev, dtensor=strategy == "fsdp")
        report.candidates.append(TrialRow("optimizer", report.optimizer,
                                          decision="preferred (one kernel over all parameters)"))
    if report.compile_mode == "whole" and strategy != "ddp":
        kept = compiled is not None and not regional_here and wrapped is model
        wrapped = compiled if kept else torch.compile(wrapped)
    if memory is None:  # a remembered decision said its one line
        _log_choices(report.candidates, report.device)
    timed = None if timer is None else (timer.call.describe(), timer.call.arguments(timer.inputs))
    acc = Accelerated(model=AcceleratedModel(model, wrapped, dev, report.precision, report.channels_last,
                                             timed_step=timed),
                      optimizer=optimizer, report=report, device=dev, module=model,
                      scaler=grad_scaler(report.precision), batch_format=fmt,
                      step_call=None if timer is None else timer.call)
    acc.hold()
    if loader is not None:
        loader = _loader_with_step(acc, loader, loss_fn, example_batch, options.refresh, progress)
        acc.loader = DeviceLoader(loader, dev, report.channels_last)
    return acc


def _plan_memory(options: AccelerateOptions, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 example_batch: Any, loader: Any, loss_fn: Any, fmt: BatchFormat, dev: torch.device,
                 report: AccelerateResult, progress: bool | Callable[[str], Any]) -> Any:
    """The memory plan (in `report.memory_plan`; the blocks it checkpoints checkpointed in `model`), and the
    example batch cut to its micro-batch for the trials."""
    if example_batch is None:
        example_batch = example_batch_of(loader) if loader is not None else None
    if example_batch is None:
        raise ValueError("accelerate(): memory_budget needs a batch to plan on: pass the training loader or "
                         "example_batch=(inputs, targets)")
    precision = options.precision if options.precision != "auto" else "fp32"  # fp32: the most memory
    plan = plan_batch(model, optimizer, example_batch, budget=options.memory_budget, loss_fn=loss_fn,
                      batch_format=fmt, device=dev, precision=precision, refresh=options.refresh, progress=progress)
    report.memory_plan = plan
    if plan.checkpointed:
        checkpoint_blocks(model, names=plan.checkpointed_names)
    return slice_batch(example_batch, plan.micro_batch) if plan.micro_batch < batch_size(
        fmt.split(example_batch)[0]) else example_batch


def _length(loader: Any) -> int | None:
    """The loader's batches per epoch, where it says (len); None otherwise."""
    try:
        return len(loader) if loader is not None else None
    except TypeError:
        return None


def _check_model(model: Any) -> None:
    """Refuse what cannot be prepared before anything is moved or measured."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, AcceleratedModel)) or hasattr(model, "_orig_mod"):
        raise ValueError("model is already wrapped (DDP or torch.compile); pass the plain nn.Module to accelerate(), "
                         "or pass the Accelerated that accelerate() returned (or its model) to the Trainer")


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Refuse an optimizer that does not hold the model's parameters (made for another model, or before
    `model.fc = ...` replaced a layer): its steps would leave the model untrained. An optimizer over a
    part of the model only (a head being fine-tuned) is fine; one over extra tensors (a loss's) too."""
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer (or None), got {type(optimizer).__name__}")
    held = {id(p) for p in parameters_of(optimizer)}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in trainable if id(p) not in held]
    ours = {id(p) for _, p in model.named_parameters()}
    foreign = sum(1 for i in held if i not in ours)
    if trainable and (len(missing) == len(trainable) or (missing and foreign)):
        raise ValueError(f"the optimizer lacks {len(missing)} of the model's {len(trainable)} trainable parameters "
                         f"(e.g. {missing[0]!r}) and holds {foreign} tensor(s) that are not the model's: it was made "
                         "for another model, or before a layer was replaced (model.fc = ...); create it from "
                         "model.parameters() after the model is final")


def _cublas_workspace_for_determinism(cuda_initialized: bool) -> None:
    """When deterministic algorithms are on, the cuBLAS workspace they need (runtime's one mechanism)."""
    if torch.are_deterministic_algorithms_enabled():
        ensure_cublas_workspace(cuda_initialized, stacklevel=3)


def _trial_timer(options: AccelerateOptions, dev: torch.device, example_batch: Any,
                 loss_fn: Callable[..., torch.Tensor] | None, fmt: BatchFormat,
                 classes: int | None = None, model: nn.Module | None = None) -> StepTimer | None:
    """The timer of the trials, or None when nothing is measured (compile left on "auto" without a batch
    is then not tried); refuses what cannot be measured or run."""
    if options.needs_batch and example_batch is None:
        raise ValueError("accelerate(): an 'auto' setting needs a batch to measure options on: pass the training "
                         "loader (accelerate(model, optimizer, loader)) or example_batch=(inputs, targets), or "
                         "give precision/channels_last/compile explicitly")
    if options.precision in SCALED and dev.type != "cuda":
        raise ValueError("precision='fp16' is for CUDA GPUs (with a GradScaler); use 'bf16' or 'fp32' on the CPU")
    if example_batch is None or not (options.measures_step or options.measures_cuda_switches(dev)):
        return None
    return StepTimer(example_batch, loss_fn, dev, options.trial_steps, fmt, classes, model)


def _apply(report: AccelerateResult, model: nn.Module) -> None:
    """The memory format and the process-wide switches of a decision taken without the trials."""
    model.to(memory_format=torch.channels_last if report.channels_last else torch.contiguous_format)
    apply_tf32(report.tf32)
    apply_cudnn_benchmark(report.cudnn_benchmark)


def _log_choices(rows: Iterable[TrialRow], device: str) -> None:
    """One INFO line per setting: every option with its measured median step and its decision."""
    by_setting: dict[str, list[str]] = {}
    for t in rows:
        figures = ("" if t.step_s is None else f" {t.step_s * 1e3:.1f} ms") + (
            f" + {t.one_off_s:.1f} s one-off" if t.one_off_s else "")
        by_setting.setdefault(t.setting, []).append(f"{t.value}{figures} [{t.decision}]")
    for setting, parts in by_setting.items():
        log.info("accelerate on %s, %s: %s", device, setting, "; ".join(parts))


# ---------------------------------------------------------------- the remembered decision
def _decide(model: nn.Module, timer: StepTimer, options: AccelerateOptions, report: AccelerateResult, loss_fn: Any,
            say: Callable[[str], Any], horizon: Horizon) -> tuple[nn.Module | None, remembered.Memory | None]:
    """The step settings remembered for this model, batch, step and machine (rank 0's under torchrun), else
    measured: (what the compile trial compiled and kept, the memory followed or None)."""
    compiled = None

    def trials() -> dict[str, Any]:
        nonlocal compiled
        with trial_state_kept(model):
            width = timer.preflight(model)
            quiet = measure.wait_for_quiet_machine(max_s=3.0, window_s=0.25)
            if quiet.waited_s > 0.5:
                say(f"accelerate: waited {quiet.waited_s:.1f} s for other processes to leave the cores")
            compiled = choose_step_settings(model, timer, options, report, timer.device, say, horizon)
        report.others_cores = timer.others_cores
        if report.busy_warning:  # a choice made on noise is not kept for the next runs
            log.warning("accelerate: %s (not remembered)", report.busy_warning)
        return {**report.decided(), "logits_width": width, "doubt": timer.stand_in}

    decision, memory = remembered.recall_or_measure(
        "accelerate", _memory_parts(options, model, timer, loss_fn, horizon), trials, decode=_decode,
        encode=lambda d: (d, _figure(report)), busy=lambda d: bool(report.busy_warning), refresh=options.refresh,
        what=f"accelerate on {report.device}")
    if memory is not None:
        _follow(decision, memory, timer, options, report)
        _apply(report, model)
        say(f"accelerate: {memory.describe()}")
    return compiled, memory


def _decode(memory: remembered.Memory) -> dict[str, Any]:
    """A remembered decision, each value checked (one edited into nonsense is measured again)."""
    width, doubt = memory.decision["logits_width"], memory.decision.get("doubt")
    if not (width is None or (type(width) is int and width > 0)):
        raise ValueError(f"logits_width={width!r} is not a width")
    if not (doubt is None or isinstance(doubt, str)):
        raise ValueError(f"doubt={doubt!r} is not a sentence")
    return {**AccelerateResult("").take(memory.decision).decided(), "logits_width": width, "doubt": doubt}


def _figure(report: AccelerateResult) -> str:
    """What the trials chose and its measured step: 'bf16 + channels_last, 41.2 ms/step'."""
    steps = [r.step_s for r in report.candidates if r.step_s is not None and r.decision.startswith("kept")]
    compiled = "regional compile" if report.compile_mode == "regional" else "compile"
    chosen = [report.precision] + [n for n, on in (("channels_last", report.channels_last),
                                                   (compiled, report.compile), ("tf32", report.tf32)) if on]
    return " + ".join(chosen) + (f", {steps[-1] * 1e3:.1f} ms/step" if steps else "")


def _follow(decision: Mapping[str, Any], memory: remembered.Memory, timer: StepTimer, options: AccelerateOptions,
            report: AccelerateResult) -> None:
    """A remembered decision taken instead of measuring: one row per setting (those given are in the key),
    the labels checked against the logits' width then."""
    report.take(decision)
    timer.stand_in = decision["doubt"]  # found by the first run's preflight, which a recall does not run
    for name in DECIDED:
        if name in ("tf32", "cudnn_benchmark") and not report.device.startswith("cuda"):
            continue
        given = getattr(options, name) != "auto"
        value = report.compile_setting if name == "compile" else getattr(report, name)
        report.candidates.append(TrialRow(name, str(value), decision="given" if given else memory.describe()))
    check_class_width(decision["logits_width"], timer.targets, timer.loss_fn, timer.classes)


def _qualified_name(fn: Any) -> str | None:
    """The loss's qualified name (a module's class, a function, a partial's function) for a decision's key."""
    if fn is None:
        return None
    fn = getattr(fn, "func", fn)
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '')}.{named.__qualname__}"


def _memory_parts(options: AccelerateOptions, model: nn.Module, timer: StepTimer, loss_fn: Any,
                  horizon: Horizon) -> dict[str, Any]:
    """What accelerate()'s decision depends on, besides the machine (`remembered` adds it): the model's
    structure, the batch's shapes, the step timed, the device type, the world size, the settings measured
    or given, deterministic mode, the loss, and the run's length where compile is weighed against it."""
    parts: dict[str, Any] = {
        "model": remembered.model_fingerprint(model), "inputs": remembered.shapes_of(timer.inputs),
        "targets": remembered.shapes_of(timer.targets), "step": timer.call.describe(), "device": timer.device.type,
        "world_size": ranks.env().world_size,
        "precision": options.precision, "channels_last": str(options.channels_last), "compile": str(options.compile),
        "tf32": str(options.tf32), "cudnn_benchmark": str(options.cudnn_benchmark), "margin": options.margin,
        "compile_may_be_tried": options.compile_may_be_tried,
        "deterministic": torch.are_deterministic_algorithms_enabled(), "loss_fn": _qualified_name(loss_fn),
        "untried": sorted(options.untried)}
    if parts["compile_may_be_tried"]:  # whether compile repays itself depends on the run's length
        parts["horizon_steps"], parts["min_compile_cost_s"] = horizon.steps, options.min_compile_cost_s
    if timer.device.type == "cuda":  # switches the process set before count as the user's (trials' CUDA switches)
        parts["switches"] = switches_now()
    return parts


# ---------------------------------------------------------------- the loader, with the prepared step
def step_parts(acc: Accelerated, loss_fn: Any, batch: Any) -> dict[str, Any]:
    """What the time of a prepared training step depends on besides the machine (the key of the loader
    choice made with it): the model's structure, the batch's shapes, the choices accelerate() made,
    the optimizer, the loss, the world size."""
    inputs, targets = (acc.batch_format or BatchFormat()).split(batch)
    r, opt = acc.report, acc.optimizer
    return {"model": remembered.model_fingerprint(acc.module), "inputs": remembered.shapes_of(inputs),
            "targets": remembered.shapes_of(targets), "step": r.timed_step, "device": acc.device.type,
            "world_size": ranks.env().world_size, "precision": r.precision, "channels_last": r.channels_last,
            "compile": r.compile_setting, "strategy": r.strategy, "tf32": r.tf32,
            "cudnn_benchmark": r.cudnn_benchmark,
            "optimizer": None if opt is None else f"{type(opt).__qualname__} ({r.optimizer})",
            "loss_fn": _qualified_name(loss_fn)}


def _loader_with_step(acc: Accelerated, loader: Any, loss_fn: Any, batch: Any, refresh: bool,
                      progress: bool | Callable[[str], Any]) -> Any:
    """A loader whose counts were measured alone (a FastLoader on "auto"), re-chosen with real training
    steps of the prepared model in the loop (`loader_choice.choose_counts`); any other loader as it is."""
    if alone_counts(loader) is None:
        return loader
    if acc.optimizer is None:
        log.info("accelerate: the loader keeps the counts it measured alone (no optimizer was given, so no "
                 "training step can be timed with it)")
        return loader
    if batch is None:
        batch = example_batch_of(loader)
    chosen, result = choose_counts(loader, training_step(acc, loss_fn), step_parts(acc, loss_fn, batch),
                                   model=acc.model, optimizer=acc.optimizer, scaler=acc.scaler, device=acc.device,
                                   refresh=refresh, progress=progress)
    acc.report.record_loader(result)
    return chosen
