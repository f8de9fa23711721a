"""Where this process sits in a torchrun launch, read in one place, and how ranks agree on a value.

torchrun tells each process its place through WORLD_SIZE, RANK and LOCAL_RANK; an initialised process
group knows the same once `init_process_group` ran. Loaders shard by it, the Trainer and accelerate
read it, doctor names its per-rank records by it, and a measured decision is taken by rank 0 and sent
to every other rank (`broadcast_ints`, `broadcast_json`) so that no two ranks train differently.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "env", "world", "active", "comm_device", "broadcast_ints", "broadcast_json"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a torchrun launch (world_size 1 when not launched by torchrun)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env() -> DistEnv:
    """torchrun's environment variables (WORLD_SIZE, RANK, LOCAL_RANK), read before or after the
    process group exists."""
    try:
        return DistEnv(int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)),
                       int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError:
        raise ValueError(f"the environment variables WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}, "
                         f"RANK={os.environ.get('RANK')!r} and LOCAL_RANK={os.environ.get('LOCAL_RANK')!r} must be "
                         "integers (torchrun sets them)") from None


def world(num_replicas: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """(num_replicas, rank) to shard by: each explicit argument wins; else an initialised process group;
    else torchrun's environment (a loader built before `init_process_group` still shards); else (1, 0)."""
    if num_replicas is not None and rank is not None:
        return num_replicas, rank
    if dist.is_available() and dist.is_initialized():
        found = dist.get_world_size(), dist.get_rank()
    else:
        e = env()
        found = e.world_size, e.rank
    return (found[0] if num_replicas is None else num_replicas), (found[1] if rank is None else rank)


def active() -> bool:
    """Whether a process group of more than one rank is running (collectives are needed)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def comm_device() -> torch.device:
    """Where the process group's tensors live: the rank's GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_ints(values: list[int], src: int = 0) -> list[int]:
    """Rank `src`'s integers on every rank (so measured decisions cannot differ between ranks)."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=comm_device())
    dist.broadcast(t, src)
    return [int(v) for v in t.tolist()]


def broadcast_json(value: Any, src: int = 0) -> Any:
    """Rank `src`'s plain-JSON `value` on every rank (sent as UTF-8 JSON bytes, never pickled)."""
    if not active():
        return value
    data = json.dumps(value).encode() if dist.get_rank() == src else b""
    (size,) = broadcast_ints([len(data)], src)
    buf = torch.zeros(size, dtype=torch.uint8, device=comm_device())
    if dist.get_rank() == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src)
    return json.loads(buf.cpu().numpy().tobytes().decode())
