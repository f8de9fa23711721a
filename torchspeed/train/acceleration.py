"""accelerate(): choose precision, memory format, compilation and the distributed wrapper by measuring.

(Module named acceleration, not accelerate: a submodule called accelerate would shadow the
public function ts.train.accelerate once imported.)

    model, optimizer, loader = ts.train.accelerate(model, optimizer, loader)

Each "auto" setting is decided by timing a few real training steps (forward, loss, backward) of the
user's model on one batch (the loader's first, or `example_batch`), and an option is kept only when
it is faster by a clear margin; one-off costs (torch.compile's compile time) are charged against the
expected length of the run. The model's weights, buffers and RNG state are restored after the
trials, so trying options changes nothing about training. What was decided is remembered
(`torchspeed.remembered`, keyed by the machine, the model's structure, the batch's shapes and the
settings), so the next run of the same script decides at once; `refresh=True` measures again. The
result lists every option as a `TrialRow` with its figures and decision, and each setting's outcome
is logged as one INFO line on this module's logger.

The model returned runs its forward the chosen way by itself (`wrapping.AcceleratedModel`), so the
user's loop stays `loss = loss_fn(model(x), y); loss.backward(); optimizer.step()`; under fp16 the
GradScaler needs `acc.backward(loss)` and `acc.step(optimizer)`, and a plain step is refused.

The settings are one `AccelerateOptions` value, checked once when it is made (`accelerate` builds it
from its keywords; the Trainer holds one). `accelerate` runs four steps in order, one function each:
the precision and memory-format trials (`_choose_precision_and_layout`), the compile trial
(`_choose_compile`), the distributed wrapper (`_wrap_for_strategy`) and the optimizer implementation
(`_choose_optimizer_implementation`); then a loader whose counts were measured alone (a FastLoader on
"auto") has them chosen again with real training steps of the prepared model in the loop
(`_loader_with_step`, see `loader_choice`).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed import measure, remembered
from torchspeed.args import progress_fn
from torchspeed.batches import BatchFormat, to_device
from torchspeed.runtime import (
    FLOAT_PRECISIONS,
    default_precision,
    ensure_cublas_workspace,
    precision_dtype,
    resolve_device,
    rng_state,
    set_rng_state,
    synchronize,
)
from torchspeed.train import distributed
from torchspeed.train.loader_choice import LoaderStepResult, alone_counts, choose_counts
from torchspeed.train.wrapping import (
    AcceleratedModel,
    DeviceLoader,
    class_count,
    example_batch_of,
    warn_if_unsharded,
)

__all__ = ["accelerate", "accelerate_with", "AccelerateOptions", "Accelerated", "AccelerateResult", "TrialRow",
           "apply_cudnn_benchmark", "apply_tf32", "autocast_for", "check_class_outputs", "forget_prepared",
           "release_step_guard", "step_parts", "training_step", "AcceleratedModel", "DeviceLoader"]

log = logging.getLogger(__name__)


_AUTO_OR_BOOL = ("auto", True, False)
_STRATEGIES = ("auto", "ddp", "fsdp", None)


@dataclass(frozen=True)
class AccelerateOptions:
    """accelerate()'s settings, checked once here: "auto" is measured, anything else is used as given.

    `strategy` "none" is read as None. `untried` maps a setting to the reason it is deliberately not
    tried. The fields are accelerate()'s keywords of the same names (see its docstring)."""

    precision: str = "auto"
    channels_last: bool | str = "auto"
    compile: bool | str = "auto"  # noqa: A003 (the public name of the setting)
    strategy: str | None = "auto"
    device: str | torch.device = "auto"
    tf32: bool | str = "auto"
    cudnn_benchmark: bool | str = "auto"
    expected_steps: int | None = None
    trial_steps: int = 3
    margin: float = 0.05
    min_compile_cost_s: float = 20.0
    untried: Mapping[str, str] = field(default_factory=dict)
    fused_optimizer: bool = True
    refresh: bool = False  # measure again instead of recalling what an earlier run measured

    def __post_init__(self) -> None:
        if self.precision not in ("auto", *FLOAT_PRECISIONS):
            raise ValueError(f"precision must be 'auto' or one of {', '.join(repr(p) for p in FLOAT_PRECISIONS)}, "
                             f"got {self.precision!r}")
        for name in ("channels_last", "compile", "tf32", "cudnn_benchmark"):
            value = getattr(self, name)
            if value not in _AUTO_OR_BOOL:
                raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")
        strategy = None if self.strategy == "none" else self.strategy
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be 'auto', 'ddp', 'fsdp' or None, got {self.strategy!r}")
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "untried", dict(self.untried or {}))

    @property
    def measures_step(self) -> bool:
        """Whether precision, memory format or compile is left to measurement (an example batch is needed)."""
        return "auto" in (self.precision, self.channels_last) or self.compile_may_be_tried

    @property
    def compile_may_be_tried(self) -> bool:
        """Whether the compile trial can run: compile on "auto", not untried, and a run length given
        (without `expected_steps` compile's one-off cost cannot be weighed)."""
        return self.compile == "auto" and "compile" not in self.untried and self.expected_steps is not None

    def measures_cuda_switches(self, device: torch.device) -> bool:
        """Whether TF32 or cudnn.benchmark is left to measurement on `device` (CUDA only)."""
        return device.type == "cuda" and "auto" in (self.tf32, self.cudnn_benchmark)


