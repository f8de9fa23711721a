"""The one timing tool: every measured choice (loader tuning, accelerate trials, optimize candidates)
and every benchmark suite times through it.

Rules it enforces, so figures compare like with like:
- warm-up runs are excluded; several repeats are taken and the median reported (min/max/p90 kept);
- contenders compared with a baseline run interleaved in one process, and the ratio is of medians;
- between contenders compare() pauses (`cooldown_s`) so a runtime's spinning worker threads
  (OpenMP, ONNX Runtime, oneDNN) go idle instead of stealing cores from the next contender;
- peak memory: on CUDA `max_memory_allocated` (reset per contender, synchronised); on Linux CPU the
  process's peak RSS, reset per contender through /proc/self/clear_refs, so one contender's peak
  cannot leak into the next;
- a busy machine is noticed, not hidden: `compare` records how many cores other processes used while
  it timed (`Comparison.others_cores`, from /proc/stat less this process tree), and `busy_warning`
  words it for a report.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from torchspeed.args import positive_number

__all__ = ["Timing", "Comparison", "PeakMemory", "OthersLoad", "time_callable", "time_iterable", "compare",
           "process_tree_cpu_seconds", "job_root_pid", "machine_busy_cpu_seconds", "busy_warning", "wait_until_quiet",
           "wait_for_quiet_machine", "Quiet"]

BUSY_CORES = 0.3  # other processes using more than this many cores while we time: the figures may be off


def _percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return math.nan
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Timing:
    """Repeated measurements of one contender. `times_s` are per repeat, `items` per repeat."""

    name: str
    times_s: list[float]
    items: list[float] = field(default_factory=list)
    peak_mem_bytes: int | None = None
    unit: str = "items"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median_s(self) -> float:
        return _percentile(self.times_s, 0.5)

    @property
    def min_s(self) -> float:
        return min(self.times_s) if self.times_s else math.nan

    @property
    def max_s(self) -> float:
        return max(self.times_s) if self.times_s else math.nan

    @property
    def p90_s(self) -> float:
        return _percentile(self.times_s, 0.9)

    @property
    def rates(self) -> list[float]:
        """Items per second of each repeat."""
        return [n / t for n, t in zip(self.items, self.times_s) if t > 0]

    @property
    def throughput(self) -> float | None:
        """Median items per second over the repeats (None when no item count was given)."""
        return _percentile(self.rates, 0.5) if self.items else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(median_s=self.median_s, min_s=self.min_s, max_s=self.max_s, p90_s=self.p90_s, throughput=self.throughput)
        return d

    def __str__(self) -> str:
        rate = f", {self.throughput:,.1f} {self.unit}/s" if self.items else ""
        return (
            f"{self.name}: median {self.median_s * 1e3:.2f} ms (min {self.min_s * 1e3:.2f}, "
            f"max {self.max_s * 1e3:.2f}, n={len(self.times_s)}){rate}"
        )


@dataclass
class Comparison:
    """Contenders measured interleaved in one run; ratios are baseline median / contender median."""

    timings: list[Timing]
    baseline: str
    others_cores: float | None = None  # cores other processes used while timing (None: not measurable here)

    def __getitem__(self, name: str) -> Timing:
        for t in self.timings:
            if t.name == name:
                return t
        raise KeyError(f"no contender named {name!r}; have {[t.name for t in self.timings]}")

    def speedup(self, name: str) -> float:
        """How many times faster `name` is than the baseline (>1 is faster)."""
        return self[self.baseline].median_s / self[name].median_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "timings": [t.to_dict() for t in self.timings],
            "speedup": {t.name: self.speedup(t.name) for t in self.timings},
            "others_cores": self.others_cores,
        }

    def __str__(self) -> str:
        return "\n".join(f"{t}  x{self.speedup(t.name):.2f}" for t in self.timings)


class PeakMemory:
    """Resettable peak-memory counter: CUDA allocator peak on a GPU, process peak RSS on Linux CPU."""

    def __init__(self, device: Any = "cpu"):
        self.cuda = str(device).startswith("cuda")

    def reset(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        try:  # "5" resets VmHWM (peak RSS) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def peak(self) -> int | None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated())
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None


def _sync(device: Any) -> None:
    if device is not None and str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_callable(
    fn: Callable[[], Any],
    *,
    name: str = "fn",
    warmup: int = 2,
    repeats: int = 5,
    inner: int = 1,
    items: float | None = None,
    unit: str = "items",
    min_time_s: float = 0.0,
    device: Any = None,
    measure_memory: bool = False,
) -> Timing:
    """Time `fn()`: `warmup` untimed calls, then `repeats` timed repeats of `inner` calls each.

    `items` is the work of one call (e.g. the batch size) for throughput. With `min_time_s`, `inner`
    grows until one repeat lasts at least that long (for calls too short to time singly). Each
    recorded time is per call.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    positive_number(min_time_s, "min_time_s", zero=True)  # inf would never end, nan fails late
    mem = PeakMemory(device or "cpu") if measure_memory else None
    if mem:
        mem.reset()
    for _ in range(warmup):
        fn()
    _sync(device)
    times: list[float] = []
    while True:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        dt = time.perf_counter() - t0
        if dt >= min_time_s or inner >= 1 << 20:
            times.append(dt / inner)
            break
        inner = max(inner * 2, math.ceil(inner * min_time_s / max(dt, 1e-9)))
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / inner)
    return Timing(
        name=name,
        times_s=times,
        items=[float(items)] * len(times) if items is not None else [],
        peak_mem_bytes=mem.peak() if mem else None,
        unit=unit,
        extra={"inner": inner},
    )


