"""Inference: Conv+BN fusion, precision variants, ONNX export, INT8 quantization, runtimes, and the
`optimize` search that keeps the fastest variant that passes its accuracy check.

Module names differ from the public function names (`search` holds `optimize`, `artifact` holds
`load`) so that importing a submodule never shadows the function of the same name."""
from __future__ import annotations

from torchspeed._lazy import lazy_getattr

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "fuse_conv_bn": "fuse",
    "to_precision": "precision",
    "output_error": "precision",
    "export_onnx": "export",
    "convert_onnx_fp16": "export",
    "quantize_onnx_static": "quantize",
    "quantize_onnx_dynamic": "quantize",
    "quantize_openvino": "quantize",
    "available_backends": "runtimes",
    "ort_cuda_problem": "runtimes",
    "TorchRunner": "runtimes",
    "OrtRunner": "runtimes",
    "OpenVINORunner": "runtimes",
    "optimize": "search",
    "OptimizeResult": "search",
    "VariantResult": "search",
    "Variant": "search",
    "load": "artifact",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
