"""accelerate(): choose precision, memory format, compilation and the distributed wrapper by measuring.

(Module named acceleration, not accelerate: a submodule called accelerate would shadow the
public function ts.train.accelerate once imported.)

Each "auto" setting is decided by timing a few real training steps (forward, loss, backward) of the
user's model on an example batch, and a candidate is kept only when it is faster by a clear margin;
one-off costs (torch.compile's compile time) are charged against the expected length of the run.
The model's weights, buffers and RNG state are restored after the trials, so trying candidates
changes nothing about training. The report lists every candidate with its figures and decision.
"""
from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed.runtime import default_precision, resolve_device, rng_state, set_rng_state, synchronize
from torchspeed.train import distributed

__all__ = ["accelerate", "Accelerated", "AccelerateReport", "Candidate", "autocast_for", "to_device"]

_PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Candidate:
    """One measured (or deliberately untried) option of one setting."""

    setting: str                  # "precision" | "channels_last" | "compile" | "optimizer" | "strategy"
    value: str
    step_s: float | None = None   # median measured step (forward + loss + backward), seconds
    one_off_s: float = 0.0        # one-off cost, e.g. compile time
    decision: str = ""            # "kept", "rejected: ...", "not tried: ...", "given", ...

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AccelerateReport:
    """What accelerate() chose and every candidate it measured."""

    device: str
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    strategy: str | None = None
    optimizer: str = "unchanged"
    candidates: list[Candidate] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidates"] = [c.to_dict() for c in self.candidates]
        return d

    def rows(self) -> list[tuple[Any, ...]]:
        return [(c.setting, c.value, None if c.step_s is None else c.step_s * 1e3, c.one_off_s, c.decision)
                for c in self.candidates]

    def __str__(self) -> str:
        lines = [f"accelerate on {self.device}: precision={self.precision} channels_last={self.channels_last} "
                 f"compile={self.compile} strategy={self.strategy} optimizer={self.optimizer}"]
        for c in self.candidates:
            step = "-" if c.step_s is None else f"{c.step_s * 1e3:.1f} ms"
            lines.append(f"  {c.setting:13s} {c.value:6s} step {step:>10s}  one-off {c.one_off_s:.1f} s  {c.decision}")
        return "\n".join(lines)


@dataclass
class Accelerated:
    """The prepared model and optimizer (unpack: `model, optimizer = acc`) plus how to run them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    report: AccelerateReport
    device: torch.device
    module: nn.Module             # the unwrapped model (no DDP / compile wrapper): state_dict lives here
    scaler: Any = None            # torch.amp.GradScaler for fp16, else None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.optimizer))

    @property
    def precision(self) -> str:
        return self.report.precision

    @property
    def channels_last(self) -> bool:
        return self.report.channels_last

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context for forward passes at the chosen precision (fp32 weights are kept)."""
        return autocast_for(self.device, self.report.precision)

    def prepare_input(self, x: Any) -> Any:
        return to_device(x, self.device, self.report.channels_last)


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[precision])


def to_device(x: Any, device: torch.device, channels_last: bool | None = None) -> Any:
    """Move a tensor (or a tuple/list/dict of them) to `device`; 4-D float tensors to NHWC (True) or
    NCHW (False) memory format, left as they are with None (a no-op when already in that format)."""
    if isinstance(x, torch.Tensor):
        x = x.to(device, non_blocking=True)
        if channels_last is not None and x.dim() == 4 and x.is_floating_point():
            x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device, channels_last) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device, channels_last) for k, v in x.items()}
    return x


def _default_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """For timing only: cross-entropy for class logits, else the mean output (same backward cost)."""
    if (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() == 2
            and targets.dtype == torch.int64 and targets.dim() == 1):
        return nn.functional.cross_entropy(outputs.float(), targets)
    out = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    return out.float().mean()