def time_iterable(
    make_iter: Callable[[], Iterable[Any]],
    *,
    name: str = "iterable",
    count: Callable[[Any], float] = lambda batch: len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch),
    warmup_items: int = 1,
    passes: int = 3,
    min_pass_s: float = 5.0,
    max_pass_items: int | None = None,
    unit: str = "items",
    device: Any = None,
    measure_memory: bool = False,
) -> Timing:
    """Throughput of an iterable (a data loader): items per second over `passes` timed passes.

    The first `warmup_items` elements (worker start-up, caches) are consumed untimed. A pass runs for
    at least `min_pass_s` seconds, starting a new epoch (`make_iter()` again) whenever one ends, so
    short epochs still give long, stable passes. `count(element)` says how many items an element
    holds (default: the batch size of `(x, y)` or `x`).
    """
    mem = PeakMemory(device or "cpu") if measure_memory else None
    if mem:
        mem.reset()
    it: Iterator[Any] = iter(make_iter())

    def next_element() -> Any:
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = iter(make_iter())
            try:
                return next(it)
            except StopIteration:
                raise ValueError(f"{name}: the iterable is empty") from None

    for _ in range(warmup_items):
        next_element()
    _sync(device)
    times, items = [], []
    for _ in range(passes):
        n = 0.0
        t0 = time.perf_counter()
        while True:
            n += count(next_element())
            dt = time.perf_counter() - t0
            if dt >= min_pass_s or (max_pass_items is not None and n >= max_pass_items):
                break
        _sync(device)
        times.append(time.perf_counter() - t0)
        items.append(n)
    del it
    return Timing(name=name, times_s=times, items=items, peak_mem_bytes=mem.peak() if mem else None, unit=unit)


def compare(
    contenders: dict[str, Callable[[], Any]],
    *,
    baseline: str | None = None,
    warmup: int = 2,
    repeats: int = 5,
    items: float | None = None,
    unit: str = "items",
    min_time_s: float = 0.0,
    cooldown_s: float = 0.25,
    device: Any = None,
    measure_memory: bool = False,
) -> Comparison:
    """Time several callables doing the same work, interleaved: repeat r runs every contender once.

    Interleaving spreads slow drifts (thermal, background load) over all contenders instead of
    penalising whichever ran last. `cooldown_s` pauses between contenders so spinning runtime threads
    (OpenMP's blocktime is 200 ms) yield the cores. Peak memory is taken during each contender's own
    warm-up, with the counter reset before it.
    """
    if not contenders:
        raise ValueError("compare() needs at least one contender")
    positive_number(cooldown_s, "cooldown_s", zero=True)
    baseline = baseline or next(iter(contenders))
    if baseline not in contenders:
        raise ValueError(f"baseline {baseline!r} is not among the contenders {list(contenders)}")
    inner: dict[str, int] = {}
    peaks: dict[str, int | None] = {}
    for cname, fn in contenders.items():  # warm-up, calibrate inner loop counts, memory
        t = time_callable(fn, name=cname, warmup=warmup, repeats=1, min_time_s=min_time_s, device=device,
                          measure_memory=measure_memory)
        inner[cname] = t.extra["inner"]
        peaks[cname] = t.peak_mem_bytes
        time.sleep(cooldown_s)
    times: dict[str, list[float]] = {c: [] for c in contenders}
    others = OthersLoad()
    for _ in range(repeats):
        for cname, fn in contenders.items():
            t0 = time.perf_counter()
            for _ in range(inner[cname]):
                fn()
            _sync(device)
            times[cname].append((time.perf_counter() - t0) / inner[cname])
            time.sleep(cooldown_s)
    timings = [
        Timing(
            name=c,
            times_s=times[c],
            items=[float(items)] * repeats if items is not None else [],
            peak_mem_bytes=peaks[c],
            unit=unit,
            extra={"inner": inner[c]},
        )
        for c in contenders
    ]
    return Comparison(timings=timings, baseline=baseline, others_cores=others.cores())


