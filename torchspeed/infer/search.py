"""`optimize`: build every inference variant this machine can run, verify each, judge each, time each,
keep the fastest that passed.

The variants are a registry (`VARIANTS`): each `Variant` has a name, a label saying what it is, a
`build(context) -> Runner` and an `applicable(machine, model)` that returns None or why it is skipped.
Eager fp32 (the baseline), Conv+BN fused, bf16 / fp16 + channels_last, torch.compile, ONNX Runtime
fp32 / INT8 (static QDQ, or dynamic for Linear-heavy models), OpenVINO fp32 / bf16 / INT8 (NNCF), and
ONNX Runtime's TensorRT provider where a GPU has it.

The search runs in separate steps:
- export: the ONNX file every ONNX Runtime / OpenVINO variant starts from, made once on first need
  (`OnnxExport`); a failed export fails those variants only;
- verification (`verify`): each variant's outputs against eager fp32 on the same inputs. Exact
  rewrites (fp32 everywhere) must match (max relative error <= `exact_tol`); lossy ones (bf16,
  fp16, int8) without `eval_fn` must agree (relative L2 error <= `max_output_error`);
- judging (`judge`): with `eval_fn`, lossy variants are scored on held-out data against the fp32
  model and rejected when the metric drops by more than `max_metric_drop`;
- timing (`time_variants`): torchspeed.measure, interleaved, at every batch size, with the same
  explicit thread count for every runtime; torch's own thread count is restored afterwards.
A variant whose build fails (an operator a runtime does not support, a missing runtime) is recorded
as failed with its message and the search goes on. Every variant built logs one INFO line on
`torchspeed.infer.search` (its p50 at each batch size, its metric drop, passed or why not), and the
choice logs one more.
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed import runtime
from torchspeed.args import as_list, progress_fn
from torchspeed.batches import BatchFormat, batch_size, map_tensors, to_device
from torchspeed.infer.export import OnnxGraph
from torchspeed.infer.precision import as_fp32, output_error
from torchspeed.models import ModelSpec, spec_of
from torchspeed.infer.runtimes import (
    Runner,
    TorchRunner,
    available_backends,
    module_device,
)
from torchspeed.runtime import default_precision, usable_cores

__all__ = ["optimize", "OptimizeResult", "VariantResult", "Variant", "VARIANTS", "Machine", "ModelFacts",
           "BuildContext", "OnnxExport", "BACKENDS"]

log = logging.getLogger(__name__)

BACKENDS = ("torch", "torch.compile", "onnxruntime", "onnxruntime-cuda", "openvino", "tensorrt")
BASELINE = "eager fp32"
NO_CALIBRATION = "no calibration data (pass calib_data for INT8)"


# ----------------------------------------------------------------------------------------- results
@dataclass
class VariantResult:
    """One row of the table: a variant, whether it passed its checks, and what it measured."""

    name: str
    backend: str
    precision: str
    exact: bool
    label: str = ""
    status: str = "pending"        # ok | rejected | failed | skipped
    reason: str = ""
    max_rel_error: float | None = None
    rel_l2_error: float | None = None
    metric: float | None = None
    metric_drop: float | None = None
    latency_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # batch -> p50/p90/throughput
    size_mb: float | None = None
    build_s: float | None = None
    runner: Runner | None = field(default=None, repr=False)
    input_shape: list[int] | dict[str, list[int]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "ok"

    def p50_ms(self, batch: int) -> float:
        return self.latency_ms.get(batch, {}).get("p50_ms", math.nan)

    def __call__(self, x: Any) -> torch.Tensor:
        if self.runner is None:
            raise ValueError(f"variant {self.name!r} has no runnable model ({self.status}: {self.reason})")
        return self.runner(x)

    def save(self, directory: str | os.PathLike) -> str:
        """Write a self-describing artifact (model file + manifest.json) that `ts.infer.load` runs."""
        if self.runner is None:
            raise ValueError(f"variant {self.name!r} cannot be saved: {self.status}: {self.reason}")
        directory = os.fspath(directory)
        self.runner.save(directory)
        import json

        from torchspeed.atomic import write_json
        from torchspeed.infer.runtimes import MANIFEST

        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        if isinstance(self.input_shape, dict):
            shape: Any = {k: [None, *v[1:]] for k, v in self.input_shape.items()}
        else:
            shape = [None, *self.input_shape[1:]]
        manifest.update(name=self.name, input_shape=shape, measured=self.to_dict())
        write_json(os.path.join(directory, MANIFEST), manifest)
        return directory

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "backend": self.backend, "precision": self.precision, "exact": self.exact,
            "label": self.label, "status": self.status, "reason": self.reason,
            "max_rel_error": self.max_rel_error, "rel_l2_error": self.rel_l2_error, "metric": self.metric,
            "metric_drop": self.metric_drop, "latency_ms": {str(b): v for b, v in self.latency_ms.items()},
            "size_mb": self.size_mb, "build_s": self.build_s, **({"extra": self.extra} if self.extra else {}),
        }


@dataclass
class OptimizeResult:
    """The full table (rejected, failed and skipped variants too) and `.best`, the chosen row."""

    table: list[VariantResult]
    batch_sizes: tuple[int, ...]
    objective: str
    baseline_metric: float | None
    threads: int
    unavailable: dict[str, str]
    _workdir: Any = field(default=None, repr=False)  # keeps exported files alive while the result lives

    @property
    def best(self) -> VariantResult | None:
        """The passed, timed row that wins the objective: lowest p50 at the first batch size
        ('latency') or highest throughput at the largest ('throughput'); None if none passed."""
        passed = [r for r in self.table if r.passed and r.latency_ms]
        if self.objective == "latency":
            return min(passed, key=lambda r: r.p50_ms(self.batch_sizes[0]), default=None)
        big = max(self.batch_sizes)
        return max(passed, key=lambda r: r.latency_ms[big]["throughput"] or 0.0, default=None)

    def __getitem__(self, name: str) -> VariantResult:
        for r in self.table:
            if r.name == name:
                return r
        raise KeyError(f"no variant named {name!r}; have {[r.name for r in self.table]}")

    def fastest_at(self, batch: int, passed_only: bool = True) -> VariantResult | None:
        """The row with the lowest p50 at `batch` (among those that passed, unless `passed_only=False`)."""
        pool = [r for r in self.table if (r.passed or not passed_only) and not math.isnan(r.p50_ms(batch))]
        return min(pool, key=lambda r: r.p50_ms(batch), default=None)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "best": best.name if best else None, "objective": self.objective,
            "batch_sizes": list(self.batch_sizes), "baseline_metric": self.baseline_metric,
            "threads": self.threads, "unavailable": self.unavailable,
            "candidates": [r.to_dict() for r in self.table],
        }

    def rows(self) -> list[list[Any]]:
        base = self.table[0] if self.table else None
        best = self.best
        out = []
        for r in self.table:
            if r.status == "skipped":
                continue
            row: list[Any] = [r.name + (" *" if r is best else ""), r.status]
            for b in self.batch_sizes:
                p = r.p50_ms(b)
                row += [None if math.isnan(p) else p,
                        None if (math.isnan(p) or base is None or math.isnan(base.p50_ms(b))) else base.p50_ms(b) / p]
            row += [r.metric_drop if r.metric_drop is not None else r.rel_l2_error, r.size_mb,
                    r.reason[:70] if r.reason else ""]
            out.append(row)
        return out

    def columns(self) -> list[str]:
        cols = ["variant", "status"]
        for b in self.batch_sizes:
            cols += [f"p50 ms (b{b})", f"x (b{b})"]
        return cols + ["drop / err", "MB", "note"]

    def print(self, console: Any = None) -> None:
        from rich.console import Console

        from torchspeed.tables import print_table

        console = console or Console()
        best = self.best
        print_table(f"optimize: {self.threads} threads, best = {best.name if best else 'none'}",
                    self.columns(), self.rows(), console)
        skipped = [f"{r.name} ({r.reason})" for r in self.table if r.status == "skipped"]
        if skipped:
            console.print("skipped: " + "; ".join(skipped), highlight=False)


# ----------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Machine:
    """What this machine offers the search: each backend (None when usable, else why not), the
    device the model runs on (candidates run there), and whether that device runs bf16 natively."""

    backends: dict[str, str | None]
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
        return cls(available_backends(), native, str(device))


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
                 progress: Callable[[str], None], batch_format: BatchFormat | None = None):
        self.model, self.example, self.target, self.exporter, self.progress = model, example, path, exporter, progress
        self.batch_format = batch_format
        self.report: dict[str, Any] | None = None
        self.seconds: float | None = None
        self.error: str | None = None

    @classmethod
    def given(cls, graph: OnnxGraph) -> OnnxExport:
        """The user's own ONNX file (read once by `read_onnx`): nothing to export."""
        done = cls(None, None, graph.path, "given", lambda _: None)
        done.report = {"path": graph.path, "exporter": "given", "fallback_reason": None,
                       "input_names": graph.input_names}
        return done

    def path(self) -> str:
        if self.error is not None:
            raise RuntimeError(f"needs the ONNX export, which failed: {self.error}")
        if self.report is None:
            from torchspeed.infer.export import export_onnx

            t0 = time.perf_counter()
            try:
                rep = export_onnx(self.model, self.example, self.target, exporter=self.exporter,
                                  batch_format=self.batch_format)
            except Exception as e:  # noqa: BLE001 - remembered; every ONNX variant fails with it
                self.error = str(e)
                raise
            self.seconds = time.perf_counter() - t0
            self.report = rep.to_dict()
            self.progress(f"exported ONNX with the {rep.exporter} exporter ({self.seconds:.0f} s)")
        return self.report["path"]


