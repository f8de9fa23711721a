"""The memory planner: the largest micro-batch whose training step fits a memory budget, and the gradient
accumulation that keeps the effective batch the user asked for, predicted from a few measured probe steps
instead of found by running out of memory.

For fixed shapes a step's peak grows linearly with the micro-batch: peak(b) = fixed + per_sample x b, the
fixed part being the weights, gradients and optimizer state, the rest activations and the batch. Two probe
steps (forward, loss, backward, optimizer step, as the loop runs them: `step_call`) at small slices of the
example batch give the line; the third runs at the micro-batch chosen (the example tiled where it is larger)
and checks it: a peak more than `LINEAR_TOLERANCE` off the line means memory does not grow linearly (shapes
that change with the batch), said in one line, and the plan then takes the steepest line through the three (as
it does where the peak measured is over the budget less its margin). The micro-batch is the largest divisor of
the effective batch whose predicted peak is under the budget less its margin, so micro_batch x accumulation is
exactly the effective batch. Each peak is read from the allocator (`torchspeed.memory`: CUDA's, or the CPU's
through the profiler), and every probe is undone (`trial_state_kept`).

Where even one sample does not fit, or where the model repeats blocks and the plain plan needs accumulation,
blocks are checkpointed (`checkpointing`): the two probes also count the bytes each block saves for backward
(`SavedByBlock`), which gives what checkpointing the first k blocks frees, a line in the micro-batch like the
peak's, without a probe of its own. The configurations predicted to fit (a larger micro-batch with k blocks
checkpointed, a smaller one with more accumulation) are then run: each one's first step, the warm-up its
timing needs anyway, is measured, those whose peak is under the budget less its margin are timed per sample,
and the fastest is kept; a configuration measured over it is left out (the peak can move where the count does
not see it: into the backward, where weight gradients pile up). Wherever a prediction missed, the choice made
again is run too, and a smaller micro-batch while it is over (`_checked`, at most CHECKS steps): the
configuration kept always had its own step measured. The plan is remembered like the other measured decisions
(`remembered.recall_or_measure`). Where nothing fits on one process, sharding (FSDP) is named with its
predicted share; under torchrun, where nothing fits any rank, a sharded copy is probed and timed. Under
torchrun every rank plans and all take the smallest micro-batch.

One concept: a step's memory predicted and the batch planned from it; it stays whole because the probes,
the line, the checkpointing and sharding alternatives and the ranks' agreement are one chain of decisions.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchspeed import measure, ranks, remembered
from torchspeed.args import byte_size, progress_fn
from torchspeed.batches import BatchFormat, batch_size, map_tensors, to_device
from torchspeed.memory import MemoryWatch, device_capacity, format_bytes, held_bytes
from torchspeed.runtime import FLOAT_PRECISIONS, resolve_device
from torchspeed.train.checkpointing import SavedByBlock, blocks_checkpointed, repeated_blocks
from torchspeed.train.mixed_precision import autocast_for
from torchspeed.train.step_call import StepCall
from torchspeed.train.step_timer import trial_state_kept
from torchspeed.train.strategy import fsdp_wrap

__all__ = ["plan_batch", "MemoryPlanResult", "ProbeRow", "PlanRow", "LINEAR_TOLERANCE", "oom_message",
           "is_out_of_memory", "slice_batch"]

log = logging.getLogger(__name__)

class NothingFits(ValueError):
    """No micro-batch fits the budget on this process (even with every repeated block checkpointed)."""


PLANNER = 2  # in the remembered plan's key: plans of an earlier planner (checkpointed rows never measured) are made again
LINEAR_TOLERANCE = 0.10  # the third probe's peak this far off the line: memory does not grow linearly


@dataclass
class ProbeRow:
    """One probe step: its micro-batch, the blocks checkpointed, its measured peak (None: out of memory)."""

    micro_batch: int
    peak_bytes: int | None
    checkpointed: int = 0
    predicted_bytes: int | None = None  # what the line of the probes before it predicted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PlanRow:
    """A configuration predicted to fit the budget: micro-batch, accumulation, blocks checkpointed, predicted
    peak; where configurations were weighed, its own step's measured peak and seconds per sample, and
    whether it was kept."""

    micro_batch: int
    accumulation: int
    checkpointed: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None = None  # its own step's, where it was timed
    sample_s: float | None = None
    decision: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MemoryPlanResult:
    """The plan: `micro_batch` x `accumulation` == `effective_batch`, `checkpointed` blocks, the predicted
    peak under `budget_bytes` less `margin`; the probes measured, what they were read from (`source`), and
    the configurations timed (`table`)."""

    micro_batch: int
    accumulation: int
    effective_batch: int
    predicted_peak_bytes: int
    budget_bytes: int
    margin: float
    device: str
    source: str
    fixed_bytes: int
    per_sample_bytes: int
    linear: bool = True
    checkpointed: int = 0
    checkpointed_names: list[str] = field(default_factory=list)
    probes: list[ProbeRow] = field(default_factory=list)
    table: list[PlanRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    remembered: str | None = None

    @property
    def measured(self) -> str:
        """What was measured: '3 probe steps (micro-batches 8, 16, 32) read from the cpu allocator (profiler)'."""
        if not self.probes:
            return f"nothing now: {self.remembered}"
        sizes = ", ".join(str(p.micro_batch) + (f" with {p.checkpointed} blocks checkpointed" if p.checkpointed else "")
                          for p in self.probes)
        checked = sum(r.measured_peak_bytes is not None or r.decision.endswith("out of memory") for r in self.table)
        return (f"{len(self.probes)} probe steps (micro-batches {sizes}) read from the {self.source}"
                + (f"; {checked} configurations measured in the warm-up step of their timing" if checked else ""))

    def micro_batches(self, batch: Any) -> Iterator[Any]:
        """The micro-batches of one effective batch, in order (each `micro_batch` samples): for a loop that
        accumulates `accumulation` of them per optimizer step."""
        n = batch_size(_first_tensor_part(batch))
        for start in range(0, n, self.micro_batch):
            yield slice_batch(batch, self.micro_batch, start=start, copy=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["measured"] = self.measured
        return d

    def describe(self) -> str:
        """'micro-batch 16 x 4 accumulation = 64, predicted peak 1.20 GiB of a 2.00 GiB budget'."""
        blocks = f", {self.checkpointed} blocks checkpointed" if self.checkpointed else ""
        return (f"micro-batch {self.micro_batch} x {self.accumulation} accumulation = {self.effective_batch}{blocks}, "
                f"predicted peak {format_bytes(self.predicted_peak_bytes)} of a {format_bytes(self.budget_bytes)} "
                f"budget ({self.margin:.0%} margin)")

    def __str__(self) -> str:
        lines = [f"memory plan on {self.device}: {self.describe()}", f"  measured: {self.measured}",
                 f"  line: {format_bytes(self.fixed_bytes)} + {format_bytes(self.per_sample_bytes)} per sample"]
        lines += [f"  probe {p.micro_batch:5d} ({p.checkpointed} checkpointed): measured {format_bytes(p.peak_bytes)}"
                  + (f", predicted {format_bytes(p.predicted_bytes)}" if p.predicted_bytes else "") for p in self.probes]
        lines += [f"  config {r.micro_batch} x {r.accumulation} ({r.checkpointed} checkpointed): predicted "
                  f"{format_bytes(r.predicted_peak_bytes)}"
                  + (f", measured {format_bytes(r.measured_peak_bytes)}" if r.measured_peak_bytes is not None else "")
                  + (f", {r.sample_s * 1e3:.2f} ms/sample" if r.sample_s is not None else "") + f": {r.decision}"
                  for r in self.table]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _first_tensor_part(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (int, float)) else batch


def slice_batch(batch: Any, size: int, *, start: int = 0, copy: bool = True) -> Any:
    """Samples start..start+size of every batch-sized tensor in `batch` (tensors, (x, y), dicts of tensors),
    the batch repeated where `size` goes past it; `copy`: each part its own storage, as a loader's batch of
    that size would hold (a view would keep the whole example alive)."""
    n = batch_size(_first_tensor_part(batch))

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != n:
            return t
        if start + size > n:
            reps = math.ceil((start + size) / n)
            t = t.repeat(reps, *([1] * (t.dim() - 1)))
        part = t[start:start + size]
        return part.clone() if copy else part

    return map_tensors(cut, batch)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed: torch.OutOfMemoryError (CUDA's allocator, and the CPU's in
    recent torch), or the RuntimeError torch's CPU allocator raises where the system refuses the memory."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def oom_message(phase: str, plan: MemoryPlanResult | None, error: BaseException | None = None) -> str:
    """The line an out-of-memory error during training is reported with: the phase it happened in and what
    the planner suggests (its plan when there is one, else how to get one)."""
    what = f"out of memory during the {phase}"
    if plan is not None:
        return (f"{what}: the memory plan predicted {format_bytes(plan.predicted_peak_bytes)} at micro-batch "
                f"{plan.micro_batch} (budget {format_bytes(plan.budget_bytes)}); something else holds memory on "
                f"{plan.device}, or the shapes grew (see the plan's notes): plan again with a smaller budget, e.g. "
                f"{format_bytes(int(plan.budget_bytes * 0.8))} (memory_budget=, --memory-budget)")
    return (f"{what}: give the training a memory budget (accelerate(..., memory_budget='8GiB'), torchspeed train "
            "--memory-budget 8GiB) so the micro-batch and the gradient accumulation are planned to fit"
            + (f" ({type(error).__name__})" if error is not None else ""))


# ---------------------------------------------------------------- probing
class _Prober:
    """Probe steps of the user's model on slices of the example batch, each peak read by `MemoryWatch`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Any, fmt: BatchFormat,
                 loss_fn: Callable[..., torch.Tensor] | None, device: torch.device, precision: str):
        self.model, self.optimizer, self.batch, self.fmt = model, optimizer, batch, fmt
        self.device, self.precision = device, precision
        self.call = StepCall.of(model, batch, fmt, loss_fn)
        self.rows: list[ProbeRow] = []
        self.saved: dict[int, SavedByBlock] = {}  # micro-batch -> what its probe counted for checkpointing
        self.checked: dict[tuple[int, int], dict[str, int] | None] = {}  # (micro-batch, blocks) -> phases measured
        self.source = ""

    def step(self, micro: int) -> Callable[[], None]:
        """One training step on a `micro`-sample slice (already on the device)."""
        x, y = self.fmt.split(to_device(slice_batch(self.batch, micro), self.device))
        call, model, opt = self.call, self.model, self.optimizer

        def run(watch: MemoryWatch | None = None) -> None:
            with _phase(watch, "forward and backward"):
                with autocast_for(self.device, self.precision):
                    out = call.forward(model, x, y)
                    loss = call.loss(out, x, y)
                loss.backward()
                del out, loss
            with _phase(watch, "optimizer step"):
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                for p in model.parameters():
                    p.grad = None
        run.inputs = (x, y)  # type: ignore[attr-defined]
        return run

    def probe(self, micro: int, checkpointed: int = 0, predicted: float | None = None,
              count: Sequence[str] = (), record: bool = True) -> dict[str, int] | None:
        """The measured peak of each phase of one step at `micro` with the first `checkpointed` blocks
        checkpointed (the step's peak is the highest of them), the bytes each of the blocks `count` saves for
        backward counted in it (`self.saved[micro]`); None when it ran out of memory (the planner never asks
        for more than it predicts to fit). `record`: a probe step of the plan (`rows`), not a check of a
        configuration's own step."""
        phases: dict[str, int] | None
        if self.device.type == "cuda":  # the allocator's peak counts all the process holds: garbage (an earlier
            gc.collect()                # model's cycles) freed between two probes would tilt the line
        state = self._state_bytes()
        try:
            with blocks_checkpointed(self.model, checkpointed):
                run = self.step(micro)
                watch = MemoryWatch(self.device, held=(self.model, self.optimizer, run.inputs))
                counting = SavedByBlock(self.model, count, held=run.inputs) if count else contextlib.nullcontext()
                with watch, counting:
                    run(watch)
                del run
            if count:
                self.saved[micro] = counting
            assert watch.reading is not None
            phases, self.source = dict(watch.reading.phases), watch.reading.source
            # the optimizer's state made by this first step is held through every later step's forward and
            # backward: counted there as it will be
            phases[_FB] += max(0, self._state_bytes() - state)
            phases["step"] = max(watch.reading.peak_bytes, *phases.values())
        except torch.OutOfMemoryError:
            phases = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.checked[(micro, checkpointed)] = phases
        if record:
            self.rows.append(ProbeRow(micro, None if phases is None else phases["step"], checkpointed,
                                      None if predicted is None else int(predicted)))
        return phases

    def _state_bytes(self) -> int:
        return 0 if self.optimizer is None else held_bytes(list(self.optimizer.state.values()), device=self.device)


