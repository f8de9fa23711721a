"""Inference: Conv+BN fusion, precision variants, ONNX export, INT8 quantization, runtimes, and the
`optimize` search that keeps the fastest variant that passes its accuracy check."""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it; modules load on first use
_EXPORTS = {
    "fuse_conv_bn": "fuse",
    "to_precision": "precision",
    "output_error": "precision",
    "export_onnx": "export",
    "quantize_onnx_static": "quantize",
    "quantize_onnx_dynamic": "quantize",
    "quantize_openvino": "quantize",
    "available_backends": "runtimes",
    "TorchRunner": "runtimes",
    "OrtRunner": "runtimes",
    "OpenVINORunner": "runtimes",
    "optimize": "optimize",
    "OptimizeResult": "optimize",
    "Candidate": "optimize",
    "load": "load",
    "create_model": "models",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"torchspeed.infer.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'torchspeed.infer' has no attribute {name!r}")