@dataclass
class BuildContext:
    """Everything a variant's `build` needs: the model, the example, the shared settings, the export."""

    model: nn.Module | None  # None when optimizing an ONNX file
    example: Any             # the model's inputs: a tensor, or a dict / tuple of tensors
    threads: int
    arch: ModelSpec | None
    workdir: str
    onnx: OnnxExport
    calib_data: Iterable[Any] | None = None
    calibration: str = "minmax"
    max_calib_samples: int = 256
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    batch_format: BatchFormat = field(default_factory=BatchFormat)

    def torch(self, recipe: dict[str, Any]) -> Runner:
        return TorchRunner(self.model, recipe, self.threads, self.arch, self.batch_format)

    def low_precision(self, precision: str, **more: Any) -> dict[str, Any]:
        """The torch recipe for a bf16/fp16 variant: fused, autocast, channels_last for images."""
        images = isinstance(self.example, torch.Tensor) and self.example.ndim == 4
        return {"fuse": True, "precision": precision, "channels_last": images, **more}

    def onnxruntime(self, precision: str, provider: str = "cpu") -> Runner:
        """ONNX Runtime on `provider` ('cpu', 'cuda', 'tensorrt'): fp32, int8 (static), int8-dynamic,
        or fp16 (an fp16 ONNX model on CUDA; TensorRT makes its own fp16 engine from the fp32 model)."""
        from torchspeed.infer.quantize import (
            quantize_onnx_dynamic,
            quantize_onnx_static,
        )
        from torchspeed.infer.runtimes import OrtRunner

        src = self.onnx.path()
        if precision == "int8":
            dst = os.path.join(self.workdir, "model-int8-static.onnx")
            quantize_onnx_static(src, dst, self.calib_data, self.calibration, max_samples=self.max_calib_samples,
                                 batch_format=self.batch_format, input_names=self.onnx.report["input_names"])
            return OrtRunner(dst, "int8", self.threads)
        if precision == "int8-dynamic":
            dst = os.path.join(self.workdir, "model-int8-dynamic.onnx")
            return OrtRunner(quantize_onnx_dynamic(src, dst), "int8-dynamic", self.threads)
        if precision == "fp16" and provider == "cuda":
            from torchspeed.infer.export import convert_onnx_fp16

            src = convert_onnx_fp16(src, os.path.join(self.workdir, "model-fp16.onnx"))
        device = self.device if provider != "cpu" else None
        return OrtRunner(src, precision, self.threads, provider, device=device)

    def openvino(self, precision: str) -> Runner:
        from torchspeed.infer.runtimes import OpenVINORunner

        if precision == "int8":
            from torchspeed.infer.quantize import quantize_openvino

            quantized = quantize_openvino(self.onnx.path(), self.calib_data, self.calibration, self.max_calib_samples,
                                          batch_format=self.batch_format)
            return OpenVINORunner(quantized, "int8", self.threads)
        return OpenVINORunner(self.onnx.path(), precision, self.threads)


