"""Everything doctor changes in torch, as one table: `PATCHES`. Each entry names what it wraps (an
attribute, or a global hook registry), the wrapper that reports each event to the `Recorder` through
its public methods, and its undo; `Recorder.install()` applies the table and `uninstall()` puts every
original back. Wrappers pass straight through to the original when recording is off (`rec.enabled`:
off in loader workers, in other threads than the loop's, and after the script ends).

What each entry records (the phase, the settings) is the table of docs/doctor.md ("How it measures
without touching your code"). Not obvious from the code: torchspeed's FastLoader is patched by its
public name `torchspeed.data:FastLoader` (wherever its module is), and its inner DataLoader, iterated
by a prefetch thread, is not counted again; nn.Modules called while a batch is loaded (transforms) or
during backward (activation checkpointing) are not forwards; a host read of a CPU tensor waits for
nothing and is not counted as a sync.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchspeed.doctor.datafix import describe

if TYPE_CHECKING:
    from torchspeed.doctor.recorder import Recorder

__all__ = ["PATCHES", "AttrPatch", "HookPatch"]


def _resolve(path: str) -> Any:
    """The object at "package.module" or "package.module:Class[.Attr]" (a package's lazy public name too)."""
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class AttrPatch:
    """`owner.attr` replaced by `wrap(rec, original)` (which keeps the original's name and docstring);
    the undo puts the original back, or deletes the replacement where the owner only inherited it."""

    owner: str  # "package.module" or "package.module:Class"
    attr: str
    wrap: Callable[[Recorder, Any], Callable[..., Any]]
    optional: bool = False  # an owner this torch does not have is skipped

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.attr}"

    def target(self) -> Any:
        return _resolve(self.owner)

    def apply(self, rec: Recorder) -> Callable[[], None] | None:
        try:
            owner = self.target()
        except (ImportError, AttributeError):
            if self.optional:
                return None
            raise
        original = getattr(owner, self.attr)
        own = self.attr in vars(owner)
        stored = vars(owner)[self.attr] if own else None  # what __dict__ holds (a descriptor stays one)
        replacement = self.wrap(rec, original)
        replacement.__name__ = getattr(original, "__name__", self.attr)
        replacement.__doc__ = getattr(original, "__doc__", None)
        setattr(owner, self.attr, replacement)

        def undo() -> None:
            if own:
                setattr(owner, self.attr, stored)
            else:
                delattr(owner, self.attr)
        return undo


@dataclass(frozen=True)
class HookPatch:
    """A global torch hook: `register(make(rec), **kwargs)`; the undo removes it by its handle."""

    register: str  # "package.module:register_function"
    make: Callable[[Recorder], Callable[..., Any]]
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return self.register.replace(":", ".")

    def apply(self, rec: Recorder) -> Callable[[], None]:
        handle = _resolve(self.register)(self.make(rec), **dict(self.kwargs))
        return handle.remove


