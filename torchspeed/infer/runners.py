"""Runners: a model ready to run on one inference runtime, behind one small interface (build or
load, run, save).

Every runner is a callable `runner(batch) -> torch.Tensor` (float32 in, outputs as tensors) with a
`runtime`, an explicit `precision` label and `save(directory)`, which writes the model file plus a
JSON manifest that `torchspeed.infer.load` reads back. Runtimes are imported lazily; a missing one
is reported by `available_runtimes()`, never fatal.

Thread settings are explicit for every runtime (the same core count for all, so they compare fairly),
and ONNX Runtime's intra-op threads spin between ops as by its default (measured faster for small
models; `measure.compare` pauses between contenders so a spinning runtime does not take the next one's
cores). OpenVINO's precision hint is always set: on CPUs with bf16 instructions it would
otherwise silently run an "fp32" model in bf16.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from torchspeed.atomic import publish_files, published_set, recover_published, write_json
from torchspeed.batches import BatchFormat, map_tensors, to_device
from torchspeed.deprecated import renamed
from torchspeed.infer.export import onnx_data_files, read_onnx, save_onnx_copy
from torchspeed.infer.fuse import fuse_conv_bn
from torchspeed.infer.precision import as_fp32, to_precision
from torchspeed.infer.providers import (
    GPU_PROVIDERS,
    KIND_OF_PROVIDER,
    check_ort_cuda,
    first_line,
    ordered_with,
    ort_cuda_problem,
    ort_providers,
    provider_label,
    tensorrt_problem,
    tensorrt_profile,
)
from torchspeed.infer.program import PROGRAM_FILE, save_program
from torchspeed.models import ModelSpec, create, spec_of
from torchspeed.optional import optional
from torchspeed.runtime import import_as_found, process_as_found, usable_cores
from torchspeed.safeload import load_torch_file

__all__ = ["Runner", "TorchRunner", "OrtRunner", "OpenVINORunner", "RUNTIMES", "available_runtimes",
           "build_torch_module", "module_device", "feed_names", "read_manifest", "artifact_dir", "recover_artifact",
           "MANIFEST", "FORMAT", "RUNTIME_KEY", "ARTIFACT_FILES"]

RUNTIMES = ("torch", "torch.compile", "onnxruntime", "onnxruntime-cuda", "openvino", "tensorrt")
MANIFEST = "manifest.json"
FORMAT = "torchspeed-inference-artifact"
RUNTIME_KEY = "backend"  # the manifest key naming the runtime: part of the saved artifact format
ARTIFACT_FILES = (MANIFEST, "weights.pt", "program.pt2", "model.onnx", "model.onnx.data", "model.xml",
                  "model.bin")  # any runner's

def _as_numpy(x: Any, dtype: Any = np.float32) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=dtype))


def _as_tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


def module_device(model: Any) -> torch.device:
    """The device of a module's first parameter (or buffer); CPU for anything else."""
    if isinstance(model, nn.Module):
        for t in (*model.parameters(), *model.buffers()):
            return t.device
    return torch.device("cpu")


def available_runtimes() -> dict[str, str | None]:
    """Each of `RUNTIMES` -> None when usable here, else why not (with the install hint)."""
    out: dict[str, str | None] = {"torch": None, "torch.compile": None}
    for runtime, modules, extra in (("onnxruntime", ("onnx", "onnxruntime"), "infer"),
                                    ("openvino", ("openvino",), "openvino")):
        try:
            for module in modules:
                optional(module, extra, runtime)
            out[runtime] = None
        except ImportError as e:
            out[runtime] = str(e)
    if not torch.cuda.is_available():
        gpu: str | None = "no CUDA GPU"
    else:
        gpu = out["onnxruntime"] or ort_cuda_problem()
    out["onnxruntime-cuda"] = gpu
    out["tensorrt"] = gpu if gpu is not None else tensorrt_problem()
    return out


