"""The variants `optimize` chooses from: a registry (`VARIANTS`) of ways to run a model, what each
needs to be built (`BuildContext`, with the ONNX export made once on first need), and why one is
skipped on this machine for this model (`skip_reason`).

Each `Variant` has a name, a label saying what it is, a `build(context) -> Runner` and an
`applicable(machine, model)` that returns None or why it is skipped. Eager fp32 (the baseline), Conv+BN
fused, bf16 / fp16 + channels_last, torch.compile, ONNX Runtime fp32 / INT8 (static QDQ, or dynamic for
Linear-heavy models), OpenVINO fp32 / bf16 / INT8 (NNCF), and ONNX Runtime's CUDA and TensorRT
providers where a GPU has them.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed.batches import BatchFormat
from torchspeed.infer.export import OnnxGraph, convert_onnx_fp16, export_onnx, fp16_converter
from torchspeed.infer.quantize import quantize_onnx_dynamic, quantize_onnx_static, quantize_openvino
from torchspeed.infer.runners import RUNTIMES, OpenVINORunner, OrtRunner, Runner, TorchRunner, available_runtimes
from torchspeed.models import ModelSpec
from torchspeed.runtime import default_precision

__all__ = ["Variant", "VARIANTS", "Machine", "ModelFacts", "BuildContext", "OnnxExport", "skip_reason", "candidates",
           "BASELINE", "NO_CALIBRATION"]

BASELINE = "eager fp32"
NO_CALIBRATION = "no calibration data (pass calib_data for INT8)"


@dataclass(frozen=True)
class Machine:
    """What this machine offers the search: each runtime (None when usable, else why not), the
    device the model runs on (candidates run there), and whether that device runs bf16 natively."""

    runtimes: dict[str, str | None]
    native_bf16: bool
    device: str = "cpu"

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def detect(cls, device: str | torch.device = "cpu") -> Machine:
        device = torch.device(device)
        if device.type == "cuda":
            native = bool(torch.cuda.is_bf16_supported())
        else:
            native = default_precision("cpu").name == "bf16"
        return cls(available_runtimes(), native, str(device))


@dataclass(frozen=True)
class ModelFacts:
    """What a variant's applicability depends on besides the machine: the model and what came with it."""

    linear_heavy: bool     # more weights in Linear/LSTM/attention than in convolutions
    calibrated: bool       # calibration data was given
    calibration: str       # the calibration method asked for
    onnx_file: bool = False  # the model is an ONNX file: only ONNX-based variants apply


class OnnxExport:
    """The export step: the ONNX file every ONNX Runtime / OpenVINO variant starts from, made once on
    first need; a failed export is remembered, so each variant that needs it fails with its message."""

    def __init__(self, model: nn.Module | None, example: Any, path: str, exporter: str,
                 say: Callable[[str], Any], batch_format: BatchFormat | None = None):
        self.model, self.example, self.target, self.exporter, self.say = model, example, path, exporter, say
        self.batch_format = batch_format
        self.result: dict[str, Any] | None = None  # ExportResult.to_dict() once exported
        self.seconds: float | None = None
        self.error: str | None = None

    @classmethod
    def given(cls, graph: OnnxGraph) -> OnnxExport:
        """The user's own ONNX file (read once by `read_onnx`): nothing to export."""
        done = cls(None, None, graph.path, "given", lambda _: None)
        done.result = {"path": graph.path, "exporter": "given", "fallback_reason": None,
                       "input_names": graph.input_names}
        return done

    def path(self) -> str:
        """The ONNX file, exported on the first call; RuntimeError with the export's message once it failed."""
        if self.error is not None:
            raise RuntimeError(f"needs the ONNX export, which failed: {self.error}")
        if self.result is None:
            t0 = time.perf_counter()
            try:
                exported = export_onnx(self.model, self.example, self.target, exporter=self.exporter,
                                       batch_format=self.batch_format)
            except Exception as e:  # noqa: BLE001 - remembered; every ONNX variant fails with it
                self.error = str(e)
                raise
            self.seconds = time.perf_counter() - t0
            self.result = exported.to_dict()
            self.say(f"exported ONNX with the {exported.exporter} exporter ({self.seconds:.0f} s)")
        return self.result["path"]


