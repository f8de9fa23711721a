"""Checkpoint files: atomic, pickle-free, and never picked as "last" when incomplete.

A checkpoint is `torch.save` of tensors and plain types only, so it loads with
`torch.load(weights_only=True)` (no code can run from a checkpoint file). It is written to a temp
file, fsynced and renamed (torchspeed.atomic), so a crash mid-write leaves at most a hidden
`.step-*.tmp` file that `last_checkpoint()` ignores.

Under FSDP each rank holds a shard, so the model and optimizer go through
`torch.distributed.checkpoint` (DCP) into a directory `step-NNNNNNNN/` (written as a hidden temp
directory and renamed by rank 0 once every rank has finished). The one exception to "no pickle":
DCP's own `.metadata` file, which torch writes with pickle; load such checkpoints only from
sources you trust. The rest of the state (`state.pt`) is pickle-free as above.
"""
from __future__ import annotations

import os
import re
import shutil
import zipfile
from typing import Any

import torch

from torchspeed.atomic import atomic_write, fsync_dir

__all__ = ["checkpoint_name", "list_checkpoints", "last_checkpoint", "save_file", "load_file", "FORMAT"]

FORMAT = "torchspeed-checkpoint-v1"
_NAME = re.compile(r"^step-(\d{8,})(\.pt)?$")


def checkpoint_name(step: int, sharded: bool = False) -> str:
    return f"step-{step:08d}" + ("" if sharded else ".pt")


def _complete(path: str) -> bool:
    """A whole checkpoint: a readable zip (torch.save format), or a DCP directory with its metadata."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, ".metadata")) and _complete(os.path.join(path, "state.pt"))
    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip() is None if os.path.getsize(path) < (64 << 20) else True
    except (OSError, zipfile.BadZipFile):
        return False


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in `directory`, oldest first."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            path = os.path.join(directory, name)
            if _complete(path):
                found.append((int(m.group(1)), path))
    return sorted(found)


def last_checkpoint(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint in `directory`, or None. Partial writes are never returned."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def save_file(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """torch.save `state` atomically (temp file beside `path`, fsync, rename)."""
    with atomic_write(path, "wb") as f:
        torch.save(state, f)


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint written by `save_file`, with weights_only=True (tensors and plain types only)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "state.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"cannot read checkpoint {path!r} ({type(e).__name__}: {str(e)[:200]}); it is corrupt, "
                         "truncated or not a torchspeed checkpoint: resume from another one") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a torchspeed checkpoint (no format tag {FORMAT!r})")
    return state


def prune(directory: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (and stale temp files)."""
    found = list_checkpoints(directory)
    for _, path in found[:-keep_last] if keep_last > 0 else []:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
    fsync_dir(directory)


def save_sharded(directory: str, step: int, model: torch.nn.Module, optimizer: Any, state: dict[str, Any],
                 is_main: bool) -> str:
    """FSDP: every rank writes its shards with DCP into a temp dir; rank 0 adds state.pt and renames."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = os.path.join(directory, checkpoint_name(step, sharded=True))
    tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
    dist.barrier()
    if is_main:
        save_file(os.path.join(tmp, "state.pt"), state)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(directory)
    dist.barrier()
    return final


def load_sharded(path: str, model: torch.nn.Module, optimizer: Any) -> None:
    """FSDP: load this rank's shards of model and optimizer from a DCP checkpoint directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"{path!r} is not a sharded (FSDP) checkpoint directory; it has no DCP .metadata")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
