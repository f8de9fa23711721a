"""Measuring loader settings: a loader factory timed over num_workers, threads, prefetch_factor,
persistent_workers and pin_memory (what `tune_loader` and `fast_loader(num_workers="auto")` run).

Why (article 004): the best setting is found by timing the loader alone on this machine, and it is
not the largest: past the core count, workers only compete with each other and with the model. So
the search walks the candidate counts upward and stops as soon as throughput falls.

This module measures whatever factory it is given and knows nothing of `fast_loader` (which calls
it): the factory is `build(num_workers, prefetch_factor, persistent_workers, pin_memory[, threads])
-> iterable of batches`.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchspeed.args import as_list
from torchspeed.args import progress_fn
from torchspeed.measure import time_iterable
from torchspeed.runtime import usable_cores

__all__ = ["LoaderSettings", "LoaderTrial", "measure_settings", "dataloader_factory", "as_counts"]


def as_counts(value: Any, name: str, minimum: int) -> str | int | list[int]:
    """num_workers / threads as given: "auto", one count, or the candidate counts to measure (a list or
    a comma string such as "0,1,2"; sorted, duplicates dropped)."""
    if isinstance(value, str) and value.strip() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool):
        raise ValueError(f"{name} must be 'auto', a count or a list of counts, got {value!r}")
    if isinstance(value, int):
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        return value
    try:
        items = as_list(value, name=name) if isinstance(value, (str, Iterable)) else None
        counts = sorted({int(v) for v in items}) if items is not None else None
    except ValueError:
        counts = None
    if counts is None or any(c < minimum for c in counts):
        raise ValueError(f"{name} must be 'auto', a count >= {minimum} or a list of them (e.g. [0, 1, 2] or "
                         f"'0,1,2'), got {value!r}")
    return counts


def _candidates(value: str | int | list[int], auto: Iterable[int]) -> list[int]:
    return list(auto) if value == "auto" else [value] if isinstance(value, int) else list(value)


@dataclass
class LoaderTrial:
    """One loader configuration timed (a row of `LoaderSettings.table`)."""

    num_workers: int
    threads: int  # batch-making threads of the main process (1 unless num_workers is 0)
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool
    items_per_s: float
    final: bool = False  # a row of the interleaved final round between the walks' winners

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoaderSettings:
    """The fastest loader settings measured, with every configuration tried (`table`)."""

    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool
    throughput: float  # items/s of the chosen settings
    table: list[LoaderTrial] = field(default_factory=list)
    threads: int = 1  # fast_loader's batch-making threads when num_workers is 0
    tuning_s: float = 0.0  # how long the measurement took

    @property
    def best(self) -> LoaderTrial | None:
        """The row that measured the chosen settings."""
        rows = [r for r in self.table if (r.num_workers, r.threads, r.prefetch_factor, r.persistent_workers,
                                          r.pin_memory) == (self.num_workers, self.threads, self.prefetch_factor,
                                                            self.persistent_workers, self.pin_memory)]
        return max(rows, key=lambda r: (r.items_per_s == self.throughput, r.final, r.items_per_s), default=None)

    def dataloader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `torch.utils.data.DataLoader`."""
        kw: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.num_workers > 0:
            kw.update(prefetch_factor=self.prefetch_factor, persistent_workers=self.persistent_workers)
        return kw

    def describe(self) -> str:
        """The chosen settings as fast_loader/DataLoader arguments: 'num_workers=0, threads=2, pin_memory=False'."""
        kw = self.dataloader_kwargs()
        best = {"num_workers": kw.pop("num_workers"), **({"threads": self.threads} if self.num_workers == 0 else {}), **kw}
        return ", ".join(f"{k}={v}" for k, v in best.items())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["table"] = [r.to_dict() for r in self.table]
        return d


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


def dataloader_factory(dataset: Any, batch_size: int, collate_fn: Callable | None = None) -> Callable[..., DataLoader]:
    """A factory of plain shuffled DataLoaders over a map-style `dataset`, for `measure_settings`."""
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ValueError(f"dataset must be a map-style Dataset, a data path or a loader factory, got {type(dataset).__name__}")

    def build_plain(w: int, pf: int | None, persist: bool, pin: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=w,
                          collate_fn=collate_fn, pin_memory=pin, prefetch_factor=pf, persistent_workers=persist)

    return build_plain