@dataclass
class BuildContext:
    """Everything a variant's `build` needs: the model, the example, the shared settings, the export."""

    model: nn.Module | None  # None when optimizing an ONNX file
    example: Any             # the model's inputs: a tensor, or a dict / tuple of tensors
    threads: int
    spec: ModelSpec | None   # how to rebuild the model, for a saved torch artifact
    workdir: str
    onnx: OnnxExport
    calib_data: Iterable[Any] | None = None
    calibration: str = "minmax"
    max_calib_samples: int = 256
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    batch_format: BatchFormat = field(default_factory=BatchFormat)

    def torch(self, recipe: dict[str, Any]) -> Runner:
        return TorchRunner(self.model, recipe, self.threads, self.spec, self.batch_format, example=self.example)

    def low_precision(self, precision: str, **more: Any) -> dict[str, Any]:
        """The torch recipe for a bf16/fp16 variant: fused, autocast, channels_last for images."""
        images = isinstance(self.example, torch.Tensor) and self.example.ndim == 4
        return {"fuse": True, "precision": precision, "channels_last": images, **more}

    def onnxruntime(self, precision: str, provider: str = "cpu") -> Runner:
        """ONNX Runtime on `provider` ('cpu', 'cuda', 'tensorrt'): fp32, int8 (static), int8-dynamic,
        or fp16 (an fp16 ONNX model on CUDA; TensorRT makes its own fp16 engine from the fp32 model)."""
        src = self.onnx.path()
        if precision == "int8":
            dst = os.path.join(self.workdir, "model-int8-static.onnx")
            quantize_onnx_static(src, dst, self.calib_data, self.calibration, max_samples=self.max_calib_samples,
                                 batch_format=self.batch_format, input_names=self.onnx.result["input_names"],
                                 temp_dir=self.workdir)
            return OrtRunner(dst, "int8", self.threads)
        if precision == "int8-dynamic":
            dst = os.path.join(self.workdir, "model-int8-dynamic.onnx")
            return OrtRunner(quantize_onnx_dynamic(src, dst, temp_dir=self.workdir), "int8-dynamic", self.threads)
        if precision == "fp16" and provider == "cuda":
            src = convert_onnx_fp16(src, os.path.join(self.workdir, "model-fp16.onnx"))
        device = self.device if provider != "cpu" else None
        return OrtRunner(src, precision, self.threads, provider, device=device)

    def openvino(self, precision: str) -> Runner:
        """OpenVINO on the CPU at `precision` (its inference precision hint), or INT8 quantized by NNCF."""
        if precision == "int8":
            quantized = quantize_openvino(self.onnx.path(), self.calib_data, self.calibration, self.max_calib_samples,
                                          batch_format=self.batch_format)
            return OpenVINORunner(quantized, "int8", self.threads)
        return OpenVINORunner(self.onnx.path(), precision, self.threads)


def _always(machine: Machine, model: ModelFacts) -> str | None:
    return None


@dataclass(frozen=True)
class Variant:
    """One way to run the model: `build(context) -> Runner`; `applicable(machine, model)` is None when
    it should be built here, else why it is skipped. `runtime` and `precision` are the row's labels
    (the precision may carry a qualifier, 'int8-dynamic'); `label` says what the variant is."""

    name: str
    runtime: str
    precision: str
    label: str
    build: Callable[[BuildContext], Runner]
    applicable: Callable[[Machine, ModelFacts], str | None] = _always
    baseline: bool = False
    device: str | None = None  # "cpu": a CPU runtime; "cuda": ONNX Runtime's GPU providers; None: the model's

    @property
    def runtime_key(self) -> str:
        """The name `runtimes=` and `available_runtimes()` use for this variant's runtime."""
        return "tensorrt" if self.runtime.startswith("onnxruntime-tensorrt") else self.runtime

    @property
    def onnx_based(self) -> bool:
        """Built from the ONNX file (ONNX Runtime, OpenVINO): the variants that compete for an ONNX model."""
        return self.runtime.startswith(("onnxruntime", "openvino"))

    @property
    def precision_key(self) -> str:
        """The name `precisions=` uses: fp32, bf16, fp16 or int8."""
        return self.precision.split("-")[0].split("+")[0]

    @property
    def exact(self) -> bool:
        return self.precision == "fp32"