@dataclass
class TrialRow:
    """One row of the result: one option of one setting, measured (or deliberately not tried)."""

    setting: str                  # "precision" | "channels_last" | "precision+channels_last" | "compile" | ...
    value: str
    step_s: float | None = None   # median measured step (forward + loss + backward), seconds
    one_off_s: float = 0.0        # one-off cost, e.g. compile time
    decision: str = ""            # "kept", "baseline", "rejected: ...", "not tried: ...", "given", ...

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AccelerateResult:
    """What accelerate() chose, and every option it considered (`candidates`, a list of `TrialRow`s)."""

    device: str
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    strategy: str | None = None
    optimizer: str = "unchanged"
    tf32: bool | None = None              # TF32 for fp32 matrix multiplies (CUDA); None: not applicable here
    cudnn_benchmark: bool | None = None   # cuDNN autotuning (CUDA); None: not applicable here
    candidates: list[TrialRow] = field(default_factory=list)
    others_cores: float | None = None     # most cores other processes used during a trial (None: not measured)
    loader: LoaderStepResult | None = None  # the loader's counts chosen with the step in the loop (FastLoader)

    @property
    def busy_warning(self) -> str | None:
        """A sentence saying the trials ran on a busy machine (their choices may be noise), else None."""
        from torchspeed.measure import busy_warning

        return busy_warning(self.others_cores)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidates"] = [c.to_dict() for c in self.candidates]
        d["loader"] = self.loader.to_dict() if self.loader is not None else None
        return d

    def record_loader(self, choice: LoaderStepResult) -> None:
        """Keep the loader's counts chosen with the step in the loop: `loader`, and one "loader" row
        per setting timed (or the remembered one), as the other settings are reported."""
        self.loader = choice
        if choice.remembered:
            self.candidates.append(TrialRow("loader", choice.setting, decision=choice.remembered))
            return
        for r in choice.table:
            decision = "kept" if r.decision.startswith("chosen") else f"rejected: {r.decision}"
            self.candidates.append(TrialRow("loader", r.setting, r.step_s, decision=decision))

    def rows(self) -> list[tuple[Any, ...]]:
        return [(c.setting, c.value, None if c.step_s is None else c.step_s * 1e3, c.one_off_s, c.decision)
                for c in self.candidates]

    def __str__(self) -> str:
        cuda = "" if self.tf32 is None and self.cudnn_benchmark is None else (
            f" tf32={self.tf32} cudnn_benchmark={self.cudnn_benchmark}")
        lines = [f"accelerate on {self.device}: precision={self.precision} channels_last={self.channels_last} "
                 f"compile={self.compile} strategy={self.strategy} optimizer={self.optimizer}{cuda}"]
        for c in self.candidates:
            step = "-" if c.step_s is None else f"{c.step_s * 1e3:.1f} ms"
            lines.append(f"  {c.setting:13s} {c.value:6s} step {step:>10s}  one-off {c.one_off_s:.1f} s  {c.decision}")
        if self.busy_warning:
            lines.append(f"  note: {self.busy_warning}")
        return "\n".join(lines)


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

    def __post_init__(self) -> None:
        if self.scaler is not None and self.optimizer is not None:
            _guard_scaled_steps(self.optimizer)

    def __iter__(self) -> Iterator[Any]:
        parts = (self.model, self.optimizer) if self.loader is None else (self.model, self.optimizer, self.loader)
        return iter(parts)

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
            _BACKWARD_SCALED.add(self.scaler)
        else:
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer | None = None, max_grad_norm: float | None = None) -> bool:
        """One optimizer step on the gradients `backward()` left, then clear them (set to None).

        Under fp16 the gradients are unscaled before clipping (so `max_grad_norm` applies to the
        true gradients), the GradScaler skips a step whose gradients hold inf/NaN and adjusts its
        scale. `max_grad_norm` clips the total norm of the optimizer's parameters' gradients.
        Returns True when the step was taken, False when the scaler skipped it. Under fp16 a step
        with no `backward()` since the last one is refused (a plain `loss.backward()` left unscaled
        gradients that unscaling would shrink), before any weight changes.

        Host reads: none outside fp16 (the gradient norm stays on the device). Under fp16 one per
        step: the scaler's inf/NaN finding, read once after unscaling and before the optimizer's
        kernels are queued; a non-fused optimizer then steps (or not) on that reading, where
        GradScaler.step would read it again; a fused one takes it on the device. The scale itself
        is never read.
        """
        opt = optimizer if optimizer is not None else self.optimizer
        if opt is None:
            raise ValueError("Accelerated.step() needs the optimizer (none was given to accelerate())")
        scaler = self.scaler
        if scaler is None:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(_parameters(opt), max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return True
        if scaler not in _BACKWARD_SCALED:
            raise RuntimeError("precision is fp16: acc.step() found no acc.backward(loss) since the last step; the "
                               "GradScaler needs the loss scaled, so call acc.backward(loss) instead of "
                               "loss.backward() (nothing was stepped)")
        _guard_scaled_steps(opt)
        scaler.unscale_(opt)  # what scaler.step would do first; now the finding can be read once
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(_parameters(opt), max_grad_norm)
        found = list(scaler._found_inf_per_device(opt).values())
        stepped = not bool(sum(v.to(found[0].device) for v in found)) if found else True
        _STEPPING.add(id(opt))
        try:
            if getattr(opt, "_step_supports_amp_scaling", False):
                scaler.step(opt)  # fused: the kernel skips the update itself on the device's finding
            elif stepped:
                opt.step()  # the gradients are unscaled already; update() below reads the same finding
        finally:
            _STEPPING.discard(id(opt))
        scaler.update()
        _BACKWARD_SCALED.discard(scaler)
        opt.zero_grad(set_to_none=True)
        return stepped

    @classmethod
    def of(cls, model: Any) -> Accelerated | None:
        """The preparation accelerate() made for `model` when `model` is what it returned, else None.

        (The Trainer uses this to take a prepared model as it is instead of measuring again.)"""
        if isinstance(model, Accelerated):
            return model
        try:
            rec = _PREPARED.get(model)
        except TypeError:  # not weak-referenceable: not ours
            return None
        if rec is None:
            return None
        module, optimizer = rec.module(), rec.optimizer() if rec.optimizer is not None else None
        if module is None:
            return None
        return cls(model=model, optimizer=optimizer, report=rec.report, device=rec.device, module=module,
                   scaler=rec.scaler, batch_format=rec.batch_format)


# fp16: gradients scaled by the GradScaler must be stepped through Accelerated.step (unscaled, checked for inf)
_STEPPING: set[int] = set()  # ids of the optimizers inside Accelerated.step now
# optimizers carrying the refusing hook -> its handle (removed when the preparation is let go)
_GUARDED: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
_BACKWARD_SCALED: weakref.WeakSet[Any] = weakref.WeakSet()  # scalers with an acc.backward since their last step


def _refuse_plain_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if id(optimizer) not in _STEPPING:
        raise RuntimeError("precision is fp16: optimizer.step() was called outside acc.step(optimizer); the GradScaler "
                           "must unscale the gradients and skip steps with inf/NaN, so use acc.backward(loss) and "
                           "acc.step(optimizer) in the loop (nothing was stepped)")


def _guard_scaled_steps(optimizer: torch.optim.Optimizer) -> None:
    """Under fp16: a step pre-hook refusing any step not made through Accelerated.step, before a weight
    changes (a plain step would apply scaled, unchecked gradients: silently wrong)."""
    if optimizer not in _GUARDED:
        _GUARDED[optimizer] = optimizer.register_step_pre_hook(_refuse_plain_step)


def release_step_guard(optimizer: torch.optim.Optimizer | None) -> None:
    """Remove the fp16 hook that refuses a plain `optimizer.step()`: once the preparation is forgotten or
    let go, the optimizer is the user's again (a later fp32 loop, or another preparation, steps it)."""
    handle = _GUARDED.pop(optimizer, None) if optimizer is not None else None
    if handle is not None:
        handle.remove()


def _release_guard_of(optimizer_ref: weakref.ref[torch.optim.Optimizer]) -> None:
    release_step_guard(optimizer_ref())


@dataclass
class _Prepared:
    """What accelerate() decided for a model it returned, held without keeping the model alive."""

    report: AccelerateResult
    device: torch.device
    scaler: Any
    module: weakref.ref[nn.Module]
    optimizer: weakref.ref[torch.optim.Optimizer] | None
    batch_format: BatchFormat | None = None


# model returned by accelerate() -> its preparation; entries go when the model is garbage-collected
_PREPARED: weakref.WeakKeyDictionary[nn.Module, _Prepared] = weakref.WeakKeyDictionary()


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """torch.autocast at `precision` on `device` (a no-op context for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision_dtype(precision))


def _default_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """For timing only: cross-entropy for class logits, else the mean output (same backward cost)."""
    if (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() == 2
            and targets.dtype == torch.int64 and targets.dim() == 1):
        return nn.functional.cross_entropy(outputs.float(), targets)
    out = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    return out.float().mean()


def _indexes_by_label(loss_fn: Any) -> bool:
    """Whether the loss picks each sample's logit by its label (cross-entropy, NLL), so a label past
    the logits' width fails inside it."""
    fn = getattr(loss_fn, "func", loss_fn)  # a functools.partial of one
    return isinstance(fn, (nn.CrossEntropyLoss, nn.NLLLoss)) or fn in (
        nn.functional.cross_entropy, nn.functional.nll_loss, _default_loss)


def check_class_outputs(logits: Any, targets: Any, loss_fn: Any, classes: int | None = None) -> None:
    """Refuse class logits narrower than the labels need, before the loss indexes past them (an
    IndexError deep in torch on the CPU, a device-side assert that ends the process on CUDA).

    Only for class labels under a loss that indexes by them; `classes`: how many the data names,
    when it does. Reads the largest label (one host read), so it is called on a first batch only."""
    if isinstance(logits, torch.Tensor) and logits.dim() == 2:
        _check_class_width(logits.shape[1], targets, loss_fn, classes)


def _check_class_width(width: int | None, targets: Any, loss_fn: Any, classes: int | None) -> None:
    """check_class_outputs on the logits' width alone (a remembered decision keeps the width, so a
    recalled accelerate() checks the labels without running the model)."""
    if not (width is not None and _indexes_by_label(loss_fn) and isinstance(targets, torch.Tensor)
            and targets.dim() == 1 and not targets.is_floating_point() and targets.numel()):
        return
    top = int(targets.max())
    need = max(top + 1, classes or 0)
    if width < need:
        data = f"the data has {classes} classes" if classes and classes > top else f"a label is {top}"
        raise ValueError(f"the model gives {width} output(s) per sample (its logits' width) but {data}: a "
                         f"classifier needs one output per class; build it with {need} outputs (e.g. "
                         f"num_classes={need}), or check the labels")


def _shapes(x: Any) -> str:
    """A batch part's shapes for a message: '(32, 3, 64, 64) float32', dicts and tuples of them."""
    if isinstance(x, torch.Tensor):
        return f"({', '.join(map(str, x.shape))}) {str(x.dtype).replace('torch.', '')}"
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k!r}: {_shapes(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (tuple, list)):
        return "[" + ", ".join(_shapes(v) for v in x) + "]"
    return type(x).__name__


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Refuse an optimizer that does not hold the model's parameters (made for another model, or before
    `model.fc = ...` replaced a layer): its steps would leave the model untrained. An optimizer over a
    part of the model only (a head being fine-tuned) is fine; one over extra tensors (a loss's) too."""
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer (or None), got {type(optimizer).__name__}")
    held = {id(p) for p in _parameters(optimizer)}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in trainable if id(p) not in held]
    ours = {id(p) for _, p in model.named_parameters()}
    foreign = sum(1 for i in held if i not in ours)
    if trainable and (len(missing) == len(trainable) or (missing and foreign)):
        raise ValueError(f"the optimizer lacks {len(missing)} of the model's {len(trainable)} trainable parameters "
                         f"(e.g. {missing[0]!r}) and holds {foreign} tensor(s) that are not the model's: it was made "
                         "for another model, or before a layer was replaced (model.fc = ...); create it from "
                         "model.parameters() after the model is final")


