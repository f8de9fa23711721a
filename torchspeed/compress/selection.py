"""Choose a backbone by measured inference latency, before training anything.

Inference time depends on the architecture, not on the weights, so untrained candidates can be
compared on this machine at the deployment input shape (article 003's advice). Each candidate is
built with random weights, its parameters and multiply-accumulates counted, and its latency timed
through torchspeed.measure, all candidates interleaved in one run so background load hits them alike.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.console import Console
from torch import nn

from torchspeed.args import as_list, progress_fn
from torchspeed.batches import random_input
from torchspeed.compress.cost import count_macs, count_params, inference_fn
from torchspeed.measure import Timing, busy_warning, compare, wait_for_quiet_machine
from torchspeed.models import HOW_TO_NAME, create
from torchspeed.runtime import FLOAT_PRECISIONS, default_precision, resolve_device
from torchspeed.tables import print_table

__all__ = ["BackboneRow", "SelectResult", "select_backbone"]

log = logging.getLogger(__name__)

_HOW_TO_NAME = f"{HOW_TO_NAME}, or pass an nn.Module (a dict {{label: module}} names several)"


@dataclass
class BackboneRow:
    """One measured backbone. `latency_ms` is the median (p50) per batch at the faster precision tried."""

    name: str
    params: int
    macs: int  # per sample
    latency_ms: float
    latency_p90_ms: float
    throughput: float  # samples per second at the measured batch size
    precision: str
    fits: bool | None  # within the budget (None when no budget was given)
    tried_ms: dict[str, float] = field(default_factory=dict)  # precision -> median ms

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SelectResult:
    """The measured backbones ranked fastest first (`table`), with the settings they were measured at."""

    table: list[BackboneRow]
    input_shape: tuple[int, ...]
    batch_size: int
    budget_ms: float | None
    device: str
    others_cores: float | None = None  # cores other processes used while the candidates were timed

    @property
    def busy_warning(self) -> str | None:
        """A sentence saying the candidates were timed on a busy machine (the ranking may be noise), else None."""
        return busy_warning(self.others_cores)

    @property
    def best(self) -> BackboneRow:
        """The fastest backbone measured (within the budget whenever any backbone is)."""
        return self.table[0]

    @property
    def fastest(self) -> BackboneRow:
        """The same row as `best`: backbones are ranked by measured latency alone."""
        return self.table[0]

    @property
    def fitting(self) -> list[BackboneRow]:
        """Backbones within the budget (all of them when no budget was given), fastest first."""
        return [c for c in self.table if c.fits is not False]

    def rows(self) -> list[tuple[Any, ...]]:
        return [
            (c.name, f"{c.params / 1e6:.2f}", f"{c.macs / 1e9:.3f}", c.latency_ms, c.latency_p90_ms, c.throughput,
             c.precision, "-" if c.fits is None else ("yes" if c.fits else "no"))
            for c in self.table
        ]

    COLUMNS = ("model", "params M", "GMACs", "p50 ms", "p90 ms", "per s", "prec", "fits")

    def print(self, console: Any = None) -> None:
        budget = f", budget {self.budget_ms:g} ms" if self.budget_ms is not None else ""
        title = (f"Backbones by measured latency per batch: input {tuple(self.input_shape)}, {self.device}{budget} "
                 f"(GMACs per sample, per s = samples per second)")
        if self.busy_warning and console is None:
            console = Console()
        print_table(title, self.COLUMNS, self.rows(), console)
        if self.busy_warning:
            console.print(f"note: {self.busy_warning}", highlight=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_shape": list(self.input_shape),
            "batch_size": self.batch_size,
            "budget_ms": self.budget_ms,
            "device": self.device,
            "others_cores": self.others_cores,
            "best": self.best.name,
            "table": [c.to_dict() for c in self.table],
        }


def _input_shape(input_shape: Sequence[int], batch_size: int | None) -> tuple[tuple[int, ...], int]:
    try:
        shape = tuple(int(d) for d in input_shape)
    except (TypeError, ValueError):
        raise ValueError(f"input_shape must be a sequence of integers such as (1, 3, 224, 224), got {input_shape!r}") from None
    if len(shape) < 2 or any(d < 1 for d in shape):
        raise ValueError(f"input_shape must be (N, C, ...) with every dimension >= 1, got {input_shape!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    batch = batch_size or shape[0]
    return (batch, *shape[1:]), batch


def _label(candidate: Any, i: int) -> str:
    if isinstance(candidate, str):
        return candidate
    return f"{type(candidate).__name__}#{i}"


def select_backbone(
    candidates: str | Sequence[str | nn.Module] | Mapping[str, str | nn.Module],
    input_shape: Sequence[int],
    budget_ms: float | None = None,
    batch_size: int | None = None,
    precision: str = "auto",
    device: str | torch.device = "cpu",
    channels_last: bool = True,
    repeats: int = 15,
    warmup: int = 3,
    progress: bool | Callable[[str], Any] = False,
) -> SelectResult:
    """Measure untrained candidates at `input_shape` and rank them by median latency.

    `candidates`: model names as a list or a comma string ('resnet18,timm:efficientnet_b0'; any name
    `torchspeed.models.create` takes), modules, or a dict {label: name or module}. `input_shape` is
    (N, C, H, W); `batch_size`, when given, replaces N.
    `precision`: "auto" times fp32 and the device's mixed precision and keeps the faster for each
    candidate (the table says which); or one of "fp32", "bf16", "fp16". `budget_ms` marks which
    candidates' p50 latency per batch fits. `progress`: True prints what is being done to stderr, a
    callable receives those messages. The choice is logged at INFO on this module's logger.
    """
    shape, batch = _input_shape(input_shape, batch_size)
    if budget_ms is not None and not budget_ms > 0:
        raise ValueError(f"budget_ms must be a positive number of milliseconds, got {budget_ms!r}")
    items = _labelled(candidates)
    dev = resolve_device(device)
    precisions = _precisions_to_try(precision, dev)
    say = progress_fn(progress)

    x = random_input(shape, dev, name="input_shape")  # a shape larger than memory: one line, before any build
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    sizes: dict[str, tuple[int, int]] = {}
    contenders: dict[str, Callable[[], None]] = {}
    for label, cand in items:
        say(f"building {label}")
        model = _build(label, cand, dev, channels_last and x.dim() == 4)
        sizes[label] = (count_params(model), _macs_per_sample(label, model, x, shape))
        for p in precisions:
            contenders[f"{label}|{p}"] = inference_fn(model, x, p)
    say(f"timing {len(contenders)} variants, interleaved")
    wait_for_quiet_machine(max_s=3.0)  # other processes leave the cores first; a busy run is still named
    comparison = compare(contenders, warmup=warmup, repeats=repeats, items=batch, unit="samples",
                         device=dev, cooldown_s=0.05)
    ranked = sorted((_row(label, sizes[label], {p: comparison[f"{label}|{p}"] for p in precisions}, batch, budget_ms)
                     for label, _ in items), key=lambda c: c.latency_ms)
    result = SelectResult(table=ranked, input_shape=shape, batch_size=batch, budget_ms=budget_ms, device=str(dev),
                          others_cores=comparison.others_cores)
    _log_choice(result)
    return result


def _labelled(candidates: str | Sequence[str | nn.Module] | Mapping[str, str | nn.Module]) -> list[tuple[str, Any]]:
    """(label, name or module) for each candidate; labels unique, at least one candidate."""
    if isinstance(candidates, str):
        candidates = as_list(candidates, name="candidates")
    if isinstance(candidates, Mapping):
        items = list(candidates.items())
    else:
        items = [(_label(c, i), c) for i, c in enumerate(candidates)]
    if not items:
        raise ValueError(f"select_backbone needs at least one candidate; {_HOW_TO_NAME}")
    labels = [label for label, _ in items]
    if len(set(labels)) != len(labels):
        raise ValueError(f"candidate names must be unique, got {labels}")
    return items


def _precisions_to_try(precision: str, device: torch.device) -> list[str]:
    """fp32 and the device's mixed precision for "auto", else the one precision asked for."""
    if precision == "auto":
        mixed = default_precision(device).name
        return ["fp32"] + ([mixed] if mixed != "fp32" else [])
    if precision in FLOAT_PRECISIONS:
        return [precision]
    raise ValueError(f"precision must be 'auto', {', '.join(repr(p) for p in FLOAT_PRECISIONS)}, got {precision!r}")


