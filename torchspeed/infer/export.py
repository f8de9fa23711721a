"""Export to ONNX with a truly dynamic batch dimension, checked in ONNX Runtime against PyTorch.

The dynamo exporter (`torch.onnx.export(dynamo=True)`, needs `onnxscript`) is tried first; if it
fails, the TorchScript exporter is tried and the reason is recorded. Pitfall handled: `torch.export`
specialises a dimension whose example size is 1, so an example of batch 1 would give a model fixed
at batch 1; the example is repeated to batch 2 for tracing. The result is always verified: the ONNX
file passes `onnx.checker`, then runs in ONNX Runtime at two batch sizes next to PyTorch.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed.infer.precision import output_error

__all__ = ["export_onnx", "ExportReport"]


@dataclass
class ExportReport:
    """What was exported, how, and how far ONNX Runtime's outputs are from PyTorch's."""

    path: str
    exporter: str
    dynamic_batch: bool
    input_name: str
    input_shape: list[Any]
    max_error: dict[int, float] = field(default_factory=dict)  # batch size -> max relative error
    fallback_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _need(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"ONNX export needs {module}: pip install 'torchspeed[infer]'") from None


def _export_dynamo(model: nn.Module, x: torch.Tensor, path: str, dynamic_batch: bool, opset: int | None) -> None:
    _need("onnxscript")
    dyn = ({0: torch.export.Dim("batch", min=1, max=4096)},) if dynamic_batch else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(model, (x,), None, dynamo=True, dynamic_shapes=dyn, input_names=["input"],
                                 output_names=["output"], opset_version=opset, optimize=True, verbose=False)
    prog.save(path, external_data=False)


def _export_torchscript(model: nn.Module, x: torch.Tensor, path: str, dynamic_batch: bool, opset: int | None) -> None:
    axes = {"input": {0: "batch"}, "output": {0: "batch"}} if dynamic_batch else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), path, dynamo=False, input_names=["input"], output_names=["output"],
                          dynamic_axes=axes, opset_version=opset or 17, do_constant_folding=True)


def _ort_session(path: str) -> Any:
    ort = _need("onnxruntime")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def export_onnx(model: nn.Module, example_input: torch.Tensor, path: str | os.PathLike, dynamic_batch: bool = True,
                opset: int | None = None, check_batch_sizes: tuple[int, int] | None = None,
                exporter: str = "auto") -> ExportReport:
    """Export `model` (eval mode, fp32) to ONNX at `path`; verify with onnx.checker and ONNX Runtime.

    `example_input` fixes every dimension but the batch (dynamic unless `dynamic_batch=False`).
    Raises ValueError naming the failing operator when neither exporter can handle the model.
    """
    onnx = _need("onnx")
    if not isinstance(example_input, torch.Tensor):
        raise ValueError(f"example_input must be a tensor, got {type(example_input).__name__}")
    if exporter not in ("auto", "dynamo", "torchscript"):
        raise ValueError(f"exporter must be 'auto', 'dynamo' or 'torchscript', got {exporter!r}")
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    model = model.eval()
    x = example_input.detach().float().contiguous()
    if dynamic_batch and x.shape[0] == 1:
        x = x.repeat(2, *([1] * (x.ndim - 1)))  # size-1 dims get specialised by torch.export
    tmp = f"{path}.tmp-{os.getpid()}"
    fallback_reason, used = None, None
    try:
        if exporter in ("auto", "dynamo"):
            try:
                _export_dynamo(model, x, tmp, dynamic_batch, opset)
                used = "dynamo"
            except Exception as e:  # noqa: BLE001 - any exporter failure: try the other one, keep the reason
                fallback_reason = f"dynamo exporter failed: {type(e).__name__}: {_first_line(e)}"
                if exporter == "dynamo":
                    raise ValueError(f"cannot export {type(model).__name__} to ONNX: {fallback_reason}") from None
        if used is None:
            try:
                _export_torchscript(model, x, tmp, dynamic_batch, opset)
                used = "torchscript"
            except Exception as e:  # noqa: BLE001
                msg = f"TorchScript exporter failed: {type(e).__name__}: {_first_line(e)}"
                raise ValueError(f"cannot export {type(model).__name__} to ONNX: "
                                 f"{'; '.join(filter(None, [fallback_reason, msg]))}") from None
        onnx.checker.check_model(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    sess = _ort_session(path)
    inp = sess.get_inputs()[0]
    report = ExportReport(path, used, dynamic_batch, inp.name, list(inp.shape), fallback_reason=fallback_reason)
    n0 = example_input.shape[0]
    sizes = check_batch_sizes or ((n0, n0 + 2) if dynamic_batch else (n0,))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for b in sizes:
            xb = torch.cat([example_input.float(), torch.randn((b,) + tuple(x.shape[1:]), generator=gen)])[:b]
            ref = model(xb)
            ref = ref[0] if isinstance(ref, (tuple, list)) else ref
            out = sess.run(None, {inp.name: xb.numpy()})[0]
            report.max_error[b] = output_error(out, ref)["max_rel"]
    return report


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:  # the exporter's own summary line is more useful than a traceback header
        if "unsupported" in ln.lower() or "no symbolic" in ln.lower() or "not supported" in ln.lower():
            return ln[:300]
    return (lines[0] if lines else repr(e))[:300]