def measure_settings(
    build: Callable[..., Any],
    *,
    num_workers: str | int | Sequence[int] = "auto",
    threads: str | int | Sequence[int] | None = None,
    seconds: float = 1.0,
    device: torch.device,
    prefetch_factors: Sequence[int] = (2, 4),
    persistent: Sequence[bool] = (True, False),
    pin_memory: Sequence[bool] = (False,),
    progress: bool | Callable[[str], None] = False,
    patience: int = 2,
) -> LoaderSettings:
    """Time the loaders `build` makes over settings; return the fastest with the whole table.

    `num_workers`: the counts tried ("auto": 0..cores+1, or a list of candidates), walked upward until
    `patience` successive counts are slower than the best so far. `threads` (factories taking
    `threads=`): with "auto" (1..cores+1) or a list, num_workers=0 is walked over those threads counts
    and the worker processes over the positive num_workers candidates, then the two winners run
    again, interleaved, three passes each (rows marked `final`); an integer fixes the threads used
    at num_workers=0; None: the factory takes no threads. prefetch_factor and persistent_workers are
    then tried at the best worker count, and the `pin_memory` options last. Each configuration runs
    two passes of `seconds` after a warm-up.
    """
    t_start = time.perf_counter()
    say_ = progress_fn(progress)
    cores = usable_cores()
    worker_counts = _candidates(as_counts(num_workers, "num_workers", 0), range(0, cores + 2))
    thread_spec = None if threads is None else as_counts(threads, "threads", 1)
    pins = list(pin_memory) or [False]
    table: list[LoaderTrial] = []

    def make(w: int, pf: int | None, persist: bool, pin: bool, t: int) -> Any:
        with _more_workers_than_cores_on_purpose():  # DataLoader warns when it is built and when iterated
            return build(w, pf if w else None, persist and w > 0, pin, *(() if thread_spec is None else (t if w == 0 else 1,)))

    def run(loader: Any, w: int, passes: int) -> Any:
        with _more_workers_than_cores_on_purpose():
            return time_iterable(lambda: loader, name=f"workers={w}", warmup_items=max(1, w), passes=passes,
                                 min_pass_s=seconds, device=device)

    def record(w: int, pf: int | None, persist: bool, pin: bool, t: int, rate: float, final: bool = False) -> None:
        table.append(LoaderTrial(num_workers=w, threads=t if w == 0 else 1, prefetch_factor=pf if w else None,
                                 persistent_workers=persist and w > 0, pin_memory=pin, items_per_s=rate, final=final))

    def measure(w: int, pf: int | None, persist: bool, pin: bool, t: int = 1) -> float:
        say_(f"timing num_workers={w}, threads={t if w == 0 else 1}, prefetch_factor={pf}, "
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
        say_(f"final: {', '.join(f'num_workers={w}, threads={t}' for w, t in candidates)}, interleaved")
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
    if thread_spec is None or isinstance(thread_spec, int):
        rate, w, t = walk(worker_counts, lambda c: (c, thread_spec or 1))
    else:  # threads in this process first, then worker processes; keep the faster
        thread_counts = _candidates(thread_spec, range(1, cores + 2))
        processes = [c for c in worker_counts if c > 0]
        in_process = walk(thread_counts, lambda c: (0, c)) if 0 in worker_counts else None
        in_workers = walk(processes, lambda c: (c, 1)) if processes else None
        if in_process is None or in_workers is None:
            rate, w, t = in_process or in_workers  # type: ignore[misc]
        elif in_workers[0] > 0:
            rate, w, t = final([(0, in_process[2]), (in_workers[1], 1)])
        else:
            rate, w, t = in_process
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
                          pin_memory=pin, throughput=rate, table=table, threads=t if w == 0 else 1,
                          tuning_s=time.perf_counter() - t_start)
