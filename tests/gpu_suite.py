"""What the GPU suite (`make test-gpu`, `pytest -m gpu`) needs before its first test, used by conftest.py.

A GPU suite that skips everything passes green and proves nothing: `usable_cuda_problem` says why no
CUDA device can run a kernel here (a CPU build of torch, no driver, a driver older than torch's CUDA,
no kernel image for this GPU), and conftest ends the session non-zero with that line. `versions` is
what the session ran on (driver, CUDA, cuDNN, ONNX Runtime, TensorRT), printed in its header.
`torch_flags` snapshots the process-wide backend flags a test may set (cudnn.deterministic and
benchmark, TF32, matmul precision, deterministic algorithms) so conftest puts them back after each
test: a flag left set changes what later tests measure.
"""
from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from typing import Any


def usable_cuda_problem() -> str | None:
    """None when a CUDA device runs a kernel here, else one line saying why not."""
    import torch

    if not torch.version.cuda:
        return f"torch {torch.__version__} is a CPU build: install a CUDA build of torch to run the GPU suite"
    try:
        torch.cuda.init()  # raises with the driver's reason (none found, too old for this CUDA)
        if torch.cuda.device_count() < 1:
            return "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)"
        x = torch.ones(4, device="cuda")
        if float((x + 1).sum()) != 8.0:  # a kernel ran and gave the right answer
            return "a CUDA kernel gave a wrong result on this device"
    except Exception as e:  # noqa: BLE001 - every reason is reported, none is a crash
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"no usable CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}): {first}"
    return None


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown (no nvidia-smi)"


def versions() -> list[str]:
    """Lines naming the GPU, driver, CUDA, cuDNN, ONNX Runtime (and its providers) and TensorRT."""
    import torch

    lines = []
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        lines.append(f"gpu: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), {torch.cuda.device_count()} visible")
    lines.append(f"driver {_driver_version()}; torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
                 f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else 'none'}")
    try:
        import onnxruntime as ort

        lines.append(f"onnxruntime {ort.__version__} (CUDA {getattr(ort, 'cuda_version', '') or 'none: a CPU build'}), "
                     f"providers {', '.join(ort.get_available_providers())}")
    except ImportError:
        lines.append("onnxruntime: not installed")
    from torchspeed.infer.providers import tensorrt_problem

    try:
        import tensorrt

        trt = f"tensorrt {tensorrt.__version__}"
    except Exception:  # noqa: BLE001 - not installed, or its libraries do not load
        trt = "tensorrt python package: not installed"
    problem = tensorrt_problem()
    lines.append(f"{trt}; ONNX Runtime's TensorRT provider: {'loads' if problem is None else problem}")
    return lines


# set and read through the legacy attributes, as torchspeed and the tests do: torch 2.9+ refuses to read
# the matmul precision once the legacy and the new `fp32_precision` APIs were mixed
FLAGS = (
    ("torch.backends.cudnn", "deterministic"),
    ("torch.backends.cudnn", "benchmark"),
    ("torch.backends.cudnn", "allow_tf32"),
    ("torch.backends.cuda.matmul", "allow_fp16_reduced_precision_reduction"),
    ("torch.backends.cuda.matmul", "allow_bf16_reduced_precision_reduction"),
)
NEW_API = ("torch.backends.cuda.matmul", "torch.backends.cudnn.conv", "torch.backends.cudnn.rnn")


def _owner(path: str) -> Any:
    import importlib

    return importlib.import_module(path) if path == "torch.backends.cudnn" else _attr_path(path)


def _attr_path(path: str) -> Any:
    import torch

    obj: Any = torch
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def torch_flags() -> Iterator[None]:
    """Put the process-wide torch backend flags back as they were on exit (whatever the body set)."""
    import torch

    saved = [(owner, name, getattr(owner, name)) for owner, name in ((_owner(p), n) for p, n in FLAGS)
             if hasattr(owner, name)]
    try:
        precision: str | None = torch.get_float32_matmul_precision()
        strings: list[tuple[Any, str]] = []
    except RuntimeError:  # set through the new API: saved and put back through it
        precision = None
        strings = [(o, o.fp32_precision) for o in map(_attr_path, NEW_API) if hasattr(o, "fp32_precision")]
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        yield
    finally:
        if precision is not None:
            torch.set_float32_matmul_precision(precision)  # first: it also resets the matmul TF32 switch
        for owner, value in strings:
            owner.fp32_precision = value
        for owner, name, value in saved:
            if getattr(owner, name) != value:
                setattr(owner, name, value)
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) \
                != deterministic:
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


if __name__ == "__main__":  # `make test-gpu`'s first step: fail in one line, or say what the suite runs on
    import sys

    why = usable_cuda_problem()
    if why:
        print(f"make test-gpu: the GPU suite cannot run: {why}", file=sys.stderr)
        sys.exit(3)
    print("\n".join(versions()))
