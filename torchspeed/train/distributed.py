"""torchrun awareness: process group set-up, data sharding and metric reduction.

Everything here is a no-op in a single process, so the same training script runs unchanged with
`python train.py` and `torchrun --nproc_per_node=K train.py` (and torchrun's multi-node flags).
"""
from __future__ import annotations

import io
import logging
import math
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["DistEnv", "env", "setup", "timeout", "attempt_generation", "cuda_index", "all_reduce_sums", "any_rank",
           "barrier", "broadcast_ints", "gather_states", "shard_loader", "with_sampler", "sampler_order",
           "remaining_share"]


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


def timeout() -> timedelta:
    """How long a collective (or forming the process group) waits for a peer before it fails:
    $TORCHSPEED_DIST_TIMEOUT seconds, else 600. A peer that dies is noticed at once (its connection
    closes); this bounds the wait for one that hangs, so a run ends with an error torchrun restarts
    from instead of waiting for ever. Long enough for rank 0 to measure accelerate()'s candidates
    while the others wait."""
    text = os.environ.get("TORCHSPEED_DIST_TIMEOUT", "600")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"TORCHSPEED_DIST_TIMEOUT={text!r}: give the seconds a collective may wait for a peer "
                         "(a positive number; 600 when unset)")
    return timedelta(seconds=seconds)


def attempt_generation(store: dist.Store, rank: int, world_size: int, wait: timedelta) -> int:
    """A number every rank of this launch attempt agrees on and no earlier attempt used.

    torchrun's agent keeps one store for the whole job: after a restart the keys of the dead
    attempt (each rank's gloo address, NCCL id, barrier counts) are still there, and a restarted rank
    reading them connects to a dead process ("connectFullMesh ... Connection refused") or waits for
    ever. TORCHELASTIC_RESTART_COUNT cannot tell attempts apart, as each node's agent counts only
    its own failures. So rank 0 draws the next number from the store, and each other rank asks for
    it under a nonce of its own, acknowledging what it got: a stale question is answered but never
    acknowledged under the new number, so only this attempt's ranks complete the exchange."""
    deadline = time.monotonic() + wait.total_seconds()
    if rank != 0:
        nonce = secrets.token_hex(8)
        store.set(f"torchspeed/ask/{rank}", nonce)
        store.wait([f"torchspeed/answer/{nonce}"], wait)
        generation = int(store.get(f"torchspeed/answer/{nonce}"))
        store.set(f"torchspeed/ack/{generation}/{rank}", "1")
        return generation
    generation = int(store.add("torchspeed/generation", 1))
    answered: dict[int, bytes] = {}
    pending = set(range(1, world_size))
    while pending:
        for r in sorted(pending):
            if store.check([f"torchspeed/ack/{generation}/{r}"]):
                pending.discard(r)
            elif store.check([f"torchspeed/ask/{r}"]):
                nonce = store.get(f"torchspeed/ask/{r}")
                if answered.get(r) != nonce:
                    store.set(f"torchspeed/answer/{nonce.decode()}", str(generation))
                    answered[r] = nonce
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"rank(s) {sorted(pending)} of {world_size} did not join the process group within "
                               f"{wait.total_seconds():.0f} s (TORCHSPEED_DIST_TIMEOUT); see their logs")
        if pending:
            time.sleep(0.01)
    return generation


def _store_of_this_attempt(e: DistEnv, wait: timedelta) -> dist.Store | None:
    """Under torchrun's shared agent store: that store, with keys of this attempt only (see
    `attempt_generation`). None elsewhere (init_process_group's own env:// store is fresh each launch)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not addr or not port.isdigit():
        return None
    store = dist.TCPStore(addr, int(port), e.world_size, is_master=False, timeout=wait)
    generation = attempt_generation(store, e.rank, e.world_size, wait)
    log.debug("process group of launch attempt %d (torchrun restart %s)", generation,
              os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"))
    return dist.PrefixStore(f"torchspeed/attempt-{generation}/", store)


def setup(device: torch.device) -> tuple[DistEnv, torch.device]:
    """Initialise the process group once (NCCL on CUDA, gloo on CPU) and pick this rank's device
    (`cuda_index`: a wrong LOCAL_RANK / device count is an error on every rank before any rank waits).

    Made to survive torchrun's restarts: every attempt forms its group on keys of its own
    (`attempt_generation`), and collectives wait at most `timeout()` for a peer."""
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
        wait = timeout()
        store = _store_of_this_attempt(e, wait)
        where = dict(store=store, rank=e.rank, world_size=e.world_size) if store is not None else {}
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=wait,
                                device_id=device if device.type == "cuda" else None, **where)
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
    whose DistributedSampler is this rank's of this world) is kept; a DistributedSampler made for
    another world is remade for this one (same seed and order); any other iterable is sharded by
    taking every world_size-th batch.
    """
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    if not e.distributed or getattr(loader, "shards_distributed", False):
        return loader
    if getattr(getattr(loader, "batch_sampler", None), "num_replicas", 1) == e.world_size:
        return loader  # e.g. a FastLoader built after the process group: already this rank's shard
    if isinstance(loader, DataLoader):
        s = loader.sampler
        if isinstance(s, DistributedSampler):
            if (s.num_replicas, s.rank) == (e.world_size, e.rank):
                return loader
            # made for another world (e.g. num_replicas=1 in one process): the same order, this world's shard
            return with_sampler(loader, DistributedSampler(loader.dataset, num_replicas=e.world_size, rank=e.rank,
                                                           shuffle=s.shuffle, seed=s.seed, drop_last=s.drop_last))
        if loader.batch_size is None:
            return _Strided(loader, e.rank, e.world_size)
        shuffle = isinstance(loader.sampler, RandomSampler)
        seed = int(loader.generator.initial_seed()) if loader.generator is not None else shuffle_seed
        return with_sampler(loader, DistributedSampler(loader.dataset, num_replicas=e.world_size, rank=e.rank,
                                                       shuffle=shuffle, seed=seed % 2**31, drop_last=loader.drop_last))
    return _Strided(loader, e.rank, e.world_size)


