"""The distributed strategy (DDP or FSDP2 over a torchrun launch) and the optimizer's implementation.

Neither is measured. One process per device is the way to use several: the strategy is the one asked
for (on "auto", DDP under torchrun), one wrapping function each in `WRAPPERS`. DDP keeps the gradients
in its buckets (no second copy, no copy into the buckets each step) and looks for unused parameters
every step only when one probe step found some. One fused (else foreach) kernel over all parameters is
never slower than a Python loop over them, same math.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchspeed import ranks
from torchspeed.batches import to_device
from torchspeed.optional import optional
from torchspeed.runtime import precision_dtype
from torchspeed.train import distributed
from torchspeed.train.choices import AccelerateOptions, AccelerateResult, TrialRow
from torchspeed.train.mixed_precision import autocast_for
from torchspeed.train.step_timer import StepTimer, trial_state_kept

__all__ = ["WRAPPERS", "choose_optimizer_implementation", "fsdp_policy", "fsdp_wrap", "resolve_strategy",
           "unused_parameters", "wrap_for_strategy"]


def resolve_strategy(options: AccelerateOptions,
                     dev: torch.device) -> tuple[ranks.DistEnv, torch.device, str | None, AccelerateOptions]:
    """The process group first (under torchrun it also fixes this rank's device), then the wrapper
    that will actually be used (DDP or FSDP only exist in a torchrun launch), and the options with
    the reason in `untried` when the one asked for cannot be."""
    asked = options.strategy
    denv, dev = distributed.setup(dev) if asked == "auto" or asked in WRAPPERS else (ranks.env(), dev)
    if asked in WRAPPERS and not denv.distributed:
        why = f"{asked} needs a torchrun launch (WORLD_SIZE > 1)"
        return denv, dev, None, replace(options, untried={"strategy": why, **options.untried})
    return denv, dev, ("ddp" if denv.distributed else None) if asked == "auto" else asked, options


def _fsdp_module() -> ModuleType:
    """torch.distributed.fsdp, imported on first use (half a second; not in every torch build)."""
    return optional("torch.distributed.fsdp", "a torch build with torch.distributed", "strategy='fsdp'")


def fsdp_policy(precision: str) -> Any:
    """FSDP2's MixedPrecisionPolicy for a chosen precision: parameters all-gathered and computed in
    bf16/fp16 (half the all-gather traffic of fp32), gradients reduced in fp32; None for fp32."""
    if precision == "fp32":
        return None
    return _fsdp_module().MixedPrecisionPolicy(param_dtype=precision_dtype(precision), reduce_dtype=torch.float32)


def fsdp_wrap(module: nn.Module, precision: str = "fp32") -> nn.Module:
    """FSDP2: shard each top-level block that holds parameters, then the root, with the precision's
    MixedPrecisionPolicy (the sharded parameters stay fp32)."""
    fully_shard = _fsdp_module().fully_shard
    policy = fsdp_policy(precision)
    kwargs = {"mp_policy": policy} if policy is not None else {}
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, **kwargs)
    fully_shard(module, **kwargs)
    return module


def unused_parameters(model: nn.Module, timer: StepTimer, precision: str, channels_last: bool) -> list[str]:
    """The trainable parameters that one training step of the timed step (`timer`, its example batch)
    leaves without a gradient: a head the loss does not use, a branch the forward skips. The model is
    put back as it was (`trial_state_kept`)."""
    x = to_device(timer.inputs, timer.device, channels_last)
    y = to_device(timer.targets, timer.device)
    with trial_state_kept(model):
        with autocast_for(timer.device, precision):
            loss = timer.call.loss(timer.call.forward(model, x, y), x, y)
        loss.backward()
        return [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]


def _ddp(model: nn.Module, optimizer: torch.optim.Optimizer | None, dev: torch.device, precision: str,
         world_size: int, unused: list[str] | None = None) -> tuple[nn.Module, str]:
    """DDP with its buckets as the gradients (`gradient_as_bucket_view`: no copy between them each step)
    and `find_unused_parameters` only when some rank's probe step found a parameter without a gradient
    (`unused`; None: not probed), as every rank must wrap alike: that search walks the autograd graph
    every step, and without it a parameter left out makes DDP fail at the next step."""
    find = distributed.any_rank(bool(unused))
    wrapped = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                      gradient_as_bucket_view=True, find_unused_parameters=find)
    why = f"kept: torchrun world of {world_size}, gradients as bucket views"
    if find:
        here = f"{len(unused)} here, e.g. {unused[0]}" if unused else "on another rank"
        why += f", find_unused_parameters (parameters without a gradient: {here})"
    elif unused is None:
        why += " (no example batch to probe for unused parameters: none assumed)"
    return wrapped, why


def _fsdp(model: nn.Module, optimizer: torch.optim.Optimizer | None, dev: torch.device, precision: str,
          world_size: int, unused: list[str] | None = None) -> tuple[nn.Module, str]:
    if optimizer is not None and optimizer.state:
        raise ValueError("strategy='fsdp' needs an optimizer without state yet (create it, then call accelerate)")
    names = {id(p): n for n, p in model.named_parameters()}
    wrapped = fsdp_wrap(model, precision)
    if optimizer is not None:  # the optimizer's groups pointed at the new (sharded) parameters
        new = dict(model.named_parameters())
        for g in optimizer.param_groups:
            g["params"] = [new[names[id(p)]] for p in g["params"]]
    mp = "" if precision == "fp32" else f", {precision} parameters (MixedPrecisionPolicy, fp32 reduce)"
    return wrapped, f"kept: fully_shard over {world_size} ranks{mp}"


# strategy -> fn(model, optimizer, device, precision, world_size, unused) -> (what runs the forward, decision)
WRAPPERS: dict[str, Callable[..., tuple[nn.Module, str]]] = {"ddp": _ddp, "fsdp": _fsdp}


def wrap_for_strategy(model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: str | None,
                      options: AccelerateOptions, report: AccelerateResult, dev: torch.device,
                      timer: StepTimer | None = None, runs: nn.Module | None = None) -> nn.Module:
    """The model wrapped for the strategy to be used (`resolve_strategy`) at the chosen precision, with
    its row (or the reason the strategy asked for is not used). `timer`: the trials' step, probed once
    under DDP for parameters without a gradient (`unused_parameters`). `runs`: what DDP wraps and runs
    in `model`'s place (the model compiled, its parameters the model's; default the model); FSDP shards
    `model` itself."""
    if strategy in WRAPPERS:
        unused = None
        if strategy == "ddp" and timer is not None:
            unused = unused_parameters(model, timer, report.precision, report.channels_last)
        target = runs if strategy == "ddp" and runs is not None else model
        wrapped, why = WRAPPERS[strategy](target, optimizer, dev, report.precision, ranks.env().world_size, unused)
        report.candidates.append(TrialRow("strategy", strategy, decision=why))
        return wrapped
    if "strategy" in options.untried:
        report.candidates.append(TrialRow("strategy", str(options.strategy),
                                          decision=f"not used: {options.untried['strategy']}"))
    return model


def choose_optimizer_implementation(optimizer: torch.optim.Optimizer, device: torch.device, dtensor: bool) -> str:
    """Switch a fresh optimizer to its fused (else foreach) implementation, in place; say what was done.
    An optimizer with state already is left as it is."""
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
