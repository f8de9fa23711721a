"""Device and capability detection, precision choice, seeding, RNG state and determinism.

This is the floor every other module stands on; it imports nothing else from torchspeed.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import multiprocessing
import os
import platform
import random
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

__all__ = [
    "free_memory",
    "isa_caps",
    "machine_key",
    "FLOAT_PRECISIONS",
    "PRECISIONS",
    "PrecisionChoice",
    "cache_dir",
    "cpu_flags",
    "default_precision",
    "default_mp_context",
    "describe",
    "deterministic",
    "precision_dtype",
    "process_as_found",
    "import_as_found",
    "resolve_device",
    "rng_state",
    "seed_everything",
    "set_rng_state",
    "start_helper_threads",
    "synchronize",
]

_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
# Caps on the instructions torch's kernels (ATen) and oneDNN's may use, set in the environment before torch
# starts (to reproduce an older CPU, or by a site's policy): what a process measures holds for its cap only.
ISA_CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
# The values each takes: ATen compares exactly (lower case; anything else it ignores with a warning), oneDNN
# ignores case but not spaces, and its ALL is no cap.
_ATEN_CAPS = frozenset({"default", "avx2", "avx512", "vsx", "zvector", "sve256"})
_ONEDNN_CAPS = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                          "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                          "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2"})


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (empty where /proc/cpuinfo is absent)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_caps() -> dict[str, str]:
    """The instruction-set caps this process runs under (upper-cased), as the libraries read them: a value they
    ignore (a misspelling, spaces, ATen's in upper case) caps nothing and is left out; {} for none."""
    caps = {}
    for name in ISA_CAP_VARIABLES:
        value = os.environ.get(name, "")
        known = _ATEN_CAPS if name == "ATEN_CPU_CAPABILITY" else _ONEDNN_CAPS
        if (value if name == "ATEN_CPU_CAPABILITY" else value.upper()) in known:
            caps[name] = value.upper()
    return caps


def _torch_cpu_kernels() -> str:
    """The widest instructions ATen dispatches to here (its warning for an ignored ATEN_CPU_CAPABILITY is
    torch's to give, once, when a kernel first runs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.backends.cpu.get_cpu_capability()


def usable_cores() -> int:
    """Cores this process may run on (respects taskset / cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def describe() -> dict[str, Any]:
    """A plain-dict description of the machine: CPU, ISA, GPU, library versions."""
    flags = cpu_flags()
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "cores": usable_cores(),
        "isa": {name: name in flags for name in _ISA_FLAGS},
        "isa_caps": isa_caps(),
        "torch_cpu_kernels": _torch_cpu_kernels(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1)}
            )
    return info


def machine_key(info: dict[str, Any] | None = None) -> str:
    """A short stable key of what decides this machine's speed: CPU, cores, ISA, GPUs, torch version
    (the ceilings and remembered decisions are kept under it), and the instruction-set caps where any are set
    (a process capped at AVX2 measures another machine's ceilings)."""
    info = info if info is not None else describe()
    keep = {k: info.get(k) for k in ("cpu", "arch", "cores", "isa", "gpus", "torch")}
    if info.get("isa_caps"):
        keep["isa_caps"] = info["isa_caps"]
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def describe_line(info: dict[str, Any] | None = None) -> str:
    """One line for reports: 'CPU (N cores; avx512_bf16, amx_bf16), GPU ..., torch X', with the instruction-set
    caps the process ran under where any were set ('...; capped: ONEDNN_MAX_CPU_ISA=AVX2')."""
    info = info or describe()
    isa = ", ".join(k for k, v in info["isa"].items() if v) or "no AVX"
    caps = info.get("isa_caps") or {}
    if caps:
        isa += "; capped: " + ", ".join(f"{k}={v}" for k, v in caps.items())
    gpus = "; ".join(f"{g['name']} (sm {g['capability']})" for g in info["gpus"]) or "no GPU"
    return f"{info['cpu']} ({info['cores']} cores; {isa}); {gpus}; torch {info['torch']}"


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' means the first CUDA device when there is one, else the CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def synchronize(device: str | torch.device) -> None:
    """Wait for queued device work, so a host timer measures it (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class _ForkGate:
    """Helper threads decode and convert between `enter` and `exit`; a fork (DataLoader workers start
    by fork) waits until none is inside. A thread forked away mid-work could hold a lock (malloc's, a
    decoder's) that the child inherits held forever: worker processes that hang at their first batch.
    Only leaf work goes inside, never a wait on another thread, so a fork waits one batch at most."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._forking = False

    def __enter__(self) -> None:
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._busy += 1

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self._busy -= 1
            if not self._busy:
                self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()  # held through the fork: the child gets a consistent, idle gate
        self._forking = True
        while self._busy:
            self._cond.wait()

    def after_fork_in_parent(self) -> None:
        self._forking = False
        self._cond.notify_all()
        self._cond.release()

    def after_fork_in_child(self) -> None:
        self.__init__()


helper_work = _ForkGate()
"""`with helper_work:` around a helper thread's unit of work (one batch), so no fork lands inside it."""
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=helper_work.before_fork, after_in_parent=helper_work.after_fork_in_parent,
                        after_in_child=helper_work.after_fork_in_child)


