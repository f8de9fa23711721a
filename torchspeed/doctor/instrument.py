"""What `torchspeed doctor` runs inside the user's process: patch torch from outside the user's code,
run the unchanged script with runpy, and write what was seen to a JSON file the parent reads.

The child is started as `python [interpreter options] -c BOOTSTRAP MODE TARGET ARGS...` (MODE is
script, module or code), so the user's own interpreter and options are kept. What is instrumented
is the table `PATCHES` (each entry: what it wraps, the wrapper that records into the phase clock, its
undo); `Recorder.install()` applies it and `Recorder.uninstall()` puts every original back:

- DataLoader: `__iter__` (worker start-up) and iterator `__next__`: phase `data`, per-loader settings
  (num_workers, pin_memory, batch_size, persistent_workers, and the image files and transforms it
  reads, `datafix.describe`), batches, epochs, first-batch waits; the labels and image statistics of
  the first batches (`--try`'s numerics);
- torchspeed's FastLoader: `__iter__`, the loop's wait for each batch: phase `data`, its num_workers
  and threads (its inner DataLoader, iterated by a prefetch thread, is not counted again);
- module forward, via torch's global forward hooks: the outermost call is phase `forward` (autograd
  on) or `eval` (no_grad / inference_mode), also inside `optimizer.step(closure)` (Lightning's
  automatic optimisation); nn.Modules called while a batch is being loaded (transforms) or during
  backward (activation checkpointing) are not counted as forward;
- `torch.autograd.backward` (so `loss.backward()` too): phase `backward`; the first losses are kept
  on their device (no sync) for `--try`'s numerics check;
- `Optimizer.step` via torch's global optimizer hooks, and `zero_grad`: phase `optimizer`;
  `Optimizer.__init__` tells whether the script has an optimizer at all;
- step boundaries: each backward and each optimizer step closes a segment; a step is the segments up
  to an optimizer step (so gradient accumulation is one step), or up to a backward call in a loop that
  makes no torch.optim optimizer (manual `p.data` updates); with a step limit the script is stopped
  cleanly after that many;
- `Tensor.to` / `Tensor.cuda` called in the loop itself (not inside a phase): phase `copy`;
- `.item()`, `.cpu()`, `.tolist()`, `.numpy()`, `float(t)`, `int(t)`, `bool(t)` in the loop on a CUDA
  tensor: host syncs (on CPU the value is already on the host: such a read costs nothing, is not counted);
- `F.cross_entropy` / `F.nll_loss` inputs (first calls only): softmax output fed to them;
- settings: autocast in training forwards, GradScaler, cudnn.benchmark, torch.compile,
  DataParallel / DDP, forwards in eval mode with autograd on, no_grad forwards in train mode.

On CUDA, each phase change records a CUDA event on the loop's current stream (no host sync: the
loop keeps its overlap of host and device) and each step boundary synchronises once; a step's phases
are then read on the GPU's timeline (`timeline_phases`), so queued GPU work is charged to the phase
that queued it, and a phase the GPU ran ahead of costs what the GPU spent in it.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV_OUT = "TORCHSPEED_DOCTOR_OUT"
ENV_STEPS = "TORCHSPEED_DOCTOR_STEPS"
ENV_TRACE = "TORCHSPEED_DOCTOR_TRACE"
ENV_CPROFILE = "TORCHSPEED_DOCTOR_CPROFILE"
ENV_SEED = "TORCHSPEED_DOCTOR_SEED"  # --try: every run seeded alike, so losses compare
ENV_FIXES = "TORCHSPEED_DOCTOR_FIXES"  # --try: JSON {fix name: value} applied by the bootstrap
KEEP_LOSSES = 5  # first losses (and batch fingerprints) kept for the numerics check
TRACE_STEPS = 3  # steps recorded by --trace, after the first (warm-up) step


class StopScript(SystemExit):
    """Raised after the last requested step; a SystemExit so `except Exception` in the script lets it pass."""

    def __init__(self) -> None:
        super().__init__(0)


class Recorder:
    """Accumulates phase times per step window and the settings seen."""

    def __init__(self, max_steps: int | None = None, trace_path: str | None = None):
        from torchspeed.doctor.phases import PhaseClock

        self.pid = os.getpid()
        self.loop_thread = threading.get_ident()  # the script's thread: the training loop runs here
        self._enabled = True
        self.clock = PhaseClock()
        self.max_steps = max_steps
        self.trace_path = trace_path
        self._trace_prof: Any = None
        self.cprofile: Any = None
        self.in_loop = False
        self.t_start = time.perf_counter()
        self.steps = 0
        self.segments: list[dict[str, Any]] = []  # closed by a backward or an optimizer step
        self.opt_steps = 0
        self.optimizers_made = 0
        self.losses: list[Any] = []  # first KEEP_LOSSES losses, detached on their device
        self.batch_prints: list[list[Any]] = []  # integer contents (labels) of the first batches
        self.batch_stats: list[Any] = []  # image statistics of the first batches (datafix.image_stats)
        self._samples = 0
        self.fix: Any = None  # doctor --try: the fixes.FixState this run injects
        self.non_blocking = False  # --try pin_memory: pinned copies to CUDA made non_blocking
        self._fwd_stack: list[bool] = []
        self._pending_eval_grad = False
        self._bn_cache: dict[int, bool] = {}
        self._last_loader: int | None = None
        self._loss_checks_left = 2
        self._cuda_seen = False
        self._marks: list[tuple[Any, str | None]] | None = None  # CUDA: (event, phase running from it) this step
        self._marks_whole = False  # the marks cover the whole step window (not only since CUDA was first seen)
        self.loaders: dict[int, dict[str, Any]] = {}
        self.s: dict[str, Any] = {
            "autocast": False, "autocast_precision": None, "grad_scaler": False, "compiled": False,
            "parallel": "none", "eval_forwards_with_grad": 0, "train_mode_eval_forwards": 0,
            "host_syncs": 0, "copies": {"count": 0, "bytes": 0, "non_blocking": True, "from_pinned": True},
            "input": None, "model": None, "optimizers": [], "optimizer_options": {}, "loss_checks": [],
            "backward_calls": 0,
        }
        self._undo: list[tuple[str, Callable[[], None]]] = []  # (patch name, its undo), in install order

    @property
    def enabled(self) -> bool:
        """Recording is on, and this is the loop's thread: what loader threads (a prefetcher, decoding
        threads) do overlaps the step and must not enter the loop's phases (one phase stack)."""
        return self._enabled and threading.get_ident() == self.loop_thread

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = value

    # ---------------------------------------------------------------- loaders
    def _loader_epoch(self, loader: Any, kind: str, **settings: Any) -> None:
        """A new pass over `loader`: its record (made on the first pass) counts an epoch."""
        info = self.loaders.get(id(loader))
        if info is None:
            info = self.loaders[id(loader)] = {
                "name": f"{kind} #{len(self.loaders) + 1}", **settings, "dataset": type(loader.dataset).__name__,
                "batches": 0, "epochs": 0, "startup_s": [], "data_s": 0.0, "training": False}
        info["epochs"] += 1
        info["_t_iter"], info["_first"] = time.perf_counter(), True

    def _batch_received(self, key: int | None, t0: float, batch: Any = None) -> None:
        """The loop got a batch from loader `key` after waiting since `t0`."""
        info = self.loaders.get(key)  # type: ignore[arg-type]
        if info is None:
            return
        now = time.perf_counter()
        info["batches"] += 1
        info["data_s"] += now - t0
        if len(self.batch_prints) < KEEP_LOSSES and batch is not None:
            from torchspeed.doctor.datafix import image_stats

            self.batch_prints.append(_fingerprint(batch))
            self.batch_stats.append(image_stats(batch))
        if info.pop("_first", False):
            info["startup_s"].append(now - info.pop("_t_iter", t0))
        self._last_loader = key

    # ---------------------------------------------------------------- phases
    def _enter(self, phase: str) -> None:
        self.in_loop = True
        self.clock.enter(phase)
        self._mark()

    def _exit(self) -> None:
        self.clock.exit()
        self._mark()

    def _unwind(self, depth: int) -> None:
        """Close the phases an exception left open, down to `depth`."""
        self.clock.unwind(depth)
        self._mark()

    def _mark(self) -> None:
        """Once CUDA is seen: an event on the current stream where the running phase changes (no sync)."""
        if self._marks is not None:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((event, self.clock.current))

    @property
    def step_source(self) -> str:
        """What ends a training step: "optimizer" (torch.optim steps) or "backward" (a loop without a
        torch.optim optimizer, e.g. manual SGD on p.data: each backward call is a step)."""
        return "optimizer" if self.opt_steps or self.optimizers_made else "backward"

    @property
    def windows(self) -> list[dict[str, Any]]:
        """Per training step: wall, phases, samples (segments merged up to each step's end; a trailing
        incomplete step is left out)."""
        src = "optimizer" if self.opt_steps else "backward"
        out: list[dict[str, Any]] = []
        acc: dict[str, Any] | None = None
        for seg in self.segments:
            if acc is None:
                acc = {"wall": seg["wall"], "phases": dict(seg["phases"]), "samples": seg["samples"]}
            else:
                acc["wall"] += seg["wall"]
                acc["samples"] += seg["samples"]
                for k, v in seg["phases"].items():
                    acc["phases"][k] = acc["phases"].get(k, 0.0) + v
            if seg["end"] == src:
                out.append(acc)
                acc = None
        return out

    def _segment_end(self, kind: str) -> None:
        """A backward call or an optimizer step ended: close the segment; count a step if `kind` is
        what ends steps in this script."""
        marks = self._marks
        if marks is not None:
            import torch

            self._mark()  # the step's end on the GPU's timeline
            torch.cuda.synchronize()  # the one host sync of the step: every mark is reached now
        res = self.clock.boundary()
        if marks is not None:
            whole, self._marks, self._marks_whole = self._marks_whole, marks[-1:], True
        if res is None:
            return
        wall, phases = res
        if marks is not None and whole:
            phases = timeline_phases(marks, lambda a, b: a.elapsed_time(b) / 1e3, wall)
        self.segments.append({"wall": wall, "phases": phases, "samples": self._samples, "end": kind})
        self._samples = 0
        if kind == "optimizer":
            self.opt_steps += 1
            if self.opt_steps == 1:
                self.steps = 0  # backward calls counted before an optimizer was known were not steps
        if kind != self.step_source:
            return
        self.steps += 1
        if self.steps == 1 and self.cprofile is not None:
            self.cprofile.enable()  # hot spots of the steady loop, not of imports and set-up
        self._trace_tick()
        if self.max_steps is not None and self.steps >= self.max_steps:
            raise StopScript()

    def _trace_tick(self) -> None:
        if not self.trace_path:
            return
        import torch

        if self.steps == 1 and self._trace_prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self._cuda_seen:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._trace_prof = torch.profiler.profile(activities=acts)
            self._trace_prof.__enter__()
        elif self._trace_prof is not None and self.steps == 1 + TRACE_STEPS:
            self._finish_trace()

    def _finish_trace(self) -> None:
        prof, self._trace_prof = self._trace_prof, None
        if prof is None:
            return
        prof.__exit__(None, None, None)
        tmp = self.trace_path + ".tmp.json"
        prof.export_chrome_trace(tmp)
        os.replace(tmp, self.trace_path)

    # ---------------------------------------------------------------- install
    def install(self) -> None:
        """Apply every patch of `PATCHES`, in order; `uninstall()` undoes them in reverse."""
        if self._undo:
            raise RuntimeError("this Recorder is already installed")
        os.register_at_fork(after_in_child=self._disable)  # loader workers inherit patches: keep them quiet
        try:
            for patch in PATCHES:
                undo = patch.apply(self)
                if undo is not None:
                    self._undo.append((patch.name, undo))
        except BaseException:
            self.uninstall()
            raise

    @property
    def installed(self) -> list[str]:
        """Names of the patches in place (those of `PATCHES` this torch has), in installation order."""
        return [name for name, _ in self._undo]

    def uninstall(self) -> None:
        """Put back every original object the patches replaced, and remove the global hooks."""
        while self._undo:
            _, undo = self._undo.pop()
            undo()

    def inject(self, fixes: dict[str, Any]) -> None:
        """doctor --try: inject `fixes` ({fix name: value}) into the run; `uninstall()` undoes them too."""
        from torchspeed.doctor.fixes import FixState

        self.fix = FixState(fixes)
        self._undo.extend(("fix", undo) for undo in self.fix.install(self))

    def _disable(self) -> None:
        self.enabled = False

    def _cuda_on(self) -> None:
        if not self._cuda_seen:
            self._cuda_seen = True
            self._marks, self._marks_whole = [], False  # this step window began before: timed on the host
            self._mark()

    def _has_bn_dropout(self, module: Any) -> bool:
        key = id(module)
        if key not in self._bn_cache:
            from torch import nn

            self._bn_cache[key] = any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout))
                                      for m in module.modules())
        return self._bn_cache[key]

    def _observe_model(self, module: Any, args: tuple, training: bool) -> None:
        import torch

        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and x.is_cuda:
            self._cuda_on()
        if not training:
            return
        if x is not None:
            self._samples += int(x.shape[0]) if x.dim() else 1
        dev = x.device.type if x is not None else "cpu"
        if torch.is_autocast_enabled(dev):
            self.s["autocast"] = True
            self.s["autocast_precision"] = _precision_name(torch.get_autocast_dtype(dev))
        if self.s["model"] is None:
            from torchspeed.doctor.settings import model_settings

            self.s["model"] = model_settings(module)
            self.s["parallel"] = self.s["model"]["parallel"]
            if x is not None:
                self.s["input"] = {"shape": list(x.shape), "dtype": str(x.dtype), "device": str(x.device),
                                   "channels_last": x.dim() == 4 and not x.is_contiguous()
                                   and x.is_contiguous(memory_format=torch.channels_last)}

    def _check_probabilities(self, x: Any, rule: str) -> None:
        """softmax output fed to cross_entropy / nll_loss: non-negative rows summing to 1 over dim 1."""
        import torch

        if x.dim() < 2 or not x.is_floating_point() or x.shape[1] < 2:
            return
        with torch.no_grad():
            v = x.detach().float()
            tol = 1e-3 if x.dtype in (torch.float32, torch.float64) else 2e-2  # bf16/fp16 softmax rows round
            probs = bool((v.min() >= 0) & (v.max() <= 1 + tol) & ((v.sum(1) - 1).abs().max() < tol))
        if probs:
            self._loss_checks_left = 0  # one finding is enough
            what = "CrossEntropyLoss / F.cross_entropy" if rule == "double-softmax" else "NLLLoss / F.nll_loss"
            self.s["loss_checks"].append({"rule": rule, "where": [], "message": (
                f"{what} is fed probabilities (non-negative rows summing to 1, i.e. softmax output)"
                + (": it applies log_softmax again, so gradients shrink and training can stall"
                   if rule == "double-softmax" else ": it expects log-probabilities from log_softmax"))})

    # ---------------------------------------------------------------- results
    def results(self) -> dict[str, Any]:
        import torch

        from torchspeed.doctor.settings import machine_settings
        from torchspeed.measure import PeakMemory

        if self._trace_prof is not None:
            try:
                self._finish_trace()
            except Exception:  # a trace is a bonus; the report matters more
                pass
        if self._pending_eval_grad:
            self.s["eval_forwards_with_grad"] += 1
            self._pending_eval_grad = False
        s = dict(self.s)
        s.update(machine_settings())
        s["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
        s["loaders"] = [{k: v for k, v in ld.items() if not k.startswith("_")} for ld in self.loaders.values()]
        s["device"] = "cuda" if self._cuda_seen else "cpu"
        s["step_source"] = "optimizer" if self.opt_steps else "backward"
        s["optimizers_made"] = self.optimizers_made
        try:
            from torchspeed.runtime import default_precision

            s["mixed_precision"] = default_precision(s["device"]).to_dict()  # the capability, read first
        except Exception:  # noqa: BLE001 - a capability probe must not cost the report
            s["mixed_precision"] = {"name": "fp32", "reason": "capability unknown"}
        peak = PeakMemory("cuda" if self._cuda_seen else "cpu").peak()  # never reset: the script's whole run
        losses = [float(t.float()) for t in self.losses]
        return {"steps_run": self.steps, "windows": self.windows, "settings": s, "peak_memory_bytes": peak,
                "losses": losses, "batch_prints": self.batch_prints, "batch_stats": self.batch_stats,
                "fixes": self.fix.spec if self.fix is not None else {},
                "fix_notes": self.fix.notes if self.fix is not None else {},
                "compile_window": self.fix.compile_window if self.fix is not None else None,
                "script_s": time.perf_counter() - self.t_start, "trace": self.trace_path if self.trace_path
                and os.path.exists(self.trace_path) else None}


# ====================================================================== the patch table
# Everything doctor changes in torch is one entry of PATCHES: what it wraps (an attribute, or a global
# hook registry), the wrapper that records into the Recorder's phase clock, and its undo. Wrappers
# pass straight through to the original when recording is off (`rec.enabled`: off in loader
# workers, in other threads than the loop's, and after the script ends).

def timeline_phases(marks: list[tuple[Any, str | None]], seconds_between: Callable[[Any, Any], float],
                    wall: float) -> dict[str, float]:
    """A step's seconds per phase on the device's timeline: between consecutive marks (each a point
    where the running phase changed, with the phase running from it; None: no phase), the time goes to
    that phase; `other` is the rest of `wall`. Shares are kept and scaled to `wall` should the device's
    clock read a little longer than the host's."""
    from torchspeed.doctor.phases import EXTRA_PHASES, PHASES

    out = dict.fromkeys(PHASES[:-1] + EXTRA_PHASES, 0.0)
    for (a, phase), (b, _) in zip(marks, marks[1:]):
        if phase is not None:
            out[phase] = out.get(phase, 0.0) + max(0.0, seconds_between(a, b))
    busy = sum(out.values())
    if busy > wall > 0:
        out = {k: v * wall / busy for k, v in out.items()}
        busy = wall
    out["other"] = max(0.0, wall - busy)
    return out


def _resolve(path: str) -> Any:
    """The object at "package.module" or "package.module:Class[.Attr]"."""
    import importlib

    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class AttrPatch:
    """`owner.attr` replaced by `wrap(rec, original)` (which keeps the original's name and docstring);
    the undo puts the original back, or deletes the replacement where the owner only inherited it."""

    owner: str  # "package.module" or "package.module:Class"
    attr: str
    wrap: Callable[[Recorder, Any], Callable[..., Any]]
    optional: bool = False  # an owner this torch does not have is skipped

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.attr}"

    def target(self) -> Any:
        return _resolve(self.owner)

    def apply(self, rec: Recorder) -> Callable[[], None] | None:
        try:
            owner = self.target()
        except (ImportError, AttributeError):
            if self.optional:
                return None
            raise
        original = getattr(owner, self.attr)
        own = self.attr in vars(owner)
        stored = vars(owner)[self.attr] if own else None  # what __dict__ holds (a descriptor stays one)
        replacement = self.wrap(rec, original)
        replacement.__name__ = getattr(original, "__name__", self.attr)
        replacement.__doc__ = getattr(original, "__doc__", None)
        setattr(owner, self.attr, replacement)

        def undo() -> None:
            if own:
                setattr(owner, self.attr, stored)
            else:
                delattr(owner, self.attr)
        return undo


