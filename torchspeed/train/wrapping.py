"""The user's model and loader wrapped so that an unchanged loop runs the way accelerate() chose
(`AcceleratedModel`, `DeviceLoader`). Train never imports torchspeed.data: a loader is known by the
protocols of `torchspeed.loader_contract`."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from torchspeed.batches import map_tensors, to_device
from torchspeed.loader_contract import Stateful, conforms
from torchspeed.runtime import rng_state, set_rng_state
from torchspeed.train.mixed_precision import autocast_once

__all__ = ["AcceleratedModel", "DeviceLoader", "class_count", "example_batch_of", "inputs_in_layout", "outputs_fp32",
           "warn_if_unsharded"]

log = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)


def inputs_in_layout(module: nn.Module, args: Any, kwargs: Any, channels_last: bool = True) -> tuple[Any, Any]:
    """A forward pre-hook (`with_kwargs=True`, the layout bound with functools.partial): 4-D float inputs
    in the chosen memory format where they enter `module`, as AcceleratedModel does (for a loop it does
    not run, e.g. Lightning's)."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return map_tensors(lambda t: t.contiguous(memory_format=layout) if t.dim() == 4 and t.is_floating_point() else t,
                       (args, kwargs))


def outputs_fp32(out: Any) -> Any:
    """bf16/fp16 tensors in a model's output as fp32 (the loss and metrics then compute in fp32): a tensor,
    tuples / lists / dicts of them (a GPT's `(logits, loss)`), nested. Mappings keep their type (a Hugging
    Face ModelOutput keeps `.logits` and `.loss`): changed in place; a dataclass output is a copy."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.dtype in _HALF else out
    if isinstance(out, Mapping) and type(out) is not dict:
        for k in list(out.keys()):
            out[k] = outputs_fp32(out[k])  # type: ignore[index]
        return out
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{f.name: outputs_fp32(getattr(out, f.name))
                                           for f in dataclasses.fields(out) if f.init})
    if isinstance(out, (dict, tuple, list)):
        return map_tensors(outputs_fp32, out, leaf=object)
    return out


class AcceleratedModel(nn.Module):
    """The user's model (`module`) run at the precision and memory format accelerate() chose: inputs moved
    to the device and memory format where they enter, the forward under autocast (unless already on at
    that dtype), floating outputs in fp32 for the loss (as Accelerate's `convert_outputs_to_fp32` and
    Fabric's `_FabricModule` do). `wrapped` runs the forward (the model or its DDP / FSDP / compile
    wrapper). State_dict, parameter names and attributes the wrapper lacks are the user's model's (no
    `module.` / `_orig_mod.` prefixes; `model.fc = nn.Linear(...)` reaches it), so checkpoints load both
    ways; a container (nn.Sequential, ModuleList, ModuleDict) keeps `len`, iteration and `model[i]`.

    `timed_step`: (what accelerate()'s trials ran, how many arguments its forward got); the loop's first
    training forward that gets another number of arguments is one WARNING (the choices were measured on
    another step: e.g. `model(x)` timed while the loop runs `model(x, y)`)."""

    def __new__(cls, module: nn.Module | None = None, *args: Any, **kwargs: Any) -> AcceleratedModel:
        container = cls is AcceleratedModel and hasattr(type(module), "__len__") and hasattr(type(module), "__iter__")
        return super().__new__(_AcceleratedContainer if container else cls)

    def __init__(self, module: nn.Module, wrapped: nn.Module, device: torch.device, precision: str,
                 channels_last: bool, timed_step: tuple[str, int] | None = None):
        super().__init__()
        self._forward_module = wrapped
        self._original_module = module
        self.device, self.precision, self.channels_last = device, precision, channels_last
        self._timed_step = timed_step  # checked against the loop's first training forward, then None
        self._ts_ready = True

    @property
    def module(self) -> nn.Module:
        return self._original_module

    @property
    def wrapped(self) -> nn.Module:
        return self._forward_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_timed_step") is not None and torch.is_grad_enabled() and self.training:
            self._check_step(args, kwargs)
        args, kwargs = to_device((args, kwargs), self.device, self.channels_last)
        with autocast_once(self.device, self.precision):
            out = self._forward_module(*args, **kwargs)
        return out if self.precision == "fp32" else outputs_fp32(out)

    def _check_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The loop's first training forward: said once when it gets another number of arguments than the
        step accelerate() timed."""
        timed, n_timed = self.__dict__["_timed_step"]
        self.__dict__["_timed_step"] = None
        n = sum(a is not None for a in args) + sum(v is not None for v in kwargs.values())
        if n != n_timed:
            log.warning("accelerate(): the trials timed the step %s (%d argument(s) to the forward), but the loop's "
                        "first training forward got %d: the choices were measured on another step. Give "
                        "accelerate() the loop's step: loss_fn= for a loss computed outside the model, no loss_fn "
                        "for a model that takes the targets and returns its loss, batch_format=BatchFormat(inputs="
                        "...) for other arguments; refresh=True measures again", timed, n_timed, n)

    # the user's model's names, not the wrapper's: checkpoints and optimizers see the plain model
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self._original_module.named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self._original_module.named_buffers(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_modules", {}).get("_original_module")
            if original is None:
                raise
            return getattr(original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_ts_ready"):
            super().__setattr__(name, value)
            return
        original = self._original_module
        mine = name in self.__dict__ or name in self._modules or name in self._parameters or hasattr(type(self), name)
        if hasattr(original, name) or not mine:
            setattr(original, name, value)
        if mine:
            super().__setattr__(name, value)

    def __getitem__(self, index: Any) -> Any:  # an nn.Sequential / ModuleList / ModuleDict model
        return self._original_module[index]

    def __repr__(self) -> str:
        return (f"AcceleratedModel(precision={self.precision}, channels_last={self.channels_last}, "
                f"device={self.device}):\n{self._original_module!r}")


class _AcceleratedContainer(AcceleratedModel):
    """An AcceleratedModel of a container model: len() and iteration are the user's model's (defined only
    here, so any other model stays without len() and is never taken for an iterable)."""

    def __len__(self) -> int:
        return len(self._original_module)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._original_module)


class DeviceLoader:
    """The user's loader, each batch moved to `device` (non_blocking; pinned first on CUDA) with 4-D
    float tensors in the chosen memory format. Every other attribute is the user's loader's."""

    yields_device_batches = True

    def __init__(self, loader: Any, device: torch.device, channels_last: bool):
        self.loader, self.device, self.channels_last = loader, device, channels_last

    def __iter__(self) -> Iterator[Any]:
        pin = self.device.type == "cuda"
        for batch in self.loader:
            if pin:
                batch = map_tensors(lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t,
                                    batch)
            yield to_device(batch, self.device, self.channels_last)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if loader is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(loader, name)

    def __repr__(self) -> str:
        return f"DeviceLoader({self.loader!r}, device={self.device}, channels_last={self.channels_last})"


def example_batch_of(loader: Any) -> Any:
    """The loader's first batch, taken without moving any RNG, the loader's generator or its position
    (its state_dict), so the run that follows sees the same batches as without it."""
    saved = rng_state()
    gen = getattr(loader, "generator", None)
    gen_state = gen.get_state() if isinstance(gen, torch.Generator) else None
    position = loader.state_dict() if conforms(loader, Stateful) else None
    try:
        batch = next(iter(loader))  # the iterator is let go at once (a DataLoader's workers with it)
    except StopIteration:
        raise ValueError("the training loader is empty") from None
    finally:
        set_rng_state(saved)
        if gen_state is not None:
            gen.set_state(gen_state)
        if position is not None:
            loader.load_state_dict(position)
    return batch


def class_count(loader: Any) -> int | None:
    """How many classes the loader's dataset names (torchvision's `classes` convention), if it does."""
    classes = getattr(getattr(loader, "dataset", None), "classes", None)
    return len(classes) if isinstance(classes, (list, tuple)) and classes else None


def warn_if_unsharded(loader: Any, world_size: int) -> None:
    """Under torchrun a DataLoader without a DistributedSampler gives every rank all the data: say so."""
    if world_size <= 1 or not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    if any(isinstance(s, DistributedSampler) for s in samplers):
        return
    log.warning("accelerate(): the loader is a DataLoader without a DistributedSampler under torchrun (world of %d), "
                "so each rank would see all the data; build it with sampler=torch.utils.data.DistributedSampler("
                "dataset) (and call sampler.set_epoch(epoch) each epoch), or use ts.data.fast_loader, which shards "
                "itself", world_size)