def start_helper_threads(target: Callable[[int], None], count: int, name: str,
                         torch_threads: int = 1) -> list[threading.Thread]:
    """Start `count` daemon threads running `target(i)`, whose torch ops use `torch_threads` cores each.

    Why not just call torch.set_num_threads in the thread: it also sets the default that every
    thread not yet initialised picks up (the main thread too, if it has run no parallel op yet),
    so a helper asking for one core could leave the model on one core. The caller's count is read
    first (which fixes it for the caller) and the default is put back once the helpers have theirs.
    """
    caller = torch.get_num_threads()
    ready = threading.Barrier(count + 1)

    def run(i: int) -> None:
        try:
            torch.get_num_threads()  # torch's first-use initialisation would undo a count set before it
            torch.set_num_threads(torch_threads)
        finally:
            ready.wait()  # the caller never waits forever, whatever happened here
        target(i)

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    ready.wait()
    torch.set_num_threads(caller)
    return threads


# The one precision vocabulary, spelled so in every API, table, command and JSON file. Training and
# autocast take the floating ones; inference adds int8 (quantized weights and activations).
FLOAT_PRECISIONS = ("fp32", "bf16", "fp16")
PRECISIONS = (*FLOAT_PRECISIONS, "int8")


def precision_dtype(name: str) -> torch.dtype:
    """The floating dtype of a precision name ('fp32', 'bf16', 'fp16')."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unknown precision {name!r}: use one of {', '.join(FLOAT_PRECISIONS)}")
    return dtypes[name]


@dataclass(frozen=True)
class PrecisionChoice:
    """A precision ('bf16', 'fp16' or 'fp32') and why it was chosen."""

    name: str
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return precision_dtype(self.name)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


# oneDNN's instruction-set caps below its bf16 kernels: a process started with ONEDNN_MAX_CPU_ISA set to one of
# them (to reproduce an older CPU, or by a site's policy) emulates bf16 on any CPU.
ONEDNN_ISAS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                      "AVX512_CORE_VNNI"})


def default_precision(device: str | torch.device = "auto") -> PrecisionChoice:
    """The mixed precision a device runs fastest by its capabilities (a default; measure to confirm)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        if major >= 8:
            return PrecisionChoice("bf16", f"CUDA compute capability {major}.{minor} >= 8.0 has fast bf16 tensor cores")
        if major >= 7:
            return PrecisionChoice("fp16", f"CUDA compute capability {major}.{minor} has fp16 tensor cores but no fast bf16")
        return PrecisionChoice("fp32", f"CUDA compute capability {major}.{minor} has no tensor cores")
    if dev.type == "cpu":
        flags = cpu_flags()
        native = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
        caps = isa_caps()
        name, capped = next(((k, v) for k, v in caps.items() if k != "ATEN_CPU_CAPABILITY"), ("", ""))
        if native and capped in ONEDNN_ISAS_WITHOUT_BF16:
            return PrecisionChoice("fp32", f"{name}={capped} keeps oneDNN from the CPU's bf16 instructions "
                                           f"({', '.join(native)}), so bf16 would be emulated")
        if native:
            return PrecisionChoice("bf16", f"the CPU has native bf16 instructions ({', '.join(native)})")
        return PrecisionChoice("fp32", "the CPU has no native bf16 instructions (avx512_bf16 / amx_bf16), so bf16 would be emulated")
    return PrecisionChoice("fp32", f"no mixed-precision rule for device type {dev.type!r}")


