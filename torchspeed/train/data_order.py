"""Which samples each rank reads, in which order: a loader sharded over torchrun's ranks, and an epoch's
order written down so that another number of ranks can continue it: a checkpoint taken mid-epoch
records the order (`sampler_order`: a DistributedSampler's permutation, seeded by seed + epoch) and how
many samples were read; the ranks resuming it each read their part of the rest (`remaining_share`),
through a DataLoader with the user's settings (`with_sampler`) or a `loader_contract.EpochOrdered` loader.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from torchspeed.loader_contract import EpochOrder, EpochOrdered, conforms, yields_device_batches
from torchspeed.ranks import DistEnv

__all__ = ["shard_loader", "with_sampler", "sampler_order", "remaining_share"]


class _Strided:
    """Rank r of W keeps batches r, r+W, ...: shards any iterable of batches (re-iterable, has len)."""

    def __init__(self, loader: Iterable[Any], rank: int, world: int):
        self.loader, self.rank, self.world = loader, rank, world
        self.yields_device_batches = yields_device_batches(loader)

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
    """This rank's share of the data. A plain DataLoader is rebuilt around a DistributedSampler (the global
    batch is world_size x batch_size); a loader that shards itself (`shards_distributed = True`, a batch
    sampler with `num_replicas == world_size`, a DistributedSampler of this rank and world) is kept; a
    DistributedSampler of another world is remade for this one (same seed and order); any other iterable
    keeps every world_size-th batch."""
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
    DistributedSampler, or an `EpochOrdered` loader whose sampler is an `EpochOrder` (a FastLoader's
    not in a source's own order, as tar shards are). Plain types, for a checkpoint; None for any other
    order (a RandomSampler's depends on generator draws)."""
    s = getattr(loader, "sampler", None)
    if isinstance(loader, DataLoader) and isinstance(s, DistributedSampler) and loader.batch_size:
        n, batch, replicas = len(s.dataset), loader.batch_size, s.num_replicas  # type: ignore[arg-type]
    elif conforms(loader, EpochOrdered) and conforms(s, EpochOrder) and s.order is None:
        n, batch, replicas = s.n, s.batch_size, s.num_replicas
    else:
        return None
    return {"n": int(n), "seed": int(s.seed), "shuffle": bool(s.shuffle), "epoch": int(s.epoch),
            "world_size": int(replicas), "batch_size": int(batch),
            "sampler_drop_last": bool(getattr(s, "drop_last", False)) if isinstance(s, DistributedSampler) else False}


def remaining_share(order: dict[str, Any], consumed: int, world_size: int, rank: int) -> list[int]:
    """This rank's part of what is left of an epoch when `world_size` ranks continue it. `order` (see
    `sampler_order`) gives the epoch's samples as its K ranks read them (interleaved: rank r reads the
    r-th of every K), so after each read b batches of B the first K*b*B (`consumed`) are read. The rest
    is split the same way over `world_size` ranks, padded by wrapping around (as DistributedSampler
    pads) so all have as many batches (none waits at the epoch's end): a few twice, none left out."""
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