def _compile_precision(wanted: str) -> Callable[[Machine, ModelFacts], str | None]:
    # torch.compile costs a minute of compiling per model here: one precision only, the faster kind.
    def applicable(machine: Machine, model: ModelFacts) -> str | None:
        chosen = "bf16" if machine.native_bf16 else "fp32"
        where = "this GPU" if machine.cuda else "this CPU"
        return None if wanted == chosen else f"torch.compile is tried at one precision only, {chosen} on {where}"
    return applicable


def _needs_calibration(machine: Machine, model: ModelFacts) -> str | None:
    return None if model.calibrated else NO_CALIBRATION


def _needs_linear_heavy(machine: Machine, model: ModelFacts) -> str | None:
    return None if model.linear_heavy else "static INT8 suits convolutional models better"


def _nncf_calibration(machine: Machine, model: ModelFacts) -> str | None:
    if not model.calibrated:
        return NO_CALIBRATION
    if model.calibration != "minmax":
        return f"NNCF has no {model.calibration!r} calibration; only ONNX Runtime offers it"
    return None


def _wrong_device(variant: Variant, machine: Machine) -> str | None:
    """Why a variant bound to one kind of device does not run for a model on the other (candidates run
    on the model's device), or None."""
    if variant.device == "cpu" and machine.cuda:
        return f"runs on the CPU; the model is on {machine.device} (candidates run on the model's device)"
    if variant.device == "cuda" and not machine.cuda:
        return "the model is on the CPU; a model on a CUDA device (or device='cuda') tries ONNX Runtime's GPU providers"
    return None


def _fp16_onnx(machine: Machine, model: ModelFacts) -> str | None:
    return None if fp16_converter() is not None else "no fp16 ONNX converter: pip install onnxconverter-common"


VARIANTS: tuple[Variant, ...] = (
    Variant(BASELINE, "torch", "fp32", "PyTorch eager, fp32", lambda c: c.torch({}), baseline=True),
    Variant("fused fp32", "torch", "fp32", "Conv+BN folded (FX), fp32", lambda c: c.torch({"fuse": True})),
    Variant("bf16 + channels_last", "torch", "bf16", "fused, bf16 autocast, channels_last",
            lambda c: c.torch(c.low_precision("bf16"))),
    Variant("fp16 + channels_last", "torch", "fp16", "fused, fp16 autocast, channels_last",
            lambda c: c.torch(c.low_precision("fp16"))),
    Variant("torch.compile bf16", "torch.compile", "bf16", "inductor, freezing, bf16 + channels_last",
            lambda c: c.torch(c.low_precision("bf16", compile=True)), _compile_precision("bf16")),
    Variant("torch.compile fp32", "torch.compile", "fp32", "inductor, freezing, fused fp32",
            lambda c: c.torch({"fuse": True, "compile": True}), _compile_precision("fp32")),
    Variant("onnxruntime fp32", "onnxruntime", "fp32", "ONNX, ONNX Runtime CPU, fp32",
            lambda c: c.onnxruntime("fp32"), device="cpu"),
    Variant("onnxruntime int8", "onnxruntime", "int8", "ONNX Runtime quantize_static, QDQ per-channel U8S8",
            lambda c: c.onnxruntime("int8"), _needs_calibration, device="cpu"),
    Variant("onnxruntime int8 dynamic", "onnxruntime", "int8-dynamic", "ONNX Runtime quantize_dynamic (MatMul/Gemm)",
            lambda c: c.onnxruntime("int8-dynamic"), _needs_linear_heavy, device="cpu"),
    Variant("openvino fp32", "openvino", "fp32", "OpenVINO CPU, inference precision f32",
            lambda c: c.openvino("fp32"), device="cpu"),
    Variant("openvino bf16", "openvino", "bf16", "OpenVINO CPU, inference precision bf16",
            lambda c: c.openvino("bf16"), device="cpu"),
    Variant("openvino int8", "openvino", "int8", "NNCF nncf.quantize (PTQ), OpenVINO CPU",
            lambda c: c.openvino("int8"), _nncf_calibration, device="cpu"),
    Variant("onnxruntime-cuda fp32", "onnxruntime-cuda", "fp32", "ONNX Runtime CUDA provider, fp32, IO binding",
            lambda c: c.onnxruntime("fp32", "cuda"), device="cuda"),
    Variant("onnxruntime-cuda fp16", "onnxruntime-cuda", "fp16",
            "ONNX converted to fp16 (float32 inputs/outputs), ONNX Runtime CUDA provider, IO binding",
            lambda c: c.onnxruntime("fp16", "cuda"), _fp16_onnx, device="cuda"),
    Variant("onnxruntime-tensorrt fp16", "onnxruntime-tensorrt", "fp16",
            "ONNX Runtime TensorRT provider, trt_fp16_enable, engine cache, IO binding",
            lambda c: c.onnxruntime("fp16", "tensorrt"), device="cuda"),
)


