"""Size and speed of a model on one input: parameters, multiply-accumulates, latency.

Pruning and backbone selection both report these, measured the same way: MACs from
`torch.utils.flop_counter` (every conv / matmul the forward really runs, whatever the model's
source), latency through torchspeed.measure (warm-up excluded, median of repeats).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from torchspeed.runtime import FLOAT_PRECISIONS, precision_dtype, process_as_found, synchronize

__all__ = ["count_params", "count_macs", "inference_fn"]


def count_params(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def count_macs(model: nn.Module, example_input: torch.Tensor) -> int:
    """Multiply-accumulates of one forward pass on `example_input` (FLOPs of conv/matmul / 2)."""
    was_training = model.training
    model.eval()
    try:
        # a dispatch mode's first use imports torch._dynamo (TORCHINDUCTOR_CACHE_DIR, sympy's warning filter)
        with process_as_found(), FlopCounterMode(display=False) as counter, torch.no_grad():
            model(example_input)
    finally:
        model.train(was_training)
    return int(counter.get_total_flops() // 2)


def inference_fn(model: nn.Module, example_input: torch.Tensor, precision: str = "fp32") -> Callable[[], None]:
    """A no-argument callable running one inference forward pass, for torchspeed.measure to time.

    `precision` is "fp32", or "bf16" / "fp16" for autocast on the input's device. The model must
    already be on that device and in eval mode.
    """
    device = example_input.device
    if precision == "fp32":
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    elif precision in FLOAT_PRECISIONS:
        dtype = precision_dtype(precision)

        def autocast() -> contextlib.AbstractContextManager:
            return torch.autocast(device.type, dtype=dtype)
    else:
        raise ValueError(f"precision must be one of {', '.join(map(repr, FLOAT_PRECISIONS))}, got {precision!r}")

    def run() -> None:
        with torch.inference_mode(), autocast():
            model(example_input)
        synchronize(device)

    return run