class Runner:
    """A model ready to run: `runner(x) -> outputs`, with runtime, precision label and `save(dir)`."""

    runtime: str = ""
    precision: str = ""
    files: tuple[str, ...] = ()
    saves: tuple[str, ...] = ()  # the names `save` may write into an artifact folder (one of ARTIFACT_FILES each)

    def __call__(self, x: Any) -> torch.Tensor:
        raise NotImplementedError

    @property
    def backend(self) -> str:
        """The old name of `runtime`."""
        renamed("Runner.backend", "Runner.runtime")
        return self.runtime

    def manifest(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": 1, RUNTIME_KEY: self.runtime, "precision": self.precision}

    def save(self, directory: str | os.PathLike, manifest_extra: dict[str, Any] | None = None) -> str:
        """Write the model file(s) and `manifest.json` (with `manifest_extra` added) into `directory`;
        returns the directory."""
        raise NotImplementedError

    def size_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files if os.path.exists(f))

    def _publish(self, directory: str | os.PathLike, write: Callable[[str], dict[str, Any]],
                 manifest_extra: dict[str, Any] | None) -> str:
        """`write(tmp)` writes the model file(s) and returns the manifest's fields. Files and manifest
        replace the artifact in `directory` as one set (manifest last, the previous set kept whole until
        then), so an interrupted save never leaves a mix; files of the previous artifact that the new
        one lacks are removed. A failed write (a full disk) is one OSError naming the folder."""
        directory = os.fspath(directory)

        def build(tmp: str) -> None:
            fields = write(tmp)
            write_json(os.path.join(tmp, MANIFEST), {**self.manifest(), **fields, "files": sorted(os.listdir(tmp)),
                                                     **(manifest_extra or {})})

        try:
            return publish_files(directory, build, last=MANIFEST, replaces=_artifact_files(directory))
        except OSError as e:
            raise OSError(e.errno, f"cannot save the artifact in {directory!r}: {e.strerror or e} (an artifact "
                                   "saved there before is left as it was)") from None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.runtime} {self.precision}>"


# ----------------------------------------------------------------------------------------- torch
def build_torch_module(model: nn.Module, recipe: dict[str, Any]) -> nn.Module | Any:
    """Apply a torch recipe {'fuse', 'precision', 'mode', 'channels_last', 'compile'} to a model copy."""
    m = fuse_conv_bn(model) if recipe.get("fuse") else copy.deepcopy(model).eval()
    m = to_precision(m, recipe.get("precision", "fp32"), recipe.get("mode", "autocast"),
                     bool(recipe.get("channels_last")), copy_model=False)
    if recipe.get("compile"):
        with process_as_found():  # torch.compile's first use sets TORCHINDUCTOR_CACHE_DIR
            m = torch.compile(m, dynamic=False)  # compiled on first call, under TorchRunner's freezing patch
    return m