class _Trial:
    """Times training steps of a model on one batch and restores everything it touched afterwards."""

    def __init__(self, model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor] | None,
                 device: torch.device, steps: int):
        self.model, self.device, self.steps = model, device, steps
        self.loss_fn = loss_fn or _default_loss
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise ValueError("example_batch must be (inputs, targets), e.g. one batch from the training loader")
        self.inputs, self.targets = batch[0], batch[1]

    def step_fn(self, model: nn.Module, precision: str, channels_last: bool) -> Callable[[], None]:
        x = to_device(self.inputs, self.device, channels_last)
        y = to_device(self.targets, self.device)
        needs_inputs = getattr(self.loss_fn, "needs_inputs", False)

        def step() -> None:
            with autocast_for(self.device, precision):
                out = model(x)
                loss = self.loss_fn(out, y, x) if needs_inputs else self.loss_fn(out, y)
            loss.backward()
            for p in model.parameters():
                p.grad = None
        return step

    def measure(self, step: Callable[[], None]) -> tuple[float, float]:
        """(median step seconds, first-call seconds): the first call carries one-off costs."""
        from torchspeed.measure import time_callable

        t0 = time.perf_counter()
        step()
        synchronize(self.device)
        first = time.perf_counter() - t0
        t = time_callable(step, name="trial", warmup=1, repeats=self.steps, device=self.device)
        return t.median_s, first

    def compare(self, steps: dict[str, Callable[[], None]]) -> dict[str, float]:
        """Median step seconds of each candidate, timed interleaved (drifts hit all alike)."""
        from torchspeed.measure import compare

        c = compare(steps, warmup=1, repeats=self.steps, cooldown_s=0.05, device=self.device)
        return {name: c[name].median_s for name in steps}


def _margin_ok(base: float, new: float, margin: float) -> bool:
    return new < base * (1.0 - margin)


def _precision_candidates(device: torch.device) -> list[str]:
    best = default_precision(device).name
    return ["fp32"] if best == "fp32" else ["fp32", best]


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in model.modules())


def _prefer_fused(optimizer: torch.optim.Optimizer, device: torch.device, dtensor: bool) -> str:
    """Switch a fresh optimizer to its fused (else foreach) implementation, in place; say what was done."""
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


def _rebind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], module: nn.Module) -> None:
    """After FSDP replaced the parameters, point the optimizer's groups at the new (sharded) ones."""
    if optimizer.state:
        raise ValueError("strategy='fsdp' needs an optimizer without state yet (create it, then call accelerate)")
    new = dict(module.named_parameters())
    for g in optimizer.param_groups:
        g["params"] = [new[names[id(p)]] for p in g["params"]]


def _fsdp_wrap(module: nn.Module) -> nn.Module:
    """FSDP2: shard each top-level block that holds parameters, then the root (autocast does precision)."""
    from torch.distributed.fsdp import fully_shard

    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(module)
    return module


