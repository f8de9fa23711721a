"""Export to ONNX with a truly dynamic batch dimension, checked in ONNX Runtime against PyTorch.

The dynamo exporter (`torch.onnx.export(dynamo=True)`, needs `onnxscript`) is tried first; if it
fails, the TorchScript exporter is tried and the reason is recorded. Pitfall handled: `torch.export`
specialises a dimension whose example size is 1, so an example of batch 1 would give a model fixed
at batch 1; the example is repeated to batch 2 for tracing. The result is always verified: the ONNX
file passes `onnx.checker`, then runs in ONNX Runtime at two batch sizes next to PyTorch.
"""
from __future__ import annotations

import copy
import math
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed.atomic import atomic_write
from torchspeed.batches import BatchFormat
from torchspeed.infer.precision import as_fp32, output_error
from torchspeed.optional import optional
from torchspeed.runtime import process_as_found

__all__ = ["export_onnx", "ExportResult", "flatten_inputs", "grow_batch", "convert_onnx_fp16", "fp16_converter",
           "onnx_inputs", "onnx_example", "read_onnx", "OnnxGraph", "save_onnx_copy", "onnx_data_files"]


@dataclass
class ExportResult:
    """What was exported, how, and how far ONNX Runtime's outputs are from PyTorch's."""

    path: str
    exporter: str
    dynamic_batch: bool
    input_name: str
    input_shape: list[Any]
    max_error: dict[int, float] = field(default_factory=dict)  # batch size -> max relative error
    fallback_reason: str | None = None
    input_names: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _need(module: str) -> Any:
    return optional(module, "infer", "ONNX export")


class _Flat(nn.Module):
    """Positional tensors in, logits out: the form ONNX export takes, for a model that takes a dict
    (named inputs, Hugging Face style) or several tensors and returns a dict, dataclass or tuple."""

    def __init__(self, model: nn.Module, names: list[str] | None, batch_format: BatchFormat):
        super().__init__()
        self.model, self.names, self.format = model, names, batch_format

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if self.names is None:
            inputs: Any = xs[0] if len(xs) == 1 else tuple(xs)
        else:
            inputs = dict(zip(self.names, xs))
        return self.format.logits_of(self.format.forward(self.model, inputs))


def flatten_inputs(example: Any) -> tuple[list[str], list[torch.Tensor], list[str] | None]:
    """(ONNX input names, tensors, dict keys or None) of a model's inputs: one tensor ('input'), a
    dict of tensors (named by their keys) or a tuple of tensors ('input_0', 'input_1', ...)."""
    if isinstance(example, torch.Tensor):
        return ["input"], [example], None
    if isinstance(example, dict) and example and all(isinstance(v, torch.Tensor) for v in example.values()):
        return list(example), list(example.values()), list(example)
    if isinstance(example, (tuple, list)) and example and all(isinstance(v, torch.Tensor) for v in example):
        return [f"input_{i}" for i in range(len(example))], list(example), None
    raise ValueError("example_input must be a tensor, or a dict or tuple of tensors (the model's inputs), "
                     f"got {type(example).__name__}")


def _export_dynamo(model: nn.Module, xs: tuple[torch.Tensor, ...], names: list[str], path: str,
                   dynamic_batch: bool, opset: int | None) -> None:
    with process_as_found():  # torch.export's first use sets TORCHINDUCTOR_CACHE_DIR and sympy's warning filter
        _need("onnxscript")
        batch = torch.export.Dim("batch", min=1, max=4096)
        # one entry for forward's *xs, holding one spec per tensor
        dyn = (tuple({0: batch} for _ in xs),) if dynamic_batch else None
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(model, xs, None, dynamo=True, dynamic_shapes=dyn, input_names=names,
                                 output_names=["output"], opset_version=opset, optimize=True, verbose=False)
    prog.save(path, external_data=False)


def _export_torchscript(model: nn.Module, xs: tuple[torch.Tensor, ...], names: list[str], path: str,
                        dynamic_batch: bool, opset: int | None) -> None:
    axes = {**{n: {0: "batch"} for n in names}, "output": {0: "batch"}} if dynamic_batch else None
    with process_as_found():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, xs, path, dynamo=False, input_names=names, output_names=["output"],
                          dynamic_axes=axes, opset_version=opset or 17, do_constant_folding=True)


