"""What train and doctor may ask of a loader, written down as protocols.

Training takes any iterable of batches. Some loaders can do more, and the Trainer, `accelerate` and
doctor use what a loader can do without importing the loader's module (a FastLoader is one of
`torchspeed.data`, a layer beside `train`, so neither knows the other's classes):

- `DeviceBatches`: its batches are already on the device, normalised (no `.to(device)` needed);
- `Resumable`: it knows its place in an epoch and starts its next pass where a saved state left off;
- `Recountable`: it can be rebuilt with other worker/thread counts, same data, order and position,
  and names the data it reads (the key of a remembered choice);
- `EpochOrdered`: its epoch order is DistributedSampler's (seed + epoch, rank r of K reading every
  K-th sample), so a checkpoint taken mid-epoch by K ranks can be continued by another number, each
  rank reading its part of the samples nobody read (`continue_epoch`).

`conforms(loader, Protocol)` checks that the members exist, also on a wrapper that forwards them through
`__getattr__` (which `isinstance` on a protocol no longer sees from Python 3.12 on); what they mean is
what each docstring says, and `tests/test_loader_contract.py` holds FastLoader to it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["DeviceBatches", "Stateful", "Resumable", "Recountable", "EpochOrder", "EpochOrdered", "conforms",
           "yields_device_batches", "release_workers"]


@runtime_checkable
class DeviceBatches(Protocol):
    """Batches arrive on the training device, normalised, in the chosen memory format (when true)."""

    yields_device_batches: bool


@runtime_checkable
class Stateful(Protocol):
    """Its position saved by `state_dict()` and put back by `load_state_dict(state)` (torchdata's
    StatefulDataLoader too, which has no `set_epoch`): what reads a batch ahead puts it back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class Resumable(Protocol):
    """A position within an epoch that survives a restart: `state_dict()` is plain JSON-able values;
    after `load_state_dict(state)` the next pass starts at the first batch not seen when it was taken.
    `set_epoch(epoch)` starts epoch `epoch` (its shuffle) from its first batch."""

    def set_epoch(self, epoch: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class Recountable(Protocol):
    """Rebuildable with `num_workers` worker processes (or, at 0, `threads` threads of this process):
    same data, order, epoch and position. `identity()` names what its batches depend on (JSON-able)."""

    @property
    def num_workers(self) -> int: ...

    def with_counts(self, num_workers: int, threads: int = 1) -> Recountable: ...

    def identity(self) -> dict[str, Any]: ...


@runtime_checkable
class EpochOrder(Protocol):
    """A batch sampler in DistributedSampler's order: `n` samples, a permutation seeded by `seed` +
    `epoch` when `shuffle`, padded by wrapping around, rank r of `num_replicas` reading every
    `num_replicas`-th sample, `batch_size` samples a batch; `order` is None (a source's own order,
    e.g. tar shards read shard by shard, is not this one)."""

    n: int
    seed: int
    shuffle: bool
    epoch: int
    batch_size: int
    order: Any

    @property
    def num_replicas(self) -> int: ...


@runtime_checkable
class EpochOrdered(Resumable, Protocol):
    """A resumable loader whose `sampler` is an `EpochOrder`, which can continue an epoch that another
    number of ranks began: `continue_epoch(epoch, first, share)` makes its next pass epoch `epoch`
    from batch `first` on, reading the sample indices `share` (this rank's part of what is left)."""

    @property
    def sampler(self) -> Any: ...

    def continue_epoch(self, epoch: int, first: int, share: Sequence[int]) -> None: ...


def conforms(obj: Any, protocol: type) -> bool:
    """Whether `obj` has every member of `protocol` (one of those above), found as `getattr` finds them:
    a wrapper forwarding its loader's attributes conforms as its loader does."""
    members = {name for cls in protocol.__mro__ if cls not in (object, Protocol)
               for name in (*vars(cls), *getattr(cls, "__annotations__", {}))
               if not name.startswith("_")}
    return all(hasattr(obj, name) for name in members)


def yields_device_batches(loader: Iterable[Any]) -> bool:
    """Whether `loader`'s batches are already on the device (a `DeviceBatches` saying so)."""
    return conforms(loader, DeviceBatches) and bool(loader.yields_device_batches)


def release_workers(loader: Any) -> None:
    """Stop a loader's worker processes now instead of whenever it is collected, so the next thing is
    timed on quiet cores (a FastLoader's DataLoader is its `dataloader`; a loader of threads has none)."""
    dl = getattr(loader, "dataloader", loader)
    it = getattr(dl, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
        dl._iterator = None
