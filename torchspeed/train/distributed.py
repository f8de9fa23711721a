"""torchrun awareness: process group set-up, data sharding and metric reduction.

Everything here is a no-op in a single process, so the same training script runs unchanged with
`python train.py` and `torchrun --nproc_per_node=K train.py` (and torchrun's multi-node flags).
"""
from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "env", "setup", "cuda_index", "all_reduce_sums", "any_rank", "barrier", "broadcast_ints",
           "gather_states", "shard_loader"]


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
    """Read torchrun's environment variables (WORLD_SIZE, RANK, LOCAL_RANK)."""
    try:
        return DistEnv(int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)),
                       int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise ValueError(f"torchrun environment variables WORLD_SIZE/RANK/LOCAL_RANK are not integers: {e}") from None


def cuda_index(local_rank: int, device_count: int, local_world_size: int | None = None,
               visible_devices: str | None = None) -> int:
    """The CUDA device index this process trains on.

    torchrun with one GPU per process: LOCAL_RANK. When every process is given its own GPU(s) through
    CUDA_VISIBLE_DEVICES (SLURM's one GPU per task), each sees them from index 0: LOCAL_RANK modulo
    the visible count (cuda:0 with one). Otherwise, more processes on this node than visible GPUs
    would share one (NCCL refuses, or rank 0 waits for a rank that crashed): a ValueError on every
    rank, before the process group, saying what to change.
    """
    if device_count < 1:
        raise ValueError("device 'cuda' was asked for, but no CUDA device is visible to this process (check "
                         "CUDA_VISIBLE_DEVICES and the driver), or train on the CPU with device='cpu'")
    if local_rank < device_count and (local_world_size is None or local_world_size <= device_count):
        return local_rank
    if visible_devices:  # each process was given its own device(s): they start at index 0 in every process
        return local_rank % device_count
    raise ValueError(
        f"{local_world_size or local_rank + 1} training processes on this node (LOCAL_RANK {local_rank}) but "
        f"{device_count} CUDA device(s) visible: processes would share a GPU. Launch at most {device_count} "
        f"per node (torchrun --nproc_per_node={device_count}), give each process its own GPU with "
        "CUDA_VISIBLE_DEVICES (as SLURM's --gpus-per-task does), or train on the CPU (device='cpu', gloo)")


def setup(device: torch.device) -> tuple[DistEnv, torch.device]:
    """Initialise the process group once (NCCL on CUDA, gloo on CPU) and pick this rank's device
    (`cuda_index`: a wrong LOCAL_RANK / device count is an error on every rank before any rank waits)."""
    e = env()
    if not e.distributed:
        return e, device
    if device.type == "cuda":
        lws = os.environ.get("LOCAL_WORLD_SIZE")
        device = torch.device("cuda", cuda_index(e.local_rank, torch.cuda.device_count(),
                                                 int(lws) if lws and lws.isdigit() else None,
                                                 os.environ.get("CUDA_VISIBLE_DEVICES")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return e, device


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sums(values: list[float]) -> list[float]:
    """Sum floats over all ranks (identity in one process)."""
    if not _active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any rank: stop decisions are agreed by all ranks."""
    return bool(all_reduce_sums([float(flag)])[0] > 0)


def broadcast_ints(values: list[int], src: int = 0) -> list[int]:
    """Rank `src`'s integers on every rank (so measured decisions cannot differ between ranks)."""
    if not _active():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_comm_device())
    dist.broadcast(t, src)
    return [int(v) for v in t.tolist()]


def gather_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `state` (tensors and plain types, e.g. its RNG state), in rank order, on every rank
    (`[state]` in one process). Sent as torch.save bytes and read back with weights_only=True."""
    if not _active():
        return [state]
    buf = io.BytesIO()
    torch.save(state, buf)
    dev = _comm_device()
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev))
    longest = max(int(t.item()) for t in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[:data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in sizes]
    dist.all_gather(parts, padded)
    return [torch.load(io.BytesIO(p[:int(n.item())].cpu().numpy().tobytes()), weights_only=True)
            for p, n in zip(parts, sizes)]


def barrier() -> None:
    if _active():
        dist.barrier()


class _Strided:
    """Rank r of W keeps batches r, r+W, ...: shards any iterable of batches (re-iterable, has len)."""

    def __init__(self, loader: Iterable[Any], rank: int, world: int):
        self.loader, self.rank, self.world = loader, rank, world
        self.yields_device_batches = getattr(loader, "yields_device_batches", False)

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.loader):
            if i % self.world == self.rank:
                yield batch

    def __len__(self) -> int:
        n = len(self.loader)  # type: ignore[arg-type]
        return n // self.world + (1 if self.rank < n % self.world else 0)

    def __getattr__(self, name: str) -> Any:  # set_epoch, state_dict, ... reach the inner loader
        return getattr(self.__dict__["loader"], name)


def shard_loader(loader: Iterable[Any], e: DistEnv, shuffle_seed: int = 0) -> Iterable[Any]:
    """This rank's share of the data.

    A plain DataLoader is rebuilt around a DistributedSampler (each rank reads only its samples; the
    global batch is world_size x batch_size). A loader that already shards itself (attribute
    `shards_distributed = True`, a batch sampler with `num_replicas == world_size`, or a DataLoader
    whose sampler is a DistributedSampler) is kept; any
    other iterable is sharded by taking every world_size-th batch.
    """
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    if not e.distributed or getattr(loader, "shards_distributed", False):
        return loader
    if getattr(getattr(loader, "batch_sampler", None), "num_replicas", 1) == e.world_size:
        return loader  # e.g. a FastLoader built after the process group: already this rank's shard
    if isinstance(loader, DataLoader):
        if isinstance(loader.sampler, DistributedSampler):
            return loader
        if loader.batch_size is None:
            return _Strided(loader, e.rank, e.world_size)
        shuffle = isinstance(loader.sampler, RandomSampler)
        seed = int(loader.generator.initial_seed()) if loader.generator is not None else shuffle_seed
        sampler = DistributedSampler(loader.dataset, num_replicas=e.world_size, rank=e.rank, shuffle=shuffle,
                                     seed=seed % 2**31, drop_last=loader.drop_last)
        kwargs: dict[str, Any] = dict(batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                                      drop_last=loader.drop_last, worker_init_fn=loader.worker_init_fn,
                                      generator=loader.generator, timeout=loader.timeout)
        if loader.num_workers > 0:
            kwargs.update(persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor)
        return DataLoader(loader.dataset, **kwargs)
    return _Strided(loader, e.rank, e.world_size)