class TorchRunner(Runner):
    """PyTorch eager or torch.compile. Saved as the original weights (torch.save, loaded weights_only)
    plus the architecture name and the recipe; loading rebuilds and re-applies the recipe. A model
    with no name (your own class, not made by `torchspeed.models.create`) is saved as a program
    captured by torch.export on `example` (its inputs), see `torchspeed.infer.program`. No pickle."""

    saves = ("weights.pt", "program.pt2", MANIFEST)

    def __init__(self, model: nn.Module, recipe: dict[str, Any], threads: int | None = None,
                 spec: ModelSpec | None = None, batch_format: BatchFormat | dict | None = None,
                 example: Any = None):
        self.source = model
        self.example = example
        self.recipe = dict(recipe)
        self.spec = spec if spec is not None else spec_of(model)
        self.runtime = "torch.compile" if recipe.get("compile") else "torch"
        self.precision = recipe.get("precision", "fp32")
        self.threads = threads or usable_cores()
        self.format = BatchFormat.of(batch_format)
        self.device = module_device(model)  # runs where the model is: inputs are moved there
        self.module = build_torch_module(model, recipe)
        self._compiled_for: set[tuple] = set()  # input shapes torch.compile has compiled the module for

    def __call__(self, x: Any) -> torch.Tensor:
        """Logits for the model's inputs (a tensor, or a dict / tuple of them as `batch_format` says).

        On a CPU the call runs with the runner's thread count (what it was timed with) and gives the
        caller's back on return."""
        caller_threads = torch.get_num_threads()
        if self.device.type == "cpu" and caller_threads != self.threads:
            torch.set_num_threads(self.threads)
        try:
            # tensors (arrays made tensors), floating ones as float32; a list is positional inputs, as a tuple
            x = map_tensors(lambda v: as_fp32(_as_tensor(v)), tuple(x) if isinstance(x, list) else x, leaf=object)
            x = to_device(x, self.device)
            with torch.inference_mode(), self._compile_config(x):
                out = self.format.forward(self.module, x)
            return self.format.logits_of(out)
        finally:
            if torch.get_num_threads() != caller_threads:
                torch.set_num_threads(caller_threads)

    def _compile_config(self, x: Any) -> Any:
        """Inductor's settings for the call; a call that compiles (an input shape not seen yet) also runs
        inside `process_as_found`, since compiling sets TORCHINDUCTOR_CACHE_DIR and warning filters."""
        if not self.recipe.get("compile"):
            return contextlib.nullcontext()
        inductor_config = import_as_found("torch._inductor.config")  # heavy: imported by the first compiled call
        stack = contextlib.ExitStack()
        shapes: list[tuple] = []
        map_tensors(lambda t: shapes.append((tuple(t.shape), t.dtype)) or t, x)
        if tuple(shapes) not in self._compiled_for:
            self._compiled_for.add(tuple(shapes))
            stack.enter_context(process_as_found())
        # freezing: weights become constants, folded and pre-packed for oneDNN (inference only)
        stack.enter_context(inductor_config.patch(freezing=True))
        return stack

    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.module.state_dict().values() if isinstance(t, torch.Tensor))

    def save(self, directory: str | os.PathLike, manifest_extra: dict[str, Any] | None = None) -> str:
        if self.spec is None:  # no name to rebuild it by: saved as a torch.export program
            def write_program(tmp: str) -> dict[str, Any]:
                program = save_program(self.source, self.example, os.path.join(tmp, PROGRAM_FILE), self.format,
                                       fuse=bool(self.recipe.get("fuse")))
                return {"file": PROGRAM_FILE, "program": program, "recipe": self.recipe, "threads": self.threads,
                        "device": str(self.device)}

            return self._publish(directory, write_program, manifest_extra)
        state = {k: v.detach().contiguous() for k, v in self.source.state_dict().items()}

        def write(tmp: str) -> dict[str, Any]:
            with open(os.path.join(tmp, "weights.pt"), "wb") as f:  # a file object: a full disk is an OSError
                torch.save(state, f)
            return {"file": "weights.pt", "arch": self.spec.to_dict(), "recipe": self.recipe, "threads": self.threads,
                    "device": str(self.device)}

        return self._publish(directory, write, manifest_extra)

    @classmethod
    def load(cls, directory: str, manifest: dict[str, Any], model: nn.Module | None = None,
             trust_code: bool = False) -> TorchRunner:
        """Rebuild the architecture the manifest names (through `torchspeed.models.create`), load the
        weights (`weights_only=True`) and re-apply the recipe.

        A torchvision or timm architecture is rebuilt by name. The user's own architecture (a spec
        whose source is 'module' or 'file') would import the Python code the manifest names, so it is
        refused unless the caller passes `model=` (their own freshly built instance, which receives
        the weights) or `trust_code=True`. Keyword arguments that name a file are refused either way
        (`ModelSpec.check_saved`): a folder names no file outside itself.
        """
        where = f"the torch artifact in {directory!r}"
        spec = ModelSpec.from_dict(manifest.get("arch"), where=where)
        if not isinstance(manifest.get("recipe"), dict):
            raise ValueError(f"{where} is damaged: its manifest has no recipe")
        if model is None:
            weights = f"DIR/{manifest['file']}"
            if spec.runs_user_code and not trust_code:
                raise ValueError(
                    f"{where} was built from your own code ({spec.source} {spec.name!r}); loading it would "
                    "import that code, so it is not done on the manifest's word. Build the model yourself and "
                    f"pass it: ts.infer.load(dir, model=my_model) (on the command line: give the spec and --weights "
                    f"{weights}), or pass trust_code=True if you trust this directory")
            spec.check_saved(where, remedy=f"Build the model and pass it: ts.infer.load(dir, model=m) (command "
                                                 f"line: the spec and --weights {weights})")
            model = create(spec)
        state = load_torch_file(os.path.join(directory, manifest["file"]), what="the artifact's weights")
        if not isinstance(state, dict):
            raise ValueError(f"the artifact's weights {os.path.join(directory, manifest['file'])!r} are not a "
                             f"state dict (found {type(state).__name__}); re-save the artifact")
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise ValueError(f"the weights in {directory!r} do not fit {type(model).__name__}: "
                             f"{str(e).strip().splitlines()[0]}") from None
        device = str(manifest.get("device") or "cpu")
        if device.startswith("cuda") and torch.cuda.is_available():  # measured on a GPU: run there when there is one
            model = model.to(device)
        return cls(model.eval(), manifest["recipe"], manifest.get("threads"), spec)


