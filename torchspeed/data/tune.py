"""tune_loader(): time the loader itself over num_workers, prefetch_factor, persistent_workers, pin_memory.

Why (article 004): the best setting is found by timing the loader alone on this machine, and it is
not the largest: past the core count, workers only compete with each other and with the model. So
the search walks num_workers upward from 0 and stops as soon as throughput falls.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchspeed.measure import time_iterable
from torchspeed.runtime import resolve_device, usable_cores

__all__ = ["tune_loader", "LoaderSettings"]


@dataclass
class LoaderSettings:
    """The fastest DataLoader settings measured, with every configuration tried (`table`)."""

    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool
    throughput: float  # items/s of the chosen settings
    table: list[dict[str, Any]] = field(default_factory=list)
    threads: int = 1  # fast_loader's batch-making threads when num_workers is 0

    def dataloader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `torch.utils.data.DataLoader`."""
        kw: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.num_workers > 0:
            kw.update(prefetch_factor=self.prefetch_factor, persistent_workers=self.persistent_workers)
        return kw

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextmanager
def _more_workers_than_cores_on_purpose() -> Iterator[None]:
    """Silence DataLoader's warning about more workers than cores: trying them is how we see throughput fall."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        yield


def _shutdown(loader: Any) -> None:
    """Stop a measured loader's worker processes now instead of whenever it is collected."""
    dl = getattr(loader, "dataloader", loader)
    it = getattr(dl, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
        dl._iterator = None


def tune_loader(
    dataset: Any,
    batch_size: int,
    *,
    max_workers: int | None = None,
    seconds: float = 1.0,
    device: str | torch.device = "auto",
    prefetch_factors: Sequence[int] = (2, 4),
    persistent: Sequence[bool] = (True, False),
    pin_memory: str | bool = "auto",
    collate_fn: Callable | None = None,
    crop: int = 224,
    train: bool = True,
    progress: Callable[[str], None] | None = None,
    patience: int = 2,
    threads: int | str | None = None,
) -> LoaderSettings:
    """Measure loader throughput over settings; return the fastest with the whole table.

    `dataset`: a map-style Dataset (timed as a plain shuffled DataLoader), an ImageFolder or store
    path (timed as the torchspeed pipeline, `fast_loader` with `crop` and `train`), or a factory
    `build(num_workers, prefetch_factor, persistent_workers, pin_memory) -> iterable of batches`.
    num_workers goes from 0 up to `max_workers` (default: cores + 1) and stops when throughput
    falls (`patience` successive counts slower than the best so far: one noisy measurement does
    not end the search); prefetch_factor and persistent_workers are then tried at the best worker count, and
    pin_memory only with CUDA. Each configuration runs two passes of `seconds` after a warm-up.
    `threads` (torchspeed pipelines, whose factory takes `threads=`): with "auto", num_workers=0 is
    tried with 1, 2, ... threads making batches in this process (same stopping rule) before the
    worker processes, and the best of each then run again, interleaved, three passes each (rows
    marked `final`); an integer fixes the threads used at num_workers=0.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    dev = resolve_device(device)
    build = _factory(dataset, batch_size, dev, collate_fn, crop, train)
    max_workers = usable_cores() + 1 if max_workers is None else max_workers
    if max_workers < 0:
        raise ValueError(f"max_workers must be >= 0, got {max_workers}")
    pins = [False, True] if (pin_memory == "auto" and dev.type == "cuda") else [bool(pin_memory) and pin_memory != "auto"]
    table: list[dict[str, Any]] = []

    if isinstance(dataset, (str, os.PathLike)) and threads is None:
        threads = "auto"  # the torchspeed pipeline: its threads are part of the search
    if not (threads is None or threads == "auto" or (isinstance(threads, int) and threads >= 1)):
        raise ValueError(f"threads must be None, 'auto' or a positive integer, got {threads!r}")

    def make(w: int, pf: int | None, persist: bool, pin: bool, t: int) -> Any:
        with _more_workers_than_cores_on_purpose():  # DataLoader warns when it is built and when iterated
            return build(w, pf if w else None, persist and w > 0, pin, *(() if threads is None else (t if w == 0 else 1,)))

    def run(loader: Any, w: int, passes: int) -> Any:
        with _more_workers_than_cores_on_purpose():
            return time_iterable(lambda: loader, name=f"workers={w}", warmup_items=max(1, w), passes=passes,
                                 min_pass_s=seconds, device=dev)

    def record(w: int, pf: int | None, persist: bool, pin: bool, t: int, rate: float, **extra: Any) -> None:
        row = {"num_workers": w, "prefetch_factor": pf if w else None, "persistent_workers": persist and w > 0,
               "pin_memory": pin, "items_per_s": rate, **extra}
        if threads is not None:
            row["threads"] = t if w == 0 else 1
        table.append(row)

    def measure(w: int, pf: int | None, persist: bool, pin: bool, t: int = 1) -> float:
        if progress:
            progress(f"timing num_workers={w}, threads={t if w == 0 else 1}, prefetch_factor={pf}, "
                     f"persistent={persist}, pin={pin}")
        loader = make(w, pf, persist, pin, t)
        try:
            timing = run(loader, w, passes=2)
        finally:
            _shutdown(loader)
        rate = float(timing.throughput or 0.0)
        record(w, pf, persist, pin, t, rate)
        return rate

    def final(candidates: list[tuple[int, int]], rounds: int = 3) -> tuple[float, int, int]:
        """The walks' winners again, passes interleaved: one noisy pass must not decide a close call.

        Scored by items over seconds of all their passes (what an epoch gets), so a setting that is
        fast in most passes but stalls in some loses against a steady one."""
        if progress:
            progress(f"final: {', '.join(f'num_workers={w}, threads={t}' for w, t in candidates)}, interleaved")
        loaders = {c: make(c[0], pf0, persist0, pin0, c[1]) for c in candidates}
        items = {c: 0.0 for c in candidates}
        spent = {c: 0.0 for c in candidates}
        try:
            for _ in range(rounds):
                for (w, t), loader in loaders.items():
                    timing = run(loader, w, passes=1)
                    items[(w, t)] += sum(timing.items)
                    spent[(w, t)] += sum(timing.times_s)
        finally:
            for loader in loaders.values():
                _shutdown(loader)
        rates = {c: items[c] / spent[c] if spent[c] > 0 else 0.0 for c in candidates}
        for (w, t), r in rates.items():
            record(w, pf0, persist0, pin0, t, r, final=True)
        (w, t) = max(rates, key=rates.__getitem__)
        return rates[(w, t)], w, t

    def walk(counts: Sequence[int], config: Callable[[int], tuple[int, int]]) -> tuple[float, int, int]:
        """Measure counts in order until `patience` in a row are slower than the best; the best (rate, w, t)."""
        best, slower = (-1.0, 0, 1), 0
        for c in counts:
            w, t = config(c)
            rate = measure(w, pf0, persist0, pin0, t)
            if rate > best[0]:
                best, slower = (rate, w, t), 0
            else:
                slower += 1
                if slower >= patience:
                    break  # throughput fell: more workers only compete for the cores
        return best

    pf0, persist0, pin0 = prefetch_factors[0] if prefetch_factors else 2, persistent[0] if persistent else True, pins[0]
    if threads == "auto":  # threads in this process first, then worker processes; keep the faster
        in_process = walk(range(1, max(1, max_workers) + 1), lambda c: (0, c))
        in_workers = walk(range(1, max_workers + 1), lambda c: (c, 1))
        rate, w, t = final([(0, in_process[2]), (in_workers[1], 1)]) if in_workers[0] > 0 else in_process
    else:
        rate, w, t = walk(range(0, max_workers + 1), lambda c: (c, threads or 1))
    best = (rate, w, pf0, persist0, pin0)
    if w > 0:
        for option in prefetch_factors[1:]:
            r = measure(w, option, persist0, pin0)
            if r > best[0]:
                best = (r, w, option, persist0, pin0)
        for option in persistent[1:]:
            r = measure(w, best[2], option, pin0)
            if r > best[0]:
                best = (r, w, best[2], option, pin0)
    for option in pins[1:]:
        r = measure(best[1], best[2], best[3], option, t)
        if r > best[0]:
            best = (r, best[1], best[2], best[3], option)
    rate, w, pf, persist, pin = best
    return LoaderSettings(num_workers=w, prefetch_factor=pf if w else None, persistent_workers=persist and w > 0,
                          pin_memory=pin, throughput=rate, table=table, threads=t if w == 0 else 1)


def _factory(dataset: Any, batch_size: int, dev: torch.device, collate_fn: Callable | None, crop: int,
             train: bool) -> Callable[[int, int | None, bool, bool], Any]:
    if callable(dataset) and not hasattr(dataset, "__getitem__"):
        return dataset
    if isinstance(dataset, (str, os.PathLike)):
        from torchspeed.data.loader import fast_loader

        def build_fast(w: int, pf: int | None, persist: bool, pin: bool, threads: int = 1) -> Any:
            return fast_loader(dataset, batch_size, train=train, crop=crop, device=dev, num_workers=w,
                               prefetch_factor=pf, persistent_workers=persist, pin_memory=pin, threads=threads)

        return build_fast
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ValueError(f"dataset must be a map-style Dataset, a data path or a loader factory, got {type(dataset).__name__}")

    def build_plain(w: int, pf: int | None, persist: bool, pin: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=w,
                          collate_fn=collate_fn, pin_memory=pin, prefetch_factor=pf, persistent_workers=persist)

    return build_plain