def _phase(watch: MemoryWatch | None, name: str) -> Any:
    return contextlib.nullcontext() if watch is None else watch.phase(name)


@dataclass(frozen=True)
class _Line:
    fixed: float
    per_sample: float

    @classmethod
    def through(cls, a: tuple[int, int], b: tuple[int, int]) -> _Line:
        slope = (b[1] - a[1]) / (b[0] - a[0])
        return cls(a[1] - slope * a[0], slope)

    def at(self, micro: float) -> float:
        return self.fixed + self.per_sample * micro


def _divisors(n: int) -> list[int]:
    return sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)})


def _largest_fit(predict: Callable[[int], float], usable: float, effective: int) -> int | None:
    """The largest divisor of `effective` whose predicted peak is under `usable`, or None."""
    fits = [d for d in _divisors(effective) if predict(d) <= usable]
    return max(fits) if fits else None


def _first_failed_rank(failed_here: bool) -> int | None:
    """Under torchrun, the lowest rank whose plan failed (None: every rank planned), agreed by all ranks."""
    if not ranks.active():
        return None
    world = dist.get_world_size()
    t = torch.tensor([dist.get_rank() if failed_here else world], dtype=torch.int64, device=ranks.comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item()) if int(t.item()) < world else None


def _every_rank(flag: bool) -> bool:
    """Under torchrun, whether `flag` holds on every rank (False without a process group)."""
    if not ranks.active():
        return False
    t = torch.tensor([int(flag)], dtype=torch.int64, device=ranks.comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _sharded_fit(model: nn.Module, optimizer: torch.optim.Optimizer | None, example_batch: Any, fmt: BatchFormat,
                 n: int, effective: int, loss_fn: Callable[..., torch.Tensor] | None, dev: torch.device,
                 precision: str, usable: float, say: Callable[[str], Any]) -> str:
    """Where no rank fits one sample alone: the model sharded over the ranks (FSDP2, a copy; the caller's
    model is left alone) probed as the plan probes, the largest micro-batch every rank fits, and its step
    timed: one line saying what fits at what measured speed, or that sharding does not fit either.
    Every rank runs the same probes and steps (their collectives must match)."""
    world = dist.get_world_size()
    say(f"memory plan: nothing fits one rank; probing the model sharded over {world} ranks (FSDP)")
    shard = fsdp_wrap(copy.deepcopy(model), precision)
    opt = None if optimizer is None else _same_kind(optimizer, shard.parameters())
    with trial_state_kept(shard, opt):
        prober = _Prober(shard, opt, example_batch, fmt, loss_fn, dev, precision)
        b1, b2 = max(1, n // 4), max(2, n // 2)  # as the plan's own probes
        b1 = min(b1, b2 - 1)
        p1, p2 = prober.probe(b1), prober.probe(b2)
        if p1 is None or p2 is None:
            return f"sharded over {world} ranks (FSDP) {b1 if p1 is None else b2} samples ran out of memory too"
        fit = _lines(b1, p1, b2, p2)

        def predict(micro: int) -> float:
            return max(ln.at(micro) for phase, ln in fit.items() if phase != "step")

        micro = _agree_smallest(_largest_fit(predict, usable, effective) or 0)
        if micro < 1:
            return (f"sharded over {world} ranks (FSDP) one sample needs {format_bytes(predict(1))} a rank "
                    f"(measured, {prober.source}): more than the budget too")
        c = measure.compare({"fsdp": prober.step(micro)}, warmup=1, repeats=3, device=dev)
    per_sample = c["fsdp"].median_s / micro
    return (f"sharded over {world} ranks (FSDP, strategy='fsdp') micro-batch {micro} fits: "
            f"{format_bytes(predict(micro))} a rank predicted from probes at {b1} and {b2} samples ({prober.source}), "
            f"{per_sample * 1e3:.1f} ms a sample measured")


def _same_kind(optimizer: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class and settings over `params` (the settings its constructor takes)."""
    takes = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(params, **{k: v for k, v in optimizer.defaults.items() if k in takes})


def _agree_smallest(micro: int) -> int:
    """Under torchrun, the smallest micro-batch any rank planned (every rank's is a divisor of the effective
    batch, so the smallest is too)."""
    if not ranks.active():
        return micro
    t = torch.tensor([micro], dtype=torch.int64, device=ranks.comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# ---------------------------------------------------------------- the plan
def plan_batch(model: nn.Module, optimizer: torch.optim.Optimizer | None, example_batch: Any, *,
               budget: int | str, effective_batch: int | None = None, margin: float = 0.1,
               loss_fn: Callable[..., torch.Tensor] | None = None, batch_format: BatchFormat | dict | None = None,
               device: str | torch.device = "auto", precision: str = "fp32", checkpointing: bool | str = "auto",
               refresh: bool = False, progress: bool | Callable[[str], Any] = False) -> MemoryPlanResult:
    """The micro-batch and gradient accumulation whose training step fits `budget` (bytes, or "8GiB",
    "500MB") less `margin` with `micro_batch * accumulation == effective_batch` exactly (default: the
    example batch's size; per process under torchrun), predicted from at most 3 probe steps of the loop's
    own step on slices of `example_batch` (see the module docstring); the model, optimizer and RNG are left
    as found. `checkpointing`: "auto" (blocks checkpointed where one sample does not fit, and timed
    against accumulation where the model repeats blocks), True (always considered), False (never).
    `precision`: the autocast the step runs at (fp32 plans the most memory). `progress`: a line per probe.

        plan = ts.train.plan_batch(model, optimizer, batch, budget="8GiB", effective_batch=256)
        loader = DataLoader(ds, batch_size=plan.micro_batch)   # Trainer(..., grad_accum_steps=plan.accumulation)

    A budget over the device's memory, a budget nothing fits in (with every block checkpointed; FSDP is
    named where ranks could share the fixed part), an example batch of one sample, a bad effective
    batch: one ValueError each. Memory that does not grow linearly with the batch: one WARNING line and
    `linear` False (the plan then follows the steepest line measured)."""
    say = progress_fn(progress)
    budget_bytes = byte_size(budget, "memory budget")
    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ValueError(f"margin = {margin!r}: a fraction of the budget kept free, 0 <= margin < 1 (e.g. 0.1)")
    if precision not in FLOAT_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(FLOAT_PRECISIONS)}, got {precision!r}")
    if checkpointing not in ("auto", True, False):
        raise ValueError(f"checkpointing must be 'auto', True or False, got {checkpointing!r}")
    dev = resolve_device(device)
    fmt = BatchFormat.of(batch_format)
    n = batch_size(fmt.split(example_batch)[0])
    effective = n if effective_batch is None else effective_batch

    def here() -> tuple[MemoryPlanResult, Any]:
        """This rank's plan (what it checks and measures may differ from another rank's)."""
        capacity, called = device_capacity(dev)
        if capacity is not None and budget_bytes > capacity:
            raise ValueError(f"memory budget {format_bytes(budget_bytes)} is more than this {dev.type}'s {called} "
                             f"({format_bytes(capacity)}): give at most {format_bytes(capacity)}")
        if not (type(effective) is int and effective >= 1):
            raise ValueError(f"effective_batch = {effective_batch!r}: the samples of one optimizer step, a positive int")
        if n < 2:
            raise ValueError("the example batch has 1 sample: the planner needs at least 2 to see how memory grows "
                             "with the batch; give a batch of the loader's size")
        on = {p.device.type for p in model.parameters()}
        if on and on != {dev.type}:
            raise ValueError(f"the model is on {', '.join(sorted(on))} and the plan is for {dev}: move it first "
                             f"(model.to({str(dev)!r}))")
        usable = budget_bytes * (1 - margin)
        parts = {"model": remembered.model_fingerprint(model), "batch": remembered.shapes_of(example_batch),
                 "optimizer": None if optimizer is None else type(optimizer).__qualname__, "budget": budget_bytes,
                 "margin": margin, "effective_batch": effective, "precision": precision, "device": dev.type,
                 "checkpointing": str(checkpointing), "world_size": ranks.env().world_size, "planner": PLANNER}

        def measure_plan() -> MemoryPlanResult:
            with trial_state_kept(model, optimizer):
                prober = _Prober(model, optimizer, example_batch, fmt, loss_fn, dev, precision)
                return _plan(prober, n, effective, budget_bytes, usable, margin, checkpointing, say)

        plan, memory = remembered.recall_or_measure(
            "memory_plan", parts, measure_plan, decode=_decode, encode=lambda p: (p.to_dict(), p.describe()),
            refresh=refresh, what=f"memory plan on {dev}", logger=log)
        return plan, memory

    failure: ValueError | None = None
    try:
        plan, memory = here()
    except ValueError as e:  # nothing fits here: every rank must hear it, or the others wait in the agreement
        failure = e
    failed = _first_failed_rank(failure is not None)
    if _every_rank(isinstance(failure, NothingFits)) and dist.get_world_size() > 1:
        sharded = _sharded_fit(model, optimizer, example_batch, fmt, n, effective, loss_fn, dev, precision,
                               budget_bytes * (1 - margin), say)
        raise NothingFits(f"{failure}; measured instead: {sharded}") from None
    if failure is not None:
        raise failure
    if failed is not None:
        raise ValueError(f"rank {failed} could not plan a micro-batch (its own error says why: e.g. a budget that "
                         "fits nothing there), so no rank trains on a plan: fix that rank's budget or batch")
    if memory is not None:
        plan.remembered = memory.describe()
        say(f"memory plan: {memory.describe()}")
    agreed = _agree_smallest(plan.micro_batch)
    if agreed != plan.micro_batch:
        plan.notes.append(f"another rank fits only {agreed} samples: every rank takes micro-batch {agreed}")
        plan.micro_batch, plan.accumulation = agreed, effective // agreed
        plan.predicted_peak_bytes = int(plan.fixed_bytes + plan.per_sample_bytes * agreed)
    log.info("memory plan on %s: %s; measured %s", dev, plan.describe(), plan.measured)
    return plan


def _decode(memory: remembered.Memory) -> MemoryPlanResult:
    """A remembered plan, checked (one edited into nonsense is measured again)."""
    d = dict(memory.decision)
    d.pop("measured", None)
    plan = MemoryPlanResult(**{k: v for k, v in d.items() if k not in ("probes", "table")})
    plan.probes = []
    plan.table = [PlanRow(**r) for r in d.get("table", [])]
    if not (type(plan.micro_batch) is int and plan.micro_batch >= 1
            and plan.micro_batch * plan.accumulation == plan.effective_batch):
        raise ValueError("micro_batch x accumulation is not the effective batch")
    return plan


_FB = "forward and backward"  # the phase whose memory grows with the batch (activations); the optimizer step's
                              # holds the weights, gradients and state: a step's peak is the higher of the two


def _lines(b1: int, p1: dict[str, int], b2: int, p2: dict[str, int]) -> dict[str, _Line]:
    return {phase: _Line.through((b1, p1[phase]), (b2, p2[phase])) for phase in p1 if phase in p2}


def _plan(prober: _Prober, n: int, effective: int, budget: int, usable: float, margin: float,
          checkpointing: bool | str, say: Callable[[str], Any]) -> MemoryPlanResult:
    """Probe, fit a line per phase (a step's peak is the highest phase's), choose, check the choice (see the
    module docstring)."""
    b1, b2 = max(1, n // 4), max(2, n // 2)
    if b2 <= b1:
        b1 = b2 - 1
    blocks = repeated_blocks(prober.model)
    count = blocks if checkpointing is not False else []
    p1 = prober.probe(b1, count=count)
    p2 = prober.probe(b2, count=count) if p1 is not None else None
    if p1 is None or p2 is None:
        raise ValueError(f"the training step ran out of memory at micro-batch {b1 if p1 is None else b2} before any "
                         "plan: give a smaller example batch (the planner probes a quarter and half of it)")
    fits = [_lines(b1, p1, b2, p2)]
    freed = {k: _Line.through((b1, prober.saved[b1].freed(k)), (b2, prober.saved[b2].freed(k)))
             for k in range(1, len(count) + 1)}  # bytes checkpointing k blocks frees: a line in the micro-batch

    def predict(micro: int, checkpointed: int = 0) -> float:
        off = freed[checkpointed].at(micro) if checkpointed else 0.0
        return max(ln.at(micro) - (off if phase == _FB else 0.0)
                   for fit in fits for phase, ln in fit.items() if phase != "step")

    say(f"memory plan: probes {b1} -> {format_bytes(p1['step'])}, {b2} -> {format_bytes(p2['step'])} "
        f"({prober.source}); {format_bytes(fits[0][_FB].per_sample)} per sample")
    micro = _largest_fit(predict, usable, effective)
    binding = max(fits[0].items(), key=lambda kv: -1.0 if kv[0] == "step" else kv[1].at(micro or 1))[1]
    plan = MemoryPlanResult(micro_batch=micro or 1, accumulation=effective // (micro or 1), effective_batch=effective,
                            predicted_peak_bytes=int(predict(micro or 1)), budget_bytes=budget, margin=margin,
                            device=str(prober.device), source=prober.source, fixed_bytes=int(binding.fixed),
                            per_sample_bytes=int(round(binding.per_sample)))
    chosen: PlanRow | None = None
    if count and (micro is None or checkpointing is True or plan.accumulation > 1):
        say(f"memory plan: every block checkpointed frees {format_bytes(freed[len(count)].per_sample)} per sample "
            "(counted in the probes)")
        plan.table = _configs(predict, usable, effective, len(count))
        if len(plan.table) > 1 or any(r.checkpointed for r in plan.table):  # weighed, or its speed said
            chosen = _measure_configs(prober, plan.table, usable)
            if chosen is None and plan.table:
                plan.notes.append("no configuration predicted to fit measured under the budget: "
                                  + "; ".join(f"{r.micro_batch} x {r.accumulation} ({r.checkpointed} checkpointed) "
                                              f"{_measured(r)}" for r in plan.table))
    if chosen is None:
        third = _third_probe(micro, b1, b2, predict, usable)
        if third is not None and third not in (b1, b2):
            expected = predict(third)
            seen = (third, 0) in prober.checked  # its step was measured as a configuration: not run again
            p3 = prober.checked[(third, 0)] if seen else prober.probe(third, predicted=expected)
            linear = p3 is not None and abs(p3["step"] - expected) <= LINEAR_TOLERANCE * expected
            if not linear or p3["step"] > usable:
                plan.notes.append(_corrected(p3, expected, third, usable, fits, b1, p1, b2, p2, linear))
                plan.linear = plan.linear and linear
                log.warning("memory plan: %s", plan.notes[-1])
        micro, k = _largest_fit(predict, usable, effective), 0
        if micro is None and plan.table:  # the plain line fits nothing: the most blocks checkpointed, smaller
            k = max(r.checkpointed for r in plan.table)
            micro = _largest_fit(lambda d: predict(d, k), usable, effective)
        if micro is not None:
            micro = _checked(prober, micro, k, usable, effective, plan.notes)
            if micro is None:
                plan.probes = prober.rows
                raise NothingFits(f"memory budget {format_bytes(budget)} (less its {margin:.0%} margin): no "
                                  f"micro-batch measured under it ({'; '.join(plan.notes)}); give a larger budget")
        for r in plan.table:
            r.decision = "kept" if (r.micro_batch, r.checkpointed) == (micro, k) else r.decision or "over the budget"
    else:
        micro, k = chosen.micro_batch, chosen.checkpointed
    plan.probes = prober.rows
    if micro is None:
        raise NothingFits(_nothing_fits(plan, prober, blocks, checkpointing))
    plan.micro_batch, plan.accumulation, plan.checkpointed = micro, effective // micro, k
    measured = prober.checked.get((micro, k))  # where its step ran, the plan says no less than it measured
    plan.predicted_peak_bytes = max(int(predict(micro, k)), measured["step"] if measured else 0)
    plan.checkpointed_names = blocks[:k]
    if k:
        speed = f", {chosen.sample_s * 1e3:.2f} ms a sample measured" if chosen and chosen.sample_s else ""
        plain = "" if any(r.checkpointed == 0 for r in plan.table) else " (without, not even one sample fits)"
        plan.notes.append(f"{k} of {len(blocks)} blocks checkpointed (checkpoint_blocks(model, {k})): micro-batch "
                          f"{micro} x {plan.accumulation}{speed}{plain}")
    elif micro < effective:
        plan.notes.append(f"micro-batch {micro} divides the effective batch {effective} "
                          f"({plan.accumulation} accumulation steps)")
    return plan


def _corrected(p3: dict[str, int] | None, expected: float, third: int, usable: float,
               fits: list[dict[str, _Line]], b1: int, p1: dict[str, int], b2: int, p2: dict[str, int],
               linear: bool) -> str:
    """The third probe measured what the first two did not predict, or more than the budget allows: the
    plan follows the steepest line through the three probes from now on (`fits` grows in place); the line
    that says so. `linear`: the third probe was on the line, only over the budget."""
    measured = "out of memory" if p3 is None else format_bytes(p3["step"])
    if p3 is None:
        fits.append({_FB: _Line(0.0, usable / third)})  # `third` does not fit: nothing at or above it does
    else:
        fits += [_lines(b1, p1, third, p3), _lines(b2, p2, third, p3)]
    if linear:
        return (f"micro-batch {third} measured {measured}, predicted {format_bytes(expected)}: over the budget less "
                "its margin, so the plan follows the steepest line through the three probes")
    return (f"memory does not grow linearly with the batch (shapes that change with it?): the probes predicted "
            f"{format_bytes(expected)} at micro-batch {third}, it measured {measured}; the plan follows the steepest "
            "line through the three probes")


def _third_probe(micro: int | None, b1: int, b2: int, predict: Callable[[int], float], usable: float) -> int | None:
    """Where the third probe checks the line: at the micro-batch chosen, else at the largest size predicted to
    fit above the two probes, else between them; None where no other size fits."""
    if micro is not None and micro not in (b1, b2):
        return micro
    lo, hi = b2, b2 + 1  # the largest size predicted to fit: the line checked where the budget binds
    while predict(hi) <= usable and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if predict(mid) <= usable else (lo, mid)
    if lo > b2:
        return lo
    middle = (b1 + b2) // 2
    return middle if middle not in (b1, b2) and predict(middle) <= usable else None


def _nothing_fits(plan: MemoryPlanResult, prober: _Prober, blocks: list[str], checkpointing: bool | str) -> str:
    """The one line for a budget nothing fits in, naming what was tried and what is left (FSDP)."""
    one = plan.fixed_bytes + plan.per_sample_bytes
    tried = (" (no repeated blocks to checkpoint)" if not blocks
             else f" (checkpointing=False: its {len(blocks)} repeated blocks were not checkpointed)"
             if checkpointing is False else f" with all {len(blocks)} repeated blocks checkpointed")
    state = held_bytes(prober.model, prober.optimizer, device=prober.device)
    world = ranks.env().world_size
    shard = ("sharding (strategy='fsdp') splits the weights, gradients and optimizer state "
             f"({format_bytes(state)}) over the ranks: launch it with torchrun --nproc_per_node N (more than 1)"
             if world < 2 else f"sharding (strategy='fsdp') over the {world} ranks would hold about "
             f"{format_bytes(one - state * (1 - 1 / world))} a rank (predicted, not measured)")
    return (f"memory budget {format_bytes(plan.budget_bytes)} (less its {plan.margin:.0%} margin) is too small for "
            f"even one sample{tried}: one sample needs about {format_bytes(one)} ({plan.source}); give a larger "
            f"budget, or {shard}")


def _configs(predict: Callable[..., float], usable: float, effective: int, blocks: int) -> list[PlanRow]:
    """The configurations that fit: for each count of blocks checkpointed, the largest micro-batch dividing the
    effective batch predicted under `usable` (a count that fits no larger micro-batch than a smaller count
    is left out)."""
    configs: dict[int, int] = {}  # micro-batch -> fewest blocks checkpointed for it
    for k in range(blocks + 1):
        micro = _largest_fit(lambda d, k=k: predict(d, k), usable, effective)
        if micro is not None and micro not in configs:
            configs[micro] = k
    return [PlanRow(m, effective // m, k, int(predict(m, k))) for m, k in sorted(configs.items())]


CHECKS = 3  # steps run to find a micro-batch under the budget where a prediction missed


def _checked(prober: _Prober, micro: int, k: int, usable: float, effective: int, notes: list[str]) -> int | None:
    """`micro` with `k` blocks checkpointed, its step measured where none was (a choice made after a miss);
    while over `usable`, a smaller divisor of `effective` (the largest the line through the last two steps
    measured predicts under it, else the next smaller), at most CHECKS steps in all: the first measured
    under it, or None. A line in `notes` for each step run here."""
    points: list[tuple[int, int]] = []
    d: int | None = micro
    for _ in range(CHECKS):
        assert d is not None
        known = (d, k) in prober.checked
        phases = prober.checked[(d, k)] if known else prober.probe(d, k, record=False)
        peak = None if phases is None else phases["step"]
        if not known:
            notes.append(f"micro-batch {d}{f' with {k} blocks checkpointed' if k else ''} run to check: "
                         + ("out of memory" if peak is None else f"measured {format_bytes(peak)}"))
        if peak is not None and peak <= usable:
            return d
        smaller = [x for x in _divisors(effective) if x < d]
        if not smaller:
            return None
        if peak is not None:
            points.append((d, peak))
        line = _Line.through(points[-2], points[-1]) if len(points) >= 2 else None
        fit = [x for x in smaller if line is not None and line.at(x) <= usable]
        d = max(fit) if fit else (min(smaller) if line is not None else max(smaller))
    return None


def _measured(row: PlanRow) -> str:
    return ("out of memory in its first step" if row.measured_peak_bytes is None
            else f"measured {format_bytes(row.measured_peak_bytes)}")


def _measure_configs(prober: _Prober, rows: list[PlanRow], usable: float) -> PlanRow | None:
    """Each configuration's own step measured (its peak read in its first, warm-up step), those under `usable`
    timed per sample, interleaved (`measure.compare`): the fastest of them, or None where none fits as
    measured. Each row's decision says why it was kept or not."""
    for r in rows:
        phases = prober.probe(r.micro_batch, r.checkpointed, record=False)
        r.measured_peak_bytes = None if phases is None else phases["step"]
    fitting = [r for r in rows if r.measured_peak_bytes is not None and r.measured_peak_bytes <= usable]
    steps: dict[str, Callable[[], None]] = {}
    for r in fitting:
        run = prober.step(r.micro_batch)

        def checkpointed_step(run: Callable[[], None] = run, k: int = r.checkpointed) -> None:
            with blocks_checkpointed(prober.model, k):
                run()
        steps[f"{r.micro_batch}x{r.accumulation}/{r.checkpointed}"] = checkpointed_step
    if steps:
        c = measure.compare(steps, warmup=0, repeats=3, device=prober.device)
        for r, name in zip(fitting, steps):
            r.sample_s = c[name].median_s / r.micro_batch
    best = min(fitting, key=lambda r: r.sample_s or math.inf, default=None)
    for r in rows:
        r.decision = ("kept" if r is best else "slower per sample" if r in fitting
                      else f"over the budget: {_measured(r)}")
    return best