def _always(machine: Machine, model: ModelFacts) -> str | None:
    return None


@dataclass(frozen=True)
class Variant:
    """One way to run the model: `build(context) -> Runner`; `applicable(machine, model)` is None when
    it should be built here, else why it is skipped. `backend` and `precision` are the row's labels
    (the precision may carry a qualifier, 'int8-dynamic'); `label` says what the variant is."""

    name: str
    backend: str
    precision: str
    label: str
    build: Callable[[BuildContext], Runner]
    applicable: Callable[[Machine, ModelFacts], str | None] = _always
    baseline: bool = False

    @property
    def backend_key(self) -> str:
        """The name `backends=` and `available_backends()` use for this variant's runtime."""
        return "tensorrt" if self.backend.startswith("onnxruntime-tensorrt") else self.backend

    @property
    def onnx_based(self) -> bool:
        """Built from the ONNX file (ONNX Runtime, OpenVINO): the variants that compete for an ONNX model."""
        return self.backend.startswith(("onnxruntime", "openvino"))

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


def _on_cpu(applicable: Callable[[Machine, ModelFacts], str | None] = _always) -> Callable[[Machine, ModelFacts], str | None]:
    """A CPU runtime: left out for a model on a GPU (candidates run on the model's device)."""
    def check(machine: Machine, model: ModelFacts) -> str | None:
        if machine.cuda:
            return f"runs on the CPU; the model is on {machine.device} (candidates run on the model's device)"
        return applicable(machine, model)
    return check


def _on_gpu(machine: Machine, model: ModelFacts) -> str | None:
    """ONNX Runtime's GPU providers: for a model on a GPU (their availability is checked as a backend)."""
    if not machine.cuda:
        return "the model is on the CPU; a model on a CUDA device (or device='cuda') tries ONNX Runtime's GPU providers"
    return None