def _ort_session(path: str) -> Any:
    ort = _need("onnxruntime")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def grow_batch(t: torch.Tensor, b: int, gen: torch.Generator) -> torch.Tensor:
    """`t` cut or extended to batch `b`: random rows for float inputs, repeated rows for ids/masks. The
    export check and optimize's verification and timing inputs are all made this way."""
    if t.is_floating_point():
        extra = torch.randn((max(0, b - len(t)),) + tuple(t.shape[1:]), generator=gen, dtype=t.dtype)
        return torch.cat([t, extra.to(t.device)])[:b].contiguous()
    reps = -(-b // len(t))
    return t.repeat(reps, *([1] * (t.ndim - 1)))[:b].contiguous()


def export_onnx(model: nn.Module, example_input: Any, path: str | os.PathLike, dynamic_batch: bool = True,
                opset: int | None = None, check_batch_sizes: tuple[int, int] | None = None,
                exporter: str = "auto", batch_format: BatchFormat | dict | None = None) -> ExportResult:
    """Export `model` (eval mode, fp32, on the CPU) to ONNX at `path`; verify with onnx.checker and ONNX Runtime.

    `example_input` (a tensor, or a dict / tuple of tensors: the model's inputs, named inputs for a
    dict) fixes every dimension but the batch (dynamic unless `dynamic_batch=False`). The graph's one
    output is the logits, read from the model's output by `batch_format` (a dict or dataclass output
    with `.logits` works by default). A model on a GPU is exported from a CPU copy.
    Raises ValueError naming the failing operator when neither exporter can handle the model.
    """
    names, tensors, keys = flatten_inputs(example_input)
    if exporter not in ("auto", "dynamo", "torchscript"):
        raise ValueError(f"exporter must be 'auto', 'dynamo' or 'torchscript', got {exporter!r}")
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if any(p.device.type != "cpu" for p in (*model.parameters(), *model.buffers())):
        model = copy.deepcopy(model).cpu()
    model = model.eval()
    flat = _Flat(model, keys, BatchFormat.of(batch_format)).eval()
    tensors = [as_fp32(t.detach().cpu()).contiguous() for t in tensors]
    n0 = len(tensors[0])
    # torch.export specialises size-1 dimensions: a batch-1 example is repeated to batch 2 for tracing
    xs = tuple(t.repeat(2, *([1] * (t.ndim - 1))) if dynamic_batch and n0 == 1 else t for t in tensors)
    used, fallback_reason = _write_onnx(flat, xs, names, path, dynamic_batch, opset, exporter, type(model).__name__)
    sess = _ort_session(path)
    inp = sess.get_inputs()[0]
    result = ExportResult(path, used, dynamic_batch, inp.name, list(inp.shape), fallback_reason=fallback_reason,
                          input_names=[i.name for i in sess.get_inputs()])
    sizes = check_batch_sizes or ((n0, n0 + 2) if dynamic_batch else (n0,))
    result.max_error = _ort_errors(sess, flat, names, tensors, sizes)
    return result


def _write_onnx(flat: nn.Module, xs: tuple[torch.Tensor, ...], names: list[str], path: str, dynamic_batch: bool,
                opset: int | None, exporter: str, model_name: str) -> tuple[str, str | None]:
    """Export with the dynamo exporter, else TorchScript (`exporter` 'auto'), check the graph and put
    it at `path` only when it passed; (exporter used, why dynamo failed or None)."""
    onnx = _need("onnx")
    tmp = f"{path}.tmp-{os.getpid()}"
    fallback_reason, used = None, None
    try:
        if exporter in ("auto", "dynamo"):
            try:
                _export_dynamo(flat, xs, names, tmp, dynamic_batch, opset)
                used = "dynamo"
            except Exception as e:  # noqa: BLE001 - any exporter failure: try the other one, keep the reason
                fallback_reason = f"dynamo exporter failed: {type(e).__name__}: {_first_line(e)}"
                if exporter == "dynamo":
                    raise ValueError(f"cannot export {model_name} to ONNX: {fallback_reason}") from None
        if used is None:
            try:
                _export_torchscript(flat, xs, names, tmp, dynamic_batch, opset)
                used = "torchscript"
            except Exception as e:  # noqa: BLE001
                msg = f"TorchScript exporter failed: {type(e).__name__}: {_first_line(e)}"
                raise ValueError(f"cannot export {model_name} to ONNX: "
                                 f"{'; '.join(filter(None, [fallback_reason, msg]))}") from None
        onnx.checker.check_model(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return used, fallback_reason


def _ort_errors(sess: Any, flat: nn.Module, names: list[str], tensors: list[torch.Tensor],
                sizes: tuple[int, ...]) -> dict[int, float]:
    """Batch size -> max relative error of ONNX Runtime's outputs against PyTorch's on the same inputs."""
    gen = torch.Generator().manual_seed(0)
    graph_names = [i.name for i in sess.get_inputs()]
    errors = {}
    with torch.inference_mode():
        for b in sizes:
            xb = [grow_batch(t, b, gen) for t in tensors]
            ref = flat(*xb)
            feed = {n: t.numpy() for n, t in zip(names, xb) if n in graph_names}  # an unused input is dropped
            errors[b] = output_error(sess.run(None, feed)[0], ref)["max_rel"]
    return errors


def convert_onnx_fp16(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    """An fp16 copy of an ONNX model for a GPU (ONNX Runtime's CUDA provider): weights and compute in
    fp16, inputs and outputs kept float32 so it is a drop-in for the fp32 model; precision-sensitive
    ops stay fp32 by the converter's block list. Uses onnxconverter-common, else the converter that
    ships with onnxruntime (`onnxruntime.transformers.float16`); ImportError when neither is there."""
    converter = fp16_converter()
    if converter is None:
        raise ImportError("fp16 ONNX conversion needs onnxconverter-common (pip install onnxconverter-common) or "
                          "an onnxruntime that ships onnxruntime.transformers")
    onnx = _need("onnx")
    model = converter.convert_float_to_float16(onnx.load(os.fspath(src)), keep_io_types=True)
    dst = os.fspath(dst)
    with atomic_write(dst, "wb") as f:
        f.write(model.SerializeToString())
    return dst


def _tensors(graph: Any) -> Iterator[Any]:
    """Every tensor a graph holds: initializers (sparse ones too) and node attributes, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def _external(tensor: Any) -> str | None:
    """The file an external tensor's data is in (as the model names it), or None for an inline tensor."""
    if tensor.data_location != 1:  # TensorProto.EXTERNAL
        return None
    return next((e.value for e in tensor.external_data if e.key == "location"), None)


def onnx_data_files(path: str | os.PathLike) -> list[str]:
    """The external data files an ONNX model names (paths beside it); [] when its weights are inline
    or it cannot be parsed."""
    onnx = _need("onnx")
    path = os.fspath(path)
    try:
        graph = onnx.load(path, load_external_data=False).graph
    except Exception:  # noqa: BLE001 - a size estimate only; loading reports a damaged file
        return []
    names = dict.fromkeys(loc for t in _tensors(graph) if (loc := _external(t)))
    return [os.path.join(os.path.dirname(os.path.abspath(path)), n) for n in names]


_PROTOBUF_LIMIT = 2**31 - 2**20  # an ONNX file holds at most 2 GB; a little kept for the graph itself


def save_onnx_copy(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the ONNX model `src` to `dst` with its weights, returning the files written.

    A model whose weights are inline is copied as it is. One with external data (files beside it
    named by its tensors) is read whole and written with the weights inline when they fit protobuf's
    2 GB, else into one `<dst name>.data` file beside `dst`: a copy of the graph alone would not load.
    ValueError naming `src` when its external data cannot be read."""
    onnx = _need("onnx")
    src, dst = os.fspath(src), os.fspath(dst)
    model = onnx.load(src, load_external_data=False)
    if not any(_external(t) for t in _tensors(model.graph)):
        shutil.copyfile(src, dst)
        return [dst]
    try:
        _need("onnx.external_data_helper").load_external_data_for_model(model, os.path.dirname(os.path.abspath(src)))
    except Exception as e:  # noqa: BLE001 - a missing, short or escaping data file: one line naming the model
        raise ValueError(f"cannot read the external data of the ONNX model {src!r}: {_first_line(e)}") from None
    inline = sum(len(t.raw_data) for t in _tensors(model.graph)) + os.path.getsize(src) < _PROTOBUF_LIMIT
    data = f"{os.path.basename(dst)}.data"
    onnx.save_model(model, dst, save_as_external_data=not inline, all_tensors_to_one_file=True, location=data,
                    size_threshold=0)
    return [dst] if inline else [dst, os.path.join(os.path.dirname(dst), data)]


_ONNX_DTYPES = {1: torch.float32, 10: torch.float16, 11: torch.float64, 6: torch.int32, 7: torch.int64, 9: torch.bool}
_LINEAR_OPS = ("MatMul", "Gemm", "LSTM", "GRU", "Attention")


@dataclass(frozen=True)
class OnnxGraph:
    """What optimize reads from an ONNX file, from one parse of it (`read_onnx`): its inputs and how
    its weights are spread, passed along instead of parsing the file again for each question."""

    path: str
    inputs: list[tuple[str, list[int | str | None], torch.dtype]]  # (name, dims, dtype); dynamic dim: its name
    linear_heavy: bool  # more weight elements feed MatMul/Gemm/LSTM/GRU/Attention than Conv: dynamic INT8 pays

    @property
    def input_names(self) -> list[str]:
        return [name for name, _, _ in self.inputs]

    @property
    def fixed_batches(self) -> set[int]:
        """The batch sizes the inputs are fixed at (empty when the batch dimension is dynamic)."""
        return {d[0] for _, d, _ in self.inputs if d and isinstance(d[0], int) and d[0] > 0}


def read_onnx(path: str | os.PathLike) -> OnnxGraph:
    """Parse an ONNX file once (without its external weights) for its inputs and weight spread;
    ValueError naming the file when it is not a readable ONNX model or has inputs optimize cannot feed."""
    onnx = _need("onnx")
    path = os.fspath(path)
    try:
        graph = onnx.load(path, load_external_data=False).graph
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: one line naming it
        raise ValueError(f"{path!r} is not a readable ONNX model: {_first_line(e)}") from None
    sizes = {i.name: math.prod(i.dims) for i in graph.initializer}
    inputs = []
    for inp in graph.input:
        if inp.name in sizes:
            continue
        t = inp.type.tensor_type
        if t.elem_type not in _ONNX_DTYPES:
            raise ValueError(f"ONNX input {inp.name!r} of {path!r} has element type {t.elem_type}, which optimize "
                             "cannot feed (float, int32/64 and bool inputs are supported)")
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        inputs.append((inp.name, dims, _ONNX_DTYPES[t.elem_type]))
    if not inputs:
        raise ValueError(f"the ONNX model {path!r} has no inputs")

    def weights(ops: tuple[str, ...]) -> int:
        return sum(sizes.get(n, 0) for node in graph.node if node.op_type in ops for n in node.input)

    return OnnxGraph(path, inputs, weights(_LINEAR_OPS) > weights(("Conv", "ConvTranspose")))


def onnx_inputs(path: str | os.PathLike) -> list[tuple[str, list[int | str | None], torch.dtype]]:
    """(name, dims, dtype) of each input of an ONNX file; a dynamic dimension is its name (or None)."""
    return read_onnx(path).inputs


def onnx_example(path: str | os.PathLike | OnnxGraph, input_shape: tuple[int, ...] | list[int] | None = None) -> Any:
    """An example input of batch 1 for an ONNX file (or its `read_onnx` graph), its shape read from
    the graph: a tensor for a one-input model, a dict by input name otherwise. A dynamic batch
    dimension becomes 1; any other dynamic dimension must come from `input_shape` (one-input models;
    --input-shape on the command line)."""
    graph = path if isinstance(path, OnnxGraph) else read_onnx(path)
    inputs = graph.inputs
    if input_shape is not None and len(inputs) != 1:
        raise ValueError(f"the ONNX model {graph.path!r} has {len(inputs)} inputs "
                         f"({', '.join(graph.input_names)}); input_shape describes one: pass example_input= "
                         "as a dict of tensors by input name instead")
    gen = torch.Generator().manual_seed(0)
    example = {}
    for name, dims, dtype in inputs:
        if input_shape is not None:
            if len(input_shape) != len(dims):
                raise ValueError(f"input shape {tuple(input_shape)} has {len(input_shape)} dimensions but the ONNX "
                                 f"input {name!r} has {len(dims)}: {dims}")
            fixed = [d for d, g in zip(input_shape, dims) if isinstance(g, int) and g > 0 and g != d]
            if fixed:
                raise ValueError(f"input shape {tuple(input_shape)} does not fit the ONNX input {name!r} "
                                 f"(fixed dimensions {dims})")
            shape = [int(d) for d in input_shape]
        else:
            shape = [d if isinstance(d, int) and d > 0 else (1 if i == 0 else None) for i, d in enumerate(dims)]
            if None in shape:
                raise ValueError(f"the ONNX input {name!r} has dynamic dimensions {dims}: give the input shape "
                                 "(--input-shape N,C,H,W, or example_input= / input_shape= in the API)")
        if dtype.is_floating_point:
            example[name] = torch.randn(shape, generator=gen).to(dtype)
        else:
            example[name] = torch.zeros(shape, dtype=dtype)
    return next(iter(example.values())) if len(example) == 1 else example


def fp16_converter() -> Any:
    """The float16 conversion module to use, or None (imported lazily: it pulls in extra libraries)."""
    for name in ("onnxconverter_common.float16", "onnxruntime.transformers.float16"):
        try:
            return optional(name, "pip install onnxconverter-common", "fp16 ONNX conversion")
        except ImportError:
            continue
    return None


def _first_line(e: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # the exporters colour their messages
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:  # the exporter's own summary line is more useful than a traceback header
        if "unsupported" in ln.lower() or "no symbolic" in ln.lower() or "not supported" in ln.lower():
            return ln[:300]
    return (lines[0] if lines else repr(e))[:300]