def skip_reason(variant: Variant, machine: Machine, model: ModelFacts, runtimes: frozenset[str] | None = None,
                precisions: frozenset[str] | None = None) -> str | None:
    """None when `variant` is to be built, else why not: not requested (`runtimes` / `precisions`, None
    for 'auto'), runtime missing here, not worth it by default on this machine, or not applicable to
    this model. The baseline is always built; extra candidates whenever they apply."""
    if variant.baseline:
        return None
    known = variant.runtime_key in RUNTIMES
    if model.onnx_file and known and not variant.onnx_based:
        return "the model is an ONNX file: PyTorch variants need the nn.Module"
    if known and runtimes is not None and variant.runtime_key not in runtimes:
        return "runtime not requested"
    if known and precisions is not None and variant.precision_key not in precisions:
        return "precision not requested"
    wrong = _wrong_device(variant, machine)  # before how to install a runtime that would not run anyway
    if wrong:
        return wrong
    if known and machine.runtimes.get(variant.runtime_key):
        return machine.runtimes[variant.runtime_key]
    if known and precisions is None:
        reason = _auto_precision_skip(variant.precision_key, machine, model)
        if reason:
            return reason
    return variant.applicable(machine, model)


def _auto_precision_skip(precision: str, machine: Machine, model: ModelFacts) -> str | None:
    """Why `precisions='auto'` leaves out a precision here (it can still be asked for by name)."""
    if precision == "bf16" and not machine.native_bf16:
        return f"no native bf16 on this {'GPU' if machine.cuda else 'CPU'} (would be emulated, slow)"
    if precision == "fp16" and not machine.cuda:
        return "fp16 is emulated on CPU; ask for it with precisions=['fp16']"
    if precision == "int8" and not (model.calibrated or model.linear_heavy):
        return NO_CALIBRATION
    return None


def candidates(device: torch.device, onnx_file: bool = False,
               extra: dict[str, Callable[[Any], Any]] | None = None, source: Any = None,
               batch_format: BatchFormat | None = None) -> list[Variant]:
    """The variants to try, in table order: the baseline first (eager fp32; for an ONNX file, ONNX
    Runtime fp32 on the file, on `device`), the registry, then `extra` (name -> function of `source`,
    the model or the .onnx path, returning a module or callable; judged as lossy)."""
    variants = list(VARIANTS)
    if onnx_file:
        kind = "cuda" if device.type == "cuda" else "cpu"
        name = "onnxruntime-cuda fp32" if kind == "cuda" else "onnxruntime fp32"
        base = Variant(name, "onnxruntime" if kind == "cpu" else "onnxruntime-cuda", "fp32",
                       "your ONNX model, ONNX Runtime fp32 (the reference)", lambda c: c.onnxruntime("fp32", kind),
                       baseline=True)
        variants = [base] + [v for v in variants if not v.baseline and v.name != name]
    variants += [Variant(name, "custom", "custom", "your variant",
                         lambda c, fn=fn: _CallableRunner(fn(source), batch_format))
                 for name, fn in (extra or {}).items()]
    return variants


class _CallableRunner(Runner):
    """A user-supplied variant (module or callable), for `extra_candidates`."""

    runtime, precision = "custom", "custom"

    def __init__(self, fn: Any, batch_format: BatchFormat | None = None):
        self.fn = fn.eval() if isinstance(fn, nn.Module) else fn
        self.format = batch_format or BatchFormat()

    def __call__(self, x: Any) -> torch.Tensor:
        if not isinstance(x, (torch.Tensor, dict, tuple, list)):
            x = torch.as_tensor(x)
        with torch.inference_mode():
            return self.format.logits_of(self.format.forward(self.fn, x))

    def size_bytes(self) -> int:
        return 0

    def save(self, directory: str | os.PathLike, manifest_extra: dict[str, Any] | None = None) -> str:
        raise ValueError("a custom variant cannot be saved as an artifact")