def _fp16_onnx(machine: Machine, model: ModelFacts) -> str | None:
    from torchspeed.infer.export import fp16_converter

    return _on_gpu(machine, model) or (None if fp16_converter() is not None else
                                       "no fp16 ONNX converter: pip install onnxconverter-common")

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
            lambda c: c.onnxruntime("fp32"), _on_cpu()),
    Variant("onnxruntime int8", "onnxruntime", "int8", "ONNX Runtime quantize_static, QDQ per-channel U8S8",
            lambda c: c.onnxruntime("int8"), _on_cpu(_needs_calibration)),
    Variant("onnxruntime int8 dynamic", "onnxruntime", "int8-dynamic", "ONNX Runtime quantize_dynamic (MatMul/Gemm)",
            lambda c: c.onnxruntime("int8-dynamic"), _on_cpu(_needs_linear_heavy)),
    Variant("openvino fp32", "openvino", "fp32", "OpenVINO CPU, inference precision f32",
            lambda c: c.openvino("fp32"), _on_cpu()),
    Variant("openvino bf16", "openvino", "bf16", "OpenVINO CPU, inference precision bf16",
            lambda c: c.openvino("bf16"), _on_cpu()),
    Variant("openvino int8", "openvino", "int8", "NNCF nncf.quantize (PTQ), OpenVINO CPU",
            lambda c: c.openvino("int8"), _on_cpu(_nncf_calibration)),
    Variant("onnxruntime-cuda fp32", "onnxruntime-cuda", "fp32", "ONNX Runtime CUDA provider, fp32, IO binding",
            lambda c: c.onnxruntime("fp32", "cuda"), _on_gpu),
    Variant("onnxruntime-cuda fp16", "onnxruntime-cuda", "fp16",
            "ONNX converted to fp16 (float32 inputs/outputs), ONNX Runtime CUDA provider, IO binding",
            lambda c: c.onnxruntime("fp16", "cuda"), _fp16_onnx),
    Variant("onnxruntime-tensorrt fp16", "onnxruntime-tensorrt", "fp16",
            "ONNX Runtime TensorRT provider, trt_fp16_enable, engine cache, IO binding",
            lambda c: c.onnxruntime("fp16", "tensorrt"), _on_gpu),
)


@dataclass(frozen=True)
class _Request:
    """What the caller asked for: backends and precisions (None = auto)."""

    backends: frozenset[str] | None
    precisions: frozenset[str] | None

    def skip_reason(self, variant: Variant, machine: Machine, model: ModelFacts) -> str | None:
        """None when `variant` is to be built, else why not: not requested, runtime missing here,
        not worth it by default on this machine, or not applicable to this model."""
        if variant.baseline:
            return None  # the baseline is always measured
        if model.onnx_file and variant.backend_key in BACKENDS and not variant.onnx_based:
            return "the model is an ONNX file: PyTorch variants need the nn.Module"
        if variant.backend_key in BACKENDS:  # extra_candidates are always built
            if self.backends is not None and variant.backend_key not in self.backends:
                return "backend not requested"
            if self.precisions is not None and variant.precision_key not in self.precisions:
                return "precision not requested"
            if machine.backends.get(variant.backend_key):
                return machine.backends[variant.backend_key]
            if self.precisions is None:
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


# ----------------------------------------------------------------------------------------- the steps
def _linear_heavy(model: nn.Module) -> bool:
    """More weights in Linear/LSTM/attention than in convolutions: dynamic INT8 pays off there."""
    lin = sum(p.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.LSTM, nn.GRU, nn.MultiheadAttention))
              for p in m.parameters(recurse=False))
    conv = sum(p.numel() for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd) for p in m.parameters(recurse=False))
    return lin > conv


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:240]}"


def _batch_of(example: Any, b: int, gen: torch.Generator) -> Any:
    """The example inputs at batch `b` (a tensor, or each tensor of a dict / tuple): random rows added
    for float inputs, rows repeated for ids and masks; on the example's device."""
    from torchspeed.infer.export import _grow

    return map_tensors(lambda t: _grow(as_fp32(t), b, gen), example)


