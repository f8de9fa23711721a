"""`profile`: time each phase of a training step on the user's own model, loader and optimizer: data
(blocked in next(loader)), copy (host-to-device), forward (model + loss), backward, optimizer (step +
zero_grad), other (the rest). On CPU ops are synchronous, so host timers measure the work; on CUDA,
events time the GPU work of each phase, the host the step's wall (one sync per step, so the loop keeps
its overlap), and the GPU's busy share tells launch overhead apart. One more step, untimed, is measured
for where its memory goes (`memory_breakdown.StepMemory`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed.batches import DICT_KEY_PAIRS, BatchFormat, batch_size, split_batch, to_device
from torchspeed.doctor.advice import Finding
from torchspeed.doctor.linting import loss_pairing
from torchspeed.doctor.loop_setup import loader_settings, machine_settings, model_settings
from torchspeed.doctor.memory_breakdown import StepMemory
from torchspeed.doctor.output import format_profile
from torchspeed.doctor.phases import PHASES, busy_time, verdict
from torchspeed.doctor.rules import loop_findings
from torchspeed.measure import PeakMemory

__all__ = ["ProfileResult", "profile"]


@dataclass
class ProfileResult:
    """The phase breakdown of `steps` measured training steps, the verdict and the ranked advice."""

    steps: int
    wall_s: float
    phases: dict[str, float]
    per_step_ms: dict[str, float]
    throughput: float | None
    peak_memory_bytes: int | None
    verdict: str
    evidence: list[str]
    settings: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)
    gpu_busy_s: float | None = None
    memory: dict[str, Any] | None = None  # where one more step's memory goes (`MemoryBreakdown.to_dict()`)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "wall_s": self.wall_s, "phases": self.phases, "per_step_ms": self.per_step_ms,
                "throughput": self.throughput, "peak_memory_bytes": self.peak_memory_bytes, "verdict": self.verdict,
                "evidence": self.evidence, "settings": self.settings, "gpu_busy_s": self.gpu_busy_s,
                "findings": [f.to_dict() for f in self.findings], "memory": self.memory}

    def __str__(self) -> str:
        return format_profile(self.to_dict())


def _split(batch: Any, fmt: BatchFormat | None = None) -> tuple[Any, Any]:
    """(inputs, targets) as `fmt` says; without one, as `torchspeed.batches.split_batch` reads them, and
    any 2-key dict in order."""
    if fmt is not None:
        x, y = fmt.split(batch)
        if y is None:
            raise ValueError("profile(): the batch has no target; name it with batch_format=BatchFormat(target=KEY)")
        return x, y
    try:
        return split_batch(batch)
    except ValueError:
        if isinstance(batch, dict) and len(batch) == 2:
            a, b = batch.values()
            return a, b
        keys = f" with keys {sorted(map(str, batch))}" if isinstance(batch, dict) else ""
        raise ValueError("profile() needs batches of (inputs, targets) (a tuple, a dict with one of the key pairs "
                         f"{', '.join('/'.join(k) for k in DICT_KEY_PAIRS)}, or a 2-key dict); "
                         f"the loader yielded {type(batch).__name__}{keys}") from None


class _Restarting:
    """The loader's batches, starting a new pass when one runs out; counts the passes begun."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self.it = iter(loader)
        self.epochs = 1

    def next(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            self.epochs += 1
            try:
                return next(self.it)
            except StopIteration:
                raise ValueError("profile(): the loader yielded no batches") from None


@dataclass
class _Step:
    """What the training step ran on: the model, optimizer and loss, the device and how batches read."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], torch.Tensor]
    dev: torch.device
    fmt: BatchFormat
    given: BatchFormat | None  # the batch format the caller named (None: read batches by convention)

    @property
    def cuda(self) -> bool:
        return self.dev.type == "cuda"


@dataclass
class _Totals:
    """Sums over the measured steps."""

    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES[:-1], 0.0))
    gpu_busy: float = 0.0
    wall: float = 0.0
    samples: int = 0
    step_ms: list[float] = field(default_factory=list)
    first_batch: tuple[Any, Any] | None = None


def profile(model: nn.Module, loader: Iterable[Any], optimizer: torch.optim.Optimizer,
            loss_fn: Callable[[Any, Any], torch.Tensor], steps: int = 50, warmup: int = 2,
            device: str | torch.device | None = None,
            batch_format: BatchFormat | dict | None = None, memory: bool = True) -> ProfileResult:
    """Run `warmup` + `steps` ordinary training steps and time each phase of the measured ones.
    With `memory`, one more step (untimed) says where its memory goes: its peak by part (parameters,
    gradients, optimizer state, activations, the rest), by phase, and the modules saving the most.

    The model is trained for real (its weights change). Batches are `(inputs, targets)`, or what
    `batch_format` (`torchspeed.batches.BatchFormat`) says for dict batches and structured outputs:
    the model is called on the inputs (a dict as keyword arguments) and `loss_fn` gets the logits.
    Batches are moved to the model's device (or `device`) if they are not there yet. The loader
    restarts when it runs out. Returns the phase breakdown, verdict with evidence, and ranked findings.
    """
    fmt = BatchFormat.of(batch_format)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    p = next(model.parameters(), None)
    dev = torch.device(device) if device is not None else (p.device if p is not None else torch.device("cpu"))
    step = _Step(model, optimizer, loss_fn, dev, fmt, fmt if batch_format is not None else None)
    model.train()
    batches = _Restarting(loader)
    mem = PeakMemory(dev)
    t = _measure(step, batches, warmup, steps, mem)
    peak = mem.peak()  # the timed steps' (the memory step resets CUDA's counter)
    breakdown = _memory_step(step, batches, warmup + steps + 1) if memory else None
    phases = {**t.phases, "other": max(0.0, t.wall - sum(t.phases.values()))}
    gpu_busy = None
    t.step_ms.sort()
    if step.cuda:  # the events' spans include idle gaps: the busy share comes from kernel intervals
        share = _gpu_busy_share(step, batches.next, t.step_ms[len(t.step_ms) // 2] / 1e3)
        gpu_busy = share * t.wall if share is not None else t.gpu_busy
    v, evidence = verdict(phases, t.wall, gpu_busy)
    settings = _loop_settings(step, loader, warmup + steps, batches.epochs, t.first_batch)
    facts = {"device": dev.type, "steps": steps, "wall_s": t.wall, "phases": phases, "settings": settings, "verdict": v}
    return ProfileResult(
        steps=steps, wall_s=t.wall, phases=phases,
        per_step_ms={"median": t.step_ms[len(t.step_ms) // 2], "min": t.step_ms[0], "max": t.step_ms[-1]},
        throughput=t.samples / t.wall if t.wall > 0 else None, peak_memory_bytes=peak, verdict=v,
        evidence=evidence, settings=settings, findings=loop_findings(facts), gpu_busy_s=gpu_busy, memory=breakdown)


def _measure(step: _Step, batches: _Restarting, warmup: int, steps: int, mem: PeakMemory) -> _Totals:
    """Run the steps; sum the phases of those after `warmup` (peak memory counted from there)."""
    t = _Totals()
    for i in range(warmup + steps):
        if i == warmup:
            if step.cuda:
                torch.cuda.synchronize(step.dev)
            mem.reset()
        parts, wall, x, y = _timed_step(step, batches)
        if t.first_batch is None:
            t.first_batch = (x, y)
        if i < warmup:
            continue
        for k, v in parts.items():
            t.phases[k] += v
        if step.cuda:
            t.gpu_busy += sum(v for k, v in parts.items() if k != "data")
        t.wall += wall
        t.step_ms.append(wall * 1e3)
        t.samples += batch_size(x)
    return t


def _timed_step(step: _Step, batches: _Restarting) -> tuple[dict[str, float], float, Any, Any]:
    """One training step: (seconds per phase, wall seconds, inputs, targets). On CUDA, events time the
    GPU work of copy / forward / backward / optimizer; the host clock times the wait for data and the wall."""
    cuda = step.cuda
    t0 = time.perf_counter()
    batch = batches.next()
    t1 = time.perf_counter()
    if cuda:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
        ev[0].record()
    x, y = _split(batch, step.given)
    x, y = to_device(x, step.dev), to_device(y, step.dev)
    if cuda:
        ev[1].record()
    t2 = time.perf_counter()
    loss = step.loss_fn(step.fmt.logits_of(step.fmt.forward(step.model, x)), y)
    if cuda:
        ev[2].record()
    t3 = time.perf_counter()
    loss.backward()
    if cuda:
        ev[3].record()
    t4 = time.perf_counter()
    step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=True)
    if cuda:
        ev[4].record()
        torch.cuda.synchronize(step.dev)
    t5 = time.perf_counter()
    if cuda:
        gpu = [ev[k].elapsed_time(ev[k + 1]) / 1e3 for k in range(4)]
        parts = {"data": t1 - t0, "copy": gpu[0], "forward": gpu[1], "backward": gpu[2], "optimizer": gpu[3]}
    else:
        parts = {"data": t1 - t0, "copy": t2 - t1, "forward": t3 - t2, "backward": t4 - t3, "optimizer": t5 - t4}
    return parts, t5 - t0, x, y


def _memory_step(step: _Step, batches: _Restarting, index: int) -> dict[str, Any]:
    """One more training step, untimed, with the memory accounting on: where its peak goes."""
    acct = StepMemory(step.model, [step.optimizer], step.dev, step=index)
    try:
        acct.start("data")
        batch = batches.next()
        acct.boundary("copy")
        x, y = _split(batch, step.given)
        x, y = to_device(x, step.dev), to_device(y, step.dev)
        acct.boundary("forward")
        loss = step.loss_fn(step.fmt.logits_of(step.fmt.forward(step.model, x)), y)
        acct.boundary("backward")
        loss.backward()
        acct.boundary("optimizer")
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
        acct.boundary(None)
        del batch, x, y, loss
        return acct.finish().to_dict()
    except BaseException:
        acct.abandon()
        raise


def _loop_settings(step: _Step, loader: Iterable[Any], batches: int, epochs: int,
                   first_batch: tuple[Any, Any] | None) -> dict[str, Any]:
    """The settings the loop rules judge (as `doctor` records them), and the loss pairing checked on
    the first batch."""
    dev = step.dev
    settings = machine_settings()
    ls = loader_settings(loader)
    settings["loaders"] = [{**ls, "batches": batches, "epochs": epochs}] if ls else []
    settings["model"] = model_settings(step.model)
    settings["parallel"] = settings["model"]["parallel"]
    settings["autocast"] = torch.is_autocast_enabled(dev.type) or (
        dev.type == "cpu" and torch.is_autocast_enabled("cpu"))
    x0 = first_batch[0] if first_batch else None
    if isinstance(x0, torch.Tensor):
        settings["input"] = {"shape": list(x0.shape), "dtype": str(x0.dtype),
                             "channels_last": x0.dim() == 4 and x0.is_contiguous(memory_format=torch.channels_last)
                             and not x0.is_contiguous()}
    settings["loss_checks"] = []
    if first_batch is not None and isinstance(x0, torch.Tensor):
        settings["loss_checks"] = [{"rule": f.rule, "message": f.message, "where": f.where}
                                   for f in loss_pairing(step.model, x0[:2], step.loss_fn, _slice(first_batch[1]))]
    return settings


def _gpu_busy_share(step: _Step, next_batch: Callable[[], Any], step_s: float) -> float | None:
    """The share of a training step the GPU ran a kernel or a copy: the union of their intervals in one
    more step under torch.profiler, over `step_s` (the median step timed without it); None without
    device events. Not over that step's own wall: starting the profiler (CUPTI) takes far longer than a
    step and its bookkeeping slows the host, which would push the verdict towards "overhead-bound";
    kernel durations are the GPU's and do not change under it."""
    batch = next_batch()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize(step.dev)
    with torch.profiler.profile(activities=acts) as prof:
        x, y = _split(batch, step.given)
        out = step.fmt.logits_of(step.fmt.forward(step.model, to_device(x, step.dev)))
        loss = step.loss_fn(out, to_device(y, step.dev))
        loss.backward()
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(step.dev)
    spans = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return min(1.0, busy_time(spans) / step_s) if spans and step_s > 0 else None


def _slice(y: Any) -> Any:
    """The first two targets: the loss pairing check runs on two samples."""
    return y[:2] if isinstance(y, torch.Tensor) and y.dim() else y