def accelerate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str = "auto",
    channels_last: bool | str = "auto",
    compile: bool | str = "auto",  # noqa: A002 (the public name of the setting)
    strategy: str | None = "auto",
    example_batch: Any = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    device: str | torch.device = "auto",
    expected_steps: int | None = None,
    trial_steps: int = 3,
    margin: float = 0.05,
    min_compile_cost_s: float = 20.0,
    untried: dict[str, str] | None = None,
    fused_optimizer: bool = True,
) -> Accelerated:
    """Prepare `model` and `optimizer` for fast training here; decisions are measured and reported.

    precision: "auto" | "bf16" | "fp16" | "fp32" (mixed precision keeps fp32 weights and autocasts;
    fp16 brings a GradScaler on CUDA). channels_last / compile: "auto" | True | False. strategy:
    "auto" (DDP under torchrun, else none) | "ddp" | "fsdp" | None. "auto" settings need
    `example_batch` = (inputs, targets); a candidate must beat the current choice by `margin`
    (fraction of step time). Compile's one-off cost must be repaid within `expected_steps` steps;
    with an expected run shorter than `min_compile_cost_s` it is not tried. `untried` maps a setting
    name to the reason it is deliberately not tried (e.g. {"compile": "quick mode budget"}).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if precision not in ("auto", *_PRECISIONS):
        raise ValueError(f"precision must be 'auto', 'bf16', 'fp16' or 'fp32', got {precision!r}")
    for name, v in (("channels_last", channels_last), ("compile", compile)):
        if v not in ("auto", True, False):
            raise ValueError(f"{name} must be 'auto', True or False, got {v!r}")
    if strategy not in ("auto", "ddp", "fsdp", None, "none"):
        raise ValueError(f"strategy must be 'auto', 'ddp', 'fsdp' or None, got {strategy!r}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
        raise ValueError("model is already wrapped (DDP or torch.compile); pass the plain nn.Module to accelerate()")
    untried = dict(untried or {})
    dev = resolve_device(device)
    denv, dev = distributed.setup(dev) if strategy in ("auto", "ddp", "fsdp") else (distributed.env(), dev)
    if strategy in ("ddp", "fsdp") and not denv.distributed:
        strategy_eff = None
        untried.setdefault("strategy", f"{strategy} needs a torchrun launch (WORLD_SIZE > 1)")
    else:
        strategy_eff = ("ddp" if denv.distributed else None) if strategy == "auto" else (
            None if strategy == "none" else strategy)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = not torch.are_deterministic_algorithms_enabled()  # static shapes: autotune
    model.to(dev)
    report = AccelerateReport(device=str(dev), strategy=strategy_eff)
    cands = report.candidates

    compiled: nn.Module | None = None
    needs_trials = "auto" in (precision, channels_last, compile)
    trial = None
    if needs_trials and example_batch is None:
        raise ValueError("accelerate(): an 'auto' setting needs example_batch=(inputs, targets) to measure "
                         "candidates on; pass one batch, or give precision/channels_last/compile explicitly")
    if needs_trials:
        trial = _Trial(model, example_batch, loss_fn, dev, trial_steps)
        saved_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        saved_rng = rng_state()
        was_training = model.training
        model.train()

    try:
        # 1-2. precision and memory format, searched jointly: on CPUs bf16 may only pay off in NHWC
        # (oneDNN reorders NCHW bf16 activations), so a one-axis-at-a-time search could miss the best pair.
        if precision == "fp16" and dev.type != "cuda":
            raise ValueError("precision='fp16' is for CUDA GPUs (with a GradScaler); use 'bf16' or 'fp32' on the CPU")
        precs = _precision_candidates(dev) if precision == "auto" else [precision]
        layouts = [bool(channels_last)] if channels_last != "auto" else [False, True]
        if channels_last == "auto" and not (_has_conv(model) and isinstance(trial.inputs, torch.Tensor)
                                            and trial.inputs.dim() == 4):
            layouts = [False]
            cands.append(Candidate("channels_last", "True", decision="not tried: no 2-D convolutions / 4-D input"))
        base_step = None
        if len(precs) * len(layouts) > 1:
            nhwc = copy.deepcopy(model).to(memory_format=torch.channels_last) if True in layouts else None
            label = "+".join(n for n, many in (("precision", len(precs) > 1), ("channels_last", len(layouts) > 1))
                             if many)

            def name(p: str, cl: bool) -> str:
                return "+".join(v for v, many in ((p, len(precs) > 1), ("NHWC" if cl else "NCHW", len(layouts) > 1))
                                if many)

            combos = {name(p, cl): (p, cl) for p in precs for cl in layouts}
            times = trial.compare({n: trial.step_fn(nhwc if cl else model, p, cl) for n, (p, cl) in combos.items()})
            del nhwc
            base = name(precs[0], layouts[0])  # fp32 (when auto) in NCHW (when auto): the plain way
            best = min(times, key=times.__getitem__)
            chosen_name = best if best != base and _margin_ok(times[base], times[best], margin) else base
            for n, t in times.items():
                why = "kept" if n == chosen_name else "baseline" if n == base else (
                    f"rejected: not {margin:.0%} faster than {base}" if n == best else
                    f"rejected: slower than {chosen_name}")
                cands.append(Candidate(label, n, t, decision=why))
            chosen, report.channels_last = combos[chosen_name]
            base_step = times[chosen_name]
            if len(precs) == 1:
                cands.append(Candidate("precision", chosen, decision="given" if precision != "auto" else
                                       f"kept ({default_precision(dev).reason})"))
            if len(layouts) == 1 and channels_last != "auto":
                cands.append(Candidate("channels_last", str(report.channels_last), decision="given"))
        else:
            chosen, report.channels_last = precs[0], layouts[0]
            reason = "given" if precision != "auto" else f"kept ({default_precision(dev).reason})"
            cands.append(Candidate("precision", chosen, decision=reason))
            if channels_last != "auto":
                cands.append(Candidate("channels_last", str(report.channels_last), decision="given"))
        report.precision = chosen
        model.to(memory_format=torch.channels_last if report.channels_last else torch.contiguous_format)

        # 3. compile: one-off compile time charged against the expected run
        if compile == "auto":
            if "compile" in untried:
                cands.append(Candidate("compile", "True", decision=f"not tried: {untried['compile']}"))
            else:
                if base_step is None:
                    base_step, _ = trial.measure(trial.step_fn(model, chosen, report.channels_last))
                steps = expected_steps or 0
                cands.append(Candidate("compile", "False", base_step))
                if steps and steps * base_step < min_compile_cost_s:
                    cands[-1].decision = "kept"
                    cands.append(Candidate("compile", "True", decision=(
                        f"not tried: expected run ~{steps * base_step:.0f} s is too short to repay a compile "
                        f"(typically >= {min_compile_cost_s:.0f} s)")))
                else:
                    compiled = _try_compile(model, trial, chosen, report.channels_last, base_step, steps,
                                            margin, cands)
                    report.compile = compiled is not None
        else:
            report.compile = bool(compile)
            cands.append(Candidate("compile", str(report.compile), decision="given"))
    finally:
        if trial is not None:
            model.load_state_dict(saved_state)
            set_rng_state(saved_rng)
            for p in model.parameters():
                p.grad = None
            model.train(was_training)

    # Every rank must make the same choices, whatever its own timings said.
    if denv.distributed:
        p_idx, cl, co = distributed.broadcast_ints(
            [_PRECISIONS.index(report.precision), int(report.channels_last), int(report.compile)])
        report.precision, report.channels_last, report.compile = _PRECISIONS[p_idx], bool(cl), bool(co)
        model.to(memory_format=torch.channels_last if report.channels_last else torch.contiguous_format)

    module = model
    wrapped: nn.Module = model
    names = {id(p): n for n, p in model.named_parameters()}
    if strategy_eff == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        cands.append(Candidate("strategy", "ddp", decision=f"kept: torchrun world of {denv.world_size}"))
    elif strategy_eff == "fsdp":
        wrapped = _fsdp_wrap(model)
        if optimizer is not None:
            _rebind_optimizer(optimizer, names, model)
        cands.append(Candidate("strategy", "fsdp", decision=f"kept: fully_shard over {denv.world_size} ranks"))
    elif "strategy" in untried:
        cands.append(Candidate("strategy", str(strategy), decision=f"not used: {untried['strategy']}"))

    if optimizer is not None and fused_optimizer:
        report.optimizer = _prefer_fused(optimizer, dev, dtensor=strategy_eff == "fsdp")
        cands.append(Candidate("optimizer", report.optimizer, decision="preferred (one kernel over all parameters)"))
    if report.compile:
        wrapped = compiled if (compiled is not None and wrapped is model) else torch.compile(wrapped)
    scaler = torch.amp.GradScaler("cuda") if report.precision == "fp16" else None
    return Accelerated(model=wrapped, optimizer=optimizer, report=report, device=dev, module=module, scaler=scaler)


def _try_compile(model: nn.Module, trial: _Trial, precision: str, cl: bool, base_step: float, steps: int,
                 margin: float, cands: list[Candidate]) -> nn.Module | None:
    """Compile, time, and keep only if the saving over the expected run repays the compile time."""
    try:
        compiled = torch.compile(model)
        t_c, first = trial.measure(trial.step_fn(compiled, precision, cl))
    except Exception as e:  # a model the compiler cannot handle is a rejected candidate, not a crash
        cands[-1].decision = "kept"
        cands.append(Candidate("compile", "True", decision=f"rejected: compile failed ({type(e).__name__}: {e})"[:200]))
        return None
    one_off = max(0.0, first - t_c)
    saving = (base_step - t_c) * steps if steps else None
    if not _margin_ok(base_step, t_c, margin):
        why = f"rejected: step not {margin:.0%} faster"
    elif saving is not None and saving <= one_off:
        why = f"rejected: saves {saving:.0f} s over {steps} steps, compile costs {one_off:.0f} s"
    else:
        why = "kept"
    cands[-1].decision = "baseline" if why == "kept" else "kept"
    cands.append(Candidate("compile", "True", t_c, one_off, why))
    return compiled if why == "kept" else None
