"""How much memory one call holds at its highest, read from the allocator that serves its tensors, and
how much a device has.

A planner that predicts a step's peak, and doctor's account of where a step's memory goes, need the
peak of a call, not of the process: on CUDA the caching allocator's own counters
(`torch.cuda.max_memory_allocated` after a reset, synchronised); on a CPU every allocation and free of
torch's CPU allocator as torch's profiler records them (exact, temporaries inside an op included, in
the order they happened), added to the bytes of the tensors held when the call began (`held`: the
model, its gradients, the optimizer's state, the batch, which the profiler cannot see); where the
profiler cannot be started (one is already running), the process's peak resident memory
(`measure.PeakMemory`), which counts everything the process holds. Every reading says which
(`MemoryReading.source`), so a figure is never read as another kind.

    watch = MemoryWatch("cpu", held=(model, optimizer, batch))
    with watch:
        with watch.phase("forward"):
            loss = model(x).sum()
        with watch.phase("backward"):
            loss.backward()
    watch.reading.peak_bytes, watch.reading.phases["forward"], watch.reading.source

    value, reading = peak_of(step, device="cuda")   # one call, one reading
    held_bytes(model, optimizer)                    # tensors' bytes, each storage counted once
    device_capacity(torch.device("cpu"))            # (bytes, "RAM") / (bytes, "GPU memory")
    format_bytes(3 << 30)                           # '3.00 GiB'

A reading's peaks are absolute (what was held at the highest moment), `start_bytes` what was held when
it began. On CUDA the allocator's peak counter is reset for the reading (as `measure` does per contender).
Kineto (the profiler's engine) writes a line on every start and stop unless KINETO_LOG_LEVEL says
otherwise; the first reading starts it with that level set above its loudest (a user's own setting wins),
and the variable is put back as found.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from torchspeed.measure import PeakMemory

__all__ = ["SOURCES", "MemoryReading", "MemoryWatch", "peak_of", "held_bytes", "device_capacity", "format_bytes",
           "kineto_quiet"]

CUDA_ALLOCATOR = "cuda allocator"
CPU_ALLOCATOR = "cpu allocator (profiler)"
PROCESS_RSS = "process RSS"
SOURCES = (CUDA_ALLOCATOR, CPU_ALLOCATOR, PROCESS_RSS)
_PHASE = "torchspeed.memory phase: "  # the profiler range a phase is recorded as


def format_bytes(n: float | None) -> str:
    """'1.50 GiB', '320.0 MiB', '12.0 KiB', '512 B' (binary units, as device memory is sold and counted)."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass
class MemoryReading:
    """What a call held: at its start, at its highest and at its end (bytes, absolute), the highest inside
    each named phase, on which device and read from where (`source`, one of SOURCES)."""

    device: str
    source: str
    start_bytes: int
    peak_bytes: int
    end_bytes: int
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def added_bytes(self) -> int:
        """How far the call rose above what was held when it began (its activations and temporaries)."""
        return max(0, self.peak_bytes - self.start_bytes)

    def describe(self) -> str:
        """'peak 1.20 GiB (cuda allocator)'."""
        return f"peak {format_bytes(self.peak_bytes)} ({self.source})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tensors(obj: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    """Every tensor in `obj`: a module's parameters, gradients and buffers, an optimizer's parameters, their
    gradients and its state, nested dicts / lists / tuples of tensors, and the tensors themselves."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", None)  # a sharded (DTensor) parameter holds its local shard
        yield local if isinstance(local, torch.Tensor) else obj
        if obj.is_leaf and obj.grad is not None:
            yield from _tensors(obj.grad, seen)
    elif isinstance(obj, nn.Module):
        for t in (*obj.parameters(), *obj.buffers()):
            yield from _tensors(t, seen)
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            yield from _tensors(group["params"], seen)
        for state in obj.state.values():
            yield from _tensors(state, seen)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, seen)


def held_bytes(*objects: Any, device: str | torch.device | None = None) -> int:
    """Bytes of the tensors in `objects` (modules, optimizers, tensors, nested dicts/lists/tuples of them),
    each storage counted once however many tensors view it; only those on `device` when given."""
    want = None if device is None else torch.device(device).type
    storages: dict[tuple[str, int], int] = {}
    for t in _tensors(objects, set()):
        if want is not None and t.device.type != want:
            continue
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, some subclasses)
            continue
        if s.device.type == "meta":
            continue
        storages[(str(s.device), s.data_ptr())] = s.nbytes()
    return sum(storages.values())


def device_capacity(device: str | torch.device) -> tuple[int | None, str]:
    """(bytes the device has in all, what they are called): a GPU's memory, or a CPU's RAM under its cgroup
    limit (/proc/meminfo's MemTotal, /sys/fs/cgroup/memory.max); None where it cannot be read."""
    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            return int(torch.cuda.get_device_properties(dev).total_memory), "GPU memory"
        except (RuntimeError, AssertionError, ValueError):
            return None, "GPU memory"
    total = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = int(limit) if total is None else min(total, int(limit))
    except OSError:
        pass
    return total, "RAM"