# ----------------------------------------------------------------------------------------- ONNX Runtime
def feed_names(x: Any, names: list[str]) -> dict[str, Any]:
    """Model inputs (a tensor/array, a dict by name, or a tuple by position) as {input name: value}:
    how every runtime fed by input name (ONNX Runtime, OpenVINO, the INT8 calibration reader) reads a batch."""
    if isinstance(x, dict):
        missing = [n for n in names if n not in x]
        if missing:
            raise ValueError(f"the ONNX model takes inputs {names}; the batch has {sorted(x)}")
        return {n: x[n] for n in names}
    if isinstance(x, (tuple, list)):
        if len(x) != len(names):
            raise ValueError(f"the ONNX model takes {len(names)} inputs {names}; got {len(x)}")
        return dict(zip(names, x))
    return {names[0]: x}


_ORT_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32, "tensor(int16)": np.int16, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
              "tensor(bool)": np.bool_, "tensor(double)": np.float64}
_TORCH_OF = {np.float32: torch.float32, np.float16: torch.float16, np.int64: torch.int64, np.int32: torch.int32,
             np.int16: torch.int16, np.int8: torch.int8, np.uint8: torch.uint8, np.bool_: torch.bool,
             np.float64: torch.float64}


class OrtRunner(Runner):
    """ONNX Runtime on the CPU, or on a GPU through its CUDA / TensorRT execution providers.

    `providers`: 'cpu', 'cuda' or 'tensorrt' (with the options of `ort_providers`), or ONNX Runtime's
    own list of provider names / (name, options) pairs. The row's `runtime` names the provider that
    really runs (`session.get_providers()`), and `fallback` says so when it is not the one asked for.
    On a GPU, inputs and outputs stay on the device (IO binding: torch tensors handed to ONNX Runtime
    by pointer; the output written into a torch tensor bound by pointer once its shape for these
    inputs is known, the first run's through DLPack), not copied through host numpy. ONNX Runtime
    runs on a CUDA stream of the runner's own, ordered with the caller's current stream at each call
    (`ordered_with`). TensorRT gets an optimisation profile for `batch_sizes` (`tensorrt_profile`):
    one engine for the batch range, not one per batch size.
    """

    runtime = "onnxruntime"
    saves = ("model.onnx", "model.onnx.data", MANIFEST)

    def __init__(self, path: str, precision: str = "fp32", threads: int | None = None,
                 providers: str | list[Any] | None = None, *, device: str | torch.device | None = None,
                 cache_dir: str | None = None, batch_sizes: tuple[int, ...] | list[int] = (1, 8)):
        ort = optional("onnxruntime", "infer", "an ONNX Runtime runner")
        self.path, self.precision = path, precision
        self.threads = threads or usable_cores()
        device = torch.device(device) if device is not None else None
        if device is not None and device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU under torchrun, not GPU 0
        device_id = device.index or 0 if device is not None and device.type == "cuda" else 0
        self.stream: Any = None  # ONNX Runtime's compute stream: alive as long as the session
        if providers is None or isinstance(providers, str):
            kind = providers or ("cuda" if device is not None and device.type == "cuda" else "cpu")
            if kind != "cpu" and torch.cuda.is_available():
                self.stream = torch.cuda.Stream(torch.device("cuda", device_id))
            profile = tensorrt_profile(_onnx_inputs(path), batch_sizes) if kind == "tensorrt" else None
            requested: list[Any] = ort_providers(kind, precision, device_id, cache_dir,
                                                 self.stream.cuda_stream if self.stream is not None else None, profile)
        else:
            requested = list(providers)
        names = [p[0] if isinstance(p, (tuple, list)) else p for p in requested]
        if names[0] in GPU_PROVIDERS:
            check_ort_cuda()
        self.kind = KIND_OF_PROVIDER.get(names[0], "custom")
        self.providers = names
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # intra-op threads spin between ops (ONNX Runtime's default): turned off, MobileNetV3-Small at batch 1
        # measured 1.31x slower on a 2-core CPU (4.13 vs 3.16 ms), ResNet-18 1.03x
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(path, opts, providers=requested)
        self.active = list(self.session.get_providers())
        self.runtime, self.fallback = provider_label(names, self.active)
        self.device = torch.device("cuda", device_id) if self.active and self.active[0] in GPU_PROVIDERS \
            else torch.device("cpu")
        # an input of another type (bfloat16, strings, ...) is fed as given: ONNX Runtime names a mismatch
        self.inputs = [(i.name, _ORT_NUMPY.get(i.type)) for i in self.session.get_inputs()]
        self._input_types = {i.name: i.type for i in self.session.get_inputs()}
        self.input_names = [n for n, _ in self.inputs]
        self.input_name = self.input_names[0]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.output_type = _ORT_NUMPY.get(getattr(self.session.get_outputs()[0], "type", ""))  # None: another type
        self._output_shapes: dict[tuple, tuple[int, ...]] = {}  # input shapes -> the first output's shape
        self.files = (path,)

    def __call__(self, x: Any) -> torch.Tensor:
        feed = feed_names(x, self.input_names)
        if self.device.type == "cuda":
            return self.run_bound(feed)
        types = dict(self.inputs)
        arrays = {n: _as_numpy(v, types[n]) for n, v in feed.items()}
        return torch.from_numpy(self.session.run(self.output_names[:1], arrays)[0])

    def run_bound(self, feed: dict[str, Any]) -> torch.Tensor:
        """IO binding (used on a GPU): inputs bound by pointer (torch tensors on the runner's device), the
        first output written into a torch tensor bound by pointer once its shape for these input shapes is
        known (the first run's allocated by ONNX Runtime and handed over through DLPack, or copied once
        where this onnxruntime has no DLPack), so nothing is copied through host numpy."""
        binding = self.session.io_binding()
        types = dict(self.inputs)
        kind, index = self.device.type, self.device.index or 0
        keep = []
        for name, value in feed.items():
            if types[name] is None:  # bound by pointer, its element type must be known: never guessed
                raise ValueError(f"the ONNX model's input {name!r} has type {self._input_types[name]}, which "
                                 f"torchspeed cannot bind on {self.device}; run it on the CPU runner")
            t = _as_tensor(value).to(self.device, _TORCH_OF[types[name]]).contiguous()
            keep.append(t)  # alive until the run is done
            binding.bind_input(name, kind, index, types[name], tuple(t.shape), t.data_ptr())
        key = tuple(tuple(t.shape) for t in keep)
        shape = self._output_shapes.get(key) if self.output_type is not None else None  # else ONNX Runtime allocates
        out = None
        if shape is not None:
            out = torch.empty(shape, dtype=_TORCH_OF[self.output_type], device=self.device)
            binding.bind_output(self.output_names[0], kind, index, self.output_type, shape, out.data_ptr())
        else:
            binding.bind_output(self.output_names[0], kind, index)
        current = torch.cuda.current_stream(self.device) if self.stream is not None else None
        with ordered_with(self.stream, current):
            self.session.run_with_iobinding(binding)
        if out is not None:
            return out
        value = binding.get_outputs()[0]
        if hasattr(value, "__dlpack__"):
            out = torch.from_dlpack(value)
        else:
            out = torch.from_numpy(value.numpy()).to(self.device)  # an older onnxruntime: this first run only
        self._output_shapes[key] = tuple(out.shape)
        return out

    def size_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in (self.path, *onnx_data_files(self.path)) if os.path.exists(f))

    def save(self, directory: str | os.PathLike, manifest_extra: dict[str, Any] | None = None) -> str:
        """The ONNX file, with any external data it has (inline when under protobuf's 2 GB, else in
        `model.onnx.data` beside it), and the manifest."""
        def write(tmp: str) -> dict[str, Any]:
            save_onnx_copy(self.path, os.path.join(tmp, "model.onnx"))  # fsynced by publish_files
            return {"file": "model.onnx", "threads": self.threads, "providers": self.providers,
                    "provider_kind": self.kind, "input_names": self.input_names,
                    "input_shape": [d if isinstance(d, int) else None for d in self.session.get_inputs()[0].shape]}

        return self._publish(directory, write, manifest_extra)

    @classmethod
    def load(cls, directory: str, manifest: dict[str, Any]) -> OrtRunner:
        """A GPU artifact runs on the GPU provider it was measured with when this machine has it (its
        TensorRT engine rebuilt once into the local cache: engines are specific to a GPU and TensorRT
        version), else on the CPU."""
        ort = optional("onnxruntime", "infer", "an ONNX Runtime artifact")
        kind = manifest.get("provider_kind") or KIND_OF_PROVIDER.get((manifest.get("providers") or ["CPUExecutionProvider"])[0], "cpu")
        available = ort.get_available_providers()
        if kind == "tensorrt" and "TensorrtExecutionProvider" not in available:
            kind = "cuda"
        if kind in ("cuda", "tensorrt") and ("CUDAExecutionProvider" not in available or not torch.cuda.is_available()
                                             or ort_cuda_problem()):
            kind = "cpu"
        path = os.path.join(directory, manifest["file"])
        try:
            return cls(path, manifest["precision"], manifest.get("threads"), kind if kind in KIND_OF_PROVIDER.values() else "cpu")
        except ImportError:
            raise
        except Exception as e:  # noqa: BLE001 - ORT's InvalidProtobuf, NoSuchFile, Fail...: one line naming the file
            raise ValueError(f"ONNX model {path!r} cannot be loaded by ONNX Runtime (damaged, truncated or not an "
                             f"ONNX model? re-save the artifact): {first_line(e)}") from None