def _image_input(x: Any) -> bool:
    """Whether the inputs hold a 4-D float tensor (images: a memory format applies)."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 4 and x.is_floating_point()
    values = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    return any(_image_input(v) for v in values)


class _StepTimer:
    """Times training steps (forward, loss, backward) of a model on one example batch, read through
    the batch format (inputs, target, logits) the training itself uses."""

    def __init__(self, batch: Any, loss_fn: Callable[..., torch.Tensor] | None, device: torch.device, steps: int,
                 batch_format: BatchFormat | None = None, classes: int | None = None):
        self.device, self.steps, self.classes = device, steps, classes
        self.others: list[float] = []  # cores other processes used during each timing
        self.loss_fn = loss_fn or _default_loss
        self.fmt = batch_format or BatchFormat()
        try:
            self.inputs, self.targets = self.fmt.split(batch)
        except ValueError as e:
            raise ValueError(f"example_batch: {e}; give one batch from the training loader") from None

    def step_fn(self, model: nn.Module, precision: str, channels_last: bool) -> Callable[[], None]:
        x = to_device(self.inputs, self.device, channels_last)
        y = to_device(self.targets, self.device)
        needs_inputs = getattr(self.loss_fn, "needs_inputs", False)
        fmt = self.fmt
        checked = False

        def step() -> None:
            nonlocal checked
            with autocast_for(self.device, precision):
                out = fmt.logits_of(fmt.forward(model, x))
                if not checked:  # the first call only: it reads the largest label
                    check_class_outputs(out, y, self.loss_fn, self.classes)
                    checked = True
                loss = self.loss_fn(out, y, x) if needs_inputs else self.loss_fn(out, y)
            loss.backward()
            for p in model.parameters():
                p.grad = None
        return step

    def preflight(self, model: nn.Module) -> int | None:
        """One forward and loss on the example batch before any trial, so that a batch the model cannot
        take, or class logits narrower than the labels, is one clear ValueError naming both sides (not
        an error inside a timed trial). Returns the logits' width (kept with the decision), or None."""
        x, y = to_device(self.inputs, self.device), to_device(self.targets, self.device)
        try:
            with torch.no_grad():
                out = self.fmt.logits_of(self.fmt.forward(model, x))
        except Exception as e:
            raise ValueError(f"the model cannot take the training batch (inputs {_shapes(x)}): "
                             f"{type(e).__name__}: {e}") from e
        check_class_outputs(out, y, self.loss_fn, self.classes)
        try:
            with torch.no_grad():
                self.loss_fn(out, y, x) if getattr(self.loss_fn, "needs_inputs", False) else self.loss_fn(out, y)
        except Exception as e:
            raise ValueError(f"loss_fn cannot take the model's outputs {_shapes(out)} and the batch's targets "
                             f"{_shapes(y)}: {type(e).__name__}: {e}") from e
        return int(out.shape[1]) if isinstance(out, torch.Tensor) and out.dim() == 2 else None

    def measure(self, step: Callable[[], None]) -> tuple[float, float]:
        """(median step seconds, first-call seconds): the first call carries one-off costs."""
        t0 = time.perf_counter()
        step()
        synchronize(self.device)
        first = time.perf_counter() - t0
        others = measure.OthersLoad()
        t = measure.time_callable(step, name="trial", warmup=1, repeats=self.steps, device=self.device)
        self._record(others.cores())
        return t.median_s, first

    def compare(self, steps: dict[str, Callable[[], None]]) -> dict[str, float]:
        """Median step seconds of each option, timed interleaved (drifts hit all alike)."""
        c = measure.compare(steps, warmup=1, repeats=self.steps, cooldown_s=0.05, device=self.device)
        self._record(c.others_cores)
        return {name: c[name].median_s for name in steps}

    def _record(self, others_cores: float | None) -> None:
        if others_cores is not None:
            self.others.append(others_cores)

    @property
    def others_cores(self) -> float | None:
        """The most cores other processes used during any one timing (None where none could tell)."""
        return max(self.others, default=None)


