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

What checkpointing would free is counted in an ordinary step (`SavedByBlock`), so the memory planner needs
no probe step of its own to weigh it.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import types
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from torchspeed.train.compiling import repeated_blocks

__all__ = ["checkpoint_blocks", "uncheckpoint_blocks", "checkpointed_blocks", "blocks_checkpointed",
           "repeated_blocks", "SavedByBlock"]


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


def _storage(t: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    """((device, address), bytes) of a tensor's storage; None for one without (meta, some subclasses)."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return None if s.device.type == "meta" or s.nbytes() == 0 else ((str(s.device), s.data_ptr()), s.nbytes())


class SavedByBlock:
    """What checkpointing the first k `blocks` would free, counted in one ordinary step run inside it
    (`with SavedByBlock(model, blocks, held=batch) as saved: step()`, then `saved.freed(k)`): every
    storage autograd saves for backward (a `saved_tensors_hooks` pair whose pack returns the tensor
    detached: the same values, though autograd's check of a saved tensor changed in place is skipped while
    it counts) by the blocks whose forwards saved it, and each block's tensor inputs, which a checkpointed
    block keeps for its rerun. Not activations: the model's parameters and buffers, and `held` (the batch:
    it lives through the step whatever is checkpointed). A storage is known by its address and a
    generation: an address freed and taken again during the step is another storage.

    A storage is freed by checkpointing blocks C when only blocks in C saved it and no block in C keeps it
    as its input; an input nothing saved is held by the checkpoint where it would have been freed. With
    every block checkpointed, the block nearest the output runs its forward again right where the backward
    starts, which is where a step's peak usually is: its own bytes are not counted as freed then. Elsewhere
    the peak can move (into the backward, where weight gradients pile up), so the planner measures the
    configurations it times."""

    def __init__(self, model: nn.Module, blocks: Sequence[str], held: Any = ()):
        self.model, self.blocks, self.held = model, list(blocks), held
        self.sizes: dict[tuple[tuple[str, int], int], int] = {}
        self.savers: dict[tuple[tuple[str, int], int], set[int]] = {}  # storage -> blocks that saved it (-1: none)
        self.inputs: list[set[tuple[tuple[str, int], int]]] = [set() for _ in self.blocks]
        self._own: set[tuple[str, int]] = set()
        self._holders: dict[tuple[str, int], list[weakref.ref]] = {}  # address -> the tensors seen holding it
        self._generation: dict[tuple[str, int], int] = {}
        self._running: list[int] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SavedByBlock:
        tensors = itertools.chain(self.model.parameters(), self.model.buffers(), _tensors_in(self.held))
        self._own = {found[0] for found in map(_storage, tensors) if found is not None}
        try:
            for i, name in enumerate(self.blocks):
                block = self.model.get_submodule(name)
                self._stack.callback(block.register_forward_pre_hook(functools.partial(self._enter_block, i),
                                                                      with_kwargs=True).remove)
                self._stack.callback(block.register_forward_hook(self._leave_block, always_call=True).remove)
            self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
        self.held = ()  # the batch is not kept alive by the counts (the holders are weak references)
        self._holders.clear()

    def _key(self, t: torch.Tensor, holder: torch.Tensor) -> tuple[tuple[tuple[str, int], int], int] | None:
        """(storage key, bytes) of `t`, `holder` noted as holding it; None for the model's own or the held."""
        found = _storage(t)
        if found is None or found[0] in self._own:
            return None
        address, nbytes = found
        holders = self._holders.get(address)
        if not holders or all(ref() is None for ref in holders):  # the storage seen there before is gone
            self._generation[address] = self._generation.get(address, -1) + 1
            holders = self._holders[address] = []
        holders.append(weakref.ref(holder))
        key = (address, self._generation[address])
        self.sizes[key] = nbytes
        return key, nbytes

    def _enter_block(self, index: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._running.append(index)
        for t in _tensors_in((args, kwargs)):
            found = self._key(t, t)
            if found is not None:
                self.inputs[index].add(found[0])

    def _leave_block(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._running:
            self._running.pop()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        saved = t.detach()
        found = self._key(t, saved)
        if found is not None:
            self.savers.setdefault(found[0], set()).add(self._running[-1] if self._running else -1)
        return saved

    def freed(self, k: int) -> int:
        """Bytes the counted step held for backward that it would not with the first `k` blocks checkpointed
        (negative where the inputs kept outweigh what is freed)."""
        chosen = set(range(k))
        if k and k == len(self.blocks):
            chosen.discard(k - 1)  # checkpointed, but its rerun holds its bytes again where the backward starts
        kept = set().union(*self.inputs[:k])
        freed = sum(self.sizes[s] for s, by in self.savers.items() if by <= chosen and s not in kept)
        return freed - sum(self.sizes[s] for s in kept if s not in self.savers)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) tuple, list or dict."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
