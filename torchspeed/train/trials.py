"""accelerate()'s trials, in order (`choose_step_settings`): precision and memory format searched
jointly, CUDA's process-wide switches (TF32 for fp32 matmuls, cudnn.benchmark), then compile (eager,
regional, whole; `compile_choice`) timed under the switches chosen. The plain way is each trial's
baseline; another option is kept only when `margin` faster (`_margin_ok`), compile only when its one-off
cost is repaid over the run. Each option becomes a `TrialRow` of the report, decided or deliberately not
tried.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchspeed.runtime import default_precision
from torchspeed.train.choices import AccelerateOptions, AccelerateResult, TrialRow
from torchspeed.train.compile_choice import Horizon, choose_compile, horizon_of
from torchspeed.train.mixed_precision import precision_options
from torchspeed.train.step_timer import StepTimer

__all__ = ["apply_cudnn_benchmark", "apply_tf32", "choose_step_settings", "switches_now"]

# the switches accelerate() set last, not to be taken for the user's (process-wide, as the switches are)
_SET_HERE: dict[str, Any] = {}


def _margin_ok(base: float, new: float, margin: float) -> bool:
    return new < base * (1.0 - margin)


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in model.modules())


def _image_input(x: Any) -> bool:
    """Whether the inputs hold a 4-D float tensor (images: a memory format applies)."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 4 and x.is_floating_point()
    values = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    return any(_image_input(v) for v in values)


def choose_step_settings(model: nn.Module, timer: StepTimer | None, options: AccelerateOptions,
                         report: AccelerateResult, dev: torch.device, say: Callable[[str], Any],
                         horizon: Horizon | None = None) -> nn.Module | None:
    """Precision and memory format, then the CUDA switches, then compile (timed under the switches
    chosen, weighed against `horizon`, the run's length); fills `report`, saying each trial's figure as it
    is known. Returns what the compile trial compiled and kept (see compile_choice.choose_compile)."""
    rows = report.candidates
    report.precision, report.channels_last, base_step = _choose_precision_and_layout(model, timer, options, dev,
                                                                                     rows)
    _say_rows(rows, 0, say)
    model.to(memory_format=torch.channels_last if report.channels_last else torch.contiguous_format)
    switches, done = switches_now(), len(rows)
    _choose_cuda_flags(model, timer, options, report, dev)
    _say_rows(rows, done, say)
    if switches[:2] != switches_now()[:2]:
        base_step = None  # measured under other switches: compile's baseline is timed again
    done = len(rows)
    compiled = choose_compile(model, timer, options, report, base_step,
                              horizon or horizon_of(options.expected_steps, epochs=options.epochs))
    _say_rows(rows, done, say)
    return compiled


def _say_rows(rows: list[TrialRow], start: int, say: Callable[[str], Any]) -> None:
    """progress=: one line per trial measured since `start` ('accelerate: channels_last NHWC 41.2 ms/step [kept]')."""
    for r in rows[start:]:
        if r.step_s is not None:
            one_off = f" + {r.one_off_s:.1f} s one-off" if r.one_off_s else ""
            say(f"accelerate: {r.setting} {r.value} {r.step_s * 1e3:.1f} ms/step{one_off} [{r.decision}]")


def _choose_precision_and_layout(model: nn.Module, timer: StepTimer | None, options: AccelerateOptions,
                                 dev: torch.device, rows: list[TrialRow]) -> tuple[str, bool, float | None]:
    """Precision and memory format, searched jointly: on CPUs bf16 may only pay off in NHWC (oneDNN
    reorders NCHW bf16 activations), so a one-axis-at-a-time search could miss the best pair. The
    plain way (fp32 when auto, NCHW when auto) is the baseline; another pair is kept only when it is
    `margin` faster. Returns (precision, channels_last, measured step seconds of the choice or None)."""
    precision, channels_last, margin = options.precision, options.channels_last, options.margin
    precs = precision_options(dev) if precision == "auto" else [precision]
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


def switches_now() -> list[Any]:
    """The CUDA switches as they are (matmul precision, cudnn.benchmark) and as accelerate() last set
    them: a remembered decision depends on which are the user's."""
    return [torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark, _SET_HERE.get("matmul"),
            _SET_HERE.get("cudnn_benchmark")]


def _choose_cuda_flags(model: nn.Module, timer: StepTimer | None, options: AccelerateOptions,
                       report: AccelerateResult, dev: torch.device) -> None:
    """CUDA's two process-wide switches, measured like the other settings (or as given); sets report.tf32
    / report.cudnn_benchmark (None where the switch does not apply). TF32 for fp32 matmuls (sm >= 8.0)
    only where fp32 was chosen (autocast runs matmuls in bf16/fp16); a matmul precision set before is
    the user's, kept. cudnn.benchmark (pays with static shapes) for conv models, left as it is under
    deterministic mode; turned on before, it is the user's and kept (off is PyTorch's default, not
    told apart from a choice: pass cudnn_benchmark=False to keep it off)."""
    if dev.type != "cuda":
        return
    rows, tf32, cudnn_benchmark = report.candidates, options.tf32, options.cudnn_benchmark
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
        report.tf32 = _measure_switch("tf32", apply_tf32, model, timer, report, options.margin)
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
                                                 options.margin)
    apply_cudnn_benchmark(report.cudnn_benchmark)


def _measure_switch(setting: str, apply: Callable[[bool | None], None], model: nn.Module, timer: StepTimer,
                    report: AccelerateResult, margin: float) -> bool:
    """The step timed with a process-wide switch off and on (interleaved, the switch set before each call:
    cuDNN's autotuning falls in the warm-up); on kept only when `margin` faster. Adds both rows."""
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