def _concat(parts: list[Any]) -> Any:
    """Batches of inputs (arrays or tensors; dicts / tuples of them) joined along the batch dimension."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (tuple, list)):
        return tuple(_concat([p[i] for p in parts]) for i in range(len(first)))
    return torch.cat([torch.as_tensor(p) for p in parts])


def _shape_of(x: Any) -> Any:
    """Shapes of the inputs, for the table and the manifest: a list, or a dict of lists."""
    shapes = map_tensors(lambda t: list(t.shape), x)
    return {f"input_{i}": s for i, s in enumerate(shapes)} if isinstance(x, (tuple, list)) else shapes


def _resolve(choice: str | Sequence[str], allowed: Sequence[str], what: str) -> frozenset[str] | None:
    """A list or comma string of names ('torch,onnxruntime'), or 'auto' (None)."""
    items = as_list(choice, name=f"{what}s")
    if items == ["auto"]:
        return None
    bad = sorted(set(items) - set(allowed))
    if bad:
        raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(allowed)} or 'auto'")
    return frozenset(items)


def build_variant(variant: Variant, ctx: BuildContext, verify_x: torch.Tensor) -> tuple[VariantResult, Any]:
    """The build step: the row and the variant's outputs on `verify_x` (None when the build failed)."""
    row = VariantResult(variant.name, variant.backend, variant.precision, variant.exact, variant.label,
                        input_shape=_shape_of(ctx.example))
    t0 = time.perf_counter()
    try:
        row.runner = variant.build(ctx)
        fallback = getattr(row.runner, "fallback", None)
        if fallback:  # ONNX Runtime ran another provider than the one asked for: not this row's variant
            row.extra["providers"] = getattr(row.runner, "active", [])
            row.status, row.reason, row.runner = "failed", fallback, None
            return row, None
        out = row.runner(verify_x)
    except Exception as e:  # noqa: BLE001 - an unsupported op or runtime error fails this variant only
        row.status, row.reason, row.runner = "failed", _first_line(e), None
        return row, None
    if getattr(row.runner, "active", None):
        row.extra["providers"] = row.runner.active
    row.build_s = time.perf_counter() - t0
    try:
        row.size_mb = row.runner.size_bytes() / 2**20
    except Exception:  # noqa: BLE001 - size is informative only
        pass
    return row, out


def verify(row: VariantResult, out: Any, ref: torch.Tensor, exact_tol: float, max_output_error: float | None) -> None:
    """The verification step: output error against eager fp32. Exact variants must match within
    `exact_tol` (max relative error); lossy ones within `max_output_error` (relative L2) unless
    `max_output_error` is None (they are judged by their metric instead)."""
    try:
        err = output_error(out, ref)
    except ValueError as e:
        row.status, row.reason = "rejected", str(e)
        return
    row.max_rel_error, row.rel_l2_error = err["max_rel"], err["rel_l2"]
    row.status = "ok"
    if not math.isfinite(err["rel_l2"]):
        row.status, row.reason = "rejected", "outputs contain NaN or inf"
    elif row.exact:
        if err["max_rel"] > exact_tol:
            row.status, row.reason = "rejected", f"fp32 output error {err['max_rel']:.2e} > {exact_tol:.0e}"
    elif max_output_error is not None and err["rel_l2"] > max_output_error:
        row.status, row.reason = "rejected", f"output error (rel. L2) {err['rel_l2']:.3f} > {max_output_error}"


def judge(table: list[VariantResult], eval_fn: Callable[[Callable[[Any], Any]], float], max_metric_drop: float,
          progress: Callable[[str], None]) -> float:
    """The judging step: score the baseline (the table's first row) and every lossy row still ok with
    `eval_fn`; reject a row whose metric drops by more than `max_metric_drop`. Returns the baseline's."""
    progress(f"evaluating {table[0].name} (the reference metric)")
    baseline_metric = float(eval_fn(table[0].runner))
    table[0].metric, table[0].metric_drop = baseline_metric, 0.0
    for row in table[1:]:
        if row.status != "ok" or row.exact:
            continue
        progress(f"evaluating {row.name}")
        try:
            row.metric = float(eval_fn(row.runner))
        except Exception as e:  # noqa: BLE001
            row.status, row.reason = "failed", f"eval_fn raised {_first_line(e)}"
            continue
        row.metric_drop = baseline_metric - row.metric
        if not row.metric_drop <= max_metric_drop:
            row.status = "rejected"
            row.reason = (f"metric drop {row.metric_drop:.4f} > {max_metric_drop} "
                          f"({row.metric:.4f} vs {baseline_metric:.4f})")
    return baseline_metric


def time_variants(rows: list[VariantResult], example: Any, batch_sizes: Sequence[int], gen: torch.Generator,
                  repeats: int, min_time_s: float, progress: Callable[[str], None], device: Any = None) -> None:
    """The timing step: every row with a runner, interleaved against the baseline (the first row), at
    each batch size. Inputs are made on the model's device (`example`'s); on a GPU `compare`
    synchronises the device after each run, so asynchronous kernels are timed to their end."""
    from torchspeed.measure import compare  # the one timing tool (house rule)

    for b in batch_sizes if rows else ():
        progress(f"timing {len(rows)} variants at batch {b}")
        x = _batch_of(example, b, gen)
        contenders = {r.name: (lambda r=r: r.runner(x)) for r in rows}
        cmp = compare(contenders, baseline=rows[0].name, repeats=repeats, min_time_s=min_time_s, items=b,
                      cooldown_s=0.1, device=device)
        for r in rows:
            t = cmp[r.name]
            r.latency_ms[b] = {"p50_ms": t.median_s * 1e3, "p90_ms": t.p90_s * 1e3, "min_ms": t.min_s * 1e3,
                               "max_ms": t.max_s * 1e3, "throughput": t.throughput}


