"""`optimize`: build every inference variant this machine can run, verify each, judge each, time each,
keep the fastest that passed. One concept, one file: the search's steps, in the order they run.

The variants and why one is skipped are in `torchspeed.infer.variants`; the table returned is in
`torchspeed.infer.result`. The options are checked once into a `SearchConfig`, then the steps run in
turn:
- export: the ONNX file every ONNX Runtime / OpenVINO variant starts from, made once on first need
  (`OnnxExport`); a failed export fails those variants only;
- build (`build_variant`): a variant whose build fails (an operator a runtime does not support, a
  missing runtime) is recorded as failed with its message and the search goes on;
- verification (`verify`): each variant's outputs against eager fp32 on the same inputs. Exact
  rewrites (fp32 everywhere) must match (max relative error <= `exact_tol`); lossy ones (bf16,
  fp16, int8) without `eval_fn` must agree (relative L2 error <= `max_output_error`);
- judging (`judge`): with `eval_fn`, lossy variants are scored on held-out data against the fp32
  model and rejected when the metric drops by more than `max_metric_drop`;
- timing (`time_variants`): torchspeed.measure, interleaved, at every batch size, with the same
  explicit thread count for every runtime, after waiting (at most `QUIET_WAIT_S`) for other processes
  to leave the cores; torch's own thread count is restored afterwards.
The winner is remembered on this machine (`torchspeed.remembered`, kind "optimize"), keyed by the
model's structure (or the .onnx file's bytes), the input shapes, the options and the runtimes here.
The next search for the same key builds only the baseline and the remembered winner, verifies and
judges the winner again (a remembered variant is never trusted unchecked), takes both rows' timings
from memory and says so (`OptimizeResult.remembered`); a winner that no longer builds or passes is
searched for again. A search timed on a busy machine is not remembered.
Every variant built logs one INFO line on `torchspeed.infer.search` (its p50 at each batch size, its
metric drop, passed or why not), and the choice logs one more.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed import remembered
from torchspeed.args import as_list, positive_number, progress_fn
from torchspeed.atomic import scratch_dir
from torchspeed.batches import BatchFormat, batch_size, map_tensors, to_device
from torchspeed.deprecated import renamed
from torchspeed.infer.export import OnnxGraph, grow_batch, onnx_data_files, onnx_example, read_onnx
from torchspeed.infer.precision import as_fp32, output_error
from torchspeed.infer.quantize import calibration_arrays
from torchspeed.infer.result import OptimizeResult, VariantRow
from torchspeed.infer.runners import RUNTIMES, module_device
from torchspeed.infer.variants import BuildContext, Machine, ModelFacts, OnnxExport, Variant, candidates, skip_reason
from torchspeed.measure import compare, wait_for_quiet_machine
from torchspeed.models import ModelSpec, spec_of
from torchspeed.runtime import PRECISIONS, cache_dir, usable_cores

__all__ = ["optimize", "SearchConfig", "build_variant", "verify", "judge", "time_variants", "exact_tolerance"]

log = logging.getLogger(__name__)

QUIET_WAIT_S = 5.0  # at most this long waiting for other processes to leave the cores before timing


@dataclass(frozen=True)
class SearchConfig:
    """How `optimize` searches, checked once (`SearchConfig.build`) and handed to every step: the
    runtimes and precisions to try (None: 'auto'), the accuracy bounds, calibration, export, threads,
    timing, the device the candidates run on and how the model is called (`batch_format`)."""

    batch_sizes: tuple[int, ...] = (1, 8)
    objective: str = "latency"
    runtimes: frozenset[str] | None = None
    precisions: frozenset[str] | None = None
    max_metric_drop: float = 0.01
    max_output_error: float = 0.1
    exact_tol: float = 1e-3
    calibration: str = "minmax"
    max_calib_samples: int = 256
    exporter: str = "auto"
    threads: int = field(default_factory=usable_cores)
    repeats: int = 5
    min_time_s: float = 0.05
    measure: bool = True
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    batch_format: BatchFormat = field(default_factory=BatchFormat)

    @classmethod
    def build(cls, *, device: torch.device, runtimes: str | Sequence[str] = "auto",
              precisions: str | Sequence[str] = "auto", batch_sizes: Sequence[int] = (1, 8),
              objective: str = "latency", max_metric_drop: float = 0.01, exact_tol: float | None = None,
              threads: int | None = None, batch_format: BatchFormat | dict | None = None,
              **rest: Any) -> SearchConfig:
        """The config from `optimize`'s keywords (lists as lists or comma strings, 'auto', None for the
        defaults of this machine and device; `rest`: the other fields as they are). ValueError on a bad one."""
        if objective not in ("latency", "throughput"):
            raise ValueError(f"objective must be 'latency' or 'throughput', got {objective!r}")
        sizes = tuple(int(b) for b in batch_sizes)
        if not sizes or any(b < 1 for b in sizes):
            raise ValueError(f"batch_sizes must be positive integers, got {sizes}")
        if not 0 <= max_metric_drop < 1:
            raise ValueError(f"max_metric_drop must be in [0, 1), got {max_metric_drop}")
        positive_number(rest.get("min_time_s", 0.0), "min_time_s", zero=True)  # before any variant is built
        return cls(batch_sizes=sizes, objective=objective, runtimes=_names(runtimes, RUNTIMES, "runtime"),
                   precisions=_names(precisions, PRECISIONS, "precision"), max_metric_drop=max_metric_drop,
                   exact_tol=exact_tolerance(device) if exact_tol is None else exact_tol,
                   threads=threads or usable_cores(), device=device, batch_format=BatchFormat.of(batch_format), **rest)


def _names(choice: str | Sequence[str], allowed: Sequence[str], what: str) -> frozenset[str] | None:
    """A list or comma string of names ('torch,onnxruntime'), or 'auto' (None)."""
    items = as_list(choice, name=f"{what}s")
    if items == ["auto"]:
        return None
    bad = sorted(set(items) - set(allowed))
    if bad:
        raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(allowed)} or 'auto'")
    return frozenset(items)


def exact_tolerance(device: torch.device) -> float:
    """How far an fp32 rewrite may be from eager fp32 (max relative error): 1e-3, or 1e-2 on a GPU
    where TF32 is on for convolutions or matmuls (torch's default for cuDNN convolutions): there eager
    "fp32" itself rounds inputs to a 10-bit mantissa, and another runtime rounds differently."""
    tf32 = device.type == "cuda" and (torch.backends.cudnn.allow_tf32 or torch.get_float32_matmul_precision() != "highest")
    return 1e-2 if tf32 else 1e-3


# ----------------------------------------------------------------------------------------- optimize
def optimize(
    model: nn.Module | OnnxGraph | str | os.PathLike,
    example_input: Any = None,
    calib_data: Iterable[Any] | None = None,
    eval_fn: Callable[[Callable[[Any], Any]], float] | None = None,
    max_metric_drop: float = 0.01,
    runtimes: str | Sequence[str] = "auto",
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
    spec: ModelSpec | None = None,
    measure: bool = True,
    progress: bool | Callable[[str], Any] = False,
    refresh: bool = False,
    backends: str | Sequence[str] | None = None,
) -> OptimizeResult:
    """Build, verify, judge and time every inference variant of `model`; return the table and the best.

    `model`: an `nn.Module` (candidates run on its device: a CUDA model is timed on CUDA, with the GPU
    precisions and ONNX Runtime's CUDA / TensorRT providers), or an ONNX model: the path of an `.onnx`
    file or its `read_onnx` graph (then the ONNX-based variants compete against ONNX Runtime fp32 on
    that file, on `device`, default CPU).
    `example_input` fixes the input shape (the batch dimension stays dynamic where the runtime allows):
    a tensor, or a dict / tuple of tensors for a model taking named or several inputs; for an ONNX
    file it is read from the graph, with `input_shape` for dynamic dimensions other than the batch.
    `batch_format` (`torchspeed.batches.BatchFormat`) says how the model is called and where its
    logits are (dict / dataclass outputs with `.logits` work by default), and which part of a
    calibration batch is the input. `calib_data`: iterable of input batches or labelled batches, for
    INT8. `eval_fn(run) -> float` (higher is better) scores a variant's `run(inputs) -> logits` on
    held-out data. `runtimes` / `precisions`: 'auto', a list, or a comma string ('torch,onnxruntime').
    `device`: where the candidates run (default: the model's device; a copy of the model is moved).
    `extra_candidates`: name -> function(model or .onnx path) returning an nn.Module or callable,
    judged as lossy. `spec`: how to rebuild the model, for saving a torch variant of a model not made
    by `torchspeed.models.create`. `measure=False` verifies only (no timing, so no `.best`).
    `progress`: True prints each step to stderr; a callable receives each step's message.
    The winner is remembered on this machine: the next call with the same model structure, inputs and
    options builds only it (and the baseline), checks its output error and `eval_fn` again, and takes
    the timings from memory (`result.remembered` says so); `refresh=True` searches and times again.
    The other keywords are the fields of `SearchConfig`; `backends` is the old name of `runtimes`.
    """
    if backends is not None:
        renamed("optimize(backends=)", "optimize(runtimes=)")
        runtimes = backends
    say = progress_fn(progress)
    subject, example_input, device = _subject(model, example_input, input_shape, device)
    _check_example(example_input)
    config = SearchConfig.build(
        device=device, runtimes=runtimes, precisions=precisions, batch_sizes=batch_sizes, objective=objective,
        max_metric_drop=max_metric_drop, exact_tol=exact_tol, threads=threads, batch_format=batch_format,
        max_output_error=max_output_error, calibration=calibration, max_calib_samples=max_calib_samples,
        exporter=exporter, repeats=repeats, min_time_s=min_time_s, measure=measure)
    facts = _model_facts(subject, calib_data, config)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _search(subject, example_input, calib_data, eval_fn, extra_candidates, spec, facts, config, say,
                       refresh)
    finally:
        torch.set_num_threads(old_threads)


def _subject(model: Any, example_input: Any, input_shape: Sequence[int] | None,
             device: str | torch.device | None) -> tuple[nn.Module | OnnxGraph, Any, torch.device]:
    """What is optimized (the module, or the graph of an ONNX file, parsed once), its example input and
    the device the candidates run on."""
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not path.lower().endswith(".onnx"):
            raise ValueError(f"optimize() takes an nn.Module or an .onnx file, got the path {path!r}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ONNX model {path!r} does not exist")
        model = read_onnx(path)
    if isinstance(model, OnnxGraph):
        if example_input is None:
            example_input = onnx_example(model, input_shape)
        device = torch.device(device or "cpu")
    elif not isinstance(model, nn.Module):
        raise ValueError(f"optimize() expects an nn.Module or the path of an .onnx file, got {type(model).__name__}")
    else:
        if example_input is None:
            raise ValueError("optimize() needs example_input for a PyTorch model, e.g. torch.randn(1, 3, 224, 224)")
        device = torch.device(device) if device is not None else module_device(model)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for but torch sees no CUDA device")
    return model, example_input, device


def _check_example(x: Any) -> None:
    ok = (isinstance(x, torch.Tensor) and x.ndim >= 1) or (
        isinstance(x, (dict, tuple, list)) and len(x) > 0
        and all(isinstance(v, torch.Tensor) and v.ndim >= 1 for v in (x.values() if isinstance(x, dict) else x)))
    if not ok:
        raise ValueError("example_input must be a batched tensor such as torch.randn(1, 3, 224, 224), or a dict / "
                         f"tuple of batched tensors for a model with named or several inputs; got {x!r:.80}")


def _model_facts(subject: nn.Module | OnnxGraph, calib_data: Iterable[Any] | None, config: SearchConfig) -> ModelFacts:
    """What the variants' applicability reads from the model; ValueError when the request cannot be
    met (batch sizes an ONNX file is not exported for, INT8 asked for without calibration data)."""
    graph = subject if isinstance(subject, OnnxGraph) else None
    facts = ModelFacts(linear_heavy=graph.linear_heavy if graph else _linear_heavy(subject),
                       calibrated=calib_data is not None, calibration=config.calibration, onnx_file=graph is not None)
    fixed = graph.fixed_batches if graph else set()
    if fixed and set(config.batch_sizes) != fixed:
        raise ValueError(f"the ONNX model {graph.path!r} has a fixed batch size of {min(fixed)}: time it at that "
                         f"size (batch_sizes=({min(fixed)},), --batch-sizes {min(fixed)}) or export it with a "
                         "dynamic batch dimension")
    if config.precisions is not None and "int8" in config.precisions and calib_data is None and not facts.linear_heavy:
        raise ValueError("precisions includes 'int8' but no calibration set was given: pass calib_data= (an "
                         "iterable of input batches or (input, label) pairs), or use --calib DATA on the command line")
    return facts


def _search(subject: nn.Module | OnnxGraph, example_input: Any, calib_data: Iterable[Any] | None,
            eval_fn: Callable[[Callable[[Any], Any]], float] | None,
            extra_candidates: dict[str, Callable[[Any], Any]] | None, spec: ModelSpec | None, facts: ModelFacts,
            config: SearchConfig, say: Callable[[str], Any], refresh: bool = False) -> OptimizeResult:
    """`optimize` once its arguments are checked and torch's thread count is set: the steps in turn (or
    the remembered winner checked again, see `_recalled`)."""
    graph = subject if isinstance(subject, OnnxGraph) else None
    model = None if graph else _model_on(subject, config.device)
    if graph is None and spec is None:
        spec = spec_of(subject)
    # detached fp32 copies on the device; a list of inputs is positional, as a tuple
    example = map_tensors(lambda t: as_fp32(t.detach()).to(config.device),
                          tuple(example_input) if isinstance(example_input, list) else example_input)
    gen = torch.Generator().manual_seed(0)
    verify_x = _verification_inputs(example, graph, calib_data, config, gen)
    ref = None if model is None else _reference_outputs(model, verify_x, example, config.batch_format)
    machine = Machine.detect(config.device)
    workdir = scratch_dir(cache_dir("tmp"), "optimize-")  # a killed run's files: removed by the next run
    if graph is None:
        export = OnnxExport(model, example, os.path.join(workdir.name, "model.onnx"), config.exporter, say,
                            config.batch_format)
    else:
        export = OnnxExport.given(graph)
    ctx = BuildContext(model, example, config.threads, spec, workdir.name, export, calib_data, config.calibration,
                       config.max_calib_samples, config.device, config.batch_format)
    variants = candidates(config.device, graph is not None, extra_candidates,
                          model if graph is None else graph.path, config.batch_format)
    parts = _decision_parts(subject, example, calib_data, eval_fn, extra_candidates, machine, config) \
        if config.measure else None

    def search() -> OptimizeResult:
        table = _build_and_verify(variants, ctx, verify_x, ref, machine, facts, config, eval_fn is not None, say)
        baseline_metric = judge(table, eval_fn, config.max_metric_drop, say) if eval_fn is not None else None
        others_cores = None
        if config.measure:
            wait_for_quiet_machine(max_s=QUIET_WAIT_S, window_s=0.25)
            others_cores = time_variants([r for r in table if r.runner is not None], example, config.batch_sizes,
                                         gen, config.repeats, config.min_time_s, say,
                                         device=config.device if config.device.type == "cuda" else None)
        _note_export(table, export)
        unavailable = {name: why for name, why in machine.runtimes.items() if why}
        return OptimizeResult(table, config.batch_sizes, config.objective, baseline_metric, config.threads,
                              unavailable, workdir, others_cores=others_cores)

    result, _ = remembered.recall_or_measure(
        "optimize", parts, search, refresh=refresh, what="optimize", logger=log, encode=_decision, busy=lambda r: r.busy_warning,
        decode=lambda memory: _recalled(memory, variants, ctx, verify_x, ref, machine, facts, config, eval_fn, say,
                                        workdir))
    _log_rows(result)
    return result


def _decision_parts(subject: nn.Module | OnnxGraph, example: Any, calib_data: Iterable[Any] | None,
                    eval_fn: Any, extra_candidates: dict[str, Any] | None, machine: Machine,
                    config: SearchConfig) -> dict[str, Any]:
    """What the winner depends on, as the key it is remembered by: the model's structure (or the .onnx
    file's bytes), the input shapes, every option of the search, and the runtimes usable here with
    their versions."""
    if isinstance(subject, OnnxGraph):  # the graph and its external weights, read in chunks
        digest = hashlib.sha256()
        for path in (subject.path, *onnx_data_files(subject.path)):
            with open(path, "rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
        model = "onnx:" + digest.hexdigest()[:24]
    else:
        model = remembered.model_fingerprint(subject)
    runtimes = sorted(name for name, why in machine.runtimes.items() if why is None)
    versions = {}
    for package in ("onnxruntime", "onnxruntime-gpu", "openvino", "nncf"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"model": model, "inputs": remembered.shapes_of(example), "batch_sizes": list(config.batch_sizes),
            "objective": config.objective, "runtimes": sorted(config.runtimes or ["auto"]),
            "precisions": sorted(config.precisions or ["auto"]), "max_metric_drop": config.max_metric_drop,
            "max_output_error": config.max_output_error, "exact_tol": config.exact_tol,
            "calibration": config.calibration if calib_data is not None else None,
            "max_calib_samples": config.max_calib_samples, "judged": eval_fn is not None,
            "exporter": config.exporter, "threads": config.threads, "device": str(config.device),
            "batch_format": repr(config.batch_format), "extra": sorted(extra_candidates or {}),
            "usable_runtimes": runtimes, "versions": versions}


def _recalled(memory: remembered.Memory, variants: list[Variant], ctx: BuildContext, verify_x: Any, ref: Any,
              machine: Machine, facts: ModelFacts, config: SearchConfig, eval_fn: Any, say: Callable[[str], Any],
              workdir: Any) -> OptimizeResult | None:
    """The remembered winner and the baseline built and checked again (output error, and `eval_fn`
    against the baseline's metric: never trusted unchecked), their timings taken from memory. None
    when the winner is no longer a candidate, fails to build or fails a check: then the search runs."""
    name = memory.decision.get("winner")
    chosen = [v for v in variants if v.baseline or v.name == name]
    if not any(v.name == name for v in chosen):
        log.info("optimize: the remembered winner %r is not a candidate now; searching again", name)
        return None
    say(f"{name}: {memory.describe()}; building it and checking it again")
    table = _build_and_verify(chosen, ctx, verify_x, ref, machine, facts, config, eval_fn is not None, say)
    baseline_metric = judge(table, eval_fn, config.max_metric_drop, say) if eval_fn is not None else None
    winner = next(r for r in table if r.name == name)
    if not winner.passed:
        log.info("optimize: the remembered winner %s %s now (%s); searching again", name, winner.status,
                 winner.reason)
        say(f"{name} {winner.status} now ({winner.reason}); searching again")
        return None
    try:
        for r in table:
            r.latency_ms = {int(b): {k: float(v) for k, v in t.items()}
                            for b, t in memory.decision["latency_ms"][r.name].items()}
            r.extra["remembered"] = memory.describe()
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # a damaged entry: searched again
    if any(not r.latency_ms.get(b) for r in table for b in config.batch_sizes):
        return None
    unavailable = {n: why for n, why in machine.runtimes.items() if why}
    return OptimizeResult(table, config.batch_sizes, config.objective, baseline_metric, config.threads, unavailable,
                          workdir, remembered=memory.describe())


def _decision(result: OptimizeResult) -> tuple[dict[str, Any], str] | None:
    """The winner's identity and the timings of it and the baseline, to remember; None when nothing won."""
    best, base = result.best, result.table[0]
    if best is None:
        return None
    b = result.objective_batch
    figure = f"{best.name}, {best.p50_ms(b):.3g} ms at batch {b}, {base.p50_ms(b) / best.p50_ms(b):.2f}x {base.name}"
    return {"winner": best.name, "runtime": best.runtime, "precision": best.precision,
            "latency_ms": {r.name: {str(k): v for k, v in r.latency_ms.items()} for r in (base, best)}}, figure


def _model_on(model: nn.Module, device: torch.device) -> nn.Module:
    """The model in eval mode and float32 on `device` (a copy when it is elsewhere)."""
    if module_device(model) != device:
        model = copy.deepcopy(model).to(device)
    return model.eval().float()


def _verification_inputs(example: Any, graph: OnnxGraph | None, calib_data: Iterable[Any] | None,
                         config: SearchConfig, gen: torch.Generator) -> Any:
    """The inputs every variant is verified on, on the model's device: calibration samples when given
    (representative), else the example grown to 8 rows; an ONNX file fixed at one batch size gets that."""
    fixed_batch = min(graph.fixed_batches) if graph and graph.fixed_batches else None
    verify_x = _batch_of(example, fixed_batch or max(8, batch_size(example)), gen)
    if calib_data is None:
        return verify_x
    verify_x = to_device(_concat(calibration_arrays(calib_data, fixed_batch or 16, config.batch_format)), config.device)
    if isinstance(example, torch.Tensor):
        got, want = map_tensors(lambda t: tuple(t.shape[1:]), (verify_x, example))
        if got != want:
            raise ValueError(f"calibration inputs have shape {got} per sample but "
                             f"example_input has {want}: they must match")
    return verify_x


def _reference_outputs(model: nn.Module, verify_x: Any, example: Any, fmt: BatchFormat) -> Any:
    """Eager fp32's logits on the verification inputs; ValueError when the model cannot take them."""
    try:
        with torch.inference_mode():
            return fmt.logits_of(fmt.forward(model, verify_x))
    except Exception as e:  # noqa: BLE001 - any failure here means the inputs do not suit the model
        shape = tuple(example.shape) if isinstance(example, torch.Tensor) else _shape_of(example)
        raise ValueError(f"the model cannot run on inputs of shape {shape} "
                         f"(check --input-shape / example_input, and batch_format for named or several "
                         f"inputs): {_first_line(e)}") from None


def _build_and_verify(variants: list[Variant], ctx: BuildContext, verify_x: Any, ref: Any, machine: Machine,
                      facts: ModelFacts, config: SearchConfig, judged: bool,
                      say: Callable[[str], Any]) -> list[VariantRow]:
    """One row per variant: skipped with the reason, or built and verified against `ref` (for an ONNX
    file, against its baseline's outputs). Lossy rows are left to `judge` when `judged`."""
    table: list[VariantRow] = []
    for variant in variants:
        skip = skip_reason(variant, machine, facts, config.runtimes, config.precisions)
        if skip:
            table.append(VariantRow(variant.name, variant.runtime, variant.precision, variant.exact, variant.label,
                                    status="skipped", reason=skip, input_shape=_shape_of(ctx.example)))
            continue
        say(f"building {variant.name}")
        row, out = build_variant(variant, ctx, verify_x)
        if variant.baseline and facts.onnx_file:
            if row.runner is None:
                raise ValueError(f"ONNX Runtime cannot run {ctx.onnx.target!r}: {row.reason}")
            ref = out
        if row.runner is None:
            say(f"  failed: {row.reason}")
        else:
            verify(row, out, ref, config.exact_tol, None if judged else config.max_output_error)
        table.append(row)
    return table


def _note_export(table: list[VariantRow], export: OnnxExport) -> None:
    """Each ONNX-based row records which exporter made its ONNX file (and why dynamo failed, if it did)."""
    if not export.result:
        return
    for r in table:
        if r.runtime.startswith(("onnxruntime", "openvino")) and r.runner is not None:
            r.extra["export"] = {k: export.result[k] for k in ("exporter", "fallback_reason")}


# ----------------------------------------------------------------------------------------- the steps
def build_variant(variant: Variant, ctx: BuildContext, verify_x: torch.Tensor) -> tuple[VariantRow, Any]:
    """The build step: the row and the variant's outputs on `verify_x` (None when the build failed)."""
    row = VariantRow(variant.name, variant.runtime, variant.precision, variant.exact, variant.label,
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


def verify(row: VariantRow, out: Any, ref: torch.Tensor, exact_tol: float, max_output_error: float | None) -> None:
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


def judge(table: list[VariantRow], eval_fn: Callable[[Callable[[Any], Any]], float], max_metric_drop: float,
          say: Callable[[str], Any]) -> float:
    """The judging step: score the baseline (the table's first row) and every lossy row still ok with
    `eval_fn`; reject a row whose metric drops by more than `max_metric_drop`. Returns the baseline's."""
    say(f"evaluating {table[0].name} (the reference metric)")
    baseline_metric = float(eval_fn(table[0].runner))
    table[0].metric, table[0].metric_drop = baseline_metric, 0.0
    for row in table[1:]:
        if row.status != "ok" or row.exact:
            continue
        say(f"evaluating {row.name}")
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


def time_variants(rows: list[VariantRow], example: Any, batch_sizes: Sequence[int], gen: torch.Generator,
                  repeats: int, min_time_s: float, say: Callable[[str], Any], device: Any = None) -> float | None:
    """The timing step: every row with a runner, interleaved against the baseline (the first row), at
    each batch size. Inputs are made on the model's device (`example`'s); on a GPU `compare`
    synchronises the device after each run, so asynchronous kernels are timed to their end.
    Returns the most cores other processes used while one batch size was timed (None: not measurable)."""
    others: list[float] = []
    for b in batch_sizes if rows else ():
        say(f"timing {len(rows)} variants at batch {b}")
        x = _batch_of(example, b, gen)
        contenders = {r.name: (lambda r=r: r.runner(x)) for r in rows}
        cmp = compare(contenders, baseline=rows[0].name, repeats=repeats, min_time_s=min_time_s, items=b,
                      cooldown_s=0.1, device=device)
        if cmp.others_cores is not None:
            others.append(cmp.others_cores)
        for r in rows:
            t = cmp[r.name]
            r.latency_ms[b] = {"p50_ms": t.median_s * 1e3, "p90_ms": t.p90_s * 1e3, "min_ms": t.min_s * 1e3,
                               "max_ms": t.max_s * 1e3, "throughput": t.throughput}
    return max(others, default=None)


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
    if result.busy_warning:
        log.warning("optimize: %s", result.busy_warning)
    best = result.best
    if best is None:
        log.info("optimize: no variant chosen (%s)",
                 "no variant passed its checks" if any(r.latency_ms for r in result.table) else "nothing was timed")
        return
    b = result.objective_batch
    base = result.table[0].p50_ms(b)
    log.info("optimize: chose %s (objective %s): p50 %.3g ms at batch %d, %.2fx %s; %d of %d variants passed",
             best.name, result.objective, best.p50_ms(b), b, base / best.p50_ms(b), result.table[0].name,
             sum(r.passed for r in result.table), sum(r.status != "skipped" for r in result.table))


# ----------------------------------------------------------------------------------------- helpers
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
    return map_tensors(lambda t: grow_batch(as_fp32(t), b, gen), example)


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