@dataclass(frozen=True)
class HookPatch:
    """A global torch hook: `register(make(rec), **kwargs)`; the undo removes it by its handle."""

    register: str  # "package.module:register_function"
    make: Callable[[Recorder], Callable[..., Any]]
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return self.register.replace(":", ".")

    def apply(self, rec: Recorder) -> Callable[[], None]:
        handle = _resolve(self.register)(self.make(rec), **dict(self.kwargs))
        return handle.remove


# DataLoader: worker start-up in __iter__, the wait for each batch in __next__ -------------------
def _dataloader_iter(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def dl_iter(loader):
        if not rec.enabled:
            return orig(loader)
        images = {}
        if id(loader) not in rec.loaders:  # what it reads, once: the data fix of --try needs image files
            from torchspeed.doctor.datafix import describe

            images = {"images": d} if (d := describe(loader)) else {}
        rec._loader_epoch(loader, "DataLoader", num_workers=loader.num_workers,
                          pin_memory=bool(loader.pin_memory), batch_size=loader.batch_size,
                          persistent_workers=bool(loader.persistent_workers), **images)
        rec._enter("data")
        try:
            it = orig(loader)
        finally:
            rec._exit()
        it._ts_doctor_loader = id(loader)
        return it
    return dl_iter


def _dataloader_next(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def dl_next(it):
        if not rec.enabled:
            return orig(it)
        t0 = time.perf_counter()
        rec._enter("data")
        try:
            batch = orig(it)
        finally:
            rec._exit()
        rec._batch_received(getattr(it, "_ts_doctor_loader", None), t0, batch)
        return batch
    return dl_next


# torchspeed's FastLoader: its batches come from threads or a prefetcher, so what the loop waits
# for is the FastLoader's next(), not a DataLoader's --------------------------------------------
def _fast_loader_iter(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def fast_iter(loader):
        inner = orig(loader)
        if not rec.enabled:
            return inner
        inside = loader.dataloader
        rec._loader_epoch(loader, "FastLoader", num_workers=inside.num_workers, threads=loader.threads,
                          background=True, pin_memory=bool(inside.pin_memory),
                          batch_size=loader.batch_sampler.batch_size,
                          persistent_workers=bool(inside.persistent_workers))
        return _timed_batches(rec, inner, id(loader))
    return fast_iter


def _timed_batches(rec: Recorder, inner: Any, key: int) -> Any:
    try:
        while True:
            if not rec.enabled:
                yield from inner
                return
            t0 = time.perf_counter()
            rec._enter("data")
            try:
                batch = next(inner)
            except StopIteration:
                return
            finally:
                rec._exit()
            rec._batch_received(key, t0, batch)
            yield batch
    finally:
        inner.close()  # a loop left early stops the loader's threads now


# module forward, through torch's global forward hooks ------------------------------------------
def _forward_pre(rec: Recorder) -> Callable[..., None]:
    import torch

    loss_types = (torch.nn.modules.loss._Loss,)

    def pre(module, args):
        if not rec.enabled:
            return
        # inside loading, backward, a copy: not a forward of the loop; inside optimizer.step(closure) it is
        if rec._fwd_stack or rec.clock.current not in (None, "optimizer"):
            rec._fwd_stack.append(False)
            return
        is_loss = isinstance(module, loss_types)
        grad = torch.is_grad_enabled()
        # autograd on means a training forward (even in eval mode, e.g. frozen BatchNorm fine-tuning)
        training = grad
        if not is_loss:
            if rec._pending_eval_grad:  # the previous eval-mode forward had no backward after it
                rec.s["eval_forwards_with_grad"] += 1
                rec._pending_eval_grad = False
            rec._observe_model(module, args, training)
            if grad and not module.training:
                rec._pending_eval_grad = True  # cancelled if a backward follows
            if not grad and module.training and rec._has_bn_dropout(module):
                rec.s["train_mode_eval_forwards"] += 1
        rec._fwd_stack.append(True)
        rec._enter("forward" if training else "eval")
        if rec.fix is not None:
            return rec.fix.forward_pre(rec, module, args, training and not is_loss)
        return None
    return pre


def _forward_post(rec: Recorder) -> Callable[..., None]:
    def post(module, args, output):
        if not rec.enabled or not rec._fwd_stack:
            return
        if rec._fwd_stack.pop():
            new = rec.fix.forward_post(module, output) if rec.fix is not None else None
            rec._exit()
            return new
        return None
    return post


# backward: torch.autograd.backward (loss.backward() calls it) -----------------------------------
def _backward(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def backward(*a, **k):
        if not rec.enabled:
            return orig(*a, **k)
        rec._pending_eval_grad = False
        rec.s["backward_calls"] += 1
        if rec._last_loader in rec.loaders:
            rec.loaders[rec._last_loader]["training"] = True
        tensors = a[0] if a else k.get("tensors")
        if len(rec.losses) < KEEP_LOSSES and isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            rec.losses.append(tensors.detach().clone())  # read after the run: no sync now
        if rec.fix is not None and rec.fix.scaler is not None and a:
            a = (rec.fix.scale_loss(a[0]), *a[1:])
        depth = rec.clock.depth
        rec._enter("backward")
        try:
            out = orig(*a, **k)
        finally:
            rec._unwind(depth)
        rec._segment_end("backward")
        return out
    return backward


# optimizer: step through torch's global optimizer hooks (each step ends a step window), zero_grad
def _optimizer_pre(rec: Recorder) -> Callable[..., None]:
    def opt_pre(opt, args, kwargs):
        if not rec.enabled:
            return
        name = type(opt).__name__
        if name not in rec.s["optimizers"]:
            rec.s["optimizers"].append(name)
            rec.s["optimizer_options"][name] = {k: opt.defaults.get(k) for k in ("fused", "foreach")
                                                if k in opt.defaults}
        rec._enter("optimizer")
        if rec.fix is not None:
            rec.fix.before_step(opt)
    return opt_pre


def _optimizer_post(rec: Recorder) -> Callable[..., None]:
    def opt_post(opt, args, kwargs):
        if not rec.enabled:
            return
        if rec.fix is not None:
            rec.fix.after_step(opt)
        rec._exit()
        rec._segment_end("optimizer")
    return opt_post


def _optimizer_init(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def opt_init(opt, *a, **k):
        rec.optimizers_made += 1
        return orig(opt, *a, **k)
    return opt_init


def _zero_grad(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def zero_grad(opt, *a, **k):
        if not rec.enabled or not rec.in_loop:
            return orig(opt, *a, **k)
        rec._enter("optimizer")
        try:
            return orig(opt, *a, **k)
        finally:
            rec._exit()
    return zero_grad


# copies (Tensor.to / .cuda called in the loop itself) and host syncs ----------------------------
def _copying(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def copy(t, *a, **k):
        if not rec.enabled or not rec.in_loop or rec.clock.current not in (None, "optimizer"):
            return orig(t, *a, **k)
        if rec.non_blocking and t.is_pinned():
            k.setdefault("non_blocking", True)
        rec._enter("copy")
        try:
            out = orig(t, *a, **k)
        finally:
            rec._exit()
        if isinstance(out, torch.Tensor) and out.device != t.device:
            c = rec.s["copies"]
            c["count"] += 1
            c["bytes"] += t.numel() * t.element_size()
            if out.is_cuda:
                rec._cuda_on()
                c["non_blocking"] &= bool(k.get("non_blocking", False))
                c["from_pinned"] &= bool(t.is_pinned())
        return out
    return copy


def _waits_for_device(t: Any) -> bool:
    """Does reading `t`'s value on the host wait for its device's queue? On CUDA it does (a host sync);
    a CPU tensor's value is already there."""
    return t.is_cuda


def _syncing(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    """A read of a tensor's value on the host (.item(), float(t), bool(t)...) in the loop: counted as a
    host sync when it waits for the device (the `host-syncs` rule reads the count per step)."""
    def sync(t, *a, **k):
        if rec.enabled and rec.in_loop and _waits_for_device(t):
            rec.s["host_syncs"] += 1
        return orig(t, *a, **k)
    return sync


def _fingerprint(batch: Any) -> list[Any]:
    """The integer tensors of a batch (labels, token ids) as lists, other tensors by shape: equal for the
    same samples in the same order whatever random augmentation drew."""
    import torch

    out: list[Any] = []
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch]
    for v in items:
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() or v.numel() > 4096:
                out.append(list(v.shape))
            else:
                out.append(torch._C.TensorBase.tolist(torch._C.TensorBase.cpu(v)))  # unpatched: not a loop read
    return out


# loss inputs: softmax output fed to cross_entropy / nll_loss (first calls only) -----------------
def _loss_input_check(rec: Recorder, orig: Callable[..., Any], rule: str) -> Callable[..., Any]:
    import torch

    def checked(input, *a, **k):
        if rec.enabled and rec._loss_checks_left > 0 and isinstance(input, torch.Tensor):
            rec._loss_checks_left -= 1
            rec._check_probabilities(input, rule)
        return orig(input, *a, **k)
    return checked


# settings: a GradScaler made, torch.compile called ----------------------------------------------
def _grad_scaler_init(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def gs_init(scaler, *a, **k):
        rec.s["grad_scaler"] = True
        return orig(scaler, *a, **k)
    return gs_init


def _compile(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def compile_(*a, **k):
        rec.s["compiled"] = True
        return orig(*a, **k)
    return compile_


PATCHES: tuple[AttrPatch | HookPatch, ...] = (
    AttrPatch("torch.utils.data.dataloader:DataLoader", "__iter__", _dataloader_iter),
    AttrPatch("torch.utils.data.dataloader:_BaseDataLoaderIter", "__next__", _dataloader_next),
    AttrPatch("torchspeed.data.loader:FastLoader", "__iter__", _fast_loader_iter),
    HookPatch("torch.nn.modules.module:register_module_forward_pre_hook", _forward_pre),
    HookPatch("torch.nn.modules.module:register_module_forward_hook", _forward_post, (("always_call", True),)),
    AttrPatch("torch.autograd", "backward", _backward),
    HookPatch("torch.optim.optimizer:register_optimizer_step_pre_hook", _optimizer_pre),
    HookPatch("torch.optim.optimizer:register_optimizer_step_post_hook", _optimizer_post),
    AttrPatch("torch.optim:Optimizer", "zero_grad", _zero_grad),
    AttrPatch("torch:Tensor", "to", _copying),
    AttrPatch("torch:Tensor", "cuda", _copying),
    AttrPatch("torch.optim:Optimizer", "__init__", _optimizer_init),
    *(AttrPatch("torch:Tensor", name, _syncing)
      for name in ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__")),
    AttrPatch("torch.nn.functional", "cross_entropy", functools.partial(_loss_input_check, rule="double-softmax")),
    AttrPatch("torch.nn.functional", "nll_loss", functools.partial(_loss_input_check, rule="softmax-nll")),
    AttrPatch("torch.amp:GradScaler", "__init__", _grad_scaler_init, optional=True),
    AttrPatch("torch", "compile", _compile),
)


def _precision_name(dtype: Any) -> str:
    """fp32 / bf16 / fp16 for a floating dtype (the package's precision spelling), else the dtype's name."""
    from torchspeed.runtime import FLOAT_PRECISIONS, precision_dtype

    return {precision_dtype(p): p for p in FLOAT_PRECISIONS}.get(dtype, str(dtype).replace("torch.", ""))


def _hotspots(prof: Any, n: int = 15) -> list[dict[str, Any]]:
    import pstats

    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in stats.items():
        if file.startswith(here) or "runpy" in file or "importlib" in file or func in ("<module>", "exec") \
                or "__import__" in func or "disable' of '_lsprof" in func:
            continue
        short = file if file.startswith("<") else os.path.join(os.path.basename(os.path.dirname(file)), os.path.basename(file))
        rows.append({"function": f"{short}:{line}({func})", "calls": nc, "cumulative_s": round(ct, 4),
                     "self_s": round(tt, 4)})
    rows.sort(key=lambda r: -r["cumulative_s"])
    return rows[:n]


def main() -> None:
    """Bootstrap entry: sys.argv is ['-c', MODE, TARGET, *args]."""
    from torchspeed.atomic import write_json

    _die_with_the_launcher()
    out = os.environ.pop(ENV_OUT, None)
    if out and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun worker: one record per rank
        out = f"{out}.rank{os.environ.get('RANK', '0')}"
    rec, prof = _recorder_from_env()
    mode, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    _become_the_script(mode, target, args)
    status, code, error, pending = "finished", 0, None, None
    try:
        _run_script(mode, target)
    except StopScript:
        status = "stopped"
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        status, pending = ("finished" if code == 0 else "exited"), e
    except BaseException as e:  # the report is written even when the script fails
        status, code, error, pending = "error", 1, f"{type(e).__name__}: {e}", e
    finally:
        if prof:
            prof.disable()
    rec.enabled = False
    if out:
        try:
            payload = rec.results()
            payload.update(status=status, exit_status=code, error=error,
                           hotspots=_hotspots(prof) if prof and rec.steps > 1 else [])
            write_json(out, payload)
        except Exception as e:  # never hide the script's own outcome behind a reporting failure
            print(f"torchspeed doctor: could not write the report: {type(e).__name__}: {e}", file=sys.stderr)
    if isinstance(pending, Exception):
        _print_user_traceback(pending)
        sys.exit(1)
    if pending is not None:
        raise pending
    sys.exit(0)


def _die_with_the_launcher() -> None:
    """Under torchrun, die when torchrun dies: its workers run in sessions of their own, so a killed
    doctor (which takes torchrun with it) would leave them running. Linux only (PR_SET_PDEATHSIG)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _recorder_from_env() -> tuple[Recorder, Any]:
    """The installed Recorder as the parent's environment asks (step limit, trace, fixes, seed), and the
    cProfile profiler when asked (enabled by the Recorder at the first step)."""
    steps = os.environ.pop(ENV_STEPS, "") or None
    trace = os.environ.pop(ENV_TRACE, "") or None
    use_cprofile = os.environ.pop(ENV_CPROFILE, "") == "1"
    seed = os.environ.pop(ENV_SEED, "")
    fixes = os.environ.pop(ENV_FIXES, "")
    rec = Recorder(max_steps=int(steps) if steps else None, trace_path=trace)
    rec.install()
    if fixes:
        import json

        rec.inject(json.loads(fixes))
    if seed:
        from torchspeed.runtime import seed_everything

        seed_everything(int(seed))  # every --try run alike, so their losses compare
    prof = None
    if use_cprofile:
        import cProfile

        prof = rec.cprofile = cProfile.Profile()
    return rec, prof


def _become_the_script(mode: str, target: str, args: list[str]) -> None:
    """sys.argv and sys.path[0] as Python sets them for the script, module or code run directly."""
    if mode == "script":
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    else:
        sys.argv = ["-m" if mode == "module" else "-c", *args]
        sys.path[0] = "" if mode == "code" else os.getcwd()


def _run_script(mode: str, target: str) -> None:
    """Run the user's script, module or code as `__main__`."""
    import runpy

    if mode == "script":
        runpy.run_path(target, run_name="__main__")
    elif mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})


def _print_user_traceback(e: BaseException) -> None:
    """The traceback as Python would print it for the script alone (without doctor's and runpy's frames)."""
    import traceback

    tb = e.__traceback__
    here = os.path.dirname(os.path.abspath(__file__))
    while tb is not None and (tb.tb_frame.f_code.co_filename.startswith((here, "<frozen")) or
                              tb.tb_frame.f_code.co_filename == "<string>" and tb.tb_next is not None):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb or e.__traceback__)