def _rss_now() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def kineto_quiet() -> Iterator[None]:
    """KINETO_LOG_LEVEL above Kineto's loudest (its start/stop lines) while the profiler starts, unless the
    user set it; put back as found after."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


class MemoryWatch:
    """A context manager reading the memory its block holds (see the module docstring); `phase(name)` marks
    a part of the block whose own peak is kept in `reading.phases`. `source` "auto" reads CUDA's allocator
    on a CUDA device, else the CPU allocator through the profiler, else the process's resident memory;
    "rss" asks for the last. `held`: what is held when the block begins (CPU allocator only: the profiler
    sees what is allocated while it runs, so what was there before is counted from these tensors)."""

    def __init__(self, device: str | torch.device = "cpu", *, held: Iterable[Any] = (), source: str = "auto"):
        if source not in ("auto", "rss"):
            raise ValueError(f"source must be 'auto' or 'rss', got {source!r}")
        self.device = torch.device(device)
        self.held = tuple(held)
        self.asked = source
        self.source = ""
        self.reading: MemoryReading | None = None
        self._prof: Any = None
        self._rss: PeakMemory | None = None
        self._start = 0
        self._peak = 0  # counters' peaks (CUDA, RSS) folded in as phases reset them
        self._phases: dict[str, int] = {}

    # ------------------------------------------------------------ the counters of each source
    def _counter_now(self) -> int:
        if self.source == CUDA_ALLOCATOR:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.memory_allocated(self.device))
        return _rss_now() or 0

    def _counter_peak(self) -> int:
        if self.source == CUDA_ALLOCATOR:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return (self._rss.peak() if self._rss is not None else None) or 0

    def _counter_reset(self) -> None:
        if self.source == CUDA_ALLOCATOR:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._rss is not None:
            self._rss.reset()

    def __enter__(self) -> MemoryWatch:
        self.reading, self._phases, self._peak = None, {}, 0
        if self.device.type == "cuda":
            self.source = CUDA_ALLOCATOR
        elif self.asked == "auto" and not torch.autograd.profiler._is_profiler_enabled:
            self.source = CPU_ALLOCATOR
        else:
            self.source = PROCESS_RSS
        if self.source == CPU_ALLOCATOR:
            self._start = held_bytes(self.held, device=self.device)
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with kineto_quiet():
                self._prof.__enter__()
            return self
        if self.source == PROCESS_RSS:
            self._rss = PeakMemory("cpu")
        self._counter_reset()
        self._start = self._counter_now()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.source == CPU_ALLOCATOR:
            with kineto_quiet():
                self._prof.__exit__(*exc)
            if exc[0] is None:
                self.reading = self._cpu_reading()
            self._prof = None
            return
        end = self._counter_now()
        peak = max(self._peak, self._counter_peak(), self._start, end)
        self.reading = MemoryReading(str(self.device), self.source, self._start, peak, end, dict(self._phases))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A named part of the watched block: its own peak is `reading.phases[name]` (a name repeated keeps
        the highest)."""
        if self.source == CPU_ALLOCATOR:
            with record_function(_PHASE + name):
                yield
            return
        self._peak = max(self._peak, self._counter_peak())
        self._counter_reset()
        try:
            yield
        finally:
            top = self._counter_peak()
            self._peak = max(self._peak, top)
            self._phases[name] = max(self._phases.get(name, 0), top)

    def _cpu_reading(self) -> MemoryReading:
        """The profiler's allocations and frees on this device, in time order, added up from what was held."""
        results = self._prof.profiler.kineto_results
        changes: list[tuple[int, int]] = []

        def walk(node: Any) -> None:
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == self.device.type:
                changes.append((node.start_time_ns, int(node.extra_fields.alloc_size)))
            for child in node.children:
                walk(child)

        for root in results.experimental_event_tree():
            walk(root)
        changes.sort(key=lambda c: c[0])
        times, levels, level = [], [], self._start
        for t, size in changes:
            level += size
            times.append(t)
            levels.append(level)
        phases: dict[str, int] = {}
        for e in results.events():
            if e.name().startswith(_PHASE):
                name = e.name()[len(_PHASE):]
                start, end = e.start_ns(), e.end_ns()
                before = [lv for t, lv in zip(times, levels) if t < start]
                inside = [lv for t, lv in zip(times, levels) if start <= t <= end]
                top = max([before[-1] if before else self._start, *inside])
                phases[name] = max(phases.get(name, 0), top)
        return MemoryReading(str(self.device), self.source, self._start, max([self._start, *levels]), level, phases)


def peak_of(fn: Callable[..., Any], *args: Any, device: str | torch.device = "cpu", held: Iterable[Any] = (),
            source: str = "auto", **kwargs: Any) -> tuple[Any, MemoryReading]:
    """(fn(*args, **kwargs), the memory that call held: a `MemoryReading`); see `MemoryWatch`."""
    watch = MemoryWatch(device, held=held, source=source)
    with watch:
        value = fn(*args, **kwargs)
    assert watch.reading is not None
    return value, watch.reading