@contextlib.contextmanager
def _leaving_no_trace(model: nn.Module) -> Iterator[None]:
    """Trials run real training steps; afterwards put back the weights, buffers (BatchNorm
    statistics), gradients, every RNG and train/eval mode, so trying options changes nothing."""
    saved_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved_rng = rng_state()
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.load_state_dict(saved_state)
        set_rng_state(saved_rng)
        for p in model.parameters():
            p.grad = None
        model.train(was_training)


def _margin_ok(base: float, new: float, margin: float) -> bool:
    return new < base * (1.0 - margin)


def _precision_options(device: torch.device) -> list[str]:
    best = default_precision(device).name
    return ["fp32"] if best == "fp32" else ["fp32", best]


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in model.modules())


def _check_model(model: Any) -> None:
    """Refuse what cannot be prepared before anything is moved or measured."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, AcceleratedModel)) or hasattr(model, "_orig_mod"):
        raise ValueError("model is already wrapped (DDP or torch.compile); pass the plain nn.Module to accelerate(), "
                         "or pass the Accelerated that accelerate() returned (or its model) to the Trainer")


def _resolve_strategy(strategy: str | None, dev: torch.device,
                      untried: dict[str, str]) -> tuple[distributed.DistEnv, torch.device, str | None]:
    """The process group first (under torchrun it also fixes this rank's device), then the wrapper
    that will actually be used: DDP or FSDP only exist in a torchrun launch."""
    denv, dev = distributed.setup(dev) if strategy in ("auto", "ddp", "fsdp") else (distributed.env(), dev)
    if strategy in ("ddp", "fsdp") and not denv.distributed:
        untried.setdefault("strategy", f"{strategy} needs a torchrun launch (WORLD_SIZE > 1)")
        return denv, dev, None
    if strategy == "auto":
        return denv, dev, "ddp" if denv.distributed else None
    return denv, dev, strategy


def _choose_precision_and_layout(model: nn.Module, timer: _StepTimer | None, precision: str,
                                 channels_last: bool | str, dev: torch.device, margin: float,
                                 rows: list[TrialRow]) -> tuple[str, bool, float | None]:
    """Precision and memory format, searched jointly: on CPUs bf16 may only pay off in NHWC (oneDNN
    reorders NCHW bf16 activations), so a one-axis-at-a-time search could miss the best pair. The
    plain way (fp32 when auto, NCHW when auto) is the baseline; another pair is kept only when it is
    `margin` faster. Returns (precision, channels_last, measured step seconds of the choice or None)."""
    precs = _precision_options(dev) if precision == "auto" else [precision]
    layouts = [bool(channels_last)] if channels_last != "auto" else [False, True]
    if channels_last == "auto" and not (_has_conv(model) and _image_input(timer.inputs)):
        layouts = [False]
        rows.append(TrialRow("channels_last", "True", decision="not tried: no 2-D convolutions / 4-D input"))
    precision_given = "given" if precision != "auto" else f"kept ({default_precision(dev).reason})"
    if len(precs) * len(layouts) == 1:
        rows.append(TrialRow("precision", precs[0], decision=precision_given))
        if channels_last != "auto":
            rows.append(TrialRow("channels_last", str(layouts[0]), decision="given"))
        return precs[0], layouts[0], None

    nhwc = copy.deepcopy(model).to(memory_format=torch.channels_last) if True in layouts else None
    label = "+".join(n for n, many in (("precision", len(precs) > 1), ("channels_last", len(layouts) > 1)) if many)

    def name(p: str, cl: bool) -> str:
        return "+".join(v for v, many in ((p, len(precs) > 1), ("NHWC" if cl else "NCHW", len(layouts) > 1)) if many)

    combos = {name(p, cl): (p, cl) for p in precs for cl in layouts}
    times = timer.compare({n: timer.step_fn(nhwc if cl else model, p, cl) for n, (p, cl) in combos.items()})
    del nhwc
    base = name(precs[0], layouts[0])
    best = min(times, key=times.__getitem__)
    chosen = best if best != base and _margin_ok(times[base], times[best], margin) else base
    for n, t in times.items():
        why = "kept" if n == chosen else "baseline" if n == base else (
            f"rejected: not {margin:.0%} faster than {base}" if n == best else f"rejected: slower than {chosen}")
        rows.append(TrialRow(label, n, t, decision=why))
    prec, cl = combos[chosen]
    if len(precs) == 1:
        rows.append(TrialRow("precision", prec, decision=precision_given))
    if len(layouts) == 1 and channels_last != "auto":
        rows.append(TrialRow("channels_last", str(cl), decision="given"))
    return prec, cl, times[chosen]


def _choose_compile(model: nn.Module, timer: _StepTimer | None, compile: bool | str,  # noqa: A002
                    report: AccelerateResult, base_step: float | None, expected_steps: int | None,
                    margin: float, min_compile_cost_s: float, untried: dict[str, str]) -> nn.Module | None:
    """torch.compile only where it pays: its one-off compile time is charged against the expected
    run, and a run too short to repay a typical compile (`min_compile_cost_s`) does not try it.
    Sets report.compile; returns the compiled model when the trial kept it (reused, not recompiled)."""
    rows = report.candidates
    if compile != "auto":
        report.compile = bool(compile)
        rows.append(TrialRow("compile", str(report.compile), decision="given"))
        return None
    if "compile" in untried:
        rows.append(TrialRow("compile", "True", decision=f"not tried: {untried['compile']}"))
        return None
    if expected_steps is None:
        rows.append(TrialRow("compile", "True", decision="not tried: give expected_steps to weigh compile's one-off "
                                                         "cost"))
        return None
    if base_step is None:
        base_step, _ = timer.measure(timer.step_fn(model, report.precision, report.channels_last))
    steps = expected_steps
    rows.append(TrialRow("compile", "False", base_step))
    if steps * base_step < min_compile_cost_s:
        rows[-1].decision = "kept"
        rows.append(TrialRow("compile", "True", decision=(
            f"not tried: expected run ~{steps * base_step:.0f} s is too short to repay a compile "
            f"(typically >= {min_compile_cost_s:.0f} s)")))
        return None
    compiled = _try_compile(model, timer, report.precision, report.channels_last, base_step, steps, margin, rows)
    report.compile = compiled is not None
    return compiled


def _try_compile(model: nn.Module, timer: _StepTimer, precision: str, cl: bool, base_step: float, steps: int,
                 margin: float, rows: list[TrialRow]) -> nn.Module | None:
    """Compile, time, and keep only if the saving over the expected run repays the compile time."""
    try:
        compiled = torch.compile(model)
        t_c, first = timer.measure(timer.step_fn(compiled, precision, cl))
    except Exception as e:  # a model the compiler cannot handle is a rejected option, not a crash
        rows[-1].decision = "kept"
        rows.append(TrialRow("compile", "True", decision=f"rejected: compile failed ({type(e).__name__}: {e})"[:200]))
        return None
    one_off = max(0.0, first - t_c)
    saving = (base_step - t_c) * steps if steps else None
    if not _margin_ok(base_step, t_c, margin):
        why = f"rejected: step not {margin:.0%} faster"
    elif saving is not None and saving <= one_off:
        why = f"rejected: saves {saving:.0f} s over {steps} steps, compile costs {one_off:.0f} s"
    else:
        why = "kept"
    rows[-1].decision = "baseline" if why == "kept" else "kept"
    rows.append(TrialRow("compile", "True", t_c, one_off, why))
    return compiled if why == "kept" else None


_SET_HERE: dict[str, Any] = {}  # the switches accelerate() set last (so they are not taken for the user's)


def apply_tf32(on: bool | None) -> None:
    """Set TF32 for fp32 matmuls as chosen (None: leave it); public so a Lightning run and every rank
    apply the same switch accelerate() measured."""
    if on is not None:
        _SET_HERE["matmul"] = "high" if on else "highest"
        torch.set_float32_matmul_precision(_SET_HERE["matmul"])


def apply_cudnn_benchmark(on: bool | None) -> None:
    """Set cudnn.benchmark as chosen (None: leave it); public for the same reason as `apply_tf32`."""
    if on is not None:
        _SET_HERE["cudnn_benchmark"] = on
        torch.backends.cudnn.benchmark = on


def _choose_cuda_flags(model: nn.Module, timer: _StepTimer | None, tf32: bool | str, cudnn_benchmark: bool | str,
                       report: AccelerateResult, dev: torch.device, margin: float) -> None:
    """CUDA's two process-wide speed switches, each measured like the other settings (or as given):

    - TF32 for fp32 matrix multiplies (sm >= 8.0; PyTorch leaves it off for matmuls while cuDNN
      convolutions use TF32 by default). Only where fp32 was chosen: autocast runs matmuls in bf16/fp16
      anyway. A matmul precision the process already set (`torch.set_float32_matmul_precision`) is
      the user's and is kept.
    - cudnn.benchmark (autotuning: pays with static shapes, costs with varying ones), for models
      with convolutions; left as it is under deterministic mode. Given True/False is applied as
      given; turned on by the process before accelerate is the user's and kept (off is PyTorch's
      default, indistinguishable from a choice: pass cudnn_benchmark=False to keep it off).
    Sets report.tf32 / report.cudnn_benchmark (None where the switch does not apply)."""
    if dev.type != "cuda":
        return
    rows = report.candidates
    major, _ = torch.cuda.get_device_capability(dev)
    if tf32 != "auto":
        report.tf32 = bool(tf32)
        rows.append(TrialRow("tf32", str(report.tf32), decision="given"))
    elif torch.get_float32_matmul_precision() not in ("highest", _SET_HERE.get("matmul")):
        report.tf32 = torch.get_float32_matmul_precision() != "highest"
        rows.append(TrialRow("tf32", str(report.tf32), decision=(
            f"given (matmul precision {torch.get_float32_matmul_precision()!r} set before accelerate)")))
    elif major < 8 or report.precision != "fp32" or timer is None:
        why = (f"sm {major}.x has no TF32" if major < 8 else "mixed precision chosen: matmuls run in "
               f"{report.precision}" if report.precision != "fp32" else "no example batch to measure on")
        rows.append(TrialRow("tf32", "True", decision=f"not tried: {why}"))
    else:
        report.tf32 = _measure_switch("tf32", apply_tf32, model, timer, report, margin)
    apply_tf32(report.tf32)

    deterministic = torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic
    if cudnn_benchmark != "auto":
        report.cudnn_benchmark = bool(cudnn_benchmark)
        rows.append(TrialRow("cudnn_benchmark", str(report.cudnn_benchmark), decision="given"))
    elif torch.backends.cudnn.benchmark and _SET_HERE.get("cudnn_benchmark") is not True:
        report.cudnn_benchmark = True
        rows.append(TrialRow("cudnn_benchmark", "True", decision="given (turned on before accelerate)"))
    elif deterministic or not _has_conv(model) or timer is None:
        why = ("deterministic mode" if deterministic else "no convolutions" if not _has_conv(model)
               else "no example batch to measure on")
        rows.append(TrialRow("cudnn_benchmark", "True", decision=f"not tried: {why}; left as it is "
                          f"({torch.backends.cudnn.benchmark})"))
    else:
        report.cudnn_benchmark = _measure_switch("cudnn_benchmark", apply_cudnn_benchmark, model, timer, report,
                                                 margin)
    apply_cudnn_benchmark(report.cudnn_benchmark)


def _measure_switch(setting: str, apply: Callable[[bool | None], None], model: nn.Module, timer: _StepTimer,
                    report: AccelerateResult, margin: float) -> bool:
    """Time the training step with a process-wide switch off and on (interleaved; the switch is set
    before each call, so a one-off cost such as cuDNN's autotuning falls in the warm-up); on is kept
    only when `margin` faster. Adds both rows."""
    step = timer.step_fn(model, report.precision, report.channels_last)

    def with_switch(on: bool) -> Callable[[], None]:
        def run() -> None:
            apply(on)
            step()
        return run

    times = timer.compare({"False": with_switch(False), "True": with_switch(True)})
    keep = _margin_ok(times["False"], times["True"], margin)
    report.candidates.append(TrialRow(setting, "False", times["False"], decision="baseline" if keep else "kept"))
    report.candidates.append(TrialRow(setting, "True", times["True"],
                                   decision="kept" if keep else f"rejected: not {margin:.0%} faster"))
    return keep


def _cublas_workspace_for_determinism(cuda_initialized: bool) -> None:
    """When deterministic algorithms are on, the cuBLAS workspace they need (runtime's one mechanism)."""
    if torch.are_deterministic_algorithms_enabled():
        ensure_cublas_workspace(cuda_initialized, stacklevel=3)


def _agree_across_ranks(report: AccelerateResult, model: nn.Module) -> None:
    """Every rank must make the same choices, whatever its own timings said: rank 0's win."""
    def code(v: bool | None) -> int:
        return -1 if v is None else int(v)

    p_idx, cl, co, tf, cb = distributed.broadcast_ints(
        [FLOAT_PRECISIONS.index(report.precision), int(report.channels_last), int(report.compile), code(report.tf32),
         code(report.cudnn_benchmark)])
    report.precision, report.channels_last, report.compile = FLOAT_PRECISIONS[p_idx], bool(cl), bool(co)
    report.tf32, report.cudnn_benchmark = (None if tf < 0 else bool(tf)), (None if cb < 0 else bool(cb))
    apply_tf32(report.tf32)
    apply_cudnn_benchmark(report.cudnn_benchmark)
    model.to(memory_format=torch.channels_last if report.channels_last else torch.contiguous_format)


def _rebind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], module: nn.Module) -> None:
    """After FSDP replaced the parameters, point the optimizer's groups at the new (sharded) ones."""
    if optimizer.state:
        raise ValueError("strategy='fsdp' needs an optimizer without state yet (create it, then call accelerate)")
    new = dict(module.named_parameters())
    for g in optimizer.param_groups:
        g["params"] = [new[names[id(p)]] for p in g["params"]]


