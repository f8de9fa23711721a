"""Real training steps timed on one batch (`StepTimer`: the user's own step as `step_call.StepCall` reads
it, the forward with the arguments the loop passes and the loss it backpropagates; its `preflight` makes a
batch the model or loss cannot take, or too few class logits, one clear ValueError before any trial), and
the model, optimizer, GradScaler and every RNG put back after such trials (`trial_state_kept`: accelerate's
trials and the loader's counts chosen with the step alike)."""
from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from torchspeed import measure
from torchspeed.batches import BatchFormat, to_device
from torchspeed.runtime import rng_state, set_rng_state, synchronize
from torchspeed.train.mixed_precision import autocast_for
from torchspeed.train.step_call import StepCall, default_loss, loss_of

__all__ = ["StepTimer", "check_class_outputs", "check_class_width", "default_loss", "loss_of", "trial_state_kept"]


def _indexes_by_label(loss_fn: Any) -> bool:
    """Whether the loss picks each sample's logit by its label (cross-entropy, NLL), so a label past
    the logits' width fails inside it."""
    fn = getattr(loss_fn, "func", loss_fn)  # a functools.partial of one
    return isinstance(fn, (nn.CrossEntropyLoss, nn.NLLLoss)) or fn in (
        nn.functional.cross_entropy, nn.functional.nll_loss, default_loss)


def check_class_outputs(logits: Any, targets: Any, loss_fn: Any, classes: int | None = None) -> None:
    """Refuse class logits narrower than the labels need, before the loss indexes past them (an IndexError
    deep in torch on the CPU, a device-side assert that ends the process on CUDA), for class labels under a
    loss that indexes by them; `classes`: how many the data names. One host read: on a first batch only."""
    if isinstance(logits, torch.Tensor) and logits.dim() == 2:
        check_class_width(logits.shape[1], targets, loss_fn, classes)


def check_class_width(width: int | None, targets: Any, loss_fn: Any, classes: int | None) -> None:
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


@contextlib.contextmanager
def trial_state_kept(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                     scaler: Any = None) -> Iterator[None]:
    """Real training steps run inside (the model in train mode); afterwards the weights, buffers
    (BatchNorm statistics), optimizer state (momentum, step counts), GradScaler, every RNG and the
    train/eval mode are put back and the gradients cleared, so timing steps changes nothing. The copy is
    kept in host memory: on a GPU it would take the memory the steps inside are measured in."""
    saved = (_host_copy(model.state_dict()),
             _optimizer_copy(optimizer.state_dict()) if optimizer is not None else None,
             copy.deepcopy(scaler.state_dict()) if scaler is not None else None, rng_state(), model.training)
    model.train()
    try:
        yield
    finally:
        model.load_state_dict(saved[0])
        if optimizer is not None:
            optimizer.load_state_dict(saved[1])
            optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.load_state_dict(saved[2])
        for p in model.parameters():
            p.grad = None
        set_rng_state(saved[3])
        model.train(saved[4])


def _host_copy(state: Any) -> Any:
    """A copy of a state dict with its plain device tensors copied to host memory (load_state_dict copies
    them back); anything else (CPU tensors, a sharded DTensor, numbers) deep-copied as it is."""
    if type(state) in (torch.Tensor, nn.Parameter) and state.device.type != "cpu":
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        out = copy.copy(state)  # the same kind of dict (an OrderedDict, a defaultdict)
        for k, v in state.items():
            out[k] = _host_copy(v)
        if hasattr(state, "_metadata"):  # a module's state dict: the versions load_state_dict reads
            out._metadata = copy.deepcopy(state._metadata)
        return out
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(_host_copy(v) for v in state)
    return copy.deepcopy(state)


