"""ONNX Runtime's execution providers: which ones work on this machine and the options each is given.

`get_available_providers()` lists what an onnxruntime build was compiled with, not what loads: the CUDA
provider needs the CUDA major version torch was built with, and TensorRT's needs its libraries. So the
checks here load what a session would (`ort_cuda_problem`, `tensorrt_problem`) and say what to install;
`ort_providers` builds the provider list with its options (device, stream, TensorRT's engine cache and
optimisation profile), and `provider_label` names the provider that really runs a session.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from typing import Any

import torch

from torchspeed.optional import optional
from torchspeed.runtime import cache_dir as default_cache_dir
from torchspeed.runtime import import_as_found

__all__ = ["GPU_PROVIDERS", "KIND_OF_PROVIDER", "RUNTIME_OF_PROVIDER", "GPU_INSTALL", "TRT_INSTALL", "ort_cuda_problem",
           "check_ort_cuda", "tensorrt_problem", "ort_providers", "tensorrt_profile", "ordered_with", "provider_label",
           "first_line"]


GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
RUNTIME_OF_PROVIDER = {"TensorrtExecutionProvider": "onnxruntime-tensorrt", "CUDAExecutionProvider": "onnxruntime-cuda",
               "CPUExecutionProvider": "onnxruntime"}
KIND_OF_PROVIDER = {"TensorrtExecutionProvider": "tensorrt", "CUDAExecutionProvider": "cuda", "CPUExecutionProvider": "cpu"}
GPU_INSTALL = "pip uninstall -y onnxruntime && pip install 'torchspeed[infer-gpu]'"


def _major(version: str) -> str:
    return version.split(".", 1)[0]


def ort_cuda_problem(ort_cuda: str | None = None, torch_cuda: str | None = None, ort_version: str | None = None,
                     torch_version: str | None = None) -> str | None:
    """None when the installed onnxruntime can run its CUDA / TensorRT providers beside this torch,
    else why not, naming both versions.

    onnxruntime-gpu and torch each load their own CUDA libraries into the process; with different
    CUDA major versions one of them fails to load (or crashes) at the first GPU session. The versions
    default to the installed ones (`onnxruntime.cuda_version`, '' for a CPU build; `torch.version.cuda`).
    """
    if ort_cuda is None or ort_version is None:
        try:
            ort = optional("onnxruntime", GPU_INSTALL, "ONNX Runtime on CUDA")
        except ImportError as e:
            return str(e)
        ort_cuda = getattr(ort, "cuda_version", "") or "" if ort_cuda is None else ort_cuda
        ort_version = ort_version or ort.__version__
    torch_cuda = (torch.version.cuda or "") if torch_cuda is None else torch_cuda
    torch_version = torch_version or torch.__version__
    if not torch_cuda:
        return f"torch {torch_version} is a CPU build (no CUDA), so no CUDA model can feed onnxruntime's GPU providers"
    if not ort_cuda:
        return (f"onnxruntime {ort_version} is a CPU build (no CUDA or TensorRT provider); torch {torch_version} uses "
                f"CUDA {torch_cuda}: install onnxruntime-gpu built for CUDA {_major(torch_cuda)}: {GPU_INSTALL}")
    if _major(ort_cuda) != _major(torch_cuda):
        return (f"onnxruntime-gpu {ort_version} is built for CUDA {ort_cuda} but torch {torch_version} uses CUDA "
                f"{torch_cuda}: their CUDA libraries cannot share one process. Install the onnxruntime-gpu build for "
                f"CUDA {_major(torch_cuda)} (or the torch build for CUDA {_major(ort_cuda)})")
    return None


def check_ort_cuda(**versions: str | None) -> None:
    """Raise RuntimeError with `ort_cuda_problem`'s message when onnxruntime's CUDA does not suit torch's."""
    problem = ort_cuda_problem(**versions)
    if problem:
        raise RuntimeError(problem)


