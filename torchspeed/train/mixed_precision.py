"""What a training precision means for a step: its autocast, its GradScaler, the options worth trying.

The precisions are runtime's (`FLOAT_PRECISIONS`, dtype by `precision_dtype`): a new one is a
runtime entry, and everything here follows from its dtype. Mixed precision keeps fp32 weights and
autocasts the forward; fp16 also scales the loss (a GradScaler, CUDA only).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from torchspeed.runtime import default_precision, precision_dtype

__all__ = ["autocast_for", "autocast_once", "grad_scaler", "precision_options", "SCALED"]

SCALED = ("fp16",)  # precisions whose gradients need a GradScaler (CUDA only)


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """torch.autocast at `precision` on `device` (a no-op context for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision_dtype(precision))


def autocast_once(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast at `precision` on `device`, unless it is already on at that dtype (a caller's own
    `with acc.autocast()` around the model): nested autocast would only add overhead. fp32: nothing."""
    if precision != "fp32" and torch.is_autocast_enabled(device.type) \
            and torch.get_autocast_dtype(device.type) == precision_dtype(precision):
        return contextlib.nullcontext()
    return autocast_for(device, precision)


def grad_scaler(precision: str) -> torch.amp.GradScaler | None:
    """The GradScaler a precision's steps need (fp16 on CUDA), else None."""
    return torch.amp.GradScaler("cuda") if precision in SCALED else None


def precision_options(device: torch.device) -> list[str]:
    """The precisions worth timing on `device`: fp32 and the fastest one it runs natively."""
    best = default_precision(device).name
    return ["fp32"] if best == "fp32" else ["fp32", best]