def _optimizer_copy(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state dict with its per-parameter state in host memory; the param groups deep-copied
    where they are (load_state_dict takes them back as saved: a tensor lr on the GPU stays there)."""
    return {k: _host_copy(v) if k == "state" else copy.deepcopy(v) for k, v in state.items()}


class StepTimer:
    """Times training steps (forward, loss, backward) of a model on one example batch, run as the user's loop
    runs them (`call`: the forward's arguments, targets included where the forward takes them, and the
    loss backpropagated), read through the batch format (inputs, target, logits) the training itself uses."""

    def __init__(self, batch: Any, loss_fn: Callable[..., torch.Tensor] | None, device: torch.device, steps: int,
                 batch_format: BatchFormat | None = None, classes: int | None = None, model: nn.Module | None = None):
        self.device, self.steps, self.classes = device, steps, classes
        self.others: list[float] = []  # cores other processes used during each timing
        self.loss_fn = loss_fn or default_loss
        self.fmt = batch_format or BatchFormat()
        try:
            self.inputs, self.targets = self.fmt.split(batch)
        except ValueError as e:
            raise ValueError(f"example_batch: {e}; give one batch from the training loader") from None
        self.call = StepCall.of(model, batch, self.fmt, loss_fn) if model is not None else StepCall(self.fmt, loss_fn)
        self.stand_in: str | None = None  # why the loss timed is a stand-in for the loop's (found by preflight)

    def step_fn(self, model: nn.Module, precision: str, channels_last: bool) -> Callable[[], None]:
        x = to_device(self.inputs, self.device, channels_last)
        y = to_device(self.targets, self.device)
        call = self.call
        checked = False

        def step() -> None:
            nonlocal checked
            with autocast_for(self.device, precision):
                out = call.forward(model, x, y)
                if not checked:  # the first call only: it reads the largest label
                    if call.uses_logits(out):
                        check_class_outputs(self.fmt.logits_of(out), y, self.loss_fn, self.classes)
                    checked = True
                loss = call.loss(out, x, y)
            loss.backward()
            for p in model.parameters():
                p.grad = None
        return step

    def loss_value(self, model: nn.Module, precision: str = "fp32") -> torch.Tensor:
        """The loss of the timed step on the example batch, without backward (what the loop's own step on
        that batch computes: numerics checks)."""
        x, y = to_device(self.inputs, self.device), to_device(self.targets, self.device)
        with torch.no_grad(), autocast_for(self.device, precision):
            return self.call.loss(self.call.forward(model, x, y), x, y)

    def preflight(self, model: nn.Module) -> int | None:
        """One forward and loss on the example batch before any trial, so that a batch the model cannot
        take, or class logits narrower than the labels, is one clear ValueError naming both sides (not
        an error inside a timed trial); a loss that is a stand-in for the loop's is noted in `stand_in`.
        Returns the logits' width (kept with the decision), or None."""
        x, y = to_device(self.inputs, self.device), to_device(self.targets, self.device)
        try:
            with torch.no_grad():
                out = self.call.forward(model, x, y)
        except Exception as e:
            given = f"inputs {_shapes(x)}" + (f" and targets {_shapes(y)}, called as {self.call.describe(loss=False)}"
                                              if self.call.targets_in else "")
            raise ValueError(f"the model cannot take the training batch ({given}): {type(e).__name__}: {e}") from e
        logits = self.fmt.logits_of(out) if self.call.uses_logits(out) else None
        if logits is not None:
            check_class_outputs(logits, y, self.loss_fn, self.classes)
        try:
            with torch.no_grad():
                loss = self.call.loss(out, x, y)
        except Exception as e:
            raise ValueError(f"loss_fn cannot take the model's outputs {_shapes(out)} and the batch's targets "
                             f"{_shapes(y)}: {type(e).__name__}: {e}") from e
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            raise ValueError(f"the training step's loss must be one float (a 0-d tensor to call backward on); "
                             f"{self.call.describe()} gives {_shapes(loss)}")
        self.stand_in = self.call.stand_in(out, y)
        return int(logits.shape[1]) if isinstance(logits, torch.Tensor) and logits.dim() == 2 else None

    def first_call(self, step: Callable[[], None]) -> float:
        """Seconds of one call of `step` (a compiled step's first call compiles it)."""
        t0 = time.perf_counter()
        step()
        synchronize(self.device)
        return time.perf_counter() - t0

    def measure(self, step: Callable[[], None]) -> tuple[float, float]:
        """(median step seconds, first-call seconds): the first call carries one-off costs."""
        first = self.first_call(step)
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
    def doubt(self) -> str | None:
        """Why the step timed may not be the loop's, with what to pass (the batch's parts, the loss), or None."""
        return self.call.doubt or self.stand_in

    @property
    def others_cores(self) -> float | None:
        """The most cores other processes used during any one timing (None where none could tell)."""
        return max(self.others, default=None)
