"""BatchNorm running statistics re-estimated on data (forward passes only, no training).

After pruning (channels removed, the remaining ones now see other inputs), after training on crops
and evaluating on whole images, or after any change to the layers before a BatchNorm, its stored
running mean and variance no longer describe what it sees at inference; accuracy drops although
the weights are fine. A few hundred representative samples, passed forward in training mode with
the statistics reset and then averaged over all of them, give the statistics of those samples.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from torchspeed.batches import batch_size, split_batch, to_device

__all__ = ["recalibrate_bn"]

log = logging.getLogger(__name__)


def _inputs(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch  # inputs alone
    return split_batch(batch)[0]


def recalibrate_bn(model: nn.Module, batches: Iterable[Any], limit: int | None = None) -> nn.Module:
    """Re-estimate every BatchNorm's running mean and variance on `batches`; return the model in eval mode.

    `batches` are `(inputs, targets)` batches (tuples or dicts, as a loader yields them; the targets
    are not used) or input tensors alone. Each BatchNorm's statistics are reset and then averaged
    over the batches, each weighted by its number of samples: the running mean is exactly the mean of
    that data, the running variance the weighted average of the batches' variances. `limit` caps the
    samples used. Only the BatchNorm buffers change: no gradient is computed, no
    weight is touched, each layer's momentum is restored. Inputs follow the model to its device.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"recalibrate_bn needs an nn.Module, got {type(model).__name__}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive number of samples or None, got {limit!r}")
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        log.warning("recalibrate_bn: the model has no BatchNorm layer; nothing to re-estimate")
        return model.eval()
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    momenta = [m.momentum for m in bns]
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in bns]  # restored if nothing is seen
    for m in bns:
        m.reset_running_stats()
    seen = 0
    model.train()
    try:
        with torch.no_grad():
            for batch in batches:
                x = _inputs(batch)
                if limit is not None and seen + batch_size(x) > limit:
                    x = x[: limit - seen]
                n = batch_size(x)
                for m in bns:  # running = average of the batch statistics so far, each weighted by its samples
                    m.momentum = n / (seen + n)
                model(to_device(x, device))
                seen += n
                if limit is not None and seen >= limit:
                    break
        if seen == 0:
            raise ValueError("recalibrate_bn: the batches were empty; pass a few hundred representative samples")
    except BaseException:
        for m, state in zip(bns, saved):  # a failed or empty pass leaves the statistics as they were
            m.load_state_dict(state)
        raise
    finally:
        for m, momentum in zip(bns, momenta):
            m.momentum = momentum
        model.eval()
    log.info("recalibrate_bn: running statistics of %d BatchNorm layers re-estimated on %d samples", len(bns), seen)
    return model
