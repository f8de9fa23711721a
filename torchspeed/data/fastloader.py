"""FastLoader, what `fast_loader` returns, and the loader contract it keeps (`torchspeed.loader_contract`:
DeviceBatches, Resumable, Recountable, EpochOrdered), by which train and doctor use it without importing data/."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchspeed.data.prefetch import DevicePrefetcher
from torchspeed.data.rendering import AugmentedDataset
from torchspeed.data.sampler import EpochBatchSampler
from torchspeed.data.sources import source_identity
from torchspeed.data.tune import TuneResult, worker_error

__all__ = ["FastLoader"]

log = logging.getLogger(__name__)


class FastLoader:
    """Iterable of `(images, labels)` already on the device: images normalised float NCHW
    (channels_last memory if asked), labels int64.

    Re-iterable: each complete pass advances the epoch (new shuffle); a pass left early is not
    counted (the next pass starts that epoch again from its first batch). A loader given
    `load_state_dict(state)` starts its next pass at the next batch unseen when `state` was taken.
    """

    yields_device_batches = True  # `loader_contract.DeviceBatches`: batches need no .to(device)

    def __init__(self, dataset: AugmentedDataset, sampler: EpochBatchSampler, dataloader: DataLoader,
                 prefetcher: DevicePrefetcher, batches: Iterable[Any], threads: int = 1,
                 rebuild: Callable[..., FastLoader] | None = None, decoder_table: list | None = None):
        """`batches`: what a pass iterates; `rebuild(num_workers, ...)`: `fast_loader`'s, for `with_counts`."""
        self._augmented, self.batch_sampler, self.dataloader, self.prefetcher = dataset, sampler, dataloader, prefetcher
        self.threads = threads if dataloader.num_workers == 0 else 1
        self._batches, self._rebuild = batches, rebuild
        self.settings: TuneResult | None = None  # the measurement, when num_workers or threads were tuned
        self.decoder_table = decoder_table or []  # the decoder measurement, when one was made
        self.epoch = 0
        self.batches_done = 0  # batches of this epoch yielded so far (what state_dict reports)
        self._resume_at = 0  # where the next pass starts: set by load_state_dict, used once

    @property
    def dataset(self) -> Any:
        """The underlying record source (PackedDataset, FolderSource, TarShards, ArrowImages or your Dataset's
        wrapper): `len` and `.classes`."""
        return self._augmented.source

    @property
    def batch_size(self) -> int:
        """Samples per batch (DataLoader's attribute, for code written for one)."""
        return self.batch_sampler.batch_size

    @property
    def sampler(self) -> EpochBatchSampler:
        """What orders this rank's samples: its `num_replicas`, `rank`, `shuffle` and `epoch`."""
        return self.batch_sampler

    @property
    def drop_last(self) -> bool:
        """Whether a last batch smaller than `batch_size` is left out."""
        return self.batch_sampler.drop_last

    @property
    def num_workers(self) -> int:
        """Worker processes really used (0: `threads` of this process make the batches)."""
        return self.dataloader.num_workers

    @property
    def decoder(self) -> str:
        return self._augmented.decoder

    @property
    def device(self) -> torch.device:
        return self.prefetcher.device

    @property
    def seed(self) -> int:
        return self._augmented.seed

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def identity(self) -> dict[str, Any]:
        """What this loader's batches depend on, JSON-able: the data (its files' sizes and times, or a
        Dataset's class and length), batch, crop, augmentation, decoder and device: the key under which a
        choice measured with it (e.g. `train.choose_counts`) is remembered."""
        aug = self._augmented
        return {"data": source_identity(aug.source), "batch_size": self.batch_size, "crop": aug.size,
                "transform": repr(aug.transform), "layout": aug.layout, "decoder": aug.decoder,
                "device": str(self.device), "drop_last": self.drop_last}

    def with_counts(self, num_workers: int, threads: int = 1) -> FastLoader:
        """This loader (same data, crop, decoder, order, epoch and position) with its batches made by
        `num_workers` worker processes, or at 0 by `threads` threads of this process. Why: the counts
        `fast_loader` measures are the fastest for the loader alone; whoever knows the training step
        (`train.choose_loader_with_step`) times less parallel ones with it. The two share their sampler."""
        if not isinstance(num_workers, int) or num_workers < 0 or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"with_counts needs num_workers >= 0 and threads >= 1, got {num_workers!r}, {threads!r}")
        if self._rebuild is None:
            raise ValueError("this FastLoader was not built by fast_loader(); it cannot be rebuilt with other counts")
        dl = self.dataloader
        other = self._rebuild(num_workers, dl.prefetch_factor or 2, dl.persistent_workers if dl.num_workers else True,
                              dl.pin_memory, threads)
        other.settings, other.decoder_table = self.settings, self.decoder_table
        other.epoch, other.batches_done, other._resume_at = self.epoch, self.batches_done, self._resume_at
        return other

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (its shuffle and augmentation); keeps a loaded resume point if it is the current one."""
        if epoch != self.epoch:
            self.epoch, self.batches_done, self._resume_at = int(epoch), 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "batches_done": int(self.batches_done), "seed": int(self.seed)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            epoch, done, seed = int(state["epoch"]), int(state["batches_done"]), int(state["seed"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"not a FastLoader state (need epoch, batches_done, seed): {state!r}") from None
        if seed != self.seed:
            raise ValueError(f"the state was taken with seed {seed} but this loader has seed {self.seed}; "
                             f"build the loader with seed={seed} to resume exactly")
        if not 0 <= done <= len(self):
            raise ValueError(f"batches_done {done} is outside 0..{len(self)} for this loader")
        self.epoch, self.batches_done, self._resume_at = epoch, done, done

    def continue_epoch(self, epoch: int, first: int, share: Sequence[int]) -> None:
        """Make the next pass epoch `epoch` from batch `first` on, reading the sample indices `share` (this
        rank's part of what is left of an epoch that another number of ranks began; see
        `loader_contract.EpochOrdered`). Used once: the pass after it is the next epoch, whole."""
        self.load_state_dict({**self.state_dict(), "epoch": epoch, "batches_done": first})
        self.batch_sampler.rest = list(share)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self._resume_at = self._resume_at, 0  # a loaded resume point is used once
        if start >= len(self):  # the state was taken at the very end of an epoch
            self.epoch, start = self.epoch + 1, 0
        self.batches_done = start
        self.batch_sampler.epoch, self.batch_sampler.start = self.epoch, start
        try:
            for batch in self._batches:
                self.batches_done += 1
                if len(batch[1]) == 0:  # on_error="skip" left out every sample: nothing to train on
                    log.warning("a whole batch was left out (every sample of it could not be read)")
                    continue
                yield batch
        except ValueError as e:  # a bad sample in a worker process: its one-line message, not the worker's traceback
            one_line = worker_error(e)
            if one_line is e:
                raise
            raise one_line from None
        self.epoch, self.batches_done = self.epoch + 1, 0

    def __repr__(self) -> str:
        return (f"FastLoader({self.dataset!r}, batch_size={self.batch_sampler.batch_size}, crop={self._augmented.size}, "
                f"decoder={self.decoder}, num_workers={self.dataloader.num_workers}, threads={self.threads}, "
                f"device={self.device})")
