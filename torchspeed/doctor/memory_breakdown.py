"""Where a training step's memory goes: the step's peak split into parameters, gradients, optimizer
state, activations (the tensors autograd saved for backward) and the rest (temporaries inside an op,
the batch, buffers, workspace), the peak of each phase, and the modules whose forwards saved the most.

`StepMemory` accounts for one whole step, in its own step (doctor's second, or third on a CPU;
`profile`'s extra one), so its hooks never touch a timed step. Between `start()` and `finish()` it
counts, without changing the computation:
- activations: a `saved_tensors_hooks` pair whose pack hook returns the tensor detached (same storage,
  same version counter) and counts each storage once, by the module whose forward is running (a global
  forward pre/post hook pair keeps that stack), until autograd drops its last saved reference (a
  finaliser); parameters and buffers saved by an op are the model's own, not activations;
- gradients: each parameter's first gradient of the step (a post-accumulate-grad hook), and every
  parameter's `.grad` again at each phase boundary (zero_grad frees them);
- optimizer state: its tensors at each phase boundary (the first step creates them).
Each of these events is a point where the counts change; the allocator's peak is read for every span
between two of them, so the step's peak falls in one span and is split with the counts that held in it:
`rest` is the peak less the four counted parts. On CUDA the caching allocator's counters are host-side
(an allocation is counted when it is queued), so reading and resetting them needs no device sync; on a
CPU every allocation and free of torch's CPU allocator comes from torch's profiler
(`torchspeed.memory.MemoryWatch`, each span one of its phases), above the model's and optimizer's
bytes when it started; it sees only tensors allocated while it runs, so `prelude()` starts it a step
early: what the step before left alive (the script's last logits, say) is then counted too. Nor does
it report the free of a tensor allocated before it started: the gradients held then (zero_grad frees
them) are looked for at every phase boundary, and the level is lowered from the one where they are
gone. Where a profiler already runs, the process's resident memory. The result names its source.

Off where it would change what it measures: under torch.compile (compiled graphs save their own tensors;
the hooks stand aside while it traces) and where the script installs saved-tensor hooks of its own
(activation offloading): activations are then not counted and stay in the rest, as a note says.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed.doctor.phases import EXTRA_PHASES, PHASES
from torchspeed.measure import PeakMemory
from torchspeed.memory import CPU_ALLOCATOR, CUDA_ALLOCATOR, PROCESS_RSS, MemoryWatch, held_bytes, kineto_quiet

__all__ = ["PARTS", "MemoryBreakdown", "StepMemory", "state_bytes"]

PARTS = ("parameters", "gradients", "optimizer_state", "activations", "rest")
TOP_PRODUCERS = 10  # modules listed by the activations their forwards saved
_MARK = "torchspeed.doctor memory span "  # the profiler mark where a span begins
REST = {  # what the rest holds, by the phase the peak fell in
    "backward": "the gradients of the activations on their way back, and each op's temporaries",
    "forward": "outputs no op saved for backward (the logits, the loss), the batch where no op saved it, and each "
               "op's temporaries",
    "optimizer": "the optimizer's temporaries (a foreach or fused step works on a whole group at once)",
    "eval": "the evaluation's outputs and temporaries",
    "other": "the batch, the script's own tensors between phases, and buffers",
}


def state_bytes(model: nn.Module, optimizers: Iterable[Any] = (),
                device: str | torch.device | None = None) -> dict[str, int]:
    """Bytes of the model's parameters, their gradients and the optimizers' state (each storage once;
    only tensors on `device`'s type when given): the parts of a step's memory that outlive it."""
    params = list(model.parameters())
    state = [opt.state[p] for opt in list(optimizers) for p in opt.state]
    return {"parameters": held_bytes([p.detach() for p in params], device=device),  # detached: without .grad
            "gradients": held_bytes([p.grad for p in params if p.grad is not None], device=device),
            "optimizer_state": held_bytes(state, device=device)}


@dataclass
class MemoryBreakdown:
    """One step's memory: its peak (bytes, absolute) in `peak_phase`, split into `parts` (PARTS: the
    counted parts as they stood when the peak was reached, `rest` the remainder), the peak of each phase,
    the activations saved (`activations_bytes`, the most alive at once) and their largest producers by
    module, read from `source` (one of `torchspeed.memory.SOURCES`) on `device`."""

    step: int
    device: str
    source: str
    peak_bytes: int
    peak_phase: str
    parts: dict[str, int]
    phases: dict[str, int]
    activations_bytes: int
    producers: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "device": self.device, "source": self.source, "peak_bytes": self.peak_bytes,
                "peak_phase": self.peak_phase, "parts": dict(self.parts), "phases": dict(self.phases),
                "activations_bytes": self.activations_bytes, "producers": [dict(p) for p in self.producers],
                "notes": list(self.notes)}


def _storage_key(t: torch.Tensor) -> tuple[str, int, int] | None:
    """(device, address, bytes) of a tensor's storage; None for one without (meta, some subclasses)."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if s.device.type == "meta" or s.nbytes() == 0:
        return None
    return str(s.device), s.data_ptr(), s.nbytes()