def _build(label: str, candidate: str | nn.Module, device: torch.device, channels_last: bool) -> nn.Module:
    """The candidate as a module on `device`, in eval mode (and channels_last when asked)."""
    try:
        model = create(candidate) if isinstance(candidate, str) else candidate
    except ValueError as e:  # the factory's message, plus what else select_backbone takes
        raise ValueError(f"{e} (select_backbone also takes nn.Modules; a dict {{label: module}} names several)"
                         ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"candidate {label!r} is a {type(model).__name__}; {_HOW_TO_NAME}")
    model = model.to(device).eval()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def _macs_per_sample(label: str, model: nn.Module, x: torch.Tensor, shape: tuple[int, ...]) -> int:
    try:
        return count_macs(model, x[:1])
    except Exception as e:  # the model cannot run at this shape: say which and why
        raise ValueError(f"candidate {label!r} fails on input shape {shape}: {type(e).__name__}: {e}") from None


def _row(label: str, size: tuple[int, int], timings: dict[str, Timing], batch: int,
         budget_ms: float | None) -> BackboneRow:
    """The candidate's row at its fastest precision."""
    best_p = min(timings, key=lambda p: timings[p].median_s)
    t = timings[best_p]
    latency = t.median_s * 1e3
    return BackboneRow(
        name=label, params=size[0], macs=size[1], latency_ms=latency,
        latency_p90_ms=t.p90_s * 1e3, throughput=t.throughput or batch / t.median_s, precision=best_p,
        fits=None if budget_ms is None else latency <= budget_ms,
        tried_ms={p: tm.median_s * 1e3 for p, tm in timings.items()},
    )


def _log_choice(result: SelectResult) -> None:
    best, ranked, budget_ms = result.best, result.table, result.budget_ms
    budget = ("" if budget_ms is None else
              f"; {len(result.fitting)} of {len(ranked)} within {budget_ms:g} ms")
    others = ", ".join(f"{c.name} {c.latency_ms:.2f} ms" for c in ranked[1:])
    log.info("select_backbone: fastest %s at %s, p50 %.2f ms per batch of %d on %s (%s params, %.3f GMACs per "
             "sample)%s%s", best.name, best.precision, best.latency_ms, result.batch_size, result.device,
             f"{best.params / 1e6:.2f}M", best.macs / 1e9, budget, f"; then {others}" if others else "")
    if result.busy_warning:
        log.warning("select_backbone: %s", result.busy_warning)