def with_sampler(loader: Any, sampler: Iterable[int], drop_last: bool | None = None) -> Any:
    """The DataLoader `loader` with its settings (batch size, workers, collate, generator, ...) reading
    in the order `sampler` gives (and `drop_last` when given)."""
    from torch.utils.data import DataLoader

    kwargs: dict[str, Any] = dict(batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                                  collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                                  drop_last=loader.drop_last if drop_last is None else drop_last,
                                  worker_init_fn=loader.worker_init_fn,
                                  generator=loader.generator, timeout=loader.timeout)
    if loader.num_workers > 0:
        kwargs.update(persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor)
    return DataLoader(loader.dataset, **kwargs)


def sampler_order(loader: Any) -> dict[str, Any] | None:
    """How `loader` orders this epoch's samples, when that is DistributedSampler's order (a permutation
    seeded by seed + epoch, rank r of K taking every K-th sample): a DataLoader over a
    DistributedSampler, or a loader whose sampler says the same (a FastLoader's). Plain types, for a
    checkpoint; None for any other order (a RandomSampler's depends on generator draws)."""
    from torch.utils.data import DataLoader, DistributedSampler

    s = getattr(loader, "sampler", None)
    if isinstance(loader, DataLoader) and isinstance(s, DistributedSampler) and loader.batch_size:
        n, batch, replicas = len(s.dataset), loader.batch_size, s.num_replicas  # type: ignore[arg-type]
    elif all(hasattr(s, a) for a in ("n", "seed", "shuffle", "epoch", "num_replicas", "batch_size", "rest")) \
            and getattr(s, "order", None) is None:  # a FastLoader's, not in a source's own order (tar shards)
        n, batch, replicas = s.n, s.batch_size, s.num_replicas
    else:
        return None
    return {"n": int(n), "seed": int(s.seed), "shuffle": bool(s.shuffle), "epoch": int(s.epoch),
            "world_size": int(replicas), "batch_size": int(batch),
            "sampler_drop_last": bool(getattr(s, "drop_last", False)) if isinstance(s, DistributedSampler) else False}


def remaining_share(order: dict[str, Any], consumed: int, world_size: int, rank: int) -> list[int]:
    """This rank's part of what is left of an epoch when `world_size` ranks continue it.

    `order` (see `sampler_order`) gives the epoch's samples in the order its ranks read them
    (interleaved: rank r of K reads the r-th of every K); after each rank read b batches of B, the
    first K*b*B of them are read (`consumed`), whatever K was. The rest is split the same way over
    `world_size` ranks, padded to equal length by wrapping around (as DistributedSampler pads), so
    each remaining sample is in exactly one rank's part and every rank has as many batches (none
    waits for another at the epoch's end); a few samples may be read twice, none is left out."""
    from torch.utils.data import DistributedSampler

    k = order["world_size"]
    parts = []
    for r in range(k):
        s = DistributedSampler(range(order["n"]), num_replicas=k, rank=r,  # type: ignore[arg-type]
                               shuffle=order["shuffle"], seed=order["seed"], drop_last=order["sampler_drop_last"])
        s.set_epoch(order["epoch"])
        parts.append(list(s))
    epoch = list(dict.fromkeys(i for row in zip(*parts) for i in row))  # read order, each sample once
    rest = epoch[consumed:]
    if not rest:
        return []
    pad = -len(rest) % world_size
    rest += (rest * math.ceil(pad / len(rest)))[:pad]
    return rest[rank::world_size]