def _fsdp_policy(precision: str) -> Any:
    """FSDP2's MixedPrecisionPolicy for a chosen precision: parameters all-gathered and computed in
    bf16/fp16 (half the all-gather traffic of fp32), gradients reduced in fp32; None for fp32."""
    if precision == "fp32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=precision_dtype(precision), reduce_dtype=torch.float32)


def _fsdp_wrap(module: nn.Module, precision: str = "fp32") -> nn.Module:
    """FSDP2: shard each top-level block that holds parameters, then the root, with the precision's
    MixedPrecisionPolicy (the sharded parameters stay fp32)."""
    from torch.distributed.fsdp import fully_shard

    policy = _fsdp_policy(precision)
    kwargs = {"mp_policy": policy} if policy is not None else {}
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, **kwargs)
    fully_shard(module, **kwargs)
    return module


def _wrap_for_strategy(model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy_eff: str | None,
                       asked: str | None, dev: torch.device, denv: distributed.DistEnv,
                       untried: dict[str, str], rows: list[TrialRow], precision: str = "fp32") -> nn.Module:
    """DDP or FSDP2 as asked (not measured: one process per device is the way to use several).
    FSDP replaces the parameters by shards, so the optimizer is pointed at the new ones."""
    if strategy_eff == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        rows.append(TrialRow("strategy", "ddp", decision=f"kept: torchrun world of {denv.world_size}"))
        return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    if strategy_eff == "fsdp":
        names = {id(p): n for n, p in model.named_parameters()}
        wrapped = _fsdp_wrap(model, precision)
        if optimizer is not None:
            _rebind_optimizer(optimizer, names, model)
        mp = "" if precision == "fp32" else f", {precision} parameters (MixedPrecisionPolicy, fp32 reduce)"
        rows.append(TrialRow("strategy", "fsdp", decision=f"kept: fully_shard over {denv.world_size} ranks{mp}"))
        return wrapped
    if "strategy" in untried:
        rows.append(TrialRow("strategy", str(asked), decision=f"not used: {untried['strategy']}"))
    return model


