"""Inference: Conv+BN fusion, precision variants, ONNX export, INT8 quantization, runners on each
runtime, and the `optimize` search that keeps the fastest variant that passes its accuracy check.

Module names differ from the public function names (`search` holds `optimize`, `artifact` holds
`load`, `model_input` holds `resolve_model`) so that importing a submodule never shadows the function
of the same name."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torchspeed._lazy import lazy_getattr

if TYPE_CHECKING:
    from torchspeed.infer.artifact import load
    from torchspeed.infer.export import ExportResult, OnnxGraph, convert_onnx_fp16, export_onnx, read_onnx
    from torchspeed.infer.fuse import FuseResult, fuse_conv_bn
    from torchspeed.infer.model_input import ResolvedModel, resolve_model
    from torchspeed.infer.precision import output_error, to_precision
    from torchspeed.infer.quantize import quantize_onnx_dynamic, quantize_onnx_static, quantize_openvino
    from torchspeed.infer.result import OptimizeResult, VariantRow
    from torchspeed.infer.providers import ort_cuda_problem
    from torchspeed.infer.runners import RUNTIMES, OpenVINORunner, OrtRunner, TorchRunner, available_runtimes
    from torchspeed.infer.search import SearchConfig, optimize
    from torchspeed.infer.variants import Variant

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "fuse_conv_bn": "fuse",
    "FuseResult": "fuse",
    "to_precision": "precision",
    "output_error": "precision",
    "export_onnx": "export",
    "ExportResult": "export",
    "read_onnx": "export",
    "OnnxGraph": "export",
    "convert_onnx_fp16": "export",
    "quantize_onnx_static": "quantize",
    "quantize_onnx_dynamic": "quantize",
    "quantize_openvino": "quantize",
    "RUNTIMES": "runners",
    "available_runtimes": "runners",
    "ort_cuda_problem": "providers",
    "TorchRunner": "runners",
    "OrtRunner": "runners",
    "OpenVINORunner": "runners",
    "optimize": "search",
    "SearchConfig": "search",
    "OptimizeResult": "result",
    "VariantRow": "result",
    "Variant": "variants",
    "load": "artifact",
    "resolve_model": "model_input",
    "ResolvedModel": "model_input",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