# ----------------------------------------------------------------------------------------- OpenVINO
_OV_HINT = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "int8": "f32", "int8+bf16": "bf16"}


class OpenVINORunner(Runner):
    """OpenVINO on CPU with an explicit inference precision hint ('f32' for the fp32 and int8 rows)."""

    runtime = "openvino"
    saves = ("model.xml", "model.bin", MANIFEST)

    def __init__(self, model: Any, precision: str = "fp32", threads: int | None = None):
        ov = optional("openvino", "openvino", "an OpenVINO runner")
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
        self.input_names = [p.get_any_name() for p in self.compiled.inputs]
        self.files = ()

    def __call__(self, x: Any) -> torch.Tensor:
        feed = {n: _as_numpy(v, np.float32 if _is_float(v) else np.int64)
                for n, v in feed_names(x, self.input_names).items()}
        self.request.infer(feed)
        return torch.from_numpy(np.array(self.request.get_output_tensor(0).data, copy=True))

    def save(self, directory: str | os.PathLike, manifest_extra: dict[str, Any] | None = None) -> str:
        ov = optional("openvino", "openvino", "an OpenVINO runner")
        directory = os.fspath(directory)

        def write(tmp: str) -> dict[str, Any]:
            ov.save_model(self.model, os.path.join(tmp, "model.xml"), compress_to_fp16=False)
            return {"file": "model.xml", "threads": self.threads, "config": self.config}

        self._publish(directory, write, manifest_extra)
        self.files = (os.path.join(directory, "model.xml"), os.path.join(directory, "model.bin"))
        return directory

    def size_bytes(self) -> int:
        if self.files:
            return super().size_bytes()
        with tempfile.TemporaryDirectory() as tmp:
            optional("openvino", "openvino", "an OpenVINO runner").save_model(self.model, os.path.join(tmp, "m.xml"), compress_to_fp16=False)
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
                             f"truncated or not an OpenVINO IR? re-save the artifact): {first_line(e)}") from None


