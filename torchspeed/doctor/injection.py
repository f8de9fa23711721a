"""How the bootstrap injects the fixes of one `doctor --try` run into the script's process (the child
side of `fixes`): `FixState` holds them, the Recorder's events call it, and `install` patches what is
global (DataLoader and optimizer constructors, torch's thread count, cudnn.benchmark, the SDPA backend,
the data fix's swap, the length-grouped sampler). Other areas are imported only where their fix applies:
`torchspeed.data` where the data fix swaps a loader (`_fast_loader_for`), `torchspeed.train.compiling`
where regional compilation compiles the model's repeated blocks (`_compile_regions`).
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel
from torch.utils.data import DataLoader, RandomSampler

from torchspeed.doctor.attention import backend
from torchspeed.doctor.datafix import describe, keywords
from torchspeed.doctor.fixes import FUSABLE
from torchspeed.doctor.grouping import LengthGrouped, sample_lengths

__all__ = ["FixState"]


@dataclass
class FixState:
    """The fixes one `--try` run injects; the Recorder's hooks call `forward_pre` / `forward_post` /
    `scale_loss` / `before_step` / `after_step`; everything else is patched at `install`."""

    spec: dict[str, Any]

    def __post_init__(self) -> None:
        self._ctx: list[Any] = []  # per outermost forward: the context entered (or None)
        self._converted: set[int] = set()  # modules made channels_last
        self._compiled: set[int] = set()
        self._regional_pending: Any = None  # the model whose blocks compile at its next training forward
        self.scaler: Any = None
        self.compile_window: int | None = None
        self.notes: dict[str, Any] = {}  # what a fix found while applied (the data fix: same files?)

    def install(self, rec: Any) -> list[Any]:
        """Apply the global parts of the fixes; returns undo callables."""
        undo: list[Any] = []
        spec = self.spec
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
            orig_set = torch.set_num_threads
            torch.set_num_threads = lambda n: None  # the script's own setting would undo the fix
            undo.append(lambda: setattr(torch, "set_num_threads", orig_set))
        if spec.get("cudnn_benchmark"):
            orig_flag = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = True
            undo.append(lambda: setattr(torch.backends.cudnn, "benchmark", orig_flag))
        if spec.get("fp16"):
            self.scaler = torch.amp.GradScaler("cuda")
        loader_kw: dict[str, Any] = {}
        if spec.get("workers"):
            loader_kw["num_workers"] = int(spec["workers"])
        if spec.get("persistent_workers"):
            loader_kw["persistent_workers"] = True
        if spec.get("pin_memory"):
            loader_kw["pin_memory"] = True
            rec.non_blocking = True
        if loader_kw:
            undo.append(_patch_dataloader(loader_kw))
        if spec.get("fast_loader"):
            undo.append(_swap_in_fast_loader(spec["fast_loader"], self.notes.setdefault("fast_loader", {})))
        if spec.get("fused_optimizer"):
            undo.extend(_patch_optimizers())
        if spec.get("sdpa"):
            chosen = sdpa_kernel([backend(spec["sdpa"])])
            chosen.__enter__()
            undo.append(lambda: chosen.__exit__(None, None, None))
        if spec.get("length_grouped"):
            undo.append(_patch_length_grouped(self.notes.setdefault("length_grouped", {
                "applied": False, "reason": "no shuffled DataLoader of token samples (a length per sample) was made"})))
        return undo

    # forward hooks (outermost calls only) -----------------------------------------------------
    def forward_pre(self, rec: Any, module: Any, args: tuple, training: bool) -> tuple | None:
        ctx = None
        new_args = None
        if training:
            p = next(module.parameters(), None)  # where the module runs, whatever its inputs (keywords too)
            dev = p.device.type if p is not None else "cpu"
            if self.spec.get("channels_last"):
                if id(module) not in self._converted:
                    self._converted.add(id(module))
                    module.to(memory_format=torch.channels_last)
                new_args = tuple(a.contiguous(memory_format=torch.channels_last)
                                 if isinstance(a, torch.Tensor) and a.dim() == 4 and a.is_floating_point() else a
                                 for a in args)
            if self.spec.get("bf16") or self.spec.get("fp16"):
                ctx = torch.autocast(dev, dtype=torch.bfloat16 if self.spec.get("bf16") else torch.float16)
            if self.spec.get("compile"):
                self._compile(rec, module)
        elif self.spec.get("inference_mode") and not torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            ctx = torch.inference_mode()
        if ctx is not None:
            ctx.__enter__()
        self._ctx.append(ctx)
        return new_args

    def _compile(self, rec: Any, module: Any) -> None:
        """compile=whole: the outermost training module's forward through torch.compile, from its next
        call on; compile=regional: its repeated blocks, each compiled once (`compile_regions`), at its next
        call. Either way the compile lands in the step after `compile_window`, which `step_times` skips."""
        if self._regional_pending is module:
            self._regional_pending = None
            self.notes["compile"] = _compile_regions(module)
            return
        if id(module) in self._compiled:
            return
        self._compiled.add(id(module))
        self.compile_window = rec.steps
        if self.spec["compile"] == "regional":
            self._regional_pending = module
        else:
            module.forward = torch.compile(module.forward)
            self.notes["compile"] = {"applied": True, "compiled": type(module).__name__}

    def forward_post(self, module: Any, output: Any) -> Any:
        ctx = self._ctx.pop() if self._ctx else None
        if ctx is None:
            return None
        ctx.__exit__(None, None, None)
        if self.spec.get("bf16") or self.spec.get("fp16"):
            return _to_float(output)  # the loss is computed in fp32, as the printed code does
        return None

    # GradScaler (fp16 on CUDA) -------------------------------------------------------------------
    def scale_loss(self, tensors: Any) -> Any:
        if self.scaler is None or not isinstance(tensors, torch.Tensor):
            return tensors
        return self.scaler.scale(tensors)

    def before_step(self, opt: Any) -> None:
        """scaler.step(opt) from outside: unscale; on inf/NaN gradients the step runs on no gradients."""
        if self.scaler is None:
            return
        self.scaler.unscale_(opt)
        found = sum(float(v) for v in self.scaler._found_inf_per_device(opt).values())
        if found:
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None

    def after_step(self, opt: Any) -> None:
        if self.scaler is not None:
            self.scaler.update()


def _to_float(out: Any) -> Any:
    """The floating tensors of a model's output in fp32, as the printed code computes the loss. Dicts are
    changed in place on purpose: a Hugging Face ModelOutput (a dict subclass) keeps its type and fields."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() and out.dtype != torch.float64 else out
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_to_float(o) for o in out)
    if isinstance(out, list):
        return [_to_float(o) for o in out]
    if isinstance(out, dict):
        for k in list(out):
            out[k] = _to_float(out[k])
        return out
    return out