def ort_providers(kind: str = "cpu", precision: str = "fp32", device_id: int = 0, cache_dir: str | None = None,
                  stream: int | None = None, profile: dict[str, str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """ONNX Runtime's provider list with options for `kind` ('cpu', 'cuda' or 'tensorrt').

    TensorRT: fp16 kernels allowed for an fp16 row (`trt_fp16_enable`), one engine for a range of
    batch sizes (`profile`, see `tensorrt_profile`; without one TensorRT builds an engine again for
    each new input shape), and built engines (plus TensorRT's timing cache) kept in `cache_dir`
    (default: torchspeed's cache, `tensorrt/`), so a session on the same model, GPU and TensorRT
    version loads its engine instead of rebuilding it (minutes). CUDA and TensorRT run on `stream` (a
    CUDA stream's handle) when given. It must not be 0, the legacy default stream torch's default
    `current_stream()` has: ONNX Runtime reads 0 as "no stream" and runs on a stream of its own that
    nothing orders with torch's work; `OrtRunner` gives it a stream of its own and orders it with the
    caller's (`ordered_with`). Each GPU provider is followed by its fallbacks; which one really runs is
    read back from the session (`provider_label`).
    """
    cpu = ("CPUExecutionProvider", {})
    if kind == "cpu":
        return [cpu]
    if stream == 0:
        raise ValueError("stream 0 is the legacy default CUDA stream, which ONNX Runtime takes for none: give the "
                         "handle of a torch.cuda.Stream() (its .cuda_stream)")
    on_stream = {"has_user_compute_stream": True, "user_compute_stream": str(stream)} if stream else {}
    cuda = ("CUDAExecutionProvider", {"device_id": device_id, **on_stream})
    if kind == "cuda":
        return [cuda, cpu]
    if kind == "tensorrt":
        cache = os.fspath(cache_dir) if cache_dir else default_cache_dir("tensorrt")
        trt = {"device_id": device_id, "trt_fp16_enable": precision == "fp16", "trt_engine_cache_enable": True,
               "trt_engine_cache_path": cache, "trt_timing_cache_enable": True, "trt_timing_cache_path": cache,
               **(profile or {}), **on_stream}
        return [("TensorrtExecutionProvider", trt), cuda, cpu]
    raise ValueError(f"ONNX Runtime provider kind must be 'cpu', 'cuda' or 'tensorrt', got {kind!r}")


def tensorrt_profile(inputs: list[tuple[str, list[Any]]], batch_sizes: tuple[int, ...] | list[int] = (1, 8),
                     max_batch: int = 64) -> dict[str, str]:
    """TensorRT's optimisation profile for the batch range, as ONNX Runtime's provider options: one
    engine serves every batch from 1 to max(`max_batch`, the largest of `batch_sizes`), tuned for the
    largest of `batch_sizes`. `inputs`: (name, dims) of the model's inputs, the batch first (a dynamic
    dimension is a name or None). {} when a dimension other than the batch is dynamic (no single
    range to give) or the batch is fixed (one shape, one engine anyway)."""
    if not inputs or not batch_sizes:
        return {}
    rest = [dims[1:] for _, dims in inputs]
    if any(not isinstance(d, int) or d <= 0 for r in rest for d in r):
        return {}
    if all(dims and isinstance(dims[0], int) and dims[0] > 0 for _, dims in inputs):
        return {}
    opt, top = max(batch_sizes), max(max_batch, max(batch_sizes))

    def shapes(batch: int) -> str:
        return ",".join(f"{name}:{'x'.join(str(d) for d in [batch, *r])}" for (name, _), r in zip(inputs, rest))

    return {"trt_profile_min_shapes": shapes(1), "trt_profile_opt_shapes": shapes(opt),
            "trt_profile_max_shapes": shapes(top)}


@contextlib.contextmanager
def ordered_with(own: Any, current: Any) -> Any:
    """Run the block's work (an ONNX Runtime run on stream `own`) after what the caller queued on
    `current`, and the caller's later work after it: two event waits on the device, no host sync.
    Why: the inputs torch prepared on `current` may still be in the making when ONNX Runtime starts
    on its own stream, and torch must not read the outputs (nor reuse the inputs' memory) before it
    ends. `own` None (a CPU run): nothing to order."""
    if own is None or own == current:
        yield
        return
    own.wait_stream(current)
    try:
        yield
    finally:
        current.wait_stream(own)


def provider_label(requested: list[str], active: list[str]) -> tuple[str, str | None]:
    """(runtime label of the provider really running, None or why it is not the one asked for).

    ONNX Runtime falls back silently when a provider fails to load (TensorRT libraries missing, a
    CUDA mismatch): the session's `get_providers()` is the truth, not the request."""
    wanted = requested[0] if requested else "CPUExecutionProvider"
    got = active[0] if active else "no provider"
    runtime = RUNTIME_OF_PROVIDER.get(got, f"onnxruntime ({got})")
    if got == wanted:
        return runtime, None
    return runtime, (f"asked for {wanted} but ONNX Runtime runs {got} (the {wanted} did not load: check its "
                     f"libraries, e.g. TensorRT for the TensorRT provider, and the CUDA versions)")


TRT_INSTALL = ("install TensorRT for onnxruntime-gpu's CUDA (pip install -c constraints-gpu.txt tensorrt-cu13 from "
               "a torchspeed clone) or put its libnvinfer on the library path")


def tensorrt_problem() -> str | None:
    """None when ONNX Runtime's TensorRT provider loads here, else why not.

    Why: `get_available_providers()` lists the providers onnxruntime-gpu was built with, not those
    whose libraries load; without libnvinfer a TensorRT session silently runs on CUDA instead. So the
    provider's own library is loaded (the dynamic loader then needs libnvinfer and the ONNX parser of
    the TensorRT version it was linked with), after `import tensorrt`, which puts the pip-installed
    TensorRT's libraries in the process where it is installed."""
    try:
        ort = optional("onnxruntime", GPU_INSTALL, "the TensorRT runtime")
    except ImportError as e:
        return str(e)
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} here has no TensorRT execution provider (onnxruntime-gpu has one)"
    with contextlib.suppress(Exception):  # optional: its libraries loaded into the process if installed
        import_as_found("tensorrt")
    libs = glob.glob(os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_tensorrt.*"))
    for lib in libs:
        try:
            ctypes.CDLL(lib)
        except OSError as e:
            return f"ONNX Runtime's TensorRT provider does not load ({first_line(e)}): {TRT_INSTALL}"
    return None


def first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]