def _log_rows(result: OptimizeResult) -> None:
    """One INFO line per variant built (skipped ones at DEBUG) and one for the choice."""
    for r in result.table:
        if r.status == "skipped":
            log.debug("optimize: %s skipped: %s", r.name, r.reason)
            continue
        timed = ", ".join(f"{r.p50_ms(b):.3g} ms at batch {b}" for b in result.batch_sizes if r.latency_ms.get(b))
        parts = [f"p50 {timed}" if timed else "not timed"]
        if r.metric_drop is not None:
            parts.append(f"metric drop {r.metric_drop:.4f}")
        elif r.rel_l2_error is not None:
            parts.append(f"output error {r.rel_l2_error:.2e}")
        parts.append("passed" if r.passed else f"{r.status}: {r.reason}")
        log.info("optimize: %s: %s", r.name, "; ".join(parts))
    best = result.best
    if best is None:
        log.info("optimize: no variant chosen (%s)",
                 "no variant passed its checks" if any(r.latency_ms for r in result.table) else "nothing was timed")
        return
    b = result.batch_sizes[0] if result.objective == "latency" else max(result.batch_sizes)
    base = result.table[0].p50_ms(b)
    log.info("optimize: chose %s (objective %s): p50 %.3g ms at batch %d, %.2fx %s; %d of %d variants passed",
             best.name, result.objective, best.p50_ms(b), b, base / best.p50_ms(b), result.table[0].name,
             sum(r.passed for r in result.table), sum(r.status != "skipped" for r in result.table))


# ----------------------------------------------------------------------------------------- optimize
def optimize(
    model: nn.Module | str | os.PathLike,
    example_input: Any = None,
    calib_data: Iterable[Any] | None = None,
    eval_fn: Callable[[Callable[[Any], Any]], float] | None = None,
    max_metric_drop: float = 0.01,
    backends: str | Sequence[str] = "auto",
    precisions: str | Sequence[str] = "auto",
    batch_sizes: Sequence[int] = (1, 8),
    objective: str = "latency",
    *,
    batch_format: BatchFormat | dict | None = None,
    input_shape: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    calibration: str = "minmax",
    max_calib_samples: int = 256,
    max_output_error: float = 0.1,
    exact_tol: float | None = None,
    exporter: str = "auto",
    threads: int | None = None,
    repeats: int = 5,
    min_time_s: float = 0.05,
    extra_candidates: dict[str, Callable[[Any], Any]] | None = None,
    arch: ModelSpec | None = None,
    measure: bool = True,
    progress: bool | Callable[[str], None] = False,
) -> OptimizeResult:
    """Build, verify, judge and time every inference variant of `model`; return the table and the best.

    `model`: an `nn.Module` (candidates run on its device: a CUDA model is timed on CUDA, with the GPU
    precisions and ONNX Runtime's CUDA / TensorRT providers), or the path of an `.onnx` file (then the
    ONNX-based variants compete against ONNX Runtime fp32 on that file, on `device`, default CPU).
    `example_input` fixes the input shape (the batch dimension stays dynamic where the runtime allows):
    a tensor, or a dict / tuple of tensors for a model taking named or several inputs; for an ONNX
    file it is read from the graph, with `input_shape` for dynamic dimensions other than the batch.
    `batch_format` (`torchspeed.batches.BatchFormat`) says how the model is called and where its
    logits are (dict / dataclass outputs with `.logits` work by default), and which part of a
    calibration batch is the input. `calib_data`: iterable of input batches or labelled batches, for
    INT8. `eval_fn(run) -> float` (higher is better) scores a variant's `run(inputs) -> logits` on
    held-out data. `backends` / `precisions`: 'auto', a list, or a comma string ('torch,onnxruntime').
    `device`: where the candidates run (default: the model's device; a copy of the model is moved).
    `extra_candidates`: name -> function(model or .onnx path) returning an nn.Module or callable,
    judged as lossy. `measure=False` verifies only (no timing, so no `.best`). `progress`: True prints
    each step to stderr; a callable receives each step's message.
    """
    report = progress_fn(progress)
    fmt = BatchFormat.of(batch_format)
    graph = None  # an ONNX file, parsed once: inputs, fixed batch, weight spread
    if isinstance(model, (str, os.PathLike)):
        onnx_path = os.fspath(model)
        if not onnx_path.lower().endswith(".onnx"):
            raise ValueError(f"optimize() takes an nn.Module or an .onnx file, got the path {onnx_path!r}")
        if not os.path.isfile(onnx_path):
            raise FileNotFoundError(f"ONNX model {onnx_path!r} does not exist")
        from torchspeed.infer.export import onnx_example, read_onnx

        graph = read_onnx(onnx_path)
        if example_input is None:
            example_input = onnx_example(graph, input_shape)
        fixed = graph.fixed_batches
        if fixed and {int(b) for b in batch_sizes} != fixed:
            raise ValueError(f"the ONNX model {onnx_path!r} has a fixed batch size of {min(fixed)}: time it at that "
                             f"size (batch_sizes=({min(fixed)},), --batch-sizes {min(fixed)}) or export it with a "
                             "dynamic batch dimension")
        device = torch.device(device or "cpu")
    elif not isinstance(model, nn.Module):
        raise ValueError(f"optimize() expects an nn.Module or the path of an .onnx file, got {type(model).__name__}")
    else:
        if example_input is None:
            raise ValueError("optimize() needs example_input for a PyTorch model, e.g. torch.randn(1, 3, 224, 224)")
        device = torch.device(device) if device is not None else module_device(model)
    _check_example(example_input)
    if objective not in ("latency", "throughput"):
        raise ValueError(f"objective must be 'latency' or 'throughput', got {objective!r}")
    batch_sizes = tuple(int(b) for b in batch_sizes)
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes}")
    if not 0 <= max_metric_drop < 1:
        raise ValueError(f"max_metric_drop must be in [0, 1), got {max_metric_drop}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for but torch sees no CUDA device")
    if exact_tol is None:
        exact_tol = exact_tolerance(device)
    request = _Request(_resolve(backends, BACKENDS, "backend"), _resolve(precisions, runtime.PRECISIONS, "precision"))
    facts = ModelFacts(linear_heavy=graph.linear_heavy if graph else _linear_heavy(model),
                       calibrated=calib_data is not None, calibration=calibration, onnx_file=graph is not None)
    if request.precisions is not None and "int8" in request.precisions and calib_data is None and not facts.linear_heavy:
        raise ValueError("precisions includes 'int8' but no calibration set was given: pass calib_data= (an "
                         "iterable of input batches or (input, label) pairs), or use --calib DATA on the command line")
    threads = threads or usable_cores()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _search(graph or model, example_input, calib_data, eval_fn, max_metric_drop, request, facts,
                       batch_sizes, objective, calibration=calibration, max_calib_samples=max_calib_samples,
                       max_output_error=max_output_error, exact_tol=exact_tol, exporter=exporter, threads=threads,
                       repeats=repeats, min_time_s=min_time_s, extra_candidates=extra_candidates, arch=arch,
                       measure=measure, report=report, fmt=fmt, device=device)
    finally:
        torch.set_num_threads(old_threads)