def _is_float(v: Any) -> bool:
    return v.is_floating_point() if isinstance(v, torch.Tensor) else np.issubdtype(np.asarray(v).dtype, np.floating)


def _onnx_inputs(path: str) -> list[tuple[str, list[Any]]]:
    """(name, dims) of an ONNX file's inputs ([] when it cannot be read here: no profile then)."""
    try:
        return [(name, list(dims)) for name, dims, _ in read_onnx(path).inputs]
    except (ImportError, ValueError, OSError):
        return []


# the runtime a manifest names -> the runner that loads it
RUNNERS: dict[str, type[Runner]] = {
    "torch": TorchRunner, "torch.compile": TorchRunner, "onnxruntime": OrtRunner,
    "onnxruntime-cuda": OrtRunner, "onnxruntime-tensorrt": OrtRunner, "openvino": OpenVINORunner,
}


def artifact_dir(directory: str | os.PathLike) -> str:
    """The folder holding the artifact saved into `directory`: `directory` itself, or, while a save is
    under way there or after one was killed, the previous artifact's backup inside it (which loads)."""
    return published_set(directory, MANIFEST)


def recover_artifact(directory: str | os.PathLike) -> None:
    """Tidy what a killed save left in `directory`: the previous artifact is put back when the new one
    never got its manifest, and the save temporaries of processes that died are removed."""
    recover_published(directory, MANIFEST)