def _choose_optimizer_implementation(optimizer: torch.optim.Optimizer, device: torch.device, dtensor: bool) -> str:
    """Switch a fresh optimizer to its fused (else foreach) implementation, in place; say what was done.

    Not measured: one kernel over all parameters is never slower than a Python loop over them, and
    the math is the same. An optimizer with state already is left as it is."""
    if optimizer.state:
        return "unchanged (optimizer already has state)"
    groups = optimizer.param_groups
    if not groups or any("foreach" not in g for g in groups):
        return "unchanged (no fused/foreach implementation)"
    if "fused" in groups[0] and not dtensor and device.type in ("cpu", "cuda") and all(
            p.is_floating_point() and p.device.type == device.type for g in groups for p in g["params"]):
        if not any(g.get("differentiable") or g.get("capturable") for g in groups):
            for g in groups:
                g["fused"], g["foreach"] = True, False
            optimizer._step_supports_amp_scaling = True  # as a fused optimizer built with fused=True
            return "fused"
    for g in groups:
        if not g.get("fused"):
            g["foreach"] = True
    return "foreach"


def _log_choices(rows: Iterable[TrialRow], device: str) -> None:
    """One INFO line per setting: every option with its measured median step and its decision."""
    by_setting: dict[str, list[TrialRow]] = {}
    for r in rows:
        by_setting.setdefault(r.setting, []).append(r)
    for setting, trials in by_setting.items():
        parts = []
        for t in trials:
            figures = "" if t.step_s is None else f" {t.step_s * 1e3:.1f} ms"
            figures += f" + {t.one_off_s:.1f} s one-off" if t.one_off_s else ""
            parts.append(f"{t.value}{figures} [{t.decision}]")
        log.info("accelerate on %s, %s: %s", device, setting, "; ".join(parts))