def exact_tolerance(device: torch.device) -> float:
    """How far an fp32 rewrite may be from eager fp32 (max relative error): 1e-3, or 1e-2 on a GPU
    where TF32 is on for convolutions or matmuls (torch's default for cuDNN convolutions): there eager
    "fp32" itself rounds inputs to a 10-bit mantissa, and another runtime rounds differently."""
    tf32 = device.type == "cuda" and (torch.backends.cudnn.allow_tf32 or torch.get_float32_matmul_precision() != "highest")
    return 1e-2 if tf32 else 1e-3


def _check_example(x: Any) -> None:
    ok = (isinstance(x, torch.Tensor) and x.ndim >= 1) or (
        isinstance(x, (dict, tuple, list)) and len(x) > 0
        and all(isinstance(v, torch.Tensor) and v.ndim >= 1 for v in (x.values() if isinstance(x, dict) else x)))
    if not ok:
        raise ValueError("example_input must be a batched tensor such as torch.randn(1, 3, 224, 224), or a dict / "
                         f"tuple of batched tensors for a model with named or several inputs; got {x!r:.80}")


def _search(model: nn.Module | OnnxGraph, example_input: Any, calib_data: Iterable[Any] | None,
            eval_fn: Callable[[Callable[[Any], Any]], float] | None, max_metric_drop: float, request: _Request,
            facts: ModelFacts, batch_sizes: tuple[int, ...], objective: str, *, calibration: str,
            max_calib_samples: int, max_output_error: float, exact_tol: float, exporter: str, threads: int,
            repeats: int, min_time_s: float, extra_candidates: dict[str, Callable[[Any], Any]] | None,
            arch: ModelSpec | None, measure: bool, report: Callable[[str], None], fmt: BatchFormat,
            device: torch.device) -> OptimizeResult:
    """`optimize` once its arguments are checked and torch's thread count is set."""
    graph = model if isinstance(model, OnnxGraph) else None
    onnx_path = graph.path if graph else None
    if graph is None:
        arch = arch if arch is not None else spec_of(model)
        if module_device(model) != device:
            import copy

            model = copy.deepcopy(model).to(device)
        model = model.eval().float()
    # detached fp32 copies on the device; a list of inputs is positional, as a tuple
    example = map_tensors(lambda t: as_fp32(t.detach()).to(device),
                          tuple(example_input) if isinstance(example_input, list) else example_input)
    gen = torch.Generator().manual_seed(0)

    # The reference inputs: representative ones (calibration samples when given), on the model's device.
    # an ONNX file exported at one batch size runs at that size only
    fixed_batch = min(graph.fixed_batches) if graph and graph.fixed_batches else None
    n_verify = fixed_batch or max(8, batch_size(example))
    verify_x = _batch_of(example, n_verify, gen)
    if calib_data is not None:
        from torchspeed.infer.quantize import calibration_arrays

        verify_x = to_device(_concat(calibration_arrays(calib_data, fixed_batch or 16, fmt)), device)
        if isinstance(example, torch.Tensor):
            got, want = map_tensors(lambda t: tuple(t.shape[1:]), (verify_x, example))
            if got != want:
                raise ValueError(f"calibration inputs have shape {got} per sample but "
                                 f"example_input has {want}: they must match")
    ref = None
    if onnx_path is None:
        try:
            with torch.inference_mode():
                ref = fmt.logits_of(fmt.forward(model, verify_x))
        except Exception as e:  # noqa: BLE001 - any failure here means the inputs do not suit the model
            shape = tuple(example.shape) if isinstance(example, torch.Tensor) else _shape_of(example)
            raise ValueError(f"the model cannot run on inputs of shape {shape} "
                             f"(check --input-shape / example_input, and batch_format for named or several "
                             f"inputs): {_first_line(e)}") from None

    machine = Machine.detect(device)
    workdir = tempfile.TemporaryDirectory(prefix="torchspeed-optimize-")
    if onnx_path is None:
        export = OnnxExport(model, example, os.path.join(workdir.name, "model.onnx"), exporter, report, fmt)
    else:
        export = OnnxExport.given(graph)
    ctx = BuildContext(model if onnx_path is None else None, example, threads, arch, workdir.name, export,
                       calib_data, calibration, max_calib_samples, device, fmt)
    variants = list(VARIANTS)
    if onnx_path is not None:  # the reference is ONNX Runtime fp32 on the given file, on the device asked for
        kind = "cuda" if device.type == "cuda" else "cpu"
        name = "onnxruntime-cuda fp32" if kind == "cuda" else "onnxruntime fp32"
        base = Variant(name, "onnxruntime" if kind == "cpu" else "onnxruntime-cuda", "fp32",
                       "your ONNX model, ONNX Runtime fp32 (the reference)", lambda c: c.onnxruntime("fp32", kind),
                       baseline=True)
        variants = [base] + [v for v in variants if not v.baseline and v.name != name]
    source = model if onnx_path is None else onnx_path
    variants += [Variant(name, "custom", "custom", "your variant", lambda c, fn=fn: _CallableRunner(fn(source), fmt))
                 for name, fn in (extra_candidates or {}).items()]

    table: list[VariantResult] = []
    for variant in variants:
        skip = request.skip_reason(variant, machine, facts)
        if skip:
            table.append(VariantResult(variant.name, variant.backend, variant.precision, variant.exact, variant.label,
                                       status="skipped", reason=skip, input_shape=_shape_of(example)))
            continue
        report(f"building {variant.name}")
        row, out = build_variant(variant, ctx, verify_x)
        if variant.baseline and onnx_path is not None:
            if row.runner is None:
                raise ValueError(f"ONNX Runtime cannot run {onnx_path!r}: {row.reason}")
            ref = out
        if row.runner is None:
            report(f"  failed: {row.reason}")
        else:
            verify(row, out, ref, exact_tol, None if eval_fn is not None else max_output_error)
        table.append(row)

    baseline_metric = judge(table, eval_fn, max_metric_drop, report) if eval_fn is not None else None
    if measure:
        time_variants([r for r in table if r.runner is not None], example, batch_sizes, gen, repeats, min_time_s,
                      report, device=device if device.type == "cuda" else None)
    if ctx.onnx.report:
        for r in table:
            if r.backend.startswith(("onnxruntime", "openvino")) and r.runner is not None:
                r.extra["export"] = {k: ctx.onnx.report[k] for k in ("exporter", "fallback_reason")}
    unavailable = {b: why for b, why in machine.backends.items() if why}
    result = OptimizeResult(table, batch_sizes, objective, baseline_metric, threads, unavailable, workdir)
    _log_rows(result)
    return result


class _CallableRunner(Runner):
    """A user-supplied variant (module or callable), for `extra_candidates`."""

    backend, precision = "custom", "custom"

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

    def save(self, directory: str | os.PathLike) -> str:
        raise ValueError("a custom variant cannot be saved as an artifact")