def _patch_dataloader(kw: dict[str, Any]) -> Any:
    """DataLoader.__init__ with `kw` applied: workers only where the script made none; persistent and
    pinned where it has workers / a CUDA device."""
    orig = DataLoader.__init__
    sig = inspect.signature(orig)

    def init(self, *a, **k):
        bound = sig.bind(self, *a, **k)
        args = bound.arguments
        if "num_workers" in kw and not args.get("num_workers"):
            args["num_workers"] = kw["num_workers"]
            args.setdefault("persistent_workers", True)
        if kw.get("persistent_workers") and args.get("num_workers"):
            args["persistent_workers"] = True
        if kw.get("pin_memory"):
            args["pin_memory"] = True
        return orig(*bound.args, **bound.kwargs)

    DataLoader.__init__ = init
    return lambda: setattr(DataLoader, "__init__", orig)


def _patch_optimizers() -> list[Any]:
    """SGD / Adam / AdamW made with fused=True, other torch.optim optimizers with foreach=True, unless
    the script chose either."""
    undo = []
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        params = inspect.signature(cls.__init__).parameters
        key = "fused" if name in FUSABLE and "fused" in params else "foreach" if "foreach" in params else None
        if key is None or "__init__" not in vars(cls):
            continue
        orig = vars(cls)["__init__"]

        def init(self, *a, __orig=orig, __cls=cls, __key=key, **k):
            if type(self) is __cls and k.get("fused") is None and k.get("foreach") is None:
                k[__key] = True
            return __orig(self, *a, **k)

        setattr(cls, "__init__", init)
        undo.append(lambda cls=cls, orig=orig: setattr(cls, "__init__", orig))
    return undo