def accelerate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    loader: Iterable[Any] | None = None,
    *,
    precision: str = "auto",
    channels_last: bool | str = "auto",
    compile: bool | str = "auto",  # noqa: A002 (the public name of the setting)
    strategy: str | None = "auto",
    example_batch: Any = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    device: str | torch.device = "auto",
    expected_steps: int | None = None,
    trial_steps: int = 3,
    margin: float = 0.05,
    min_compile_cost_s: float = 20.0,
    untried: dict[str, str] | None = None,
    fused_optimizer: bool = True,
    tf32: bool | str = "auto",
    cudnn_benchmark: bool | str = "auto",
    batch_format: BatchFormat | dict | None = None,
    refresh: bool = False,
    progress: bool | Callable[[str], Any] = False,
) -> Accelerated:
    """Prepare `model`, `optimizer` and `loader` for fast training here; decisions are measured,
    reported and remembered.

        model, optimizer, loader = ts.train.accelerate(model, optimizer, loader)

    The model returned runs its forward at the chosen precision and memory format (inputs moved to
    the device where they enter, autocast, fp32 outputs), so the loop stays plain; the loader
    returned yields batches on the device (everything else about it is the loader's). Under fp16
    (CUDA) step with `acc.backward(loss)` and `acc.step(optimizer)` (the GradScaler; a plain
    `optimizer.step()` is refused).

    precision: "auto" | "bf16" | "fp16" | "fp32" (mixed precision keeps fp32 weights and autocasts;
    fp16 brings a GradScaler on CUDA). channels_last / compile: "auto" | True | False. strategy:
    "auto" (DDP under torchrun, else none) | "ddp" | "fsdp" | None. "auto" settings are measured on
    the loader's first batch (taken without moving any RNG or the loader's position), or on
    `example_batch`, read by `batch_format` (`torchspeed.batches.BatchFormat`: which part is the
    input, which the target, where the logits are; default: `(x, y)` tuples and dict batches by its
    auto rules), with `loss_fn(logits, target)`; an option must beat the current choice by
    `margin` (fraction of step time). Compile is tried only when `expected_steps` is given, and
    kept only when its one-off cost is repaid within them; with an expected run shorter than
    `min_compile_cost_s` it is not tried. `untried` maps a setting name to the reason it is
    deliberately not tried (e.g. {"compile": "quick mode budget"}). On CUDA, `tf32` (TF32 for fp32
    matmuls) and `cudnn_benchmark` are "auto" (measured) | True | False; both are process-wide
    switches, set to what was chosen.

    Before any trial the batch goes through the model and the loss once: a batch the model cannot
    take, too few class outputs for the labels, or an optimizer not holding the model's parameters
    is a ValueError naming both sides. What was measured is remembered for this machine, model
    structure, batch shapes and settings; the next call decides from it at once ("remembered from
    <date> (<figure>)"); `refresh=True` measures again. `progress`: True prints one line per trial
    on stderr, a callable receives them; by default nothing is printed (INFO log lines as always).

    A loader whose worker/thread counts were measured alone (`fast_loader(..., num_workers="auto")`)
    gets them chosen again with real training steps (forward, loss, backward, optimizer step) of the
    prepared model in the loop, the setting measured alone against less parallel ones, so the
    loader's threads do not slow the step down (`report.loader`, "loader" rows; remembered; the
    model, optimizer and RNG put back exactly). Counts given explicitly are used as given.

    The model returned can be given to `Trainer` as it is (or the `Accelerated` itself): the
    Trainer then uses these choices and does not measure again.
    """
    if isinstance(loader, str):
        raise TypeError(f"accelerate()'s third argument is the training loader, got the string {loader!r}; pass "
                        f"the settings by keyword, e.g. precision={loader!r}")
    options = AccelerateOptions(
        precision=precision, channels_last=channels_last, compile=compile, strategy=strategy, device=device,
        tf32=tf32, cudnn_benchmark=cudnn_benchmark, expected_steps=expected_steps, trial_steps=trial_steps,
        margin=margin, min_compile_cost_s=min_compile_cost_s, untried=untried or {}, fused_optimizer=fused_optimizer,
        refresh=refresh)
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
    untried = dict(options.untried)
    dev = resolve_device(options.device)
    if dev.type == "cuda":
        _cublas_workspace_for_determinism(torch.cuda.is_initialized())
    denv, dev, strategy_eff = _resolve_strategy(options.strategy, dev, untried)
    if loader is not None:
        warn_if_unsharded(loader, denv.world_size)
        classes = classes if classes is not None else class_count(loader)
        needs_batch = options.measures_step or options.measures_cuda_switches(dev)
        if example_batch is None and needs_batch:
            example_batch = example_batch_of(loader)
    model.to(dev)
    report = AccelerateResult(device=str(dev), strategy=strategy_eff)
    timer = _trial_timer(options, dev, example_batch, loss_fn, fmt, classes)
    compiled, memory = None, None
    if timer is not None:
        parts = _memory_parts(options, model, timer, dev, denv.world_size, loss_fn, untried)
        memory = _recall(parts, options.refresh)
        if memory is not None:
            _follow_memory(memory, model, timer, options, report, dev)
            say(f"accelerate: {memory.describe()}")
        else:
            with _leaving_no_trace(model):
                width = timer.preflight(model)
                quiet = measure.wait_for_quiet_machine(max_s=3.0, window_s=0.25)
                if quiet.waited_s > 0.5:
                    say(f"accelerate: waited {quiet.waited_s:.1f} s for other processes to leave the cores")
                compiled = _choose_step_settings(model, timer, options, report, dev, untried, say)
            report.others_cores = timer.others_cores
            if report.busy_warning:  # a choice made on noise is not kept for the next runs
                log.warning("accelerate: %s (not remembered)", report.busy_warning)
            elif denv.is_main:
                _remember(parts, report, width)
    else:
        _choose_step_settings(model, None, options, report, dev, untried, say)
    if denv.distributed:
        _agree_across_ranks(report, model)
    wrapped = _wrap_for_strategy(model, optimizer, strategy_eff, options.strategy, dev, denv, untried,
                                 report.candidates, report.precision)
    if optimizer is not None and options.fused_optimizer:
        report.optimizer = _choose_optimizer_implementation(optimizer, dev, dtensor=strategy_eff == "fsdp")
        report.candidates.append(TrialRow("optimizer", report.optimizer,
                                          decision="preferred (one kernel over all parameters)"))
    if report.compile:
        wrapped = compiled if (compiled is not None and wrapped is model) else torch.compile(wrapped)
    scaler = torch.amp.GradScaler("cuda") if report.precision == "fp16" else None
    if memory is None:  # a remembered decision said its one line
        _log_choices(report.candidates, report.device)
    front = AcceleratedModel(model, wrapped, dev, report.precision, report.channels_last)
    _PREPARED[front] = _Prepared(report, dev, scaler, weakref.ref(model),
                                 weakref.ref(optimizer) if optimizer is not None else None, fmt)
    if scaler is not None and optimizer is not None:  # the model let go: the optimizer steps plainly again
        weakref.finalize(front, _release_guard_of, weakref.ref(optimizer))
    acc = Accelerated(model=front, optimizer=optimizer, report=report, device=dev, module=model, scaler=scaler,
                      batch_format=fmt)
    if loader is not None:
        loader = _loader_with_step(acc, loader, loss_fn, example_batch, options.refresh, progress)
        acc.loader = DeviceLoader(loader, dev, report.channels_last)
    return acc


def training_step(acc: Accelerated, loss_fn: Callable[..., torch.Tensor] | None) -> Callable[[Any], None]:
    """One real training step of the prepared model on a batch, as a plain loop runs it: forward under
    the chosen precision, `loss_fn` (cross-entropy for class logits when None, as the trials), backward
    and optimizer step through `acc` (the GradScaler under fp16)."""
    fmt = acc.batch_format or BatchFormat()
    loss = loss_fn or _default_loss
    needs_inputs = getattr(loss, "needs_inputs", False)

    def step(batch: Any) -> None:
        x, y = fmt.split(batch)
        y = to_device(y, acc.device)
        with acc.autocast():
            out = fmt.logits_of(fmt.forward(acc.model, x))
            value = loss(out, y, x) if needs_inputs else loss(out, y)
        acc.backward(value)
        acc.step(acc.optimizer)
    return step


def step_parts(acc: Accelerated, loss_fn: Any, batch: Any) -> dict[str, Any]:
    """What the time of a prepared training step depends on besides the machine (the key of the loader
    choice made with it): the model's structure, the batch's shapes, the choices accelerate() made,
    the optimizer, the loss, the world size."""
    inputs, targets = (acc.batch_format or BatchFormat()).split(batch)
    r = acc.report
    opt = acc.optimizer
    return {"model": remembered.model_fingerprint(acc.module), "inputs": remembered.shapes_of(inputs),
            "targets": remembered.shapes_of(targets), "device": acc.device.type,
            "world_size": distributed.env().world_size, "precision": r.precision, "channels_last": r.channels_last,
            "compile": r.compile, "strategy": r.strategy, "tf32": r.tf32, "cudnn_benchmark": r.cudnn_benchmark,
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


def _qualified_name(fn: Any) -> str | None:
    """The loss's qualified name (a module's class, a function, a partial's function) for a decision's key."""
    if fn is None:
        return None
    fn = getattr(fn, "func", fn)
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '')}.{named.__qualname__}"


