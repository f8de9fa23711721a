"""tune_loader(): which loader a dataset, a data path or a factory is timed as (`fast_loader`'s pipeline,
a plain DataLoader, the factory itself); the search that times it is data/tune.py's."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchspeed.args import positive_number
from torchspeed.data.hfdatasets import is_hf_dataset
from torchspeed.data.loader import FastLoader, LoaderOptions, fast_loader, with_decoder
from torchspeed.data.shards import looks_like_shards
from torchspeed.data.sources import DatasetSource, as_source, is_dataset_spec, source_identity, spec_for_tuning
from torchspeed.data.store import PackedDataset
from torchspeed.data.tune import (TuneResult, as_counts, candidate_counts, dataloader_factory, measure_settings,
                                  remembered_settings)
from torchspeed.runtime import resolve_device, usable_cores

__all__ = ["tune_loader"]

log = logging.getLogger(__name__)


def tune_loader(
    dataset: Any,
    batch_size: int,
    *,
    num_workers: str | int | Sequence[int] = "auto",
    threads: str | int | Sequence[int] | None = None,
    tune_seconds: float = 1.0,
    device: str | torch.device = "auto",
    prefetch_factor: Sequence[int] = (2, 4),
    persistent_workers: Sequence[bool] = (True, False),
    pin_memory: str | bool = "auto",
    collate_fn: Callable | None = None,
    crop: int = 224,
    train: bool = True,
    progress: bool | Callable[[str], None] = False,
    patience: int = 2,
    refresh: bool = False,
) -> TuneResult:
    """Measure loader throughput over settings; return the fastest with the whole table (`TuneResult`).

    `dataset`: a map-style Dataset (timed as a plain shuffled DataLoader), an ImageFolder or store path
    (timed as the torchspeed pipeline, `fast_loader` with `crop` and `train`), a Dataset factory spec
    `package.module:factory` or `path/file.py:factory` (built once; timed as the torchspeed pipeline when
    its samples are images it takes, PIL or uint8, else as a plain DataLoader with the Dataset's own
    transforms, logged at INFO), or a factory
    `build(num_workers, prefetch_factor, persistent_workers, pin_memory[, threads]) -> iterable of batches`.
    `num_workers`: "auto" (0..cores+1) or a list of candidates (or a comma string "0,1,2"), walked upward
    until `patience` successive counts are slower than the best so far (one noisy measurement does not
    end the search); the `prefetch_factor` and `persistent_workers` candidates are then tried at the best
    count, and pin_memory only with CUDA. `threads` (pipelines whose factory takes `threads=`; "auto" for
    a path): "auto" (1..cores+1) or a list tries num_workers=0 with those threads before the worker
    processes, then the best of each again, interleaved, three passes each (rows marked `final`); an
    integer fixes the threads at num_workers=0. Each configuration runs two passes of `tune_seconds` after
    a warm-up, once other processes have left the cores (waiting at most `tune.QUIET_WAIT_S`;
    `others_cores` and `busy_warning` say when they did not). Logged at INFO on
    "torchspeed.data.loader_tuning"; `progress` (True: stderr, or a callable) reports each configuration.

    The result is remembered on this machine for the same data (a path's files, a Dataset's class and
    length), batch, crop, device and candidates: the next call returns it at once, with `remembered`
    set ("remembered from <date> (<figure>)"), unless `refresh=True`. A loader factory has no identity
    to remember it by and is measured every time; a measurement taken on a busy machine is not kept.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    tune_seconds = positive_number(tune_seconds, "tune_seconds")
    dev = resolve_device(device)
    num_workers = as_counts(num_workers, "num_workers", 0)
    timed = _timed_factory(dataset, batch_size, num_workers, threads, collate_fn, crop, train, dev, progress, refresh)
    pins = [False, True] if (pin_memory == "auto" and dev.type == "cuda") else [bool(pin_memory) and pin_memory != "auto"]
    worker_counts, thread_counts = candidate_counts(
        timed.num_workers, None if timed.threads is None else as_counts(timed.threads, "threads", 1))
    parts = None if timed.identity is None else {
        "entry": "tune_loader", "data": timed.identity, "batch_size": batch_size, "crop": crop, "train": train,
        "device": dev.type, "cores": usable_cores(), "num_workers": worker_counts, "threads": thread_counts,
        "prefetch_factor": [int(p) for p in prefetch_factor], "persistent_workers": [bool(p) for p in persistent_workers],
        "pin_memory": pins, "patience": patience}

    def measured() -> TuneResult:
        settings = measure_settings(timed.build, num_workers=worker_counts, threads=thread_counts,
                                    prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                                    pin_memory=pins, tune_seconds=tune_seconds, device=dev, progress=progress,
                                    patience=patience)
        log.info("tune_loader: %s (%.0f items/s), %d settings timed in %.1f s", settings.describe(),
                 settings.throughput, len(settings.table), settings.tuning_s)
        return settings

    return remembered_settings("tune_loader", parts, measured, refresh, progress)


class _Timed(NamedTuple):
    """What tune_loader times and searches; `identity` None: a factory, measured every time."""

    build: Callable[..., Any]
    num_workers: str | int | list[int]
    threads: str | int | Sequence[int] | None
    identity: dict[str, Any] | None


def _timed_factory(dataset: Any, batch_size: int, num_workers: str | int | list[int],
                   threads: str | int | Sequence[int] | None, collate_fn: Callable | None, crop: int, train: bool,
                   device: torch.device, progress: Any, refresh: bool) -> _Timed:
    """What tune_loader times, and the threads it searches: the torchspeed pipeline for a path or a
    Dataset of images (its decoder chosen once, as fast_loader chooses it; threads "auto" unless
    given), the factory given, or a plain DataLoader (no threads)."""
    name = None
    if is_dataset_spec(dataset):  # built once, not once per setting timed
        name, dataset = dataset.strip(), spec_for_tuning(dataset)
        if not isinstance(dataset, DatasetSource):
            threads = None  # a plain DataLoader has worker processes only
    if is_hf_dataset(dataset) or looks_like_shards(dataset):  # read as records, like a path: not a plain DataLoader
        dataset = as_source(dataset)
    if isinstance(dataset, (str, os.PathLike, DatasetSource)) or hasattr(dataset, "record"):
        source = as_source(dataset)
        identity = source_identity(source)
        options, _ = with_decoder(source, LoaderOptions(train=train, crop=crop, device=device, num_workers=num_workers,
                                                         progress=progress, refresh=refresh))
        # a store is opened by each loader timed (its LMDB handle per process); other sources are opened once
        data = dataset if isinstance(source, PackedDataset) else source

        def build(num_workers: int, prefetch_factor: int | None, persistent_workers: bool, pin_memory: bool,
                  threads: int = 1) -> FastLoader:
            return fast_loader(data, batch_size, train=train, crop=crop, device=device, num_workers=num_workers,
                               prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                               pin_memory=pin_memory, threads=threads, decoder=options.decoder)

        # the torchspeed pipeline: its threads are searched too
        return _Timed(build, options.num_workers, "auto" if threads is None else threads,
                      {**identity, "decoder": options.decoder})
    if callable(dataset) and not hasattr(dataset, "__getitem__"):
        return _Timed(dataset, num_workers, threads, None)
    identity = {"dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}", "spec": name,
                "n": len(dataset) if hasattr(dataset, "__len__") else None,
                "collate_fn": None if collate_fn is None else getattr(collate_fn, "__qualname__", type(collate_fn).__name__)}
    return _Timed(dataloader_factory(dataset, batch_size, collate_fn, name=name), num_workers, threads, identity)
