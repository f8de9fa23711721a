"""Measuring loader settings: whatever factory `build(num_workers, prefetch_factor, persistent_workers,
pin_memory[, threads]) -> iterable of batches` it is given (it knows nothing of `fast_loader`), timed
over those settings; what `tune_loader` and `fast_loader(num_workers="auto")` run, and remember.

Why (article 004): the best setting is found by timing the loader alone on this machine, and it is
not the largest: past the core count, workers only compete with each other and with the model. So
the search walks the candidate counts upward and stops as soon as throughput falls.
"""
from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import torchspeed.measure as measure
from torchspeed import remembered
from torchspeed.args import as_list, positive_number, progress_fn
from torchspeed.loader_contract import release_workers
from torchspeed.measure import time_iterable
from torchspeed.runtime import default_mp_context, usable_cores

__all__ = ["TuneResult", "LoaderRow", "measure_settings", "dataloader_factory", "as_counts", "candidate_counts",
           "remembered_settings", "worker_error", "QUIET_WAIT_S"]

log = logging.getLogger(__name__)

QUIET_WAIT_S = 2.0  # at most this long waiting for other processes to leave the cores before timing


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


def candidate_counts(num_workers: str | int | list[int],
                     threads: str | int | list[int] | None) -> tuple[list[int], int | list[int] | None]:
    """The worker counts and threads counts a search walks (`as_counts` values), "auto" resolved on this
    machine's usable cores (0..cores+1 workers, 1..cores+1 threads); threads None or one count stays as is."""
    cores = usable_cores()
    workers = _candidates(num_workers, range(0, cores + 2))
    if threads is None or isinstance(threads, int):
        return workers, threads
    return workers, _candidates(threads, range(1, cores + 2))


def remembered_settings(what: str, parts: Mapping[str, Any] | None, measure: Callable[[], TuneResult],
                        refresh: bool = False, progress: bool | Callable[[str], Any] = False) -> TuneResult:
    """The settings remembered for `parts` (the data, batch, device, candidates: kind "loader" of
    `torchspeed.remembered`), else `measure()` now, remembered unless timed on a busy machine. Measured
    again when `refresh`, damaged, or no longer among the candidates ("num_workers", "threads",
    "prefetch_factor", "persistent_workers", "pin_memory" in `parts`); `parts` None: never kept."""

    def recalled(memory: remembered.Memory) -> TuneResult | None:
        result = TuneResult.from_dict(memory.decision)
        threads = parts.get("threads")
        threads = [threads] if isinstance(threads, int) else threads
        possible = (result.num_workers in parts.get("num_workers", ()) and result.table
                    and (result.num_workers > 0 or threads is None or result.threads in threads)
                    and (result.num_workers == 0 or result.prefetch_factor in parts.get("prefetch_factor", ()))
                    and (result.num_workers == 0 or result.persistent_workers in parts.get("persistent_workers", ()))
                    and result.pin_memory in parts.get("pin_memory", ()))
        if not possible:
            log.info("%s: the remembered settings (%s) are not among the candidates now; measuring again", what,
                     result.describe())
            return None
        result.remembered, result.tuning_s, result.others_cores, result.waited_s = memory.describe(), 0.0, None, 0.0
        progress_fn(progress)(f"{what}: {result.describe()}, {result.remembered}")
        return result

    result, _ = remembered.recall_or_measure(
        "loader", parts, measure, decode=recalled, busy=lambda r: r.busy_warning, refresh=refresh, what=what,
        encode=lambda r: ({k: v for k, v in r.to_dict().items() if k != "busy_warning"}, r.figure()))
    return result


@dataclass
class LoaderRow:
    """One loader configuration timed (a row of `TuneResult.table`)."""

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
class TuneResult:
    """The fastest loader settings measured, with every configuration tried (`table`)."""

    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool
    throughput: float  # items/s of the chosen settings
    table: list[LoaderRow] = field(default_factory=list)
    threads: int = 1  # fast_loader's batch-making threads when num_workers is 0
    tuning_s: float = 0.0  # how long the measurement took
    others_cores: float | None = None  # cores other processes used while it measured (None: not measured)
    waited_s: float = 0.0  # how long it waited for other processes to leave the cores before timing
    remembered: str | None = None  # "remembered from <date> (<figure>)" when recalled instead of measured

    @property
    def busy_warning(self) -> str | None:
        """A sentence saying the settings were timed on a busy machine (the choice may be noise), else None."""
        return measure.busy_warning(self.others_cores)

    def __str__(self) -> str:
        how = self.remembered or f"{len(self.table)} settings timed in {self.tuning_s:.1f} s"
        lines = [f"loader: {self.describe()} ({self.throughput:.0f} items/s, {how})"]
        return "\n".join(lines + ([f"note: {self.busy_warning}"] if self.busy_warning else []))

    def figure(self) -> str:
        """The decision in a few words, as remembered: '2 threads, 5,478 img/s' or '3 worker processes, ...'."""
        who = (f"{self.threads} thread{'s' * (self.threads != 1)}" if self.num_workers == 0 else
               f"{self.num_workers} worker process{'es' * (self.num_workers != 1)}")
        return f"{who}, {self.throughput:,.0f} img/s"

    @property
    def best(self) -> LoaderRow | None:
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
        return {**asdict(self), "busy_warning": self.busy_warning}  # asdict makes the table's rows dicts too

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TuneResult:
        """The result `to_dict` wrote (a remembered decision); TypeError/KeyError on anything else."""
        kept = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kept["table"] = [LoaderRow(**r) for r in d.get("table", [])]
        return cls(**kept)