def _memory_parts(options: AccelerateOptions, model: nn.Module, timer: _StepTimer, dev: torch.device,
                  world_size: int, loss_fn: Any, untried: Mapping[str, str]) -> dict[str, Any]:
    """What accelerate()'s decision depends on, besides the machine (`remembered` adds it): the model's
    structure, the batch's shapes, the device type, the world size, the settings measured or given,
    deterministic mode, the loss."""
    parts: dict[str, Any] = {
        "model": remembered.model_fingerprint(model), "inputs": remembered.shapes_of(timer.inputs),
        "targets": remembered.shapes_of(timer.targets), "device": dev.type, "world_size": world_size,
        "precision": options.precision, "channels_last": str(options.channels_last), "compile": str(options.compile),
        "tf32": str(options.tf32), "cudnn_benchmark": str(options.cudnn_benchmark), "margin": options.margin,
        "compile_may_be_tried": options.compile_may_be_tried and "compile" not in untried,
        "deterministic": torch.are_deterministic_algorithms_enabled(), "loss_fn": _qualified_name(loss_fn),
        "untried": sorted(untried)}
    if parts["compile_may_be_tried"]:  # whether compile repays itself depends on the run's length
        parts["expected_steps"], parts["min_compile_cost_s"] = options.expected_steps, options.min_compile_cost_s
    if dev.type == "cuda":  # switches the process set before count as the user's (see _choose_cuda_flags)
        parts["switches"] = [torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark,
                             _SET_HERE.get("matmul"), _SET_HERE.get("cudnn_benchmark")]
    return parts


def _recall(parts: dict[str, Any], refresh: bool) -> remembered.Memory | None:
    """The decision remembered for `parts`; under torchrun rank 0's finding is every rank's (when rank 0
    recalls, no rank measures; the choices themselves are broadcast after)."""
    memory = None if refresh else remembered.recall("accelerate", parts)
    e = distributed.env()
    if not e.distributed:
        return memory
    (found,) = distributed.broadcast_ints([int(memory is not None)])
    if not found:
        return None
    return memory or remembered.Memory("accelerate", {}, "as rank 0 remembered", "rank 0's record")


_DECIDED = ("precision", "channels_last", "compile", "tf32", "cudnn_benchmark")


def _remember(parts: dict[str, Any], report: AccelerateResult, width: int | None) -> None:
    """Keep what the trials chose, with a figure: the choice and its measured step ('bf16 + channels_last,
    41.2 ms/step')."""
    steps = [r.step_s for r in report.candidates if r.step_s is not None and r.decision.startswith("kept")]
    chosen = [report.precision] + [n for n, on in (("channels_last", report.channels_last),
                                                   ("compile", report.compile), ("tf32", report.tf32)) if on]
    figure = " + ".join(chosen) + (f", {steps[-1] * 1e3:.1f} ms/step" if steps else "")
    decision = {name: getattr(report, name) for name in _DECIDED}
    remembered.remember("accelerate", parts, {**decision, "logits_width": width}, figure)


def _follow_memory(memory: remembered.Memory, model: nn.Module, timer: _StepTimer, options: AccelerateOptions,
                   report: AccelerateResult, dev: torch.device) -> None:
    """Take a remembered decision instead of measuring: the settings as chosen then (those given now
    are the same, the key holds them), one row per setting, the labels checked against the width of
    the logits then. Under torchrun another rank's values follow from rank 0 afterwards."""
    d, said = memory.decision, memory.describe()
    for name in _DECIDED:
        given = getattr(options, name)
        if name in d:
            setattr(report, name, d[name])
        if name in ("tf32", "cudnn_benchmark") and dev.type != "cuda":
            continue
        value = getattr(report, name)
        report.candidates.append(TrialRow(name, str(value), decision="given" if given != "auto" else said))
    _check_class_width(d.get("logits_width"), timer.targets, timer.loss_fn, timer.classes)
    model.to(memory_format=torch.channels_last if report.channels_last else torch.contiguous_format)
    apply_tf32(report.tf32)
    apply_cudnn_benchmark(report.cudnn_benchmark)
    log.info("accelerate on %s: precision=%s channels_last=%s compile=%s, %s", report.device, report.precision,
             report.channels_last, report.compile, said)


def _trial_timer(options: AccelerateOptions, dev: torch.device, example_batch: Any,
                 loss_fn: Callable[..., torch.Tensor] | None, fmt: BatchFormat,
                 classes: int | None = None) -> _StepTimer | None:
    """The timer of the trials, or None when nothing is measured; refuses what cannot be measured or run."""
    if options.measures_step and example_batch is None:
        raise ValueError("accelerate(): an 'auto' setting needs a batch to measure options on: pass the training "
                         "loader (accelerate(model, optimizer, loader)) or example_batch=(inputs, targets), or "
                         "give precision/channels_last/compile explicitly")
    if options.precision == "fp16" and dev.type != "cuda":
        raise ValueError("precision='fp16' is for CUDA GPUs (with a GradScaler); use 'bf16' or 'fp32' on the CPU")
    cuda_switches = example_batch is not None and options.measures_cuda_switches(dev)
    if not (options.measures_step or cuda_switches):
        return None
    return _StepTimer(example_batch, loss_fn, dev, options.trial_steps, fmt, classes)


def _choose_step_settings(model: nn.Module, timer: _StepTimer | None, options: AccelerateOptions,
                          report: AccelerateResult, dev: torch.device, untried: dict[str, str],
                          say: Callable[[str], Any]) -> nn.Module | None:
    """Precision and memory format, then the CUDA switches, then compile (timed under the switches
    chosen); fills `report`, saying each trial's figure as it is known. Returns the compiled model
    when the compile trial kept it."""
    rows = report.candidates
    report.precision, report.channels_last, base_step = _choose_precision_and_layout(
        model, timer, options.precision, options.channels_last, dev, options.margin, rows)
    _say_rows(rows, 0, say)
    model.to(memory_format=torch.channels_last if report.channels_last else torch.contiguous_format)
    switches = (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark)
    done = len(rows)
    _choose_cuda_flags(model, timer, options.tf32, options.cudnn_benchmark, report, dev, options.margin)
    _say_rows(rows, done, say)
    if switches != (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark):
        base_step = None  # measured under other switches: compile's baseline is timed again
    done = len(rows)
    compiled = _choose_compile(model, timer, options.compile, report, base_step, options.expected_steps,
                               options.margin, options.min_compile_cost_s, untried)
    _say_rows(rows, done, say)
    return compiled


def _say_rows(rows: list[TrialRow], start: int, say: Callable[[str], Any]) -> None:
    """progress=: one line per trial measured since `start` ('accelerate: precision+channels_last
    bf16+NHWC 41.2 ms/step [kept]')."""
    for r in rows[start:]:
        if r.step_s is not None:
            one_off = f" + {r.one_off_s:.1f} s one-off" if r.one_off_s else ""
            say(f"accelerate: {r.setting} {r.value} {r.step_s * 1e3:.1f} ms/step{one_off} [{r.decision}]")


def forget_prepared(model: nn.Module) -> None:
    """Stop treating `model` as one accelerate() returned, and under fp16 let its optimizer step plainly
    again (the refusing hook removed; `Accelerated.step` puts it back while that preparation steps).
    The Trainer calls it on its own preparation, so a later Trainer given the same model prepares it
    afresh with its own settings."""
    rec = _PREPARED.pop(model, None)
    if rec is not None and rec.scaler is not None and rec.optimizer is not None:
        release_step_guard(rec.optimizer())