def seed_everything(seed: int) -> None:
    """Seed python `random`, numpy and torch (CPU and every CUDA device)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain types, so `torch.load(weights_only=True)` reads it."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` returned; the next draws of every generator repeat exactly."""
    try:
        py, npy = state["python"], state["numpy"]
        random.setstate((py["version"], tuple(int(x) for x in py["mt"].tolist()), py["gauss"]))
        np.random.set_state(
            (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached"])
        )
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not an RNG state from torchspeed.runtime.rng_state(): {e!r}") from None
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"RNG state holds {len(cuda)} CUDA generators but this machine has {torch.cuda.device_count()} devices"
            )
        torch.cuda.set_rng_state_all(cuda)


def ensure_cublas_workspace(cuda_initialized: bool, stacklevel: int = 2) -> None:
    """Deterministic mode on CUDA needs CUBLAS_WORKSPACE_CONFIG before cuBLAS's first use in the process
    (it fixes the workspace then, once): set it when it is missing (a user's own value is kept), and warn
    when CUDA has been used already, since it may then be too late to take effect."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        return
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if cuda_initialized:
        warnings.warn("deterministic mode is on but CUBLAS_WORKSPACE_CONFIG was not set before CUDA was first "
                      "used in this process, so cuBLAS may already have chosen a non-deterministic workspace: "
                      "set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before starting Python, or call "
                      "torchspeed.runtime.deterministic() before any CUDA work", RuntimeWarning, stacklevel=stacklevel + 1)


def deterministic(enabled: bool = True) -> None:
    """Make kernels reproducible (and cudnn autotuning off), or restore the fast defaults."""
    if enabled:
        ensure_cublas_workspace(torch.cuda.is_available() and torch.cuda.is_initialized(), stacklevel=3)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled, warn_only=False)


@contextlib.contextmanager
def process_as_found(env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Put back what third-party code changes in the caller's process on its first use: environment
    variables (cv2 prepends LD_LIBRARY_PATH, torch's inductor sets TORCHINDUCTOR_CACHE_DIR), warning
    filters (sympy adds one) and an unset multiprocessing start method (a library starting a process
    fixes it, after which the user's `set_start_method` fails). `env`: variables set only inside the
    block (an opt-out read by what runs there). Only the variables that changed are put back."""
    before = dict(os.environ)
    method = multiprocessing.get_start_method(allow_none=True)
    try:
        with warnings.catch_warnings():  # restores warnings.filters on exit
            os.environ.update(env or {})
            yield
    finally:
        for key in set(before) | set(os.environ):
            if os.environ.get(key) != before.get(key):
                if key in before:
                    os.environ[key] = before[key]
                else:
                    del os.environ[key]
        if method is None and multiprocessing.get_start_method(allow_none=True) is not None:
            multiprocessing.set_start_method(None, force=True)  # unset again: the user may still choose


def import_as_found(name: str, env: Mapping[str, str] | None = None) -> Any:
    """`importlib.import_module(name)`, its first import inside `process_as_found(env)`."""
    if sys.modules.get(name) is not None:  # None: an import blocked on purpose, which must raise ImportError
        return sys.modules[name]
    with process_as_found(env):
        return importlib.import_module(name)


def default_mp_context() -> Any:
    """The multiprocessing context a plain `Process` would use, without fixing the process's start
    method as using the default context does (pass it as DataLoader's `multiprocessing_context`)."""
    method = multiprocessing.get_start_method(allow_none=True)
    return multiprocessing.get_context(method or multiprocessing.get_all_start_methods()[0])


def cache_dir(*parts: str) -> str:
    """torchspeed's cache directory ($TORCHSPEED_CACHE, else $XDG_CACHE_HOME/torchspeed, else ~/.cache/torchspeed)."""
    root = os.environ.get("TORCHSPEED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "torchspeed"
    )
    path = os.path.join(root, *parts)
    os.makedirs(path, exist_ok=True)
    return path


def free_memory(device: torch.device) -> int | None:
    """Bytes free for a new tensor on `device` (a CPU's under its cgroup limit), None when unknown."""
    if device.type == "cuda":
        try:
            return torch.cuda.mem_get_info(device)[0]
        except (RuntimeError, AssertionError, ValueError):
            return None
    if device.type != "cpu":
        return None
    free = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            used = int(f.read().strip())
        if limit.isdigit() and free is not None:
            free = min(free, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return free
