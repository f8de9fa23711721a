"""Activation checkpointing per block: a repeated block (a transformer's layer, a ResNet's BasicBlock) keeps
only its inputs for the backward pass and runs its forward again there, so its activations are not held
between the two (`torch.utils.checkpoint`, non-reentrant). Memory for time: the memory planner chooses how
many blocks (`memory_plan`), as few as the budget needs, and measures whether a larger micro-batch with
blocks checkpointed trains faster per sample than a smaller one with more accumulation.

In place and removable: a block's `forward` is replaced on the instance only (its class, parameters and
state_dict keys unchanged; a deep copy checkpoints its own blocks), and `uncheckpoint_blocks` (or leaving
`blocks_checkpointed`) gives every block its class's forward back. Under `torch.no_grad()` a checkpointed
block runs as it did. Blocks are found as regional compilation finds them (`compiling.repeated_blocks`)
and taken in module order (a CNN's first blocks hold its largest activations). A block with BatchNorm
updates its running statistics again when its forward is re-run in the backward pass.
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchspeed.train.compiling import repeated_blocks

__all__ = ["checkpoint_blocks", "uncheckpoint_blocks", "checkpointed_blocks", "blocks_checkpointed",
           "repeated_blocks"]


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The block's own forward, checkpointed while gradients are recorded."""
    plain = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():
        return plain(*args, **kwargs)
    return checkpoint(plain, *args, use_reentrant=False, **kwargs)


def _is_checkpointed(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is _checkpointed_forward


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """The qualified names of `model`'s submodules checkpointed by `checkpoint_blocks`, in module order."""
    return [name for name, m in model.named_modules() if _is_checkpointed(m)]


def checkpoint_blocks(model: nn.Module, count: int | None = None, names: Sequence[str] | None = None) -> list[str]:
    """Checkpoint the first `count` of `model`'s repeated blocks (all of them when None), or the blocks
    `names`; returns the names now checkpointed. A model without repeated blocks, a count past them, or a
    block whose forward was already replaced by someone else is a ValueError."""
    found = repeated_blocks(model)
    if names is None:
        if not found:
            raise ValueError(f"{type(model).__name__} has no repeated blocks to checkpoint (one module class at least "
                             "twice in an nn.ModuleList or nn.Sequential, such as a transformer's layers)")
        if count is not None and not (type(count) is int and 0 <= count <= len(found)):
            raise ValueError(f"count = {count!r}: {type(model).__name__} has {len(found)} repeated blocks")
        names = found[:count] if count is not None else found
    for name in names:
        block = model.get_submodule(name)
        if "forward" in block.__dict__ and not _is_checkpointed(block):
            raise ValueError(f"block {name!r} has its forward replaced on the instance already; it is left as it is")
    for name in names:
        block = model.get_submodule(name)
        block.forward = types.MethodType(_checkpointed_forward, block)
    return checkpointed_blocks(model)


def uncheckpoint_blocks(model: nn.Module) -> None:
    """Every block `checkpoint_blocks` changed runs its class's forward again."""
    for m in model.modules():
        if _is_checkpointed(m):
            del m.forward


@contextlib.contextmanager
def blocks_checkpointed(model: nn.Module, count: int | None = None) -> Iterator[list[str]]:
    """`checkpoint_blocks(model, count)` inside the block; the model as found after it (what was checkpointed
    before stays so, nothing else)."""
    before = checkpointed_blocks(model)
    try:
        yield checkpoint_blocks(model, count) if count != 0 else before
    finally:
        uncheckpoint_blocks(model)
        if before:
            checkpoint_blocks(model, names=before)