@contextmanager
def _more_workers_than_cores_on_purpose() -> Iterator[None]:
    """Silence DataLoader's warning about more workers than cores: trying them is how we see throughput fall."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        yield


def worker_error(e: ValueError) -> ValueError:
    """A ValueError raised in a DataLoader worker process as its own one line: torch re-raises it in this
    process with the worker's whole traceback as the message (only the type and that text travel)."""
    text = str(e)
    if "Original Traceback" not in text:
        return e
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    return ValueError(last[len("ValueError: "):] if last.startswith("ValueError: ") else last)


class _Samples(list):
    """The samples of one batch, with the indices they were read at (named when they cannot be collated)."""

    indices: list[int]


class _NamedSamples(Dataset):
    """A user's Dataset whose failures name the sample: what raised, at which index."""

    def __init__(self, dataset: Any, name: str):
        self.dataset, self.name = dataset, name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as e:
            raise ValueError(f"sample {index} of {self.name}: the Dataset raised {type(e).__name__}: {e}") from None

    def __getitems__(self, indices: list[int]) -> list[Any]:
        own = getattr(self.dataset, "__getitems__", None)
        if own is not None:
            try:
                samples = _Samples(own(indices))
            except Exception as e:
                raise ValueError(f"samples {_span(indices)} of {self.name}: the Dataset raised "
                                 f"{type(e).__name__}: {e}") from None
        else:
            samples = _Samples(self[i] for i in indices)
        samples.indices = list(indices)
        return samples


class _NamedCollate:
    """A collate function whose failure names the samples that do not fit together (ragged shapes)."""

    def __init__(self, collate_fn: Callable | None, name: str):
        self.collate_fn, self.name = collate_fn or default_collate, name

    def __call__(self, batch: list[Any]) -> Any:
        try:
            return self.collate_fn(batch)
        except Exception as e:
            raise ValueError(self.explain(batch, e)) from None

    def explain(self, batch: list[Any], error: Exception) -> str:
        """Which sample does not fit the others (its layout against the most common one), or what failed."""
        indices = getattr(batch, "indices", None) or list(range(len(batch)))
        layouts = [_layout(sample) for sample in batch]
        usual = max(layouts, key=layouts.count) if layouts else ""
        odd = [i for i, layout in enumerate(layouts) if layout != usual]
        if odd:
            seen, other = indices[layouts.index(usual)], indices[odd[0]]
            return (f"sample {other} of {self.name} cannot be batched with sample {seen}: sample {other} is "
                    f"{layouts[odd[0]]}, sample {seen} is {usual}; every sample needs the same shapes (resize or "
                    "crop in the Dataset's transform)")
        return (f"samples {_span(indices)} of {self.name} cannot be batched ({type(error).__name__}: {error}); "
                f"each is {usual}")


def _layout(x: Any) -> str:
    """A sample's structure and shapes, for messages: '(Tensor(3, 32, 32) float32, int)'."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{type(x).__name__}{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}"
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(_layout(v) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_layout(v)}" for k, v in x.items()) + "}"
    return type(x).__name__


def _span(indices: Sequence[int]) -> str:
    return ", ".join(map(str, indices[:4])) + (", ..." if len(indices) > 4 else "")


class _OneLineErrors(DataLoader):
    """A DataLoader whose workers' ValueErrors (a sample named) arrive as one line, not a traceback."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        try:
            yield from super().__iter__()
        except ValueError as e:
            raise worker_error(e) from None