class _Saved:
    """Bytes autograd holds for backward, each storage once, by the module running when it was saved."""

    def __init__(self, owner: StepMemory, names: dict[int, str], own: set[tuple[str, int]], device_type: str):
        self.owner, self.names, self.own, self.device_type = owner, names, own, device_type
        self.thread = threading.get_ident()  # the loop's: modules other threads run (transforms) are not its forwards
        self.modules: list[Any] = []  # the forward stack (innermost last)
        self.refs: dict[tuple[str, int], int] = {}  # storage -> saved tensors alive holding it
        self.sizes: dict[tuple[str, int], int] = {}
        self.alive = 0  # bytes
        self.most = 0
        self.by_module: dict[str, list[Any]] = {}  # name -> [bytes, tensors, type]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        saved = t.detach()  # same storage and version counter: autograd's checks and results are unchanged
        key = _storage_key(t) if t.device.type == self.device_type else None
        if key is None or key[:2] in self.own:
            return saved
        storage = key[:2]
        n = self.refs.get(storage, 0)
        self.refs[storage] = n + 1
        weakref.finalize(saved, self._released, storage)
        if n == 0:
            self.sizes[storage] = key[2]
            self.alive += key[2]
            self.most = max(self.most, self.alive)
            module = self.modules[-1] if self.modules else None
            name = self.names.get(id(module), type(module).__name__) if module is not None else "(outside any module)"
            entry = self.by_module.setdefault(name, [0, 0, type(module).__name__ if module is not None else "-"])
            entry[0] += key[2]
            entry[1] += 1
            self.owner.changed()
        return saved

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def _released(self, storage: tuple[str, int]) -> None:
        n = self.refs.get(storage, 0) - 1
        if n > 0:
            self.refs[storage] = n
            return
        self.refs.pop(storage, None)
        self.alive -= self.sizes.pop(storage, 0)
        self.owner.changed()

    def module_begin(self, module: Any, args: Any) -> None:
        if not torch.compiler.is_compiling() and threading.get_ident() == self.thread:
            self.modules.append(module)

    def module_end(self, module: Any, args: Any, output: Any) -> None:
        if self.modules and self.modules[-1] is module and threading.get_ident() == self.thread:
            self.modules.pop()


