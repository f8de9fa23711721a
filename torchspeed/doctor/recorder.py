"""The Recorder: what doctor records in the script's process, and the record the parent reads. The
patches (`patches.PATCHES`, applied by `install()`) report each event through its public methods.
It is one concept, the record of one run, kept whole because every event handler shares its state
(the phase clock, the step count, the CUDA marks, the memory step) and the record is read from it.

Step boundaries: each backward and each optimizer step closes a segment; a step is the segments up to
an optimizer step (gradient accumulation is one step), or up to a backward in a loop with no
torch.optim optimizer (manual `p.data` updates); with a step limit the script is stopped after that
many. On CUDA each phase change records an event on the loop's current stream (no host sync) and each
step's end synchronises once (a backward that does not end the step waits for it: its segment's phases
are read then); a step's phases are read on the GPU's timeline (`step_on_timeline`), so queued GPU work is
charged to the phase that queued it. Nothing else reads a CUDA tensor's value while the loop runs: the
first batches' fingerprints and statistics and the loss-input check are kept on the device and read
after the run.

With `memory=True` one step (the second on CUDA, the third on a CPU, whose profiler starts a step early;
after --trace's steps) is measured for memory (`memory_breakdown.StepMemory`: where its peak goes, by
part, phase and module); its windows are marked `memory` and left out of the time figures, its hooks
being on only then.

A loop fed by no loader has the script's own batch function timed as `data` from its first training
forward (`script_code.batch_function`); the script's plan (`planned_steps`) is read at its first
backward; attention (`attention.AttentionSeen`) and the first token batches are kept for the
transformer rules.
"""
from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchspeed.doctor import script_code
from torchspeed.doctor.attention import AttentionSeen
from torchspeed.doctor.grouping import token_lengths, token_tensors
from torchspeed.doctor.injection import FixState
from torchspeed.doctor.loop_setup import machine_settings, model_settings
from torchspeed.doctor.memory_breakdown import StepMemory
from torchspeed.doctor.patches import PATCHES
from torchspeed.doctor.phases import EXTRA_PHASES, PHASES, PhaseClock
from torchspeed.measure import PeakMemory
from torchspeed.runtime import FLOAT_PRECISIONS, default_precision, precision_dtype

__all__ = ["KEEP_LOSSES", "TRACE_STEPS", "Recorder", "StopScript", "image_moments", "image_stats", "step_on_timeline"]

KEEP_LOSSES = 5  # first losses (and batch fingerprints) kept for the numerics check
TOKEN_BATCHES = 32  # token batches whose padding is read
TRACE_STEPS = 3  # steps recorded by --trace, after the first (warm-up) step


class StopScript(SystemExit):
    """Raised after the last requested step; a SystemExit so `except Exception` in the script lets it pass."""

    def __init__(self) -> None:
        super().__init__(0)