def dataloader_factory(dataset: Any, batch_size: int, collate_fn: Callable | None = None,
                       name: str | None = None) -> Callable[..., DataLoader]:
    """A factory of plain shuffled DataLoaders over a map-style `dataset`, for `measure_settings`.

    A sample that fails (the Dataset raising, samples whose shapes cannot be batched) is one
    ValueError naming its index and what was wrong; `name` names the Dataset (default: its type)."""
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ValueError(f"dataset must be a map-style Dataset, a data path or a loader factory, got {type(dataset).__name__}")
    name = name or type(dataset).__name__
    named, collate = _NamedSamples(dataset, name), _NamedCollate(collate_fn, name)

    def build_plain(num_workers: int, prefetch_factor: int | None, persistent_workers: bool,
                    pin_memory: bool) -> DataLoader:
        return _OneLineErrors(named, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=num_workers,
                              collate_fn=collate, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                              persistent_workers=persistent_workers,
                              multiprocessing_context=default_mp_context() if num_workers else None)

    return build_plain


class _Setting(NamedTuple):
    """One configuration handed to the factory, as the factory (and a LoaderRow) spells it."""

    num_workers: int
    threads: int
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool


class _Search:
    """What one measurement shares: the factory, how a configuration is timed, and the rows so far."""

    def __init__(self, build: Callable[..., Any], takes_threads: bool, first: tuple[int, bool, bool],
                 tune_seconds: float, device: torch.device, progress: bool | Callable[[str], None], patience: int):
        self.build, self.takes_threads, self.tune_seconds, self.device = build, takes_threads, tune_seconds, device
        self.first = first  # (prefetch_factor, persistent_workers, pin_memory) while the counts are walked
        self.say, self.patience = progress_fn(progress), patience
        self.table: list[LoaderRow] = []

    def setting(self, num_workers: int, threads: int) -> _Setting:
        """The counts with the first options: those only worker processes have are None/False without
        them; threads are 1 with them."""
        prefetch_factor, persistent_workers, pin_memory = self.first
        return _Setting(num_workers, threads if num_workers == 0 else 1, prefetch_factor if num_workers else None,
                        persistent_workers and num_workers > 0, pin_memory)

    def make(self, s: _Setting) -> Any:
        with _more_workers_than_cores_on_purpose():  # DataLoader warns when it is built and when iterated
            return self.build(s.num_workers, s.prefetch_factor, s.persistent_workers, s.pin_memory,
                              *((s.threads,) if self.takes_threads else ()))

    def time_passes(self, loader: Any, s: _Setting, passes: int) -> Any:
        with _more_workers_than_cores_on_purpose():
            return time_iterable(lambda: loader, name=f"workers={s.num_workers}", warmup_items=max(1, s.num_workers),
                                 passes=passes, min_pass_s=self.tune_seconds, device=self.device)

    def measure(self, s: _Setting) -> float:
        """Items/s of one configuration: two passes after a warm-up, its workers stopped afterwards."""
        self.say(f"timing num_workers={s.num_workers}, threads={s.threads}, prefetch_factor={s.prefetch_factor}, "
                 f"persistent_workers={s.persistent_workers}, pin_memory={s.pin_memory}")
        loader = self.make(s)
        try:
            timing = self.time_passes(loader, s, passes=2)
        finally:
            release_workers(loader)
        rate = float(timing.throughput or 0.0)
        self.table.append(LoaderRow(**s._asdict(), items_per_s=rate))
        return rate

    def walk(self, settings: Sequence[_Setting]) -> tuple[float, _Setting]:
        """Measure `settings` in order until `patience` in a row are slower than the best; the best."""
        best, slower = (-1.0, self.setting(0, 1)), 0
        for s in settings:
            rate = self.measure(s)
            if rate > best[0]:
                best, slower = (rate, s), 0
            else:
                slower += 1
                if slower >= self.patience:
                    break  # throughput fell: more workers only compete for the cores
        return best

    def final(self, candidates: list[_Setting], rounds: int = 3) -> tuple[float, _Setting]:
        """The walks' winners again, passes interleaved: one noisy pass must not decide a close call.

        Scored by items over seconds of all their passes (what an epoch gets), so a setting that is
        fast in most passes but stalls in some loses against a steady one."""
        self.say(f"final: {', '.join(f'num_workers={s.num_workers}, threads={s.threads}' for s in candidates)}, "
                 "interleaved")
        loaders = {s: self.make(s) for s in candidates}
        items, spent = dict.fromkeys(candidates, 0.0), dict.fromkeys(candidates, 0.0)
        try:
            for _ in range(rounds):
                for s, loader in loaders.items():
                    timing = self.time_passes(loader, s, passes=1)
                    items[s] += sum(timing.items)
                    spent[s] += sum(timing.times_s)
        finally:
            for loader in loaders.values():
                release_workers(loader)
        rates = {s: items[s] / spent[s] if spent[s] > 0 else 0.0 for s in candidates}
        self.table += [LoaderRow(**s._asdict(), items_per_s=rate, final=True) for s, rate in rates.items()]
        best = max(rates, key=rates.__getitem__)
        return rates[best], best


