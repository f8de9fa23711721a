"""accelerate()'s compile trial: eager, regional compilation of the repeated blocks (`compiling`) and
torch.compile of the whole model, each compiled one costing its compile seconds once (its first step's
excess over a steady one) and saving its steady per-step gain (interleaved steps against eager) over the
run's length (`Horizon`: `expected_steps`, else `len(loader)` x epochs, else `DEFAULT_HORIZON_STEPS`).
Kept: the one that makes the run shortest, compile included, when it is `margin` faster per step and its
compile is repaid within the run (`weigh`, a pure function of the timings); never one slower than eager.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from torchspeed.train.choices import AccelerateOptions, AccelerateResult, TrialRow
from torchspeed.train.compiling import (
    compile_regions,
    compiled_regions,
    decompile_regions,
    eager_regions,
    repeated_blocks,
)
from torchspeed.train.step_timer import StepTimer

__all__ = ["DEFAULT_HORIZON_STEPS", "Horizon", "Verdict", "choose_compile", "horizon_of", "weigh"]

DEFAULT_HORIZON_STEPS = 1000  # a run's length when neither expected_steps nor the loader's length with epochs says it


@dataclass(frozen=True)
class Horizon:
    """How many training steps a compile must repay its cost within, and where that figure comes from."""

    steps: int
    source: str  # 'expected_steps', 'len(loader) x 3 epochs', 'one epoch, len(loader)', 'the default horizon'


def horizon_of(expected_steps: int | None, loader_len: int | None = None, epochs: int | None = None) -> Horizon:
    """The run's length: `expected_steps` given; else the loader's length times `epochs`; else one epoch of
    the loader when it is longer than the default horizon; else `DEFAULT_HORIZON_STEPS`."""
    if expected_steps is not None:
        return Horizon(int(expected_steps), "expected_steps")
    if loader_len and epochs:
        return Horizon(loader_len * epochs, f"len(loader) x {epochs} epochs")
    if loader_len and loader_len > DEFAULT_HORIZON_STEPS:
        return Horizon(loader_len, "one epoch, len(loader)")
    return Horizon(DEFAULT_HORIZON_STEPS, "the default horizon")


@dataclass(frozen=True)
class Verdict:
    """One compiled option weighed against eager: its decision and the figures behind it."""

    decision: str
    gain: float | None = None             # eager step / this step (1.08 = 8% more steps per second)
    break_even_steps: int | None = None   # steps after which the compile has paid for itself


def weigh(eager_s: float, options: dict[str, tuple[float, float]], horizon: Horizon,
          margin: float) -> tuple[str | None, dict[str, Verdict]]:
    """(the option kept, or None for eager; each option's verdict). `options` maps a name to its (steady
    step seconds, compile seconds). An option qualifies when its step is `margin` faster than eager's and
    its compile is repaid within `horizon.steps`; of those, the one saving the most over the run is kept."""
    verdicts: dict[str, Verdict] = {}
    saving: dict[str, float] = {}
    for name, (step_s, one_off) in options.items():
        gain = eager_s / step_s if step_s > 0 else math.inf
        if not step_s < eager_s * (1.0 - margin):
            verdicts[name] = Verdict(f"rejected: {gain:.2f}x eager's step, not {margin:.0%} faster", gain)
            continue
        per_step = eager_s - step_s
        even = max(1, math.ceil(one_off / per_step))
        if even > horizon.steps:
            verdicts[name] = Verdict(f"rejected: {gain:.2f}x, but its {one_off:.1f} s compile is repaid after "
                                     f"{even} steps and the run is {horizon.steps} ({horizon.source})", gain, even)
            continue
        saving[name] = per_step * horizon.steps - one_off
        verdicts[name] = Verdict(f"{gain:.2f}x, its {one_off:.1f} s compile repaid after {even} of "
                                 f"{horizon.steps} steps ({horizon.source})", gain, even)
    kept = max(saving, key=saving.__getitem__) if saving else None
    for name in saving:
        v = verdicts[name]
        decision = f"kept: {v.decision}" if name == kept else (
            f"rejected: saves {saving[name]:.0f} s over the run, {kept} {saving[kept]:.0f} s")
        verdicts[name] = Verdict(decision, v.gain, v.break_even_steps)
    return kept, verdicts


def choose_compile(model: nn.Module, timer: StepTimer | None, options: AccelerateOptions, report: AccelerateResult,
                   base_step: float | None, horizon: Horizon) -> nn.Module | None:
    """Sets report.compile and report.compile_mode; adds the compile rows. Returns what the trial compiled
    and kept (the whole model's torch.compile wrapper, or `model` itself with its regions compiled in
    place), else None. A run too short to repay a typical compile (`min_compile_cost_s`) does not try."""
    rows = report.candidates
    if options.compile != "auto":
        report.compile = bool(options.compile)
        report.compile_mode = None if not report.compile else "regional" if options.compile == "regional" else "whole"
        if report.compile_mode == "regional" and not repeated_blocks(model):
            raise ValueError(f"compile='regional': {type(model).__name__} has no repeated blocks (one module class "
                             "at least twice in an nn.ModuleList or nn.Sequential); pass compile=True to compile "
                             "the whole model, or compile='auto'")
        rows.append(TrialRow("compile", str(options.compile), decision="given"))
        return None
    report.compile, report.compile_mode = False, None
    why_not = (options.untried.get("compile") if "compile" in options.untried
               else "no example batch to measure on (pass the loader or example_batch=)" if timer is None else None)
    if why_not:
        rows.append(TrialRow("compile", "True", decision=f"not tried: {why_not}"))
        return None
    if base_step is None:
        base_step, _ = timer.measure(timer.step_fn(model, report.precision, report.channels_last))
    if horizon.steps * base_step < options.min_compile_cost_s:
        rows.append(TrialRow("compile", "False", base_step, decision="kept"))
        rows.append(TrialRow("compile", "True", decision=(
            f"not tried: expected run ~{horizon.steps * base_step:.0f} s ({horizon.steps} steps: {horizon.source}) "
            f"is too short to repay a compile (typically >= {options.min_compile_cost_s:.0f} s)")))
        return None
    return _trial(model, timer, options, report, horizon)


def _trial(model: nn.Module, timer: StepTimer, options: AccelerateOptions, report: AccelerateResult,
           horizon: Horizon) -> nn.Module | None:
    """Compile each option (its first step timed: the compile seconds), time the steady steps interleaved
    with eager, weigh them; the regions compiled in place are undone unless kept."""
    rows, prec, cl = report.candidates, report.precision, report.channels_last
    eager = timer.step_fn(model, prec, cl)
    steps: dict[str, Callable[[], None]] = {"False": _regions_off(model, eager)}
    first: dict[str, float] = {}
    failed: dict[str, str] = {}
    already = compiled_regions(model)  # the user's own regions: left as they are
    blocks = [] if already else repeated_blocks(model)
    whole = torch.compile(model)
    try:
        steps["True"] = _regions_off(model, timer.step_fn(whole, prec, cl))
        first["True"] = timer.first_call(steps["True"])
    except Exception as e:  # a model the compiler cannot handle is a rejected option, not a crash
        steps.pop("True")
        failed["True"] = f"rejected: compile failed ({type(e).__name__}: {e})"[:200]
    if blocks:
        try:
            compile_regions(model)
            steps["regional"] = eager
            first["regional"] = timer.first_call(eager)
        except Exception as e:
            decompile_regions(model)
            steps.pop("regional", None)
            failed["regional"] = f"rejected: compile failed ({type(e).__name__}: {e})"[:200]
    times = timer.compare(steps)
    kept, verdicts = weigh(times["False"], {n: (times[n], max(0.0, first[n] - times[n])) for n in first},
                           horizon, options.margin)
    rows.append(TrialRow("compile", "False", times["False"], decision="baseline" if kept else "kept"))
    for name in ("regional", "True"):
        if name in verdicts:
            v = verdicts[name]
            rows.append(TrialRow("compile", name, times[name], max(0.0, first[name] - times[name]), v.decision,
                                 gain=v.gain, break_even_steps=v.break_even_steps))
        elif name in failed:
            rows.append(TrialRow("compile", name, decision=failed[name]))
        elif name == "regional":
            rows.append(TrialRow("compile", name, decision="not tried: " + (
                f"the model has compiled regions already ({', '.join(already[:3])})" if already else
                "no repeated blocks (one module class twice in an nn.ModuleList or nn.Sequential)")))
    if blocks and kept != "regional":
        decompile_regions(model)
    report.compile = kept is not None
    report.compile_mode = {"regional": "regional", "True": "whole"}.get(kept)
    return model if kept == "regional" else whole if kept == "True" else None


def _regions_off(model: nn.Module, step: Callable[[], None]) -> Callable[[], None]:
    """`step` run with `model`'s compiled regions eager (the eager baseline and the whole-model compile,
    timed beside the regional one on the same weights)."""
    def run() -> None:
        with eager_regions(model):
            step()
    return run
