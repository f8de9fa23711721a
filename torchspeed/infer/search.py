"""`optimize`: build every inference variant this machine can run, verify each, measure each, keep
the fastest that passed.

Candidates: eager fp32 (the baseline), Conv+BN fused, bf16 + channels_last, torch.compile, ONNX
Runtime fp32 / INT8 (static QDQ, or dynamic for Linear-heavy models), OpenVINO f32 / bf16 / INT8
(NNCF), and ONNX Runtime's TensorRT provider where a GPU has it. The guard:
- exact rewrites (fp32 everywhere) must match the eager outputs (max relative error <= `exact_tol`);
- lossy ones (bf16, fp16, int8) are judged by `eval_fn` on held-out data against the fp32 model and
  rejected when the metric drops by more than `max_metric_drop`; without `eval_fn`, by output
  agreement (relative L2 error <= `max_output_error`).
A candidate whose build fails (an operator a runtime does not support, a missing runtime) is
recorded as failed with its message and the search goes on. Latency is measured with
torchspeed.measure, interleaved, at every batch size, with the same explicit thread count for every runtime.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed.infer.precision import output_error
from torchspeed.infer.runtimes import Runner, TorchRunner, available_backends
from torchspeed.runtime import default_precision, usable_cores

__all__ = ["optimize", "OptimizeResult", "Candidate", "BACKENDS", "PRECISIONS"]

BACKENDS = ("torch", "torch.compile", "onnxruntime", "openvino", "tensorrt")
PRECISIONS = ("fp32", "bf16", "fp16", "int8")


@dataclass
class Candidate:
    """One variant: how it was built, whether it passed the guard, and what it measured."""

    name: str
    backend: str
    precision: str
    exact: bool
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
    input_shape: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "ok"

    def p50_ms(self, batch: int) -> float:
        return self.latency_ms.get(batch, {}).get("p50_ms", math.nan)

    def __call__(self, x: Any) -> torch.Tensor:
        if self.runner is None:
            raise ValueError(f"candidate {self.name!r} has no runnable model ({self.status}: {self.reason})")
        return self.runner(x)

    def save(self, directory: str | os.PathLike) -> str:
        """Write a self-describing artifact (model file + manifest.json) that `ts.infer.load` runs."""
        if self.runner is None:
            raise ValueError(f"candidate {self.name!r} cannot be saved: {self.status}: {self.reason}")
        directory = os.fspath(directory)
        self.runner.save(directory)
        import json

        from torchspeed.atomic import write_json
        from torchspeed.infer.runtimes import MANIFEST

        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        manifest.update(name=self.name, input_shape=[None, *self.input_shape[1:]], measured=self.to_dict())
        write_json(os.path.join(directory, MANIFEST), manifest)
        return directory

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "backend": self.backend, "precision": self.precision, "exact": self.exact,
            "status": self.status, "reason": self.reason, "max_rel_error": self.max_rel_error,
            "rel_l2_error": self.rel_l2_error, "metric": self.metric, "metric_drop": self.metric_drop,
            "latency_ms": {str(b): v for b, v in self.latency_ms.items()}, "size_mb": self.size_mb,
            "build_s": self.build_s, **({"extra": self.extra} if self.extra else {}),
        }


@dataclass
class OptimizeResult:
    """The full table (rejected and failed candidates too) and `.best`, the chosen one."""

    table: list[Candidate]
    best: Candidate | None
    batch_sizes: tuple[int, ...]
    objective: str
    baseline_metric: float | None
    threads: int
    unavailable: dict[str, str]
    _workdir: Any = field(default=None, repr=False)  # keeps exported files alive while the result lives

    def __getitem__(self, name: str) -> Candidate:
        for c in self.table:
            if c.name == name:
                return c
        raise KeyError(f"no candidate named {name!r}; have {[c.name for c in self.table]}")

    def fastest(self, batch: int, passed_only: bool = True) -> Candidate | None:
        pool = [c for c in self.table if (c.passed or not passed_only) and not math.isnan(c.p50_ms(batch))]
        return min(pool, key=lambda c: c.p50_ms(batch), default=None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": self.best.name if self.best else None, "objective": self.objective,
            "batch_sizes": list(self.batch_sizes), "baseline_metric": self.baseline_metric,
            "threads": self.threads, "unavailable": self.unavailable,
            "candidates": [c.to_dict() for c in self.table],
        }

    def rows(self) -> list[list[Any]]:
        base = self.table[0] if self.table else None
        out = []
        for c in self.table:
            if c.status == "skipped":
                continue
            row: list[Any] = [c.name + (" *" if c is self.best else ""), c.status]
            for b in self.batch_sizes:
                p = c.p50_ms(b)
                row += [None if math.isnan(p) else p,
                        None if (math.isnan(p) or base is None or math.isnan(base.p50_ms(b))) else base.p50_ms(b) / p]
            row += [c.metric_drop if c.metric_drop is not None else c.rel_l2_error, c.size_mb,
                    c.reason[:70] if c.reason else ""]
            out.append(row)
        return out

    def columns(self) -> list[str]:
        cols = ["variant", "status"]
        for b in self.batch_sizes:
            cols += [f"p50 ms (b{b})", f"x (b{b})"]
        return cols + ["drop / err", "MB", "note"]

    def print(self, console: Any = None) -> None:
        from torchspeed.tables import print_table

        from rich.console import Console

        console = console or Console()
        print_table(f"optimize: {self.threads} threads, best = {self.best.name if self.best else 'none'}",
                    self.columns(), self.rows(), console)
        skipped = [f"{c.name} ({c.reason})" for c in self.table if c.status == "skipped"]
        if skipped:
            console.print("skipped: " + "; ".join(skipped), highlight=False)


def _linear_heavy(model: nn.Module) -> bool:
    """More weights in Linear/LSTM/attention than in convolutions: dynamic INT8 pays off there."""
    lin = sum(p.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.LSTM, nn.GRU, nn.MultiheadAttention))
              for p in m.parameters(recurse=False))
    conv = sum(p.numel() for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd) for p in m.parameters(recurse=False))
    return lin > conv


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:240]}"


def _batch_of(example: torch.Tensor, b: int, gen: torch.Generator) -> torch.Tensor:
    extra = torch.randn((max(0, b - len(example)),) + tuple(example.shape[1:]), generator=gen)
    return torch.cat([example.float(), extra])[:b].contiguous()


def _resolve(choice: str | Sequence[str], allowed: Sequence[str], what: str) -> set[str] | None:
    if choice == "auto":
        return None
    chosen = {choice} if isinstance(choice, str) else set(choice)
    bad = sorted(chosen - set(allowed))
    if bad:
        raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(allowed)} or 'auto'")
    return chosen


def optimize(
    model: nn.Module,
    example_input: torch.Tensor,
    calib_data: Iterable[Any] | None = None,
    eval_fn: Callable[[Callable[[Any], Any]], float] | None = None,
    max_metric_drop: float = 0.01,
    backends: str | Sequence[str] = "auto",
    precisions: str | Sequence[str] = "auto",
    batch_sizes: Sequence[int] = (1, 8),
    objective: str = "latency",
    *,
    calibration: str = "minmax",
    max_calib_samples: int = 256,
    max_output_error: float = 0.1,
    exact_tol: float = 1e-3,
    exporter: str = "auto",
    threads: int | None = None,
    repeats: int = 5,
    min_time_s: float = 0.05,
    extra_candidates: dict[str, Callable[[nn.Module], Any]] | None = None,
    arch: dict[str, Any] | None = None,
    measure: bool = True,
    log: Callable[[str], None] | None = None,
) -> OptimizeResult:
    """Build, verify and time every inference variant of `model`; return the table and the best.

    `example_input` fixes the input shape (the batch dimension stays dynamic where the runtime allows).
    `calib_data`: iterable of input batches or (input, label) pairs, for INT8. `eval_fn(run) -> float`
    (higher is better) scores a candidate's `run(batch) -> outputs` on held-out data.
    `extra_candidates`: name -> function(model) returning an nn.Module or callable, judged as lossy.
    `measure=False` verifies only (no timing, so no `.best`).
    """
    log = log or (lambda s: None)
    if not isinstance(model, nn.Module):
        raise ValueError(f"optimize() expects an nn.Module, got {type(model).__name__}")
    if not isinstance(example_input, torch.Tensor) or example_input.ndim < 1:
        raise ValueError(f"example_input must be a batched tensor such as torch.randn(1, 3, 224, 224), got {example_input!r:.80}")
    if objective not in ("latency", "throughput"):
        raise ValueError(f"objective must be 'latency' or 'throughput', got {objective!r}")
    batch_sizes = tuple(int(b) for b in batch_sizes)
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes}")
    if not 0 <= max_metric_drop < 1:
        raise ValueError(f"max_metric_drop must be in [0, 1), got {max_metric_drop}")
    want_b = _resolve(backends, BACKENDS, "backend")
    want_p = _resolve(precisions, PRECISIONS, "precision")
    if want_p is not None and "int8" in want_p and calib_data is None and not _linear_heavy(model):
        raise ValueError("precisions includes 'int8' but no calibration set was given: pass calib_data= (an "
                         "iterable of input batches or (input, label) pairs), or use --calib DATA on the command line")
    threads = threads or usable_cores()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    arch = arch if arch is not None else getattr(model, "_torchspeed_arch", None)
    model = model.eval().float()
    example = example_input.detach().float().cpu()
    gen = torch.Generator().manual_seed(0)

    # The reference: eager fp32 on representative inputs (calibration samples when given).
    verify_x = _batch_of(example, max(8, len(example)), gen)
    if calib_data is not None:
        from torchspeed.infer.quantize import calibration_arrays

        arrs = calibration_arrays(calib_data, 16)
        verify_x = torch.cat([torch.from_numpy(a) for a in arrs])
        if tuple(verify_x.shape[1:]) != tuple(example.shape[1:]):
            raise ValueError(f"calibration inputs have shape {tuple(verify_x.shape[1:])} per sample but "
                             f"example_input has {tuple(example.shape[1:])}: they must match")
    try:
        with torch.inference_mode():
            ref = model(verify_x)
    except Exception as e:  # noqa: BLE001 - any failure here means the shape does not suit the model
        raise ValueError(f"the model cannot run on inputs of shape {tuple(example.shape)} "
                         f"(check --input-shape / example_input): {_first_line(e)}") from None
    ref = ref[0] if isinstance(ref, (tuple, list)) else ref

    avail = available_backends()
    unavailable = {b: why for b, why in avail.items() if why}
    native_bf16 = default_precision("cpu").name == "bf16"
    auto_int8 = calib_data is not None or _linear_heavy(model)
    workdir = tempfile.TemporaryDirectory(prefix="torchspeed-optimize-")
    table: list[Candidate] = []

    def wanted(backend: str, precision: str) -> str | None:
        """None if this candidate should be built, else why it is skipped."""
        bkey = "tensorrt" if backend.startswith("onnxruntime-tensorrt") else backend
        if want_b is not None and bkey not in want_b:
            return "backend not requested"
        if want_p is not None and precision.split("+")[0] not in want_p:
            return "precision not requested"
        if avail.get(bkey):
            return avail[bkey]
        if want_p is None:
            if precision == "bf16" and not native_bf16:
                return "no native bf16 on this CPU (would be emulated, slow)"
            if precision == "fp16":
                return "fp16 is emulated on CPU; ask for it with precisions=['fp16']"
            if precision == "int8" and not auto_int8:
                return "no calibration data (pass calib_data for INT8)"
        return None

    torch_bf16 = {"fuse": True, "precision": "bf16", "channels_last": example.ndim == 4}
    specs: list[tuple[str, str, str, Callable[[], Runner]]] = [
        ("eager fp32", "torch", "fp32", lambda: TorchRunner(model, {}, threads, arch)),
        ("fused fp32", "torch", "fp32", lambda: TorchRunner(model, {"fuse": True}, threads, arch)),
        ("bf16 + channels_last", "torch", "bf16", lambda: TorchRunner(model, torch_bf16, threads, arch)),
        ("fp16 + channels_last", "torch", "fp16",
         lambda: TorchRunner(model, {**torch_bf16, "precision": "fp16"}, threads, arch)),
        ("torch.compile bf16", "torch.compile", "bf16",
         lambda: TorchRunner(model, {**torch_bf16, "compile": True}, threads, arch)),
        ("torch.compile fp32", "torch.compile", "fp32",
         lambda: TorchRunner(model, {"fuse": True, "compile": True}, threads, arch)),
    ]
    # torch.compile costs a minute of compiling per model here: one precision only, the faster kind.
    specs = [s for s in specs if s[0] != ("torch.compile fp32" if native_bf16 else "torch.compile bf16")]

    onnx_state: dict[str, Any] = {}

    def onnx_path() -> str:
        if "error" in onnx_state:
            raise RuntimeError(f"needs the ONNX export, which failed: {onnx_state['error']}")
        if "path" not in onnx_state:
            from torchspeed.infer.export import export_onnx

            t0 = time.perf_counter()
            try:
                rep = export_onnx(model, example, os.path.join(workdir.name, "model.onnx"), exporter=exporter)
            except Exception as e:  # noqa: BLE001
                onnx_state["error"] = str(e)
                raise
            onnx_state.update(path=rep.path, report=rep.to_dict(), seconds=time.perf_counter() - t0)
            log(f"exported ONNX with the {rep.exporter} exporter ({onnx_state['seconds']:.0f} s)")
        return onnx_state["path"]

    def ort(precision: str, providers: list[str] | None = None) -> Runner:
        from torchspeed.infer.quantize import quantize_onnx_dynamic, quantize_onnx_static
        from torchspeed.infer.runtimes import OrtRunner

        src = onnx_path()
        if precision == "int8":
            dst = os.path.join(workdir.name, "model-int8-static.onnx")
            quantize_onnx_static(src, dst, calib_data, calibration, max_samples=max_calib_samples)
            return OrtRunner(dst, "int8", threads)
        if precision == "int8-dynamic":
            dst = os.path.join(workdir.name, "model-int8-dynamic.onnx")
            return OrtRunner(quantize_onnx_dynamic(src, dst), "int8-dynamic", threads)
        return OrtRunner(src, precision, threads, providers)

    def openvino(precision: str) -> Runner:
        from torchspeed.infer.runtimes import OpenVINORunner

        if precision == "int8":
            from torchspeed.infer.quantize import quantize_openvino

            return OpenVINORunner(quantize_openvino(onnx_path(), calib_data, calibration, max_calib_samples), "int8", threads)
        return OpenVINORunner(onnx_path(), precision, threads)

    specs += [
        ("onnxruntime fp32", "onnxruntime", "fp32", lambda: ort("fp32")),
        ("onnxruntime int8", "onnxruntime", "int8", lambda: ort("int8")),
        ("onnxruntime int8 dynamic", "onnxruntime", "int8", lambda: ort("int8-dynamic")),
        ("openvino f32", "openvino", "fp32", lambda: openvino("fp32")),
        ("openvino bf16", "openvino", "bf16", lambda: openvino("bf16")),
        ("openvino int8", "openvino", "int8", lambda: openvino("int8")),
        ("onnxruntime-tensorrt fp16", "onnxruntime-tensorrt", "fp16",
         lambda: ort("fp16", ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"])),
    ]
    for name, fn in (extra_candidates or {}).items():
        def build(fn=fn) -> Runner:
            return _CallableRunner(fn(model))
        specs.append((name, "custom", "custom", build))

    for name, backend, precision, build in specs:
        exact = precision == "fp32"
        cand = Candidate(name, backend, "int8-dynamic" if name.endswith("dynamic") else precision, exact,
                         input_shape=list(example.shape))
        skip = wanted(backend, precision) if backend != "custom" else None
        if name == "onnxruntime int8 dynamic" and skip is None:
            skip = None if _linear_heavy(model) else "static INT8 suits convolutional models better"
        if name == "onnxruntime int8" and skip is None and calib_data is None:
            skip = "no calibration data (pass calib_data for INT8)"
        if name == "openvino int8" and skip is None:
            if calib_data is None:
                skip = "no calibration data (pass calib_data for INT8)"
            elif calibration != "minmax":
                skip = f"NNCF has no {calibration!r} calibration; only ONNX Runtime offers it"
        if name == "eager fp32":
            skip = None  # the baseline is always measured
        if skip:
            cand.status, cand.reason = "skipped", skip
            table.append(cand)
            continue
        log(f"building {name}")
        t0 = time.perf_counter()
        try:
            cand.runner = build()
            out = cand.runner(verify_x)
        except Exception as e:  # noqa: BLE001 - an unsupported op or runtime error fails this candidate only
            cand.status, cand.reason = "failed", _first_line(e)
            cand.runner = None
            table.append(cand)
            log(f"  failed: {cand.reason}")
            continue
        cand.build_s = time.perf_counter() - t0
        try:
            err = output_error(out, ref)
        except ValueError as e:
            cand.status, cand.reason = "rejected", str(e)
            table.append(cand)
            continue
        cand.max_rel_error, cand.rel_l2_error = err["max_rel"], err["rel_l2"]
        cand.status = "ok"
        if not math.isfinite(err["rel_l2"]):
            cand.status, cand.reason = "rejected", "outputs contain NaN or inf"
        elif exact:
            if err["max_rel"] > exact_tol:
                cand.status, cand.reason = "rejected", f"fp32 output error {err['max_rel']:.2e} > {exact_tol:.0e}"
        elif eval_fn is not None:
            pass  # judged below, once the fp32 metric is known
        elif err["rel_l2"] > max_output_error:
            cand.status, cand.reason = "rejected", f"output error (rel. L2) {err['rel_l2']:.3f} > {max_output_error}"
        try:
            cand.size_mb = cand.runner.size_bytes() / 2**20
        except Exception:  # noqa: BLE001 - size is informative only
            pass
        table.append(cand)

    baseline_metric = None
    if eval_fn is not None:
        log("evaluating eager fp32 (the reference metric)")
        baseline_metric = float(eval_fn(table[0].runner))
        table[0].metric, table[0].metric_drop = baseline_metric, 0.0
        for cand in table[1:]:
            if cand.status != "ok" or cand.exact:
                continue
            log(f"evaluating {cand.name}")
            try:
                cand.metric = float(eval_fn(cand.runner))
            except Exception as e:  # noqa: BLE001
                cand.status, cand.reason = "failed", f"eval_fn raised {_first_line(e)}"
                continue
            cand.metric_drop = baseline_metric - cand.metric
            if not cand.metric_drop <= max_metric_drop:
                cand.status = "rejected"
                cand.reason = f"metric drop {cand.metric_drop:.4f} > {max_metric_drop} ({cand.metric:.4f} vs {baseline_metric:.4f})"

    measured = [c for c in table if c.runner is not None] if measure else []
    from torchspeed.measure import compare  # the one timing tool (house rule)

    for b in batch_sizes if measured else ():
        log(f"timing {len(measured)} variants at batch {b}")
        x = _batch_of(example, b, gen)
        contenders = {c.name: (lambda c=c: c.runner(x)) for c in measured}
        cmp = compare(contenders, baseline="eager fp32", repeats=repeats, min_time_s=min_time_s, items=b,
                      cooldown_s=0.1)
        for c in measured:
            t = cmp[c.name]
            c.latency_ms[b] = {"p50_ms": t.median_s * 1e3, "p90_ms": t.p90_s * 1e3, "min_ms": t.min_s * 1e3,
                               "max_ms": t.max_s * 1e3, "throughput": t.throughput}
    torch.set_num_threads(old_threads)

    passed = [c for c in table if c.passed and c.latency_ms]
    if objective == "latency":
        best = min(passed, key=lambda c: c.p50_ms(batch_sizes[0]), default=None)
    else:
        big = max(batch_sizes)
        best = max(passed, key=lambda c: c.latency_ms[big]["throughput"] or 0.0, default=None)
    if onnx_state.get("report"):
        for c in table:
            if c.backend.startswith(("onnxruntime", "openvino")) and c.runner is not None:
                c.extra["export"] = {k: onnx_state["report"][k] for k in ("exporter", "fallback_reason")}
    return OptimizeResult(table, best, batch_sizes, objective, baseline_metric, threads, unavailable, workdir)


class _CallableRunner(Runner):
    """A user-supplied variant (module or callable), for `extra_candidates`."""

    backend, precision = "custom", "custom"

    def __init__(self, fn: Any):
        self.fn = fn.eval() if isinstance(fn, nn.Module) else fn

    def __call__(self, x: Any) -> torch.Tensor:
        with torch.inference_mode():
            out = self.fn(x if isinstance(x, torch.Tensor) else torch.as_tensor(x))
        return out[0] if isinstance(out, (tuple, list)) else out

    def size_bytes(self) -> int:
        return 0

    def save(self, directory: str | os.PathLike) -> str:
        raise ValueError("a custom candidate cannot be saved as an artifact")