def measure_settings(
    build: Callable[..., Any],
    *,
    num_workers: str | int | Sequence[int] = "auto",
    threads: str | int | Sequence[int] | None = None,
    prefetch_factor: Sequence[int] = (2, 4),
    persistent_workers: Sequence[bool] = (True, False),
    pin_memory: Sequence[bool] = (False,),
    tune_seconds: float = 1.0,
    device: torch.device,
    progress: bool | Callable[[str], None] = False,
    patience: int = 2,
) -> TuneResult:
    """Time the loaders `build` makes over settings; return the fastest with the whole table.

    `num_workers`: "auto" (0..cores+1) or a list of candidates, walked upward until `patience`
    successive counts are slower than the best so far. `threads` (factories taking `threads=`): with
    "auto" (1..cores+1) or a list, num_workers=0 is walked over those counts and the worker processes
    over the positive num_workers, then the two winners run again, interleaved, three passes each (rows
    marked `final`); an integer fixes the threads at num_workers=0; None: the factory takes none.
    `prefetch_factor`, `persistent_workers`, `pin_memory`: candidates, the first used while the counts
    are walked, the others tried at the best count (pin_memory's last). Each configuration runs two
    passes of `tune_seconds` after a warm-up, once other processes have left the cores (waiting at most
    `QUIET_WAIT_S`; `others_cores` says when they did not).
    """
    t_start = time.perf_counter()
    tune_seconds = positive_number(tune_seconds, "tune_seconds")  # nan or inf would never end
    worker_counts = as_counts(num_workers, "num_workers", 0)
    thread_counts = None if threads is None else as_counts(threads, "threads", 1)
    first = (prefetch_factor[0] if prefetch_factor else 2, persistent_workers[0] if persistent_workers else True,
             (list(pin_memory) or [False])[0])
    search = _Search(build, thread_counts is not None, first, tune_seconds, device, progress, patience)
    quiet = measure.wait_for_quiet_machine(max_s=QUIET_WAIT_S, window_s=0.25) if QUIET_WAIT_S > 0 else None
    others = measure.OthersLoad()
    rate, best = _best_counts(search, worker_counts, thread_counts)
    rate, best = _best_options(search, rate, best, prefetch_factor[1:], persistent_workers[1:], list(pin_memory)[1:])
    result = TuneResult(num_workers=best.num_workers, prefetch_factor=best.prefetch_factor,
                        persistent_workers=best.persistent_workers, pin_memory=best.pin_memory, throughput=rate,
                        table=search.table, threads=best.threads, tuning_s=time.perf_counter() - t_start,
                        others_cores=others.cores(), waited_s=quiet.waited_s if quiet else 0.0)
    if result.busy_warning:
        log.warning("loader settings: %s", result.busy_warning)
    return result


def _best_counts(search: _Search, num_workers: str | int | list[int],
                 threads: str | int | list[int] | None) -> tuple[float, _Setting]:
    """The walk over worker counts, or (threads given as candidates) threads in this process first, then
    worker processes, and the faster of the two winners in an interleaved final round."""
    worker_counts, thread_counts = candidate_counts(num_workers, threads)
    if thread_counts is None or isinstance(thread_counts, int):
        return search.walk([search.setting(w, thread_counts or 1) for w in worker_counts])
    processes = [w for w in worker_counts if w > 0]
    in_process = search.walk([search.setting(0, t) for t in thread_counts]) if 0 in worker_counts else None
    in_workers = search.walk([search.setting(w, 1) for w in processes]) if processes else None
    if in_process is None or in_workers is None:
        return in_process or in_workers  # type: ignore[return-value]
    if in_workers[0] > 0:
        return search.final([in_process[1], in_workers[1]])
    return in_process


def _best_options(search: _Search, rate: float, best: _Setting, prefetch_factor: Sequence[int],
                  persistent_workers: Sequence[bool], pin_memory: Sequence[bool]) -> tuple[float, _Setting]:
    """At the chosen counts: the other prefetch_factor and persistent_workers values (worker processes
    only), then the other pin_memory values; each kept when it measures faster."""
    others = [("pin_memory", v) for v in pin_memory]
    if best.num_workers > 0:
        others = [("prefetch_factor", v) for v in prefetch_factor] + \
                 [("persistent_workers", v) for v in persistent_workers] + others
    for name, value in others:
        candidate = best._replace(**{name: value})
        r = search.measure(candidate)
        if r > rate:
            rate, best = r, candidate
    return rate, best