def _artifact_files(directory: str) -> list[str]:
    """The files of the artifact now in `directory` (from its manifest; none when there is no readable one)."""
    try:
        manifest = read_manifest(directory)
    except (OSError, ValueError):
        return []
    listed = manifest.get("files")
    if isinstance(listed, list) and all(isinstance(n, str) and n == os.path.basename(n) and n for n in listed):
        return list(listed)
    stem, ext = os.path.splitext(manifest["file"])
    return [manifest["file"], f"{stem}.bin"] if ext == ".xml" else [manifest["file"]]


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The checked manifest of the artifact in `directory` (read where `artifact_dir` says it is whole);
    FileNotFoundError or ValueError naming what is missing or damaged."""
    directory = artifact_dir(directory)
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
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nested too deeply
        raise ValueError(f"the artifact manifest {path!r} is damaged (not valid JSON: {first_line(e)}); "
                         "re-save the artifact") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get(RUNTIME_KEY) not in RUNNERS:
        fmt = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        runtime = manifest.get(RUNTIME_KEY) if isinstance(manifest, dict) else None
        raise ValueError(f"{path!r} is not a torchspeed inference manifest (format {fmt!r}, runtime {runtime!r})")
    bad = [k for k in ("file", "precision") if not isinstance(manifest.get(k), str) or not manifest.get(k)]
    if bad or os.path.basename(manifest["file"]) != manifest["file"]:
        raise ValueError(f"the artifact manifest {path!r} is damaged: "
                         f"{', '.join(bad) + ' missing' if bad else 'file must name a file in the artifact directory'}; "
                         "re-save the artifact")
    if not os.path.isfile(os.path.join(directory, manifest["file"])):
        raise FileNotFoundError(f"the artifact in {directory!r} is incomplete: {manifest['file']!r} is missing "
                                "(an interrupted save? re-save the artifact)")
    return manifest
