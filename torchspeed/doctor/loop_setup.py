"""The set-up of a training loop as the rules judge it: its loader, model, machine and torch's global
switches, read into the plain dicts of a report's `settings` (by `profile`, in-process, and by the
Recorder in the script under `doctor`)."""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from torchspeed.runtime import cpu_flags, usable_cores

__all__ = ["loader_settings", "machine_settings", "model_settings", "repeated_blocks"]


def loader_settings(loader: Any, name: str = "loader") -> dict[str, Any] | None:
    """num_workers / pin_memory / batch_size / persistent_workers of a DataLoader (or of the DataLoader
    inside a wrapper exposing `.dataloader`, such as FastLoader); None for other iterables."""
    dl = loader if isinstance(loader, torch.utils.data.DataLoader) else getattr(loader, "dataloader", None)
    if not isinstance(dl, torch.utils.data.DataLoader):
        return None
    return {"name": name, "num_workers": dl.num_workers, "pin_memory": bool(dl.pin_memory),
            "batch_size": dl.batch_size, "persistent_workers": bool(dl.persistent_workers),
            "dataset": type(dl.dataset).__name__, "training": True}


def machine_settings() -> dict[str, Any]:
    """What the rules need to know about this machine and torch's global switches."""
    s: dict[str, Any] = {"cores": usable_cores(), "torch_threads": torch.get_num_threads(),
                         "cpu_bf16": bool({"avx512_bf16", "amx_bf16"} & cpu_flags()),
                         "cpu_amx": "amx_bf16" in cpu_flags(),
                         "cpu_bf16_flags": sorted({"avx512_bf16", "amx_bf16"} & cpu_flags()),
                         "cuda_available": torch.cuda.is_available(), "cuda_capability": None,
                         "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)}
    if torch.cuda.is_available():
        s["cuda_capability"] = list(torch.cuda.get_device_capability())
    return s


def model_settings(model: nn.Module) -> dict[str, Any]:
    p = next(model.parameters(), None)
    mods = list(model.modules())
    parallel = ("DataParallel" if isinstance(model, nn.DataParallel)
                else "DistributedDataParallel" if isinstance(model, nn.parallel.DistributedDataParallel)
                else "FSDP" if _is_fsdp(model) else "none")
    return {"class": type(getattr(model, "module", model)).__name__,
            # a lazy module's parameters have no size until its first forward (the one being observed)
            "params": int(sum(q.numel() for q in model.parameters()
                              if not isinstance(q, nn.parameter.UninitializedParameter))),
            "dtype": str(p.dtype) if p is not None else None, "device": str(p.device) if p is not None else "cpu",
            "convs": sum(isinstance(m, nn.modules.conv._ConvNd) for m in mods),
            "bn_or_dropout": any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout)) for m in mods),
            # the largest dropout probability of its dropout modules (a Hugging Face config's 0.1 by default)
            "dropout": max((float(m.p) for m in mods if isinstance(m, nn.modules.dropout._DropoutNd)), default=0.0),
            "parallel": parallel, "repeated_blocks": repeated_blocks(model)}


def repeated_blocks(model: nn.Module) -> dict[str, Any] | None:
    """The largest run of repeated blocks (a ModuleList / Sequential holding two or more modules of one
    class that have submodules: a transformer's layers), where `--try compile=regional` compiles each
    once: {"path", "class", "count"}; None when nothing repeats."""
    best = None
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        kinds = {type(c) for c in m}
        first = next(iter(m))
        if len(kinds) == 1 and any(True for _ in first.children()):
            size = sum(p.numel() for p in m.parameters() if not isinstance(p, nn.parameter.UninitializedParameter))
            if best is None or size > best[0]:
                best = (size, {"path": name, "class": type(first).__name__, "count": len(m)})
    return best[1] if best else None


def _is_fsdp(model: nn.Module) -> bool:
    """A module sharded by FSDP2's `fully_shard` (or wrapped by FSDP1). Read from `sys.modules`: a sharded
    model imported FSDP, so doctor imports it for no other (nor fails on a torch without distributed)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, (fsdp.FSDPModule, fsdp.FullyShardedDataParallel))
