"""The distributed strategy (DDP or FSDP2 over a torchrun launch) and the optimizer's implementation.

Neither is measured. One process per device is the way to use several: the strategy is the one asked
for (on "auto", DDP under torchrun), one wrapping function each in `WRAPPERS`. One fused (else
foreach) kernel over all parameters is never slower than a Python loop over them, same math.
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
from torchspeed.optional import optional
from torchspeed.runtime import precision_dtype
from torchspeed.train import distributed
from torchspeed.train.choices import AccelerateOptions, AccelerateResult, TrialRow

__all__ = ["WRAPPERS", "choose_optimizer_implementation", "fsdp_policy", "fsdp_wrap", "resolve_strategy",
           "wrap_for_strategy"]


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


def _ddp(model: nn.Module, optimizer: torch.optim.Optimizer | None, dev: torch.device, precision: str,
         world_size: int) -> tuple[nn.Module, str]:
    wrapped = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    return wrapped, f"kept: torchrun world of {world_size}"


def _fsdp(model: nn.Module, optimizer: torch.optim.Optimizer | None, dev: torch.device, precision: str,
          world_size: int) -> tuple[nn.Module, str]:
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


# strategy -> fn(model, optimizer, device, precision, world_size) -> (what runs the forward, decision)
WRAPPERS: dict[str, Callable[..., tuple[nn.Module, str]]] = {"ddp": _ddp, "fsdp": _fsdp}


def wrap_for_strategy(model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: str | None,
                      options: AccelerateOptions, report: AccelerateResult, dev: torch.device) -> nn.Module:
    """The model wrapped for the strategy to be used (`resolve_strategy`) at the chosen precision, with
    its row (or the reason the strategy asked for is not used)."""
    if strategy in WRAPPERS:
        wrapped, why = WRAPPERS[strategy](model, optimizer, dev, report.precision, ranks.env().world_size)
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
