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

from torchspeed.batches import map_tensors
from torchspeed.runtime import FLOAT_PRECISIONS, precision_dtype

__all__ = ["PrecisionModel", "to_precision", "output_error"]


class PrecisionModel(nn.Module):
    """Runs `model` at `precision` ('fp32', 'bf16', 'fp16') by 'autocast' or 'weights'; float32 in and out."""

    def __init__(self, model: nn.Module, precision: str = "bf16", mode: str = "autocast", channels_last: bool = False):
        super().__init__()
        if precision not in FLOAT_PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(FLOAT_PRECISIONS)}, got {precision!r}")
        if mode not in ("autocast", "weights"):
            raise ValueError(f"mode must be 'autocast' or 'weights', got {mode!r}")
        self.precision, self.mode, self.channels_last = precision, mode, channels_last
        self.dtype = precision_dtype(precision)
        self.model = model.eval()
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        if mode == "weights" and precision != "fp32":
            self.model = self.model.to(self.dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's inputs as it takes them (one tensor, several, or keywords); float32 outputs."""
        if self.channels_last:
            args, kwargs = map_tensors(lambda t: t.contiguous(memory_format=torch.channels_last)
                                       if t.ndim == 4 and t.is_floating_point() else t, (args, kwargs))
        if self.precision == "fp32":
            return self.model(*args, **kwargs)
        if self.mode == "weights":
            args, kwargs = map_tensors(lambda t: t.to(self.dtype) if t.is_floating_point() else t, (args, kwargs))
            return _to_float(self.model(*args, **kwargs))
        devices: list[torch.device] = []
        map_tensors(lambda t: devices.append(t.device), (args, kwargs))  # autocast where the inputs are
        with torch.autocast(devices[0].type if devices else "cpu", dtype=self.dtype):
            return _to_float(self.model(*args, **kwargs))


def as_fp32(t: torch.Tensor) -> torch.Tensor:
    """A floating tensor as float32 (what the runners take and give); ids, masks and flags as they are."""
    return t.float() if t.is_floating_point() else t


def _to_float(out: Any) -> Any:
    """Floating tensors in an output (a tensor, tuple, dict, or a dataclass-style object with `.logits`) as float32."""
    if isinstance(out, (torch.Tensor, tuple, list, dict)):
        return map_tensors(as_fp32, out)
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        try:
            out.logits = out.logits.float()
        except AttributeError:  # a frozen output: its logits are read as they are (output_error works in float64)
            pass
    return out


def to_precision(model: nn.Module, precision: str = "bf16", mode: str = "autocast", channels_last: bool = False,
                 copy_model: bool = True) -> PrecisionModel:
    """A copy of `model` that runs at `precision` (see `PrecisionModel`); the original is untouched."""
    return PrecisionModel(copy.deepcopy(model) if copy_model else model, precision, mode, channels_last)


def output_error(out: Any, ref: Any) -> dict[str, float]:
    """Errors of `out` against `ref` (tensors or arrays): max_abs, max_rel (max |diff| / max |ref|), rel_l2."""
    # on the CPU: a GPU runner's outputs are compared with a CPU runtime's (or the reverse)
    a = torch.as_tensor(np.asarray(out) if not isinstance(out, torch.Tensor) else out).detach().cpu().double()
    b = torch.as_tensor(np.asarray(ref) if not isinstance(ref, torch.Tensor) else ref).detach().cpu().double()
    if a.shape != b.shape:
        raise ValueError(f"output shape {tuple(a.shape)} differs from the reference's {tuple(b.shape)}")
    diff = (a - b).abs()
    scale = float(b.abs().max()) or 1.0
    return {
        "max_abs": float(diff.max()) if diff.numel() else 0.0,
        "max_rel": float(diff.max()) / scale if diff.numel() else 0.0,
        "rel_l2": float(torch.linalg.vector_norm(a - b) / (torch.linalg.vector_norm(b) or 1.0)),
    }