def job_root_pid() -> int:
    """The process whose tree is this job: under torchrun with several local ranks, the agent that started
    them (the other ranks' load is the job's own work, timed in step with this rank, not interference from
    other processes); else this process."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return os.getppid() if local > 1 and os.environ.get("TORCHELASTIC_RUN_ID") else os.getpid()


def process_tree_cpu_seconds(root: int | None = None) -> float | None:
    """CPU seconds used so far by process `root` (default this one) and its live descendants (Linux /proc;
    None elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    root = os.getpid() if root is None else root
    total, todo, seen = 0.0, [str(root)], set()
    try:
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                # utime, stime, and cutime, cstime: workers that exited and were reaped count in their parent
                total += sum(int(v) for v in fields[11:15]) / tick
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        todo.extend(f.read().split())
            except (FileNotFoundError, ProcessLookupError):
                if pid == str(root):
                    return None  # no /proc/PID/task/*/children (kernel without CONFIG_PROC_CHILDREN): workers unseen
                continue  # a child that just exited
    except OSError:
        return None
    return total


def wait_until_quiet(max_s: float = 3.0, window_s: float = 0.2, quiet_cores: float = 0.25) -> float:
    """Wait (at most `max_s`) until this process and its children use under `quiet_cores` cores; the seconds waited.

    Why: a data loader left after its pass still has its prefetched batches in the making (torchvision's
    tuned loader: 2 workers x prefetch 2 = 4 batches, ~0.5 s of both cores on 2 cores), and that work
    would land in the next contender's timed pass."""
    t0 = time.perf_counter()
    last = process_tree_cpu_seconds()
    if last is None:
        return 0.0
    while time.perf_counter() - t0 < max_s:
        time.sleep(window_s)
        now = process_tree_cpu_seconds()
        if now is None or now - last < quiet_cores * window_s:
            break
        last = now
    return time.perf_counter() - t0


def machine_busy_cpu_seconds() -> float | None:
    """CPU seconds all processes of the machine have spent busy (Linux /proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user and nice
    return (sum(fields) - idle - guest) / tick


class OthersLoad:
    """How many cores processes other than this job use from now on: the machine's busy CPU time less
    this job's process tree (this process and its children; under torchrun every local rank, see
    `job_root_pid`), over the wall time. Started on construction."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._root = job_root_pid()
        self._machine0 = machine_busy_cpu_seconds()
        self._own0 = process_tree_cpu_seconds(self._root)

    def cores(self) -> float | None:
        """Average cores used by other processes since construction (None where /proc cannot tell)."""
        machine, own = machine_busy_cpu_seconds(), process_tree_cpu_seconds(self._root)
        wall = time.perf_counter() - self._t0
        if None in (machine, own, self._machine0, self._own0) or wall < 0.05:
            return None
        return max(0.0, ((machine - self._machine0) - (own - self._own0)) / wall)


@dataclass
class Quiet:
    """What `wait_for_quiet_machine` saw: seconds waited, and the cores other processes used in its
    last look (None where /proc cannot tell)."""

    waited_s: float
    others_cores: float | None

    @property
    def busy(self) -> bool:
        return self.others_cores is not None and self.others_cores > BUSY_CORES


def wait_for_quiet_machine(max_s: float = 10.0, window_s: float = 0.5, quiet_cores: float = BUSY_CORES) -> Quiet:
    """Before timing: wait (at most `max_s`) until processes other than this one and its children use at
    most `quiet_cores` cores, looking in windows of `window_s`. Returns what was seen; a caller whose
    machine stayed busy times anyway and says so (`busy_warning`), rather than waiting forever."""
    positive_number(max_s, "max_s", zero=True)  # inf would wait forever
    positive_number(window_s, "window_s")
    t0 = time.perf_counter()
    seen: float | None = None
    while True:
        load = OthersLoad()
        time.sleep(window_s)
        seen = load.cores()
        if seen is None or seen <= quiet_cores or time.perf_counter() - t0 + window_s > max_s:
            return Quiet(time.perf_counter() - t0, seen)


def busy_warning(others_cores: float | None) -> str | None:
    """One sentence for a report when other processes shared the cores while we timed, else None."""
    if others_cores is None or others_cores <= BUSY_CORES:
        return None
    return (f"the machine was busy: other processes used {others_cores:.1f} of {os.cpu_count()} cores while this "
            "was timed, so these figures may be off; measure again on a quiet machine")