def _compile_regions(model: Any) -> dict[str, Any]:
    """Each repeated block of `model` compiled in place (torchspeed.train's regional compilation)."""
    from torchspeed.train.compiling import compile_regions, compiled_regions  # the train area, only for this fix

    try:
        compile_regions(model)
    except ValueError as e:  # no repeated block
        return {"applied": False, "reason": str(e)}
    blocks = compiled_regions(model)
    return {"applied": True, "blocks": len(blocks), "first": blocks[0] if blocks else None}


def _patch_length_grouped(notes: dict[str, Any]) -> Any:
    """DataLoader.__init__ giving a shuffled loader of token samples the length-grouped order (each sample
    once per epoch, the same batch size and collate): `grouping.LengthGrouped`. Returns the undo."""
    orig = DataLoader.__init__
    sig = inspect.signature(orig)

    def init(self, *a, **k):
        bound = sig.bind(self, *a, **k)
        args = bound.arguments
        sampler = args.get("sampler")
        shuffled = args.get("shuffle") or isinstance(sampler, RandomSampler)
        if shuffled and args.get("batch_sampler") is None and args.get("batch_size", 1):
            lengths = sample_lengths(args["dataset"])
            if lengths:
                args["sampler"] = LengthGrouped(lengths, args.get("batch_size", 1), getattr(sampler, "generator", None)
                                                or args.get("generator"))
                args["shuffle"] = False
                notes.update(applied=True, reason=None, samples=len(lengths), batch_size=args.get("batch_size", 1))
        return orig(*bound.args, **bound.kwargs)

    DataLoader.__init__ = init
    return lambda: setattr(DataLoader, "__init__", orig)


def _swap_in_fast_loader(value: dict[str, Any], notes: dict[str, Any]) -> Any:
    """Make the DataLoader that `value` names (its root, train/eval crop) iterate a fast_loader of the same
    files instead; what the swap found (same samples?, decoder) goes into `notes`. Returns the undo."""
    orig = DataLoader.__iter__  # doctor's instrumented __iter__: other loaders stay measured as before
    made: dict[int, tuple[Any, Any]] = {}  # id(loader) -> (loader, its fast_loader or None); the loader kept alive

    def swapped_iter(loader: Any) -> Any:
        if id(loader) not in made:
            made[id(loader)] = (loader, _fast_loader_for(loader, value, notes))
        fast = made[id(loader)][1]
        return orig(loader) if fast is None else iter(fast)

    DataLoader.__iter__ = swapped_iter
    return lambda: setattr(DataLoader, "__iter__", orig)


def _fast_loader_for(loader: Any, value: dict[str, Any], notes: dict[str, Any]) -> Any:
    d = describe(loader)
    if not d or not d.get("supported") or d["root"] != value["root"] or d["train"] != value["train"] \
            or d["crop"] != value["crop"]:
        return None
    from torchspeed.data import fast_loader  # the data area, in the script's process, only when its fix runs

    fast = fast_loader(d["root"], loader.batch_size, **keywords(d, value))
    theirs = sorted((os.path.abspath(p), int(y)) for p, y in (getattr(loader.dataset, "samples", None)
                                                              or loader.dataset.imgs))
    ours = sorted((os.path.abspath(p), int(y)) for p, y in fast.dataset.samples)
    notes.update(root=d["root"], same_samples=theirs == ours, samples=len(theirs), fast_samples=len(ours),
                 decoder=fast.decoder, threads=fast.threads, num_workers=fast.num_workers)
    return fast