class _Allocator:
    """The allocator's peak over each span between two counting events. CUDA: the caching allocator's
    host-side counters, read and reset without a device sync. CPU: torch's profiler recording every
    allocation and free, each span's start an instant mark in the same record (a mark, not a range: a
    range opened inside `optimizer.step()`'s own profiler range and closed outside it would cross it);
    where a profiler already runs, the process's resident memory (`MemoryWatch`, each span a phase)."""

    def __init__(self, device: torch.device, held: tuple[Any, ...]):
        self.device = device
        self.cuda = device.type == "cuda"
        self.spans: list[int] = []  # CUDA: each closed span's peak
        self.watch: MemoryWatch | None = None
        self.prof: Any = None
        self._span: Any = None
        self.start_bytes = 0
        if self.cuda:
            self.source = CUDA_ALLOCATOR
            self.run_peak = int(torch.cuda.max_memory_allocated(device))  # the run's peak before this step resets it
            torch.cuda.reset_peak_memory_stats(device)
            return
        self.run_peak = PeakMemory("cpu").peak() or 0
        if torch.autograd.profiler._is_profiler_enabled:  # one is running (the script's): only RSS is left
            self.watch = MemoryWatch(device, held=held, source="rss")
            self.watch.__enter__()
            self.source = self.watch.source
            return
        self.source = CPU_ALLOCATOR
        self.start_bytes = held_bytes(held, device=device)
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with kineto_quiet():
            self.prof.__enter__()

    def span(self, index: int) -> None:
        """Close the running span; span `index` begins."""
        if self.cuda:
            if index:
                self.spans.append(int(torch.cuda.max_memory_allocated(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.prof is not None:
            with torch.profiler.record_function(f"{_MARK}{index}"):
                pass
        else:
            assert self.watch is not None
            if self._span is not None:
                self._span.__exit__(None, None, None)
            self._span = self.watch.phase(str(index))
            self._span.__enter__()

    def finish(self, count: int) -> tuple[list[int], int]:
        """(each span's peak, bytes held when the profiler started: CPU; 0 on CUDA, whose peaks are absolute)."""
        if self.cuda:
            self.spans.append(int(torch.cuda.max_memory_allocated(self.device)))
            self.run_peak = max(self.run_peak, *self.spans)
            return self.spans, 0
        if self.prof is not None:
            with kineto_quiet():
                self.prof.__exit__(None, None, None)
            return self._span_peaks(count), self.start_bytes
        assert self.watch is not None
        if self._span is not None:
            self._span.__exit__(None, None, None)
        self.watch.__exit__(None, None, None)
        reading = self.watch.reading
        assert reading is not None
        self.run_peak = max(self.run_peak, reading.peak_bytes)  # RSS spans reset the process peak: keep the run's
        return [reading.phases.get(str(i), reading.start_bytes) for i in range(count)], reading.start_bytes

    def _span_peaks(self, count: int) -> list[int]:
        """Each span's highest level: the profiler's allocations and frees and the span marks, in time order,
        added up from the bytes held when it started."""
        events = []
        for e in self.prof.profiler.kineto_results.events():
            name = e.name()
            if name == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
                events.append((e.start_ns(), 1, int(e.nbytes())))
            elif name.startswith(_MARK):
                events.append((e.start_ns(), 0, int(name[len(_MARK):])))
        events.sort(key=lambda ev: (ev[0], ev[1]))
        peaks, level, current = [self.start_bytes] * count, self.start_bytes, None
        for _, kind, value in events:
            if kind == 0:
                current = value if 0 <= value < count else None
                if current is not None:
                    peaks[current] = level
            else:
                level += value
                if current is not None:
                    peaks[current] = max(peaks[current], level)
        return peaks


class StepMemory:
    """The accounting of one training step (module docstring): `start()` at the step's beginning,
    `boundary(phase)` where the running phase changes (None: the loop's own code), `finish()` at its end,
    which returns the `MemoryBreakdown` and removes every hook."""

    def __init__(self, model: nn.Module | None, optimizers: Iterable[Any], device: str | torch.device,
                 step: int = 0, compiled: bool = False):
        self.model = model
        self.optimizers = optimizers  # read at each count: an optimizer first seen later is counted too
        self.device = torch.device(device)
        self.step = step
        self.compiled = compiled
        self.notes: list[str] = []
        self._points: list[tuple[str, dict[str, int]]] = []  # (phase running from it, counts) per span start
        self._phase = "other"
        self._saved: _Saved | None = None
        self._handles: list[Any] = []
        self._grads = 0
        self._grad_seen: set[int] = set()
        self._state: dict[str, int] = {}
        self._alloc: _Allocator | None = None
        self._opened = False
        self._done = False
        self._counting = False  # from start(): before it (the prelude) phase changes are not spans
        self._unseen_frees = 0  # bytes held when the CPU profiler started and freed since (it reports no such free)
        self._held_grads: dict[tuple[str, int], int] = {}  # those gradients' storages not yet freed -> bytes
        self._freed_at: list[int] = []  # _unseen_frees at each span's start
        self._thread = threading.get_ident()

    # ---------------------------------------------------------------- the step's events
    def prelude(self) -> None:
        """The step before the measured one begins: on a CPU the profiler starts now, so the tensors this
        step leaves alive into the next are seen (nothing is counted or reported for it)."""
        if self.device.type != "cuda" and self._alloc is None:
            self._alloc = _Allocator(self.device, self._held())
            self._follow_held_gradients()

    def _follow_held_gradients(self) -> None:
        """CPU profiler: the gradients counted as held when it started, whose frees it does not report
        (it never saw them allocated): each is looked for again at every count (`_count_state`)."""
        if self._alloc is None or self._alloc.source != CPU_ALLOCATOR or self.model is None:
            return
        self._held_grads = {key[:2]: key[2] for p in self.model.parameters()
                            if p.grad is not None and (key := _storage_key(p.grad)) is not None}

    def _held(self) -> tuple[Any, ...]:
        return (self.model, *list(self.optimizers)) if self.model is not None else tuple(self.optimizers)

    def start(self, phase: str | None = None) -> None:
        params = list(self.model.parameters()) if self.model is not None else []
        self._phase = phase or "other"
        self._count_state()
        own = {key[:2] for t in [*params, *(self.model.buffers() if self.model is not None else ())]
               if (key := _storage_key(t)) is not None}
        if self.compiled:
            self.notes.append("activations not counted: the model runs under torch.compile (its graphs save "
                              "their own tensors); they are in the rest")
        elif _saved_tensor_hooks_active():
            self.notes.append("activations not counted: the script sets saved-tensor hooks of its own "
                              "(offloading or checkpointing); they are in the rest")
        else:
            modules = self.model.named_modules() if self.model is not None else ()
            names = {id(m): n or "(the model's own forward)" for n, m in modules}
            self._saved = _Saved(self, names, own, self.device.type)
            self._handles += [nn.modules.module.register_module_forward_pre_hook(self._saved.module_begin),
                              nn.modules.module.register_module_forward_hook(self._saved.module_end, always_call=True)]
            self._saved.hooks.__enter__()
            self._opened = True
        self._handles += [p.register_post_accumulate_grad_hook(self._grad_made) for p in params if p.requires_grad]
        if self._alloc is None:
            self._alloc = _Allocator(self.device, self._held())
            self._follow_held_gradients()
        self._counting = True
        self._point()

    @property
    def counting(self) -> bool:
        """Started (not only the prelude's profiler)."""
        return self._counting

    def boundary(self, phase: str | None) -> None:
        """The running phase changes to `phase`: gradients and optimizer state are counted again."""
        if not self._counting or self._done:
            return
        self._phase = phase or "other"
        self._count_state()
        self._point()

    def changed(self) -> None:
        """A count changed inside a phase (a tensor saved or released, a gradient made): a new span."""
        self._point()

    def finish(self) -> MemoryBreakdown:
        self._count_state()
        self._close()
        assert self._alloc is not None
        self._done = True
        peaks, held_at_start = self._alloc.finish(len(self._points))
        peaks = [top - freed for top, freed in zip(peaks, self._freed_at)]
        phases: dict[str, int] = {}
        for (phase, _), top in zip(self._points, peaks):
            phases[phase] = max(phases.get(phase, 0), top)
        order = PHASES[:-1] + EXTRA_PHASES + PHASES[-1:]  # the step's order, `other` last
        phases = dict(sorted(phases.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
        i = max(range(len(peaks)), key=peaks.__getitem__) if peaks else 0
        phase, counts = self._points[i] if self._points else ("other", self._counts())
        peak = peaks[i] if peaks else 0
        parts = {k: counts[k] for k in PARTS[:-1]}
        parts["rest"] = max(0, peak - sum(parts.values()))
        if parts["rest"]:
            self.notes.append(f"the rest at the peak: {REST.get(phase, REST['other'])}")
        if self._alloc.source == CPU_ALLOCATOR:
            self.notes.append(f"CPU: the {_mib(held_at_start)} the model and optimizer held a step earlier, and every "
                              "tensor allocated since; tensors older than that step are not seen")
        elif self._alloc.source == PROCESS_RSS:
            self.notes.append("the process's resident memory (a profiler was already running): the rest holds the "
                              "interpreter, libraries and everything else the process keeps")
        saved = self._saved
        producers = []
        if saved is not None and saved.most:
            for name, (n, count, kind) in sorted(saved.by_module.items(), key=lambda kv: -kv[1][0])[:TOP_PRODUCERS]:
                producers.append({"module": name, "type": kind, "bytes": n, "tensors": count, "share": n / saved.most})
        return MemoryBreakdown(step=self.step, device=self.device.type, source=self._alloc.source, peak_bytes=peak,
                               peak_phase=phase, parts=parts, phases=phases,
                               activations_bytes=saved.most if saved is not None else 0, producers=producers,
                               notes=self.notes)

    def abandon(self) -> None:
        """Remove every hook without a result (the step did not finish)."""
        self._close()
        if self._alloc is not None and not self._done:
            self._done = True
            try:
                self._alloc.finish(len(self._points))
            except Exception:  # noqa: BLE001 - nothing to report from a step that did not finish
                pass

    @property
    def run_peak(self) -> int | None:
        """The run's peak including what this step's counter resets would hide (CUDA, RSS)."""
        return self._alloc.run_peak if self._alloc is not None else None

    # ---------------------------------------------------------------- counting
    def _grad_made(self, p: torch.Tensor) -> None:
        if id(p) not in self._grad_seen and p.grad is not None and p.grad.device.type == self.device.type:
            self._grad_seen.add(id(p))
            self._grads += held_bytes([p.grad])
            self._point()

    def _count_state(self) -> None:
        if self.model is None:
            self._state = {"parameters": 0, "gradients": 0, "optimizer_state": 0}
            return
        self._state = state_bytes(self.model, self.optimizers, self.device)
        self._grads = self._state["gradients"]
        self._grad_seen = {id(p) for p in self.model.parameters() if p.grad is not None}
        if self._held_grads:  # gradients held when the CPU profiler started and no parameter holds now: freed
            now = {key[:2] for p in self.model.parameters() if p.grad is not None and (key := _storage_key(p.grad))}
            for storage in [s for s in self._held_grads if s not in now]:
                self._unseen_frees += self._held_grads.pop(storage)

    def _counts(self) -> dict[str, int]:
        return {"parameters": self._state.get("parameters", 0), "gradients": self._grads,
                "optimizer_state": self._state.get("optimizer_state", 0),
                "activations": self._saved.alive if self._saved is not None else 0}

    def _point(self) -> None:
        # a saved tensor released after the step is not in it; one released by another thread changes the
        # counts without a span of its own (spans are the loop thread's)
        if self._alloc is None or self._done or not self._counting or threading.get_ident() != self._thread:
            return
        self._alloc.span(len(self._points))
        self._points.append((self._phase, self._counts()))
        self._freed_at.append(self._unseen_frees)

    def _close(self) -> None:
        if self._opened and self._saved is not None:
            self._opened = False
            self._saved.hooks.__exit__(None, None, None)
        while self._handles:
            self._handles.pop().remove()


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are set now (the script's own): ours would replace them."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    try:
        return top(False) is not None
    except TypeError:
        return top() is not None


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
