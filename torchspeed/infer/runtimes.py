"""Inference runtimes behind one small interface: build or load, run, save.

Every runner is a callable `runner(batch) -> torch.Tensor` (float32 in, outputs as tensors) with a
`backend`, an explicit `precision` label and `save(directory)`, which writes the model file plus a
JSON manifest that `torchspeed.infer.load` reads back. Runtimes are imported lazily; a missing one
is reported by `available_backends()`, never fatal.

Thread settings are explicit for every runtime (the same core count for all, so they compare fairly),
and ONNX Runtime's worker threads do not spin-wait after a run, so they cannot steal the cores of
the next contender. OpenVINO's precision hint is always set: on CPUs with bf16 instructions it would
otherwise silently run an "fp32" model in bf16.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from torchspeed.atomic import publish_files, write_json
from torchspeed.runtime import usable_cores

__all__ = ["Runner", "TorchRunner", "OrtRunner", "OpenVINORunner", "available_backends", "build_torch_module",
           "MANIFEST", "FORMAT"]

MANIFEST = "manifest.json"
FORMAT = "torchspeed-inference-artifact"


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().contiguous().numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


def _as_tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


def available_backends() -> dict[str, str | None]:
    """backend -> None when usable here, else why not (with the install hint)."""
    out: dict[str, str | None] = {"torch": None, "torch.compile": None}
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401

        out["onnxruntime"] = None
    except ImportError:
        out["onnxruntime"] = "onnxruntime/onnx not installed: pip install 'torchspeed[infer]'"
    try:
        import openvino  # noqa: F401

        out["openvino"] = None
    except ImportError:
        out["openvino"] = "openvino not installed: pip install 'torchspeed[infer]'"
    if not torch.cuda.is_available():
        out["tensorrt"] = "no CUDA GPU"
    elif out["onnxruntime"] is None:
        import onnxruntime as ort

        has = "TensorrtExecutionProvider" in ort.get_available_providers()
        out["tensorrt"] = None if has else "onnxruntime has no TensorRT execution provider (pip install onnxruntime-gpu, TensorRT)"
    else:
        out["tensorrt"] = out["onnxruntime"]
    return out


class Runner:
    """A model ready to run: `runner(x) -> outputs`, with backend, precision label and `save(dir)`."""

    backend: str = ""
    precision: str = ""
    files: tuple[str, ...] = ()

    def __call__(self, x: Any) -> torch.Tensor:
        raise NotImplementedError

    def manifest(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": 1, "backend": self.backend, "precision": self.precision}

    def save(self, directory: str | os.PathLike) -> str:
        """Write the model file(s) and `manifest.json` into `directory`; returns the directory."""
        raise NotImplementedError

    def size_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files if os.path.exists(f))

    def _write_manifest(self, directory: str, extra: dict[str, Any]) -> None:
        write_json(os.path.join(directory, MANIFEST), {**self.manifest(), **extra})

    def _publish(self, directory: str | os.PathLike, write: Callable[[str], None]) -> str:
        """`write(tmp)` writes the model file(s) and the manifest; they replace the artifact in
        `directory` all at once (manifest last), so an interrupted save never leaves a mix."""
        return publish_files(directory, write, last=MANIFEST)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.backend} {self.precision}>"


# ----------------------------------------------------------------------------------------- torch
def build_torch_module(model: nn.Module, recipe: dict[str, Any]) -> nn.Module | Any:
    """Apply a torch recipe {'fuse', 'precision', 'mode', 'channels_last', 'compile'} to a model copy."""
    from torchspeed.infer.fuse import fuse_conv_bn
    from torchspeed.infer.precision import to_precision

    m = fuse_conv_bn(model) if recipe.get("fuse") else __import__("copy").deepcopy(model).eval()
    m = to_precision(m, recipe.get("precision", "fp32"), recipe.get("mode", "autocast"),
                     bool(recipe.get("channels_last")), copy_model=False)
    if recipe.get("compile"):
        m = torch.compile(m, dynamic=False)  # compiled on first call, under TorchRunner's freezing patch
    return m


class TorchRunner(Runner):
    """PyTorch eager or torch.compile. Saved as the original weights (torch.save, loaded weights_only)
    plus the architecture name and the recipe; loading rebuilds and re-applies the recipe. No pickle,
    so it needs a model built by `torchspeed.models.create` (or the CLI)."""

    def __init__(self, model: nn.Module, recipe: dict[str, Any], threads: int | None = None,
                 arch: dict[str, Any] | None = None):
        self.source = model
        self.recipe = dict(recipe)
        self.arch = arch if arch is not None else getattr(model, "_torchspeed_arch", None)
        self.backend = "torch.compile" if recipe.get("compile") else "torch"
        self.precision = recipe.get("precision", "fp32")
        self.threads = threads or usable_cores()
        self.module = build_torch_module(model, recipe)

    def __call__(self, x: Any) -> torch.Tensor:
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        with torch.inference_mode(), self._compile_config():
            out = self.module(_as_tensor(x).float())
        return out[0] if isinstance(out, (tuple, list)) else out

    def _compile_config(self) -> Any:
        if not self.recipe.get("compile"):
            return contextlib.nullcontext()
        import torch._inductor.config as inductor_config

        # freezing: weights become constants, folded and pre-packed for oneDNN (inference only)
        return inductor_config.patch(freezing=True)

    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.module.state_dict().values() if isinstance(t, torch.Tensor))

    def save(self, directory: str | os.PathLike) -> str:
        directory = os.fspath(directory)
        if self.arch is None:
            raise ValueError(
                "this torch variant cannot be saved without pickle: its architecture has no name. Create the model "
                "with torchspeed.models.create('resnet18', ...) (or pass arch= to optimize), or save an "
                "ONNX Runtime / OpenVINO variant instead")
        state = {k: v.detach().contiguous() for k, v in self.source.state_dict().items()}

        def write(tmp: str) -> None:
            torch.save(state, os.path.join(tmp, "weights.pt"))
            self._write_manifest(tmp, {"file": "weights.pt", "arch": self.arch, "recipe": self.recipe,
                                       "threads": self.threads})

        return self._publish(directory, write)

    @classmethod
    def load(cls, directory: str, manifest: dict[str, Any], model: nn.Module | None = None,
             trust_code: bool = False) -> TorchRunner:
        """Rebuild the architecture the manifest names (through `torchspeed.models.create`), load the
        weights (`weights_only=True`) and re-apply the recipe.

        A torchvision or timm architecture is rebuilt by name. The user's own architecture (a spec
        whose source is 'module' or 'file') would import the Python code the manifest names, so it is
        refused unless the caller passes `model=` (their own freshly built instance, which receives
        the weights) or `trust_code=True`.
        """
        from torchspeed.models import create

        arch = manifest.get("arch")
        if not isinstance(arch, dict) or "source" not in arch or "name" not in arch:
            raise ValueError(f"the torch artifact in {directory!r} names no architecture (manifest 'arch' is {arch!r})")
        if not isinstance(manifest.get("recipe"), dict):
            raise ValueError(f"the torch artifact in {directory!r} is damaged: its manifest has no recipe")
        if model is None:
            if arch["source"] in ("module", "file") and not trust_code:
                raise ValueError(
                    f"the torch artifact in {directory!r} was built from your own code ({arch['source']} "
                    f"{arch['name']!r}); loading it would import that code, so it is not done on the manifest's "
                    "word. Build the model yourself and pass it: ts.infer.load(dir, model=my_model) (on the "
                    "command line: give the spec and --weights DIR/weights.pt), or pass trust_code=True if "
                    "you trust this directory")
            model = create(arch)
        from torchspeed.safeload import load_torch_file

        state = load_torch_file(os.path.join(directory, manifest["file"]), what="the artifact's weights")
        if not isinstance(state, dict):
            raise ValueError(f"the artifact's weights {os.path.join(directory, manifest['file'])!r} are not a "
                             f"state dict (found {type(state).__name__}); re-save the artifact")
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise ValueError(f"the weights in {directory!r} do not fit {type(model).__name__}: "
                             f"{str(e).strip().splitlines()[0]}") from None
        return cls(model.eval(), manifest["recipe"], manifest.get("threads"), arch)


# ----------------------------------------------------------------------------------------- ONNX Runtime
class OrtRunner(Runner):
    """ONNX Runtime on CPU (or the CUDA / TensorRT execution providers when present)."""

    backend = "onnxruntime"

    def __init__(self, path: str, precision: str = "fp32", threads: int | None = None,
                 providers: list[str] | None = None):
        try:
            import onnxruntime as ort
        except ImportError:
            raise ImportError("ONNX Runtime is not installed: pip install 'torchspeed[infer]'") from None
        self.path, self.precision = path, precision
        self.threads = threads or usable_cores()
        self.providers = providers or ["CPUExecutionProvider"]
        if "TensorrtExecutionProvider" in self.providers:
            self.backend = "onnxruntime-tensorrt"
        elif "CUDAExecutionProvider" in self.providers:
            self.backend = "onnxruntime-cuda"
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads sleep, not spin
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(path, opts, providers=self.providers)
        self.input_name = self.session.get_inputs()[0].name
        self.files = (path,)

    def __call__(self, x: Any) -> torch.Tensor:
        return torch.from_numpy(self.session.run(None, {self.input_name: _as_numpy(x)})[0])

    def save(self, directory: str | os.PathLike) -> str:
        def write(tmp: str) -> None:
            shutil.copyfile(self.path, os.path.join(tmp, "model.onnx"))  # fsynced by publish_files
            self._write_manifest(tmp, {"file": "model.onnx", "threads": self.threads, "providers": self.providers,
                                       "input_shape": [d if isinstance(d, int) else None
                                                       for d in self.session.get_inputs()[0].shape]})

        return self._publish(directory, write)

    @classmethod
    def load(cls, directory: str, manifest: dict[str, Any]) -> OrtRunner:
        import onnxruntime as ort

        providers = [p for p in manifest.get("providers") or [] if p in ort.get_available_providers()]
        path = os.path.join(directory, manifest["file"])
        try:
            return cls(path, manifest["precision"], manifest.get("threads"), providers or ["CPUExecutionProvider"])
        except ImportError:
            raise
        except Exception as e:  # noqa: BLE001 - ORT's InvalidProtobuf, NoSuchFile, Fail...: one line naming the file
            raise ValueError(f"ONNX model {path!r} cannot be loaded by ONNX Runtime (damaged, truncated or not an "
                             f"ONNX model? re-save the artifact): {_first_line(e)}") from None


# ----------------------------------------------------------------------------------------- OpenVINO
_OV_HINT = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "int8": "f32", "int8+bf16": "bf16"}


class OpenVINORunner(Runner):
    """OpenVINO on CPU with an explicit inference precision hint ('f32' for the fp32 and int8 rows)."""

    backend = "openvino"

    def __init__(self, model: Any, precision: str = "fp32", threads: int | None = None):
        try:
            import openvino as ov
        except ImportError:
            raise ImportError("OpenVINO is not installed: pip install 'torchspeed[infer]'") from None
        if precision not in _OV_HINT:
            raise ValueError(f"OpenVINO precision must be one of {', '.join(_OV_HINT)}, got {precision!r}")
        self.core = ov.Core()
        self.model = self.core.read_model(model) if isinstance(model, (str, os.PathLike)) else model
        self.precision = precision
        self.threads = threads or usable_cores()
        self.config = {
            "INFERENCE_PRECISION_HINT": _OV_HINT[precision],  # never let "fp32" silently run in bf16
            "INFERENCE_NUM_THREADS": self.threads,
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
        }
        self.compiled = self.core.compile_model(self.model, "CPU", self.config)
        self.request = self.compiled.create_infer_request()
        self.files = ()

    def __call__(self, x: Any) -> torch.Tensor:
        self.request.infer({0: _as_numpy(x)})
        return torch.from_numpy(np.array(self.request.get_output_tensor(0).data, copy=True))

    def save(self, directory: str | os.PathLike) -> str:
        import openvino as ov

        directory = os.fspath(directory)

        def write(tmp: str) -> None:
            ov.save_model(self.model, os.path.join(tmp, "model.xml"), compress_to_fp16=False)
            self._write_manifest(tmp, {"file": "model.xml", "threads": self.threads, "config": self.config})

        self._publish(directory, write)
        self.files = (os.path.join(directory, "model.xml"), os.path.join(directory, "model.bin"))
        return directory

    def size_bytes(self) -> int:
        if self.files:
            return super().size_bytes()
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            import openvino as ov

            ov.save_model(self.model, os.path.join(tmp, "m.xml"), compress_to_fp16=False)
            return sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))

    @classmethod
    def load(cls, directory: str, manifest: dict[str, Any]) -> OpenVINORunner:
        path = os.path.join(directory, manifest["file"])
        try:
            return cls(path, manifest["precision"], manifest.get("threads"))
        except (ImportError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - OpenVINO raises RuntimeError (or its own types) on a damaged .xml / .bin
            raise ValueError(f"OpenVINO model {path!r} (with its .bin beside it) cannot be loaded (damaged, "
                             f"truncated or not an OpenVINO IR? re-save the artifact): {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]


RUNNERS: dict[str, type[Runner]] = {
    "torch": TorchRunner, "torch.compile": TorchRunner, "onnxruntime": OrtRunner,
    "onnxruntime-cuda": OrtRunner, "onnxruntime-tensorrt": OrtRunner, "openvino": OpenVINORunner,
}


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    directory = os.fspath(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no inference artifact at {directory!r}: the directory does not exist")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory!r} is not a torchspeed artifact: {MANIFEST} is missing "
                                "(write one with OptimizeResult.best.save(dir))")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the artifact manifest {path!r}: {e.strerror}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"the artifact manifest {path!r} is damaged (not valid JSON: {_first_line(e)}); "
                         "re-save the artifact") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("backend") not in RUNNERS:
        fmt = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        backend = manifest.get("backend") if isinstance(manifest, dict) else None
        raise ValueError(f"{path!r} is not a torchspeed inference manifest (format {fmt!r}, backend {backend!r})")
    bad = [k for k in ("file", "precision") if not isinstance(manifest.get(k), str) or not manifest.get(k)]
    if bad or os.path.basename(manifest["file"]) != manifest["file"]:
        raise ValueError(f"the artifact manifest {path!r} is damaged: "
                         f"{', '.join(bad) + ' missing' if bad else 'file must name a file in the artifact directory'}; "
                         "re-save the artifact")
    if not os.path.isfile(os.path.join(directory, manifest["file"])):
        raise FileNotFoundError(f"the artifact in {directory!r} is incomplete: {manifest['file']!r} is missing "
                                "(an interrupted save? re-save the artifact)")
    return manifest
