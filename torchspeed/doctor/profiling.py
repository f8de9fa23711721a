"""`profile`: time each phase of a training step on the user's own model, loader and optimizer.

Phases: data (blocked in next(loader)), copy (host-to-device), forward (model + loss), backward,
optimizer (step + zero_grad), other (the rest of the wall time). On CPU every op is synchronous, so
host timers measure the work. On CUDA, CUDA events bracket copy/forward/backward/optimizer and time
the GPU work itself, while the host timer gives the wall time of the step (synchronised once per
step, so the loop keeps its natural overlap); the GPU's busy share tells launch overhead apart.
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
from torchspeed.doctor.phases import PHASES, verdict
from torchspeed.doctor.settings import loader_settings, machine_settings, model_settings
from torchspeed.measure import PeakMemory

__all__ = ["ProfileReport", "profile"]


@dataclass
class ProfileReport:
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

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "wall_s": self.wall_s, "phases": self.phases, "per_step_ms": self.per_step_ms,
                "throughput": self.throughput, "peak_memory_bytes": self.peak_memory_bytes, "verdict": self.verdict,
                "evidence": self.evidence, "settings": self.settings, "gpu_busy_s": self.gpu_busy_s,
                "findings": [f.to_dict() for f in self.findings]}

    def __str__(self) -> str:
        from torchspeed.doctor.report import format_profile

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


def profile(model: nn.Module, loader: Iterable[Any], optimizer: torch.optim.Optimizer,
            loss_fn: Callable[[Any, Any], torch.Tensor], steps: int = 50, warmup: int = 2,
            device: str | torch.device | None = None,
            batch_format: BatchFormat | dict | None = None) -> ProfileReport:
    """Run `warmup` + `steps` ordinary training steps and time each phase of the measured ones.

    The model is trained for real (its weights change). Batches are `(inputs, targets)`, or what
    `batch_format` (`torchspeed.batches.BatchFormat`) says for dict batches and structured outputs:
    the model is called on the inputs (a dict as keyword arguments) and `loss_fn` gets the logits.
    Batches are moved to the model's device (or `device`) if they are not there yet. The loader
    restarts when it runs out. Returns the phase breakdown, verdict with evidence, and ranked findings.
    """
    fmt = BatchFormat.of(batch_format)
    given = fmt if batch_format is not None else None
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    p = next(model.parameters(), None)
    dev = torch.device(device) if device is not None else (p.device if p is not None else torch.device("cpu"))
    cuda = dev.type == "cuda"
    model.train()
    it = iter(loader)
    epochs_started = 1

    def next_batch() -> Any:
        nonlocal it, epochs_started
        try:
            return next(it)
        except StopIteration:
            it = iter(loader)
            epochs_started += 1
            try:
                return next(it)
            except StopIteration:
                raise ValueError("profile(): the loader yielded no batches") from None

    totals = dict.fromkeys(PHASES[:-1], 0.0)
    gpu_busy = 0.0
    wall = 0.0
    samples = 0
    step_ms: list[float] = []
    first_batch = None
    mem = PeakMemory(dev)
    for i in range(warmup + steps):
        measured = i >= warmup
        if i == warmup:
            if cuda:
                torch.cuda.synchronize(dev)
            mem.reset()
        t0 = time.perf_counter()
        batch = next_batch()
        t1 = time.perf_counter()
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
            ev[0].record()
        x, y = _split(batch, given)
        x, y = to_device(x, dev), to_device(y, dev)
        if first_batch is None:
            first_batch = (x, y)
        if cuda:
            ev[1].record()
        t2 = time.perf_counter()
        out = fmt.logits_of(fmt.forward(model, x))
        loss = loss_fn(out, y)
        if cuda:
            ev[2].record()
        t3 = time.perf_counter()
        loss.backward()
        if cuda:
            ev[3].record()
        t4 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            ev[4].record()
            torch.cuda.synchronize(dev)
        t5 = time.perf_counter()
        if not measured:
            continue
        if cuda:
            gpu = [ev[k].elapsed_time(ev[k + 1]) / 1e3 for k in range(4)]
            parts = {"data": t1 - t0, "copy": gpu[0], "forward": gpu[1], "backward": gpu[2], "optimizer": gpu[3]}
            gpu_busy += sum(gpu)
        else:
            parts = {"data": t1 - t0, "copy": t2 - t1, "forward": t3 - t2, "backward": t4 - t3, "optimizer": t5 - t4}
        for k, v in parts.items():
            totals[k] += v
        wall += t5 - t0
        step_ms.append((t5 - t0) * 1e3)
        samples += batch_size(x)
    phases = {**totals, "other": max(0.0, wall - sum(totals.values()))}
    if cuda:  # the events' spans include idle gaps: the busy share comes from kernel intervals
        share = _gpu_busy_share(model, next_batch, optimizer, loss_fn, dev, fmt, given)
        gpu_busy = share * wall if share is not None else gpu_busy
    v, evidence = verdict(phases, wall, gpu_busy if cuda else None)

    settings = machine_settings()
    ls = loader_settings(loader)
    settings["loaders"] = [{**ls, "batches": warmup + steps, "epochs": epochs_started}] if ls else []
    settings["model"] = model_settings(model)
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
        from torchspeed.doctor.linting import loss_pairing

        settings["loss_checks"] = [{"rule": f.rule, "message": f.message, "where": f.where}
                                   for f in loss_pairing(model, x0[:2], loss_fn, _slice(first_batch[1]))]
    from torchspeed.doctor.rules import loop_findings

    facts = {"device": dev.type, "steps": steps, "wall_s": wall, "phases": phases, "settings": settings, "verdict": v}
    step_ms.sort()
    return ProfileReport(
        steps=steps, wall_s=wall, phases=phases,
        per_step_ms={"median": step_ms[len(step_ms) // 2], "min": step_ms[0], "max": step_ms[-1]},
        throughput=samples / wall if wall > 0 else None, peak_memory_bytes=mem.peak(), verdict=v,
        evidence=evidence, settings=settings, findings=loop_findings(facts), gpu_busy_s=gpu_busy if cuda else None)


def _gpu_busy_share(model: nn.Module, next_batch: Callable[[], Any], optimizer: torch.optim.Optimizer,
                    loss_fn: Callable[[Any, Any], torch.Tensor], dev: torch.device, fmt: BatchFormat,
                    given: BatchFormat | None) -> float | None:
    """The share of one more training step during which the GPU ran a kernel or a copy: the union of
    their intervals (torch.profiler) over the step's wall time. None if the profiler gives no device events."""
    from torchspeed.doctor.phases import busy_time

    batch = next_batch()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        x, y = _split(batch, given)
        loss = loss_fn(fmt.logits_of(fmt.forward(model, to_device(x, dev))), to_device(y, dev))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    spans = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return min(1.0, busy_time(spans) / wall) if spans and wall > 0 else None


def _slice(y: Any) -> Any:
    return y[:2] if isinstance(y, torch.Tensor) and y.dim() else y