class Recorder:
    """Accumulates phase times per step window and the settings seen."""

    def __init__(self, max_steps: int | None = None, trace_path: str | None = None, memory: bool = False):
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
        self._prints: list[list[Any]] = []  # integer contents (labels) of the first batches, on their device
        self._moments: list[Any] = []  # image statistics of the first batches (`image_moments`), on their device
        self._softmax_fed: list[tuple[str, Any]] = []  # (rule, whether a loss was fed probabilities: a 0-d tensor)
        self._samples = 0
        self.fix: Any = None  # doctor --try: the fixes.FixState this run injects
        self.non_blocking = False  # --try pin_memory: pinned copies to CUDA made non_blocking
        self._fwd_stack: list[bool] = []
        self._input_at_end = False  # the loop's forward had no positional tensor: read its input from its keywords
        self._pending_eval_grad = False
        self._bn_cache: dict[int, bool] = {}
        self._last_loader: int | None = None
        self._loss_checks_left = 2
        self._cuda_seen = False
        self._marks: list[tuple[Any, str | None]] | None = None  # CUDA: (event, phase running from it) this step
        self._marks_whole = False  # the marks cover the whole step window (not only since CUDA was first seen)
        self._unread: list[tuple[dict[str, Any], list[tuple[Any, str | None]]]] = []  # CUDA segments not yet read
        self.memory_from = (1 + (TRACE_STEPS if trace_path else 0)) if memory else None  # after the trace's steps
        self.memory_step: int | None = None  # the step measured for memory, once chosen
        self.memory: StepMemory | None = None  # the accounting, during the memory step
        self.memory_result: dict[str, Any] | None = None
        self._run_peak: int | None = None  # the run's peak before the memory step reset the counter
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.loaders: dict[int, dict[str, Any]] = {}
        self.model: Any = None  # the outermost module of the first training forward
        self.attention = AttentionSeen()
        self.measure_attention = False  # doctor --try's first run: time the attention seen, after the steps
        self._tokens: list[tuple[int | None, Any]] = []  # (loader key, (mask, ids)) of the first token batches
        self._batches_looked_for = False
        self.s: dict[str, Any] = {
            "autocast": False, "autocast_precision": None, "grad_scaler": False, "compiled": False,
            "parallel": "none", "eval_forwards_with_grad": 0, "train_mode_eval_forwards": 0,
            "host_syncs": 0, "copies": {"count": 0, "bytes": 0, "non_blocking": True, "from_pinned": True},
            "input": None, "model": None, "optimizers": [], "optimizer_options": {}, "loss_checks": [],
            "backward_calls": 0, "optimizer_calls": {}, "planned_steps": None, "driver": None,
            "grad_scaler_off": None,
        }
        self._undo: list[tuple[str, Callable[[], None]]] = []  # (patch name, its undo), in install order

    @property
    def batch_prints(self) -> list[list[Any]]:
        """The first batches' integer contents (labels, token ids) as lists, other tensors by shape."""
        return [_read_fingerprint(p) for p in self._prints]

    @property
    def batch_stats(self) -> list[Any]:
        """The first batches' image statistics (`image_stats`)."""
        return [_read_moments(m) for m in self._moments]

    @property
    def enabled(self) -> bool:
        """Recording is on, this is the loop's thread (what loader threads, a prefetcher or decoding
        threads, do overlaps the step and must not enter the loop's phases), and torch.compile is not
        tracing: compiled code carries no hook of doctor's (module hooks run inside a compiled region
        would otherwise break its graph at every module)."""
        return self._enabled and not torch.compiler.is_compiling() and threading.get_ident() == self.loop_thread

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = value

    # ---------------------------------------------------------------- events: loaders
    def loader_pass(self, loader: Any, kind: str, **settings: Any) -> None:
        """A new pass over `loader`: its record (made on the first pass) counts an epoch."""
        info = self.loaders.get(id(loader))
        if info is None:
            info = self.loaders[id(loader)] = {
                "name": f"{kind} #{len(self.loaders) + 1}", **settings, "dataset": type(loader.dataset).__name__,
                "batches": 0, "epochs": 0, "startup_s": [], "data_s": 0.0, "training": False}
        info["epochs"] += 1
        info["_t_iter"], info["_first"] = time.perf_counter(), True

    def next_batch(self, fetch: Callable[[], Any], key: int | None) -> Any:
        """The loop waits for its next batch from loader `key`: `fetch()` timed as phase `data`."""
        t0 = time.perf_counter()
        self.enter("data")
        try:
            batch = fetch()
        finally:
            self.exit()
        info = self.loaders.get(key)  # type: ignore[arg-type]
        if info is None:
            return batch
        now = time.perf_counter()
        info["batches"] += 1
        info["data_s"] += now - t0
        if len(self._prints) < KEEP_LOSSES and batch is not None:  # kept on the device: no host sync now
            self._prints.append(_fingerprint(batch))
            self._moments.append(image_moments(batch))
        if len(self._tokens) < TOKEN_BATCHES and (tokens := token_tensors(batch)) is not None:
            self._tokens.append((key, tokens))
        if info.pop("_first", False):
            info["startup_s"].append(now - info.pop("_t_iter", t0))
        self._last_loader = key
        return batch

    # ---------------------------------------------------------------- events: phases
    def enter(self, phase: str) -> None:
        self.in_loop = True
        self.clock.enter(phase)
        self._mark()

    def exit(self) -> None:
        self.clock.exit()
        self._mark()

    def unwind(self, depth: int) -> None:
        """Close the phases an exception left open, down to `depth`."""
        self.clock.unwind(depth)
        self._mark()

    def phase(self, phase: str) -> _Phase:
        """`with rec.phase(name):` the block runs as phase `name`."""
        return _Phase(self, phase)

    def forward_begin(self, module: Any, args: tuple) -> tuple | None:
        """A module's forward begins (torch's global pre-hook): the outermost one of the loop is phase
        `forward` (autograd on) or `eval`; returns the arguments a --try fix replaces, or None."""
        # inside loading, backward, a copy: not a forward of the loop; inside optimizer.step(closure) it is
        if self._fwd_stack or self.clock.current not in (None, "optimizer"):
            self._fwd_stack.append(False)
            return None
        is_loss = isinstance(module, nn.modules.loss._Loss)
        # autograd on means a training forward (even in eval mode, e.g. frozen BatchNorm fine-tuning)
        training = grad = torch.is_grad_enabled()
        if not is_loss:
            if self._pending_eval_grad:  # the previous eval-mode forward had no backward after it
                self.s["eval_forwards_with_grad"] += 1
                self._pending_eval_grad = False
            self._observe_model(module, args, training)
            if training and not self._batches_looked_for:
                self._batches_looked_for = True
                self._time_batch_function(args)
            if grad and not module.training:
                self._pending_eval_grad = True  # cancelled if a backward follows
            if not grad and module.training and self._has_bn_dropout(module):
                self.s["train_mode_eval_forwards"] += 1
        self._fwd_stack.append(True)
        self.enter("forward" if training else "eval")
        if self.fix is not None:
            return self.fix.forward_pre(self, module, args, training and not is_loss)
        return None

    def forward_end(self, module: Any, output: Any, kwargs: dict[str, Any] | None = None) -> Any:
        """A module's forward ended (torch's global hook, with the call's keyword arguments): the output a --try
        fix replaces, or None."""
        if not self._fwd_stack or not self._fwd_stack.pop():
            return None
        if self._input_at_end:  # model(**batch): its batch is in the keywords (still under the same autocast)
            self._input_at_end = False
            self._observe_input(_first_tensor((kwargs or {}).values()), torch.is_grad_enabled())
        new = self.fix.forward_post(module, output) if self.fix is not None else None
        self.exit()
        return new

    def backward_begin(self, loss: Any) -> tuple[Any, int]:
        """A backward call on `loss` begins (phase `backward`): the loss to run it on (scaled where --try's
        fp16 fix holds a GradScaler), and the phase depth to `unwind` to when it returns or raises."""
        self._pending_eval_grad = False
        self.s["backward_calls"] += 1
        if self.s["backward_calls"] == 1:  # the loop is on the stack: read what the script plans
            length = (self.loaders.get(self._last_loader) or {}).get("length")  # type: ignore[arg-type]
            self.s["planned_steps"] = script_code.planned_steps(length)
            self.s["driver"] = script_code.driver()
        if self._last_loader in self.loaders:
            self.loaders[self._last_loader]["training"] = True
        if len(self.losses) < KEEP_LOSSES and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.losses.append(loss.detach().clone())  # read after the run: no sync now
        scaled = self.fix.scale_loss(loss) if self.fix is not None else loss
        depth = self.clock.depth
        self.enter("backward")
        return scaled, depth

    def backward_end(self) -> None:
        """A backward call returned: the segment (and in a loop without an optimizer, the step) ends."""
        self._segment_end("backward")

    def optimizer_step_begin(self, opt: Any) -> None:
        """`opt.step()` begins (torch's global optimizer pre-hook): phase `optimizer`."""
        name = type(opt).__name__
        self._optimizers.add(opt)
        if name not in self.s["optimizers"]:
            self.s["optimizers"].append(name)
            self.s["optimizer_options"][name] = {k: opt.defaults.get(k) for k in ("fused", "foreach")
                                                 if k in opt.defaults}
        self.enter("optimizer")
        if self.fix is not None:
            self.fix.before_step(opt)

    def optimizer_step_end(self, opt: Any) -> None:
        """`opt.step()` ended: the segment (and in a loop with an optimizer, the step) ends."""
        if self.fix is not None:
            self.fix.after_step(opt)
        self.exit()
        self._segment_end("optimizer")

    def optimizer_made(self, opt: Any) -> None:
        """An optimizer was constructed: where (the script's line, or the library's that made it for the
        script), so a fix edits that call."""
        self.optimizers_made += 1
        name = type(opt).__name__
        if name not in self.s["optimizer_calls"] and (site := script_code.where(script_code.caller())) is not None:
            self.s["optimizer_calls"][name] = site

    def grad_scaler_made(self, scaler: Any, device: Any, asked_off: bool) -> None:
        """A GradScaler was made: on only where torch enabled it (it disables itself without its device)."""
        on = bool(scaler.is_enabled())
        self.s["grad_scaler"] = self.s["grad_scaler"] or on
        if not self.s["grad_scaler"]:
            self.s["grad_scaler_off"] = ("made with enabled=False" if asked_off
                                         else f"torch disabled it: {device} is not available")

    def _time_batch_function(self, args: tuple) -> None:
        """A first training forward fed by no loader doctor patches: the script's own function that made
        its inputs (`X, Y = get_batch("train")`) is timed as `data` from now on, as a loader's wait."""
        if any(ld["batches"] for ld in self.loaders.values()):
            return
        frame = script_code.caller()
        found = script_code.batch_function(frame, [a for a in args if isinstance(a, torch.Tensor)]) if frame else None
        if found is None:
            return
        key, fn = id(found.fn), found.fn
        self.loaders[key] = {"name": f"{found.label} #{len(self.loaders) + 1}", "kind": "batch function",
                             "dataset": found.label, "batches": 0, "epochs": 1, "startup_s": [], "data_s": 0.0,
                             "training": True}

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            return self.next_batch(lambda: fn(*a, **k), key) if self.enabled else fn(*a, **k)
        self._undo.append(("batch function", found.replace(timed)))

    def in_loop_itself(self) -> bool:
        """Recording, in the loop, in no phase but the optimizer's: a copy made now is the loop's own."""
        return self.enabled and self.in_loop and self.clock.current in (None, "optimizer")

    def copied(self, t: Any, out: Any, non_blocking: bool) -> None:
        """The loop copied `t` to `out`: counted when it changed device."""
        if isinstance(out, torch.Tensor) and out.device != t.device:
            c = self.s["copies"]
            c["count"] += 1
            c["bytes"] += t.numel() * t.element_size()
            if out.is_cuda:
                self._cuda_on()
                c["non_blocking"] &= non_blocking
                c["from_pinned"] &= bool(t.is_pinned())

    def loss_input(self, x: Any, rule: str) -> None:
        """cross_entropy / nll_loss got `x` (first calls only): softmax output, i.e. non-negative rows
        summing to 1 over dim 1, is a finding."""
        if self._loss_checks_left <= 0 or not isinstance(x, torch.Tensor):
            return
        self._loss_checks_left -= 1
        if x.dim() < 2 or not x.is_floating_point() or x.shape[1] < 2:
            return
        with torch.no_grad():
            v = x.detach().float()
            tol = 1e-3 if x.dtype in (torch.float32, torch.float64) else 2e-2  # bf16/fp16 softmax rows round
            probs = (v.min() >= 0) & (v.max() <= 1 + tol) & ((v.sum(1) - 1).abs().max() < tol)
        self._softmax_fed.append((rule, probs))  # read after the run: on CUDA a read now would be a host sync

    def _loss_findings(self) -> None:
        """The loss inputs checked in the loop, read now: the first fed probabilities is a finding."""
        read = torch._C.TensorBase  # unpatched: doctor's own read, not the loop's
        for rule, probs in self._softmax_fed:
            if not read.item(probs):
                continue
            what = "CrossEntropyLoss / F.cross_entropy" if rule == "double-softmax" else "NLLLoss / F.nll_loss"
            self.s["loss_checks"].append({"rule": rule, "where": [], "message": (
                f"{what} is fed probabilities (non-negative rows summing to 1, i.e. softmax output)"
                + (": it applies log_softmax again, so gradients shrink and training can stall"
                   if rule == "double-softmax" else ": it expects log-probabilities from log_softmax"))})
            return  # one finding is enough
        self._softmax_fed.clear()

    # ---------------------------------------------------------------- step windows
    def _mark(self) -> None:
        """Once CUDA is seen: an event on the current stream where the running phase changes (no sync).
        In the memory step: the phase boundary for the memory accounting."""
        if self.memory is not None:
            self.memory.boundary(self.clock.current)
        if self._marks is not None:
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
            if seg.get("memory"):
                acc["memory"] = True  # measured for memory: not a time figure
            if seg["end"] == src:
                out.append(acc)
                acc = None
        return out

    def _segment_end(self, kind: str) -> None:
        """A backward call or an optimizer step ended: close the segment; count a step if `kind` is
        what ends steps in this script."""
        ends_step = kind == self.step_source
        marks = self._marks
        if marks is not None:
            self._mark()  # the segment's end on the GPU's timeline
            if ends_step:
                torch.cuda.synchronize()  # the one host sync of the step: every mark is reached now
        res = self.clock.boundary()
        if marks is not None:
            whole, self._marks, self._marks_whole = self._marks_whole, marks[-1:], True
        if res is None:
            return
        wall, phases = res
        seg = {"wall": wall, "phases": phases, "samples": self._samples, "end": kind}
        if self.memory is not None:
            seg["memory"] = True
        self.segments.append(seg)
        if marks is not None and whole:
            self._unread.append((seg, marks))  # read on the GPU's timeline once its marks are reached
            if ends_step:
                self._read_timelines()
        self._samples = 0
        if kind == "optimizer":
            self.opt_steps += 1
            if self.opt_steps == 1:
                self.steps = 0  # backward calls counted before an optimizer was known were not steps
                for s in self.segments:  # and their windows were not the memory step's
                    s.pop("memory", None)
                if self.memory is not None and self.memory.counting:  # a whole accounting of micro-batches
                    self.memory.abandon()  # (a CPU profiler started straight after this one stopped can crash torch)
                    self.memory = None
                    self.memory_result = {"skipped": "the loop's backward calls were counted as steps before its "
                                                     "optimizer was seen"}
        if kind != self.step_source:
            return
        self.steps += 1
        if self.steps == 1 and self.cprofile is not None:
            self.cprofile.enable()  # hot spots of the steady loop, not of imports and set-up
        self._trace_tick()
        self._memory_tick()  # after the trace's profiler stopped: a CPU's memory needs its own
        if self.max_steps is not None and self.steps >= self.max_steps:
            raise StopScript()

    def _read_timelines(self) -> None:
        """The phases of the segments whose marks the last sync reached (one step's), on the GPU's timeline."""
        phases = step_on_timeline([(marks, seg["wall"]) for seg, marks in self._unread],
                                  lambda a, b: a.elapsed_time(b) / 1e3)
        for (seg, _), read in zip(self._unread, phases):
            seg["phases"] = read
        self._unread.clear()

    def _memory_tick(self) -> None:
        """A step ended: the memory step's accounting ends, or begins (on a CPU: its profiler a step earlier)."""
        if self.memory_from is None or self.memory_result is not None:
            return
        if self.memory is not None and self.steps == self.memory_step:
            mem, self.memory = self.memory, None
            try:
                self.memory_result = mem.finish().to_dict()
            except Exception as e:  # noqa: BLE001 - the memory figures must never cost the script or the report
                mem.abandon()
                self.memory_result = {"skipped": f"the memory accounting failed: {type(e).__name__}: {e}"}
            self._run_peak = mem.run_peak
            return
        mem = self.memory
        try:
            if mem is None and self.steps == self.memory_from:
                seen = (self.s["input"] or {}).get("device") or "cuda"
                device = torch.device(seen if self._cuda_seen else "cpu")
                self.memory_step = self.steps + (1 if device.type == "cuda" else 2)
                mem = self.memory = StepMemory(self.model, self._optimizers, device, step=self.memory_step,
                                               compiled=bool(self.s["compiled"]))
                if device.type != "cuda":
                    mem.prelude()
                    return
            if mem is not None and self.steps == (self.memory_step or 0) - 1:
                mem.start(self.clock.current)
        except Exception as e:  # noqa: BLE001 - the memory figures must never cost the script or the report
            if mem is not None:
                mem.abandon()
            self.memory = None
            self.memory_result = {"skipped": f"the memory accounting failed: {type(e).__name__}: {e}"}

    def _trace_tick(self) -> None:
        if not self.trace_path:
            return
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
            self._bn_cache[key] = any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout))
                                      for m in module.modules())
        return self._bn_cache[key]

    def _observe_model(self, module: Any, args: tuple, training: bool) -> None:
        """The loop's model, once, and its input: the first positional tensor, else (a model called with
        keywords only) the first tensor among its keywords, read when its forward ends."""
        if training and self.s["model"] is None:
            self.model = module
            self.s["model"] = model_settings(module)
            self.s["parallel"] = self.s["model"]["parallel"]
        x = _first_tensor(args)
        if x is None and not args:
            self._input_at_end = True
            return
        self._observe_input(x, training)

    def _observe_input(self, x: torch.Tensor | None, training: bool) -> None:
        """A forward's input: the GPU seen, and in training the samples of the step, the autocast it runs
        under (on its device) and, once, its shape."""
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
        if x is not None and self.s["input"] is None:
            self.s["input"] = {"shape": list(x.shape), "dtype": str(x.dtype), "device": str(x.device),
                               "channels_last": x.dim() == 4 and not x.is_contiguous()
                               and x.is_contiguous(memory_format=torch.channels_last)}

    # ---------------------------------------------------------------- results
    def results(self) -> dict[str, Any]:
        if self.memory is not None:  # the script ended before the memory step ended
            self.memory.abandon()
            self._run_peak, self.memory = self.memory.run_peak, None
            during = self.steps >= (self.memory_step or 0) - 1
            self.memory_result = {"skipped": f"the script ended during step {self.memory_step}, the one measured "
                                             "for memory" if during else
                                             f"memory is measured in step {self.memory_step}; the script ran {self.steps}"}
        elif self.memory_from is not None and self.memory_result is None:
            self.memory_result = {"skipped": f"memory is measured in step {self.memory_from + 1} on CUDA, "
                                             f"{self.memory_from + 2} on a CPU; the script ran {self.steps}"}
        if self._unread:  # segments after the last step's end (a backward without its optimizer step)
            torch.cuda.synchronize()
            self._read_timelines()
        if self._trace_prof is not None:
            try:
                self._finish_trace()
            except Exception:  # a trace is a bonus; the report matters more
                pass
        if self._pending_eval_grad:
            self.s["eval_forwards_with_grad"] += 1
            self._pending_eval_grad = False
        if self._softmax_fed:
            self._loss_findings()
        s = dict(self.s)
        s.update(machine_settings())
        s["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
        s["loaders"] = [{k: v for k, v in ld.items() if not k.startswith("_")} for ld in self.loaders.values()]
        s["device"] = "cuda" if self._cuda_seen else "cpu"
        s["step_source"] = "optimizer" if self.opt_steps else "backward"
        s["optimizers_made"] = self.optimizers_made
        try:
            s["mixed_precision"] = default_precision(s["device"]).to_dict()  # the capability, read first
        except Exception:  # noqa: BLE001 - a capability probe must not cost the report
            s["mixed_precision"] = {"name": "fp32", "reason": "capability unknown"}
        s["attention"] = self.attention.summary(measure=self.measure_attention)
        s["tokens"] = self._token_batches()
        peak = PeakMemory("cuda" if self._cuda_seen else "cpu").peak()  # the script's whole run ...
        if peak is not None and self._run_peak is not None:  # ... with what the memory step's resets hid
            peak = max(peak, self._run_peak)
        losses = [float(t.float()) for t in self.losses]
        return {"steps_run": self.steps, "windows": self.windows, "settings": s, "peak_memory_bytes": peak,
                "losses": losses, "batch_prints": self.batch_prints, "batch_stats": self.batch_stats,
                "fixes": self.fix.spec if self.fix is not None else {},
                "fix_notes": self.fix.notes if self.fix is not None else {},
                "compile_window": self.fix.compile_window if self.fix is not None else None,
                "script_s": time.perf_counter() - self.t_start, "trace": self.trace_path if self.trace_path
                and os.path.exists(self.trace_path) else None, "memory": self.memory_result}

    def _token_batches(self) -> dict[str, Any] | None:
        """The recorded training token batches: each row's real length and the padded length (from the
        attention mask, or the model's `config.pad_token_id`), for the padding rule."""
        pad_id = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        rows, source = [], None
        for key, tensors in self._tokens:
            if key is not None and not (self.loaders.get(key) or {}).get("training"):
                continue
            if (got := token_lengths(tensors, pad_id if isinstance(pad_id, int) else None)) is not None:
                lengths, padded, source = got
                rows.append({"lengths": lengths, "padded": padded})
        return {"source": source, "batches": rows} if rows else None


class _Phase:
    """What `Recorder.phase` returns (a class: @contextmanager's frames would show in --cprofile's hot spots)."""

    def __init__(self, rec: Recorder, name: str):
        self.rec, self.name = rec, name

    def __enter__(self) -> None:
        self.rec.enter(self.name)

    def __exit__(self, *exc: Any) -> None:
        self.rec.exit()


def step_on_timeline(segments: list[tuple[list[tuple[Any, str | None]], float]],
                     seconds_between: Callable[[Any, Any], float]) -> list[dict[str, float]]:
    """Per segment of one step ((marks, host wall) each), its seconds per phase on the device's timeline:
    between consecutive marks (each a point where the running phase changed, with the phase running from
    it; None: no phase), the time goes to that phase. The step is read as a whole: work a segment queued
    runs on while the host is in the next (a forward's kernels still running when the host waits at the
    step's end), so the device's time is set against the step's wall, not each segment's. `other` is the
    rest of the wall, shared by the segments where the host waited beyond its device time; shares are kept
    and scaled to the wall should the device's clock read a little longer than the host's."""
    out = []
    for marks, _ in segments:
        phases = dict.fromkeys(PHASES[:-1] + EXTRA_PHASES, 0.0)
        for (a, phase), (b, _) in zip(marks, marks[1:]):
            if phase is not None:
                phases[phase] = phases.get(phase, 0.0) + max(0.0, seconds_between(a, b))
        out.append(phases)
    wall = sum(w for _, w in segments)
    busy = sum(sum(p.values()) for p in out)
    scale = wall / busy if busy > wall else 1.0  # never more than the wall, even a wall read as 0
    slack = [max(0.0, w - sum(p.values()) * scale) for (_, w), p in zip(segments, out)]
    other = max(0.0, wall - busy) if scale == 1.0 else 0.0
    for phases, waited in zip(out, slack):
        for k in phases:
            phases[k] *= scale
        phases["other"] = other * (waited / sum(slack) if sum(slack) > 0 else 1 / len(out))
    return out


def _fingerprint(batch: Any) -> list[Any]:
    """The integer tensors of a batch (labels, token ids), copied where they are (read after the run by
    `_read_fingerprint`: no host sync in the loop), other tensors by shape: equal for the same samples in
    the same order whatever random augmentation drew."""
    out: list[Any] = []
    for v in _items(batch):
        if isinstance(v, torch.Tensor):
            out.append(list(v.shape) if v.is_floating_point() or v.numel() > 4096 else v.detach().clone())
    return out


def _read_fingerprint(prints: list[Any]) -> list[Any]:
    read = torch._C.TensorBase  # unpatched reads: doctor's own, not the loop's host syncs
    return [read.tolist(read.cpu(v)) if isinstance(v, torch.Tensor) else v for v in prints]


def image_moments(batch: Any) -> tuple[Any, Any] | None:
    """(per-image channel means, per-channel pixel std) of a batch's images (its first floating 4-D
    tensor), as tensors on its device: computed in the loop, read after it (`image_stats` reads them now)."""
    x = next((v for v in _items(batch) if isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point()), None)
    if x is None or x.shape[0] == 0:
        return None
    with torch.no_grad():
        x = x.detach().float()
        return x.mean(dim=(2, 3)), x.transpose(0, 1).reshape(x.shape[1], -1).std(dim=1)


def _read_moments(moments: tuple[Any, Any] | None) -> dict[str, Any] | None:
    if moments is None:
        return None
    read = torch._C.TensorBase  # unpatched reads: doctor's own, not the loop's host syncs
    return {"means": read.tolist(read.cpu(moments[0])), "std": read.tolist(read.cpu(moments[1]))}


def image_stats(batch: Any) -> dict[str, Any] | None:
    """Per-image channel means and the per-channel pixel std of a batch's images (its first floating
    4-D tensor): what `datafix.numerics` compares, since random crops never give the same pixels twice."""
    return _read_moments(image_moments(batch))


def _items(batch: Any) -> Any:
    return batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch]


def _first_tensor(values: Any) -> torch.Tensor | None:
    """The first tensor among a call's arguments, or among the values of a dict passed whole (a batch dict).
    A list is not looked into: a detection model's list holds one image a sample, not a batch."""
    for v in values:
        for w in (v.values() if isinstance(v, dict) else (v,)):
            if isinstance(w, torch.Tensor):
                return w
    return None


def _precision_name(dtype: Any) -> str:
    """fp32 / bf16 / fp16 for a floating dtype (the package's precision spelling), else the dtype's name."""
    return {precision_dtype(p): p for p in FLOAT_PRECISIONS}.get(dtype, str(dtype).replace("torch.", ""))
