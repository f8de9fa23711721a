"""Reduced-precision variants of a model for inference: bf16 / fp16, as autocast or as cast weights,
optionally in channels_last memory format. Each is a drop-in module taking and returning float32,
so it can be checked against the fp32 original on the same inputs.

Autocast keeps precision-sensitive ops (softmax, norms, reductions) in fp32 and is the safe default;
casting the weights is a little faster where every op has a low-precision kernel. channels_last is
the layout oneDNN's convolutions run natively, so on CPU it saves the reorders around every conv.
"""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import nn

from torchspeed.runtime import PRECISIONS, precision_dtype

__all__ = ["PrecisionModel", "to_precision", "output_error"]


class PrecisionModel(nn.Module):
    """Runs `model` at `precision` ('fp32', 'bf16', 'fp16') by 'autocast' or 'weights'; float32 in and out."""

    def __init__(self, model: nn.Module, precision: str = "bf16", mode: str = "autocast", channels_last: bool = False):
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if mode not in ("autocast", "weights"):
            raise ValueError(f"mode must be 'autocast' or 'weights', got {mode!r}")
        self.precision, self.mode, self.channels_last = precision, mode, channels_last
        self.dtype = precision_dtype(precision)
        self.model = model.eval()
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        if mode == "weights" and precision != "fp32":
            self.model = self.model.to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.precision == "fp32":
            return self.model(x)
        if self.mode == "weights":
            return _to_float(self.model(x.to(self.dtype)))
        with torch.autocast(x.device.type, dtype=self.dtype):
            return _to_float(self.model(x))


def _to_float(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.float()
    if isinstance(out, (tuple, list)):
        return type(out)(_to_float(o) for o in out)
    return out


def to_precision(model: nn.Module, precision: str = "bf16", mode: str = "autocast", channels_last: bool = False,
                 copy_model: bool = True) -> PrecisionModel:
    """A copy of `model` that runs at `precision` (see `PrecisionModel`); the original is untouched."""
    return PrecisionModel(copy.deepcopy(model) if copy_model else model, precision, mode, channels_last)


def output_error(out: Any, ref: Any) -> dict[str, float]:
    """Errors of `out` against `ref` (tensors or arrays): max_abs, max_rel (max |diff| / max |ref|), rel_l2."""
    a = torch.as_tensor(np.asarray(out) if not isinstance(out, torch.Tensor) else out).double()
    b = torch.as_tensor(np.asarray(ref) if not isinstance(ref, torch.Tensor) else ref).double()
    if a.shape != b.shape:
        raise ValueError(f"output shape {tuple(a.shape)} differs from the reference's {tuple(b.shape)}")
    diff = (a - b).abs()
    scale = float(b.abs().max()) or 1.0
    return {
        "max_abs": float(diff.max()) if diff.numel() else 0.0,
        "max_rel": float(diff.max()) / scale if diff.numel() else 0.0,
        "rel_l2": float(torch.linalg.vector_norm(a - b) / (torch.linalg.vector_norm(b) or 1.0)),
    }