# DataLoader: worker start-up in __iter__, the wait for each batch in __next__ -------------------
def _dataloader_iter(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def dl_iter(loader):
        if not rec.enabled:
            return orig(loader)
        images = {}
        if id(loader) not in rec.loaders:  # what it reads, once: the data fix of --try needs image files
            images = {"images": d} if (d := describe(loader)) else {}
        rec.loader_pass(loader, "DataLoader", num_workers=loader.num_workers, pin_memory=bool(loader.pin_memory),
                        batch_size=loader.batch_size, persistent_workers=bool(loader.persistent_workers),
                        length=_length(loader), **images)
        with rec.phase("data"):
            it = orig(loader)
        it._ts_doctor_loader = id(loader)
        return it
    return dl_iter


def _length(loader: Any) -> int | None:
    """Batches per epoch (an IterableDataset's loader may not know)."""
    try:
        return len(loader)
    except TypeError:
        return None


def _dataloader_next(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def dl_next(it):
        if not rec.enabled:
            return orig(it)
        return rec.next_batch(lambda: orig(it), getattr(it, "_ts_doctor_loader", None))
    return dl_next


# torchspeed's FastLoader: its batches come from threads or a prefetcher, so what the loop waits
# for is the FastLoader's next(), not a DataLoader's --------------------------------------------
def _fast_loader_iter(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def fast_iter(loader):
        inner = orig(loader)
        if not rec.enabled:
            return inner
        inside = loader.dataloader  # its own DataLoader: what its worker processes are
        rec.loader_pass(loader, "FastLoader", num_workers=loader.num_workers, threads=loader.threads,
                        background=True, pin_memory=bool(inside.pin_memory), batch_size=loader.batch_size,
                        persistent_workers=bool(inside.persistent_workers))
        return _timed_batches(rec, inner, id(loader))
    return fast_iter


def _timed_batches(rec: Recorder, inner: Any, key: int) -> Any:
    try:
        while True:
            if not rec.enabled:
                yield from inner
                return
            try:
                batch = rec.next_batch(lambda: next(inner), key)
            except StopIteration:
                return
            yield batch
    finally:
        inner.close()  # a loop left early stops the loader's threads now


# module forward, through torch's global forward hooks ------------------------------------------
def _forward_pre(rec: Recorder) -> Callable[..., Any]:
    def pre(module, args):
        return rec.forward_begin(module, args) if rec.enabled else None
    return pre


def _forward_post(rec: Recorder) -> Callable[..., Any]:
    def post(module, args, kwargs, output):  # with_kwargs: a model called as model(**batch) shows its batch here
        return rec.forward_end(module, output, kwargs) if rec.enabled else None
    return post


# backward: torch.autograd.backward (loss.backward() calls it) -----------------------------------
def _backward(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def backward(*a, **k):
        if not rec.enabled:
            return orig(*a, **k)
        loss, depth = rec.backward_begin(a[0] if a else k.get("tensors"))
        try:
            out = orig(*((loss, *a[1:]) if a else a), **k)
        finally:
            rec.unwind(depth)
        rec.backward_end()
        return out
    return backward


# optimizer: step through torch's global optimizer hooks (each step ends a step window), zero_grad
def _optimizer_pre(rec: Recorder) -> Callable[..., None]:
    def opt_pre(opt, args, kwargs):
        if rec.enabled:
            rec.optimizer_step_begin(opt)
    return opt_pre


def _optimizer_post(rec: Recorder) -> Callable[..., None]:
    def opt_post(opt, args, kwargs):
        if rec.enabled:
            rec.optimizer_step_end(opt)
    return opt_post


def _optimizer_init(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def opt_init(opt, *a, **k):
        out = orig(opt, *a, **k)
        rec.optimizer_made(opt)
        return out
    return opt_init


def _zero_grad(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def zero_grad(opt, *a, **k):
        if not rec.enabled or not rec.in_loop:
            return orig(opt, *a, **k)
        with rec.phase("optimizer"):
            return orig(opt, *a, **k)
    return zero_grad


# copies (Tensor.to / .cuda called in the loop itself) and host syncs ----------------------------
def _copying(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def copy(t, *a, **k):
        if not rec.in_loop_itself():
            return orig(t, *a, **k)
        if rec.non_blocking and t.is_pinned():
            k.setdefault("non_blocking", True)
        with rec.phase("copy"):
            out = orig(t, *a, **k)
        rec.copied(t, out, bool(k.get("non_blocking", False)))
        return out
    return copy


def _waits_for_device(t: Any) -> bool:
    """Does reading `t`'s value on the host wait for its device's queue? On CUDA it does (a host sync);
    a CPU tensor's value is already there."""
    return t.is_cuda


def _syncing(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    """A read of a tensor's value on the host (.item(), float(t), bool(t)...) in the loop: counted as a
    host sync when it waits for the device (the `host-syncs` rule reads the count per step)."""
    def sync(t, *a, **k):
        if rec.enabled and rec.in_loop and _waits_for_device(t):
            rec.s["host_syncs"] += 1
        return orig(t, *a, **k)
    return sync


# loss inputs: softmax output fed to cross_entropy / nll_loss (first calls only) -----------------
def _loss_input_check(rec: Recorder, orig: Callable[..., Any], rule: str) -> Callable[..., Any]:
    def checked(input, *a, **k):
        if rec.enabled:
            rec.loss_input(input, rule)
        return orig(input, *a, **k)
    return checked


# attention in training forwards: SDPA calls, and softmax over scores (hand-written attention) ------
def _sdpa(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def sdpa(*a, **k):
        if rec.enabled and rec.clock.current == "forward":
            rec.attention.sdpa_call(rec.model, a, k)
        return orig(*a, **k)
    return sdpa


def _softmax(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def softmax(x, *a, **k):
        if rec.enabled and rec.clock.current == "forward":
            rec.attention.softmax_call(rec.model, x, a[0] if a else k.get("dim"))
        return orig(x, *a, **k)
    return softmax


# settings: a GradScaler made (on only where torch enabled it), torch.compile called --------------
def _grad_scaler_init(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def gs_init(scaler, *a, **k):
        out = orig(scaler, *a, **k)
        asked = k.get("enabled", a[5] if len(a) > 5 else True)  # GradScaler(device, init_scale, ..., enabled)
        rec.grad_scaler_made(scaler, k.get("device", a[0] if a else "cuda"), asked is False)
        return out
    return gs_init


def _compile(rec: Recorder, orig: Callable[..., Any]) -> Callable[..., Any]:
    def compile_(*a, **k):
        rec.s["compiled"] = rec.s["compiled"] or not k.get("disable", False)
        return orig(*a, **k)
    return compile_


PATCHES: tuple[AttrPatch | HookPatch, ...] = (
    AttrPatch("torch.utils.data.dataloader:DataLoader", "__iter__", _dataloader_iter),
    AttrPatch("torch.utils.data.dataloader:_BaseDataLoaderIter", "__next__", _dataloader_next),
    AttrPatch("torchspeed.data:FastLoader", "__iter__", _fast_loader_iter),
    HookPatch("torch.nn.modules.module:register_module_forward_pre_hook", _forward_pre),
    HookPatch("torch.nn.modules.module:register_module_forward_hook", _forward_post,
              (("always_call", True), ("with_kwargs", True))),
    AttrPatch("torch.autograd", "backward", _backward),
    HookPatch("torch.optim.optimizer:register_optimizer_step_pre_hook", _optimizer_pre),
    HookPatch("torch.optim.optimizer:register_optimizer_step_post_hook", _optimizer_post),
    AttrPatch("torch.optim:Optimizer", "zero_grad", _zero_grad),
    AttrPatch("torch:Tensor", "to", _copying),
    AttrPatch("torch:Tensor", "cuda", _copying),
    AttrPatch("torch.optim:Optimizer", "__init__", _optimizer_init),
    *(AttrPatch("torch:Tensor", name, _syncing)
      for name in ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__")),
    AttrPatch("torch.nn.functional", "cross_entropy", functools.partial(_loss_input_check, rule="double-softmax")),
    AttrPatch("torch.nn.functional", "nll_loss", functools.partial(_loss_input_check, rule="softmax-nll")),
    AttrPatch("torch.nn.functional", "scaled_dot_product_attention", _sdpa),
    AttrPatch("torch:Tensor", "softmax", _softmax),
    AttrPatch("torch", "softmax", _softmax),
    AttrPatch("torch.amp:GradScaler", "__init__", _grad_scaler_init, optional=True),
    AttrPatch("torch", "compile", _compile),
)
