"""The epoch sampler: which samples each batch of each epoch holds on this rank, as (epoch, index)
keys (the epoch travels with the indices: persistent workers need no message, a resume skips batches free)."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import DistributedSampler

from torchspeed import ranks

__all__ = ["EpochBatchSampler"]


class EpochBatchSampler:
    """Batches of (epoch, index) for epoch `epoch`, skipping the first `start` batches.

    The order is DistributedSampler's (a permutation seeded by seed + epoch, every `num_replicas`-th
    index from `rank`: the shards of one epoch are disjoint), also for one process (num_replicas=1), so
    one code path covers both. An uneven count is padded by wrapping around to the first samples
    (DistributedSampler(drop_last=False)): every rank has the same number of batches, whatever the batch
    size, and no sample is left out of an epoch (a few are seen twice). `num_replicas`/`rank` not given
    are read each time they are needed (`world`), so a loader built before `init_process_group` follows it.
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int,
                 num_replicas: int | None = 1, rank: int | None = 0,
                 order: Callable[[int, int, bool], Sequence[int]] | None = None):
        self.n, self.batch_size, self.shuffle, self.drop_last, self.seed = n, batch_size, shuffle, drop_last, seed
        self.order = order  # a source's own epoch order (tar shards: shard order + local shuffle), or None
        self._num_replicas, self._rank = num_replicas, rank
        self.epoch, self.start = 0, 0
        # for one pass: this rank's samples of an epoch that another number of ranks began, read from
        # batch `start` on (set by `FastLoader.continue_epoch`)
        self.rest: list[int] | None = None
        self.world()  # a bad explicit value or environment fails now, naming it

    def world(self) -> tuple[int, int]:
        """(num_replicas, rank) now: the explicit ones, else the process group's, else torchrun's."""
        replicas, rank = ranks.world(self._num_replicas, self._rank)
        if not (isinstance(replicas, int) and replicas >= 1 and isinstance(rank, int) and 0 <= rank < replicas):
            raise ValueError(f"num_replicas (or WORLD_SIZE) must be a positive integer and rank (or RANK) in "
                             f"0..num_replicas - 1, got {replicas!r} and {rank!r}")
        return replicas, rank

    @property
    def num_replicas(self) -> int:
        return self.world()[0]

    @property
    def rank(self) -> int:
        return self.world()[1]

    def _indices(self) -> list[int]:
        replicas, rank = self.world()
        if self.order is not None:  # the source's order, padded as DistributedSampler pads, in contiguous
            per = self.per_replica()  # blocks: each rank reads mostly its own shards
            idx = np.resize(np.asarray(self.order(self.epoch, self.seed, self.shuffle), dtype=np.int64), per * replicas)
            return idx[rank * per:(rank + 1) * per].tolist()
        s = DistributedSampler(range(self.n), num_replicas=replicas, rank=rank,  # type: ignore[arg-type]
                               shuffle=self.shuffle, seed=self.seed, drop_last=False)
        s.set_epoch(self.epoch)
        return list(s)

    def per_replica(self) -> int:
        return math.ceil(self.n / self.num_replicas)

    def __len__(self) -> int:
        m = self.per_replica()
        return m // self.batch_size if self.drop_last else math.ceil(m / self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        idx, rest, self.rest = self._indices(), self.rest, None
        if rest is not None:
            idx = idx[:self.start * self.batch_size] + rest
        for b in range(self.start, len(self)):
            yield [(self.epoch, i) for i in idx[b * self.batch_size:(b + 1) * self.batch_size]]
