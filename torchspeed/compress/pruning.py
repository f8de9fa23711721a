"""Structural channel pruning that really removes channels (Torch-Pruning's dependency graph).

Masking weights to zero (`torch.nn.utils.prune`) leaves every tensor its full size, so nothing gets
faster. Here whole channels are cut out of every layer that shares them (a conv's output, the
BatchNorm after it, the next conv's input, residual partners), giving a smaller ordinary
`nn.Module`. The layers that produce the model's output are never pruned, so input and output
shapes stay the same. Channel counts are rounded to multiples of `round_to` (8 by default) because
vectorised conv kernels (AVX-512, tensor cores) run whole blocks of channels: 61 channels costs
about what 64 do.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from torchspeed.args import progress_fn
from torchspeed.compress.cost import count_macs, count_params, inference_fn
from torchspeed.atomic import publish_files, published_set, recover_published, write_json
from torchspeed.measure import compare
from torchspeed.models import ModelSpec, create
from torchspeed.optional import optional
from torchspeed.outputs import claim_output_dir
from torchspeed.safeload import load_torch_file

__all__ = ["PruneResult", "prune", "output_layers", "IMPORTANCES", "PRUNED_FILES", "save_pruned", "load_pruned"]

log = logging.getLogger(__name__)

# importance name -> (class name in torch_pruning.importance, kwargs): how a channel's worth is scored
IMPORTANCES: dict[str, tuple[str, dict[str, Any]]] = {
    "l1": ("MagnitudeImportance", {"p": 1}),  # sum of |w| over the channel's whole group
    "l2": ("MagnitudeImportance", {"p": 2}),
    "fpgm": ("FPGMImportance", {}),  # geometric median: prunes the most replaceable filters
    "lamp": ("LAMPImportance", {}),  # layer-adaptive magnitude
    "bn_scale": ("BNScaleImportance", {}),  # |gamma| of the BatchNorm after each conv
    "random": ("RandomImportance", {}),  # a baseline to compare the others against
}


def _torch_pruning():
    # its import sets TORCHINDUCTOR_CACHE_DIR and a warning filter: put back by `optional`
    return optional("torch_pruning", "compress", "structural pruning")


@dataclass
class PruneResult:
    """The pruned model and what pruning changed, measured: sizes on `example_input`, latency
    before/after, the optional metric. Unpacks as `model, result = prune(...)`."""

    model: nn.Module = field(repr=False, compare=False)
    ratio: float
    importance: str
    steps: int
    round_to: int | None
    params_before: int
    params_after: int
    macs_before: int
    macs_after: int
    latency_before_ms: float | None = None
    latency_after_ms: float | None = None
    metric_before: float | None = None
    metric_after: float | None = None
    ignored: list[str] | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self))

    @property
    def report(self) -> PruneResult:
        """This result itself, so `prune(...).report.speedup` and `prune(...).speedup` read alike."""
        return self

    @property
    def speedup(self) -> float | None:
        if self.latency_before_ms is None or self.latency_after_ms is None:
            return None
        return self.latency_before_ms / self.latency_after_ms

    @property
    def metric_drop(self) -> float | None:
        if self.metric_before is None or self.metric_after is None:
            return None
        return self.metric_before - self.metric_after

    def to_dict(self) -> dict[str, Any]:
        """The figures as JSON-ready values (the model left out)."""
        figures = {f.name: copy.copy(getattr(self, f.name)) for f in fields(self) if f.name != "model"}
        return {**figures, "speedup": self.speedup, "metric_drop": self.metric_drop}

    def __str__(self) -> str:
        text = (f"pruned {self.ratio:.0%} of channels ({self.importance}, {self.steps} step(s)): "
                f"params {self.params_before / 1e6:.2f}M -> {self.params_after / 1e6:.2f}M, "
                f"MACs {self.macs_before / 1e6:.1f}M -> {self.macs_after / 1e6:.1f}M")
        if self.speedup is not None:
            text += f", latency {self.latency_before_ms:.2f} -> {self.latency_after_ms:.2f} ms (x{self.speedup:.2f})"
        if self.metric_drop is not None:
            text += f", metric {self.metric_before:.4f} -> {self.metric_after:.4f}"
        return text


def output_layers(model: nn.Module, example_input: torch.Tensor) -> list[nn.Module]:
    """The leaf modules whose output is the model's output (a classifier head): pruning their
    output channels would change the output shape."""
    outputs: list[tuple[nn.Module, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda m, i, o: outputs.append((m, o)) if isinstance(o, torch.Tensor) else None)
             for m in model.modules() if next(m.children(), None) is None and any(True for _ in m.parameters(recurse=False))]
    try:
        with torch.no_grad():
            out = model(example_input)
    finally:
        for h in hooks:
            h.remove()
    finals = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
    found = [m for m, o in outputs if any(o.data_ptr() == f.data_ptr() and o.numel() == f.numel() for f in finals)]
    if not found and outputs:  # the output went through a parameter-free op (e.g. flatten+copy): last layer
        found = [outputs[-1][0]]
    return found


def _module_names(model: nn.Module, modules: Sequence[nn.Module]) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names.get(id(m), type(m).__name__) for m in modules]


def prune(
    model: nn.Module,
    example_input: torch.Tensor,
    ratio: float,
    importance: str = "l1",
    ignore: Sequence[nn.Module] | None = None,
    steps: int = 1,
    round_to: int | None = 8,
    global_pruning: bool = False,
    finetune: Callable[[nn.Module, int], Any] | None = None,
    eval_fn: Callable[[nn.Module], float] | None = None,
    measure: bool = True,
    repeats: int = 10,
    inplace: bool = False,
    progress: bool | Callable[[str], Any] = False,
) -> PruneResult:
    """Remove `ratio` of the channels of every prunable layer; return the smaller model and its figures.

    - `importance`: how channels are ranked, one of `IMPORTANCES` ('l1' by default).
    - `ignore`: modules whose output channels stay (the output layers are always kept).
    - `steps` > 1 prunes iteratively, reaching `ratio` in equal steps; `finetune(model, step)` is called
      after every step (e.g. a few hundred steps of `ts.compress.finetune`), so the network recovers
      before the next cut.
    - `round_to`: keep channel counts multiples of this (None: exact ratio).
    - `eval_fn(model) -> metric` (higher is better) is recorded before and after, in the result.
    - `measure`: time the original and the pruned model on `example_input` (fp32, eval mode,
      interleaved by torchspeed.measure); the measured speed-up is logged at INFO on this module's logger.
    - `progress`: True prints each stage to stderr; a callable receives those messages.
    The caller's model is left untouched unless `inplace=True`.
    """
    tp = _torch_pruning()
    say = progress_fn(progress)
    _check_arguments(model, example_input, ratio, importance, steps, round_to)
    was_training = model.training
    work = model if inplace else copy.deepcopy(model)
    work.eval()  # trace without updating BatchNorm statistics
    out_before = _run_example(work, example_input)
    reference = copy.deepcopy(work) if measure and inplace else model
    params_before, macs_before = count_params(work), count_macs(work, example_input)
    metric_before = float(eval_fn(work)) if eval_fn is not None else None

    keep = _kept_layers(model, work, example_input, ignore)
    _cut_channels(tp, work, example_input, float(ratio), importance, steps, round_to, global_pruning, keep,
                  finetune, say)
    _check_output_shape(work, example_input, out_before)
    result = PruneResult(
        model=work, ratio=float(ratio), importance=importance, steps=steps, round_to=round_to,
        params_before=params_before, params_after=count_params(work),
        macs_before=macs_before, macs_after=count_macs(work, example_input),
        metric_before=metric_before, metric_after=float(eval_fn(work)) if eval_fn is not None else None,
        ignored=_module_names(work, keep),
    )
    if measure:
        result.latency_before_ms, result.latency_after_ms = _latencies_ms(reference, work, example_input, repeats, say)
        reference.train(was_training)
    work.train(was_training)
    log.log(logging.INFO if measure else logging.DEBUG, "prune: %s", result)
    return result


def _check_arguments(model: Any, example_input: Any, ratio: Any, importance: Any, steps: Any, round_to: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"prune() needs an nn.Module, got {type(model).__name__}")
    if not isinstance(example_input, torch.Tensor):
        raise ValueError(f"example_input must be a tensor batch the model accepts, got {type(example_input).__name__}")
    if not isinstance(ratio, (int, float)) or not 0.0 < ratio < 1.0:
        raise ValueError(f"ratio is the fraction of channels to remove and must be in (0, 1), got {ratio!r}")
    if importance not in IMPORTANCES:
        raise ValueError(f"unknown importance {importance!r}; choose one of {', '.join(IMPORTANCES)}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if round_to is not None and (not isinstance(round_to, int) or round_to < 1):
        raise ValueError(f"round_to must be a positive integer or None, got {round_to!r}")


def _run_example(model: nn.Module, example_input: torch.Tensor) -> Any:
    """The model's output on `example_input`; a model that cannot run on it is the caller's error."""
    try:
        with torch.no_grad():
            return model(example_input)
    except Exception as e:
        raise ValueError(f"the model cannot run on example_input of shape {tuple(example_input.shape)}: "
                         f"{type(e).__name__}: {e}") from None


def _kept_layers(original: nn.Module, work: nn.Module, example_input: torch.Tensor,
                 ignore: Sequence[nn.Module] | None) -> list[nn.Module]:
    """The layers of `work` whose output channels stay: the output layers, and the twins in `work`
    of the caller's `ignore` modules (named in `original`, which `work` may be a copy of)."""
    keep = output_layers(work, example_input)
    if ignore:
        by_id = {id(m): m for m in original.modules()}
        twins = dict(zip((id(m) for m in original.modules()), work.modules()))
        for m in ignore:
            if id(m) not in by_id:
                raise ValueError(f"ignore lists a {type(m).__name__} that is not a submodule of the model")
            keep.append(twins[id(m)])
    return keep


def _cut_channels(tp: Any, work: nn.Module, example_input: torch.Tensor, ratio: float, importance: str, steps: int,
                  round_to: int | None, global_pruning: bool, keep: list[nn.Module],
                  finetune: Callable[[nn.Module, int], Any] | None, say: Callable[[str], Any]) -> None:
    """Torch-Pruning's dependency graph cuts the channels in `steps` equal steps, `finetune` after each."""
    cls_name, kwargs = IMPORTANCES[importance]
    scorer = getattr(tp.importance, cls_name)(**kwargs)
    pruner = tp.pruner.BasePruner(
        work, example_input, importance=scorer, pruning_ratio=ratio, iterative_steps=steps,
        ignored_layers=keep, round_to=round_to, global_pruning=global_pruning,
    )
    for step in range(steps):
        say(f"pruning step {step + 1}/{steps}: {importance} importance")
        work.eval()
        pruner.step()
        if finetune is not None:
            say(f"fine-tuning after step {step + 1}/{steps}")
            finetune(work, step)
    work.eval()


def _check_output_shape(work: nn.Module, example_input: torch.Tensor, out_before: Any) -> None:
    with torch.no_grad():
        out_after = work(example_input)
    if getattr(out_after, "shape", None) != getattr(out_before, "shape", None):
        raise RuntimeError(f"pruning changed the output shape from {tuple(out_before.shape)} to "
                           f"{tuple(out_after.shape)}; pass the output layer in ignore=[...]")


def _latencies_ms(reference: nn.Module, pruned: nn.Module, example_input: torch.Tensor, repeats: int,
                  say: Callable[[str], Any]) -> tuple[float, float]:
    """Median latency of the original and the pruned model, timed interleaved by torchspeed.measure."""
    say("timing the original and the pruned model, interleaved")
    reference.eval()
    contenders = {"original": inference_fn(reference, example_input), "pruned": inference_fn(pruned, example_input)}
    timing = compare(contenders, repeats=repeats, warmup=3, min_time_s=0.02, device=example_input.device)
    return timing["original"].median_s * 1e3, timing["pruned"].median_s * 1e3


# The attributes that say a layer's size, by layer type: a pruned model is rebuilt from its
# architecture spec by setting these and giving each parameter its saved shape.
_SIZE_ATTRS: dict[type, tuple[str, ...]] = {
    nn.Conv1d: ("in_channels", "out_channels", "groups"),
    nn.Conv2d: ("in_channels", "out_channels", "groups"),
    nn.Conv3d: ("in_channels", "out_channels", "groups"),
    nn.ConvTranspose2d: ("in_channels", "out_channels", "groups"),
    nn.Linear: ("in_features", "out_features"),
    nn.BatchNorm1d: ("num_features",),
    nn.BatchNorm2d: ("num_features",),
    nn.BatchNorm3d: ("num_features",),
    nn.GroupNorm: ("num_groups", "num_channels"),
    nn.LayerNorm: ("normalized_shape",),
}


PRUNED_FILES = ("model.pt", "pruned.json")  # what save_pruned writes into its folder


def save_pruned(model: nn.Module, directory: str, spec: ModelSpec | str, report: PruneResult | None = None, *,
                overwrite: bool = False) -> None:
    """Write a pruned model as `model.pt` (its state dict: tensors only) and `pruned.json` (the
    architecture spec and every resized layer's size), so `load_pruned` rebuilds it without pickle.

    `spec` names the unpruned architecture: `torchspeed.models.spec_of(original)` or a spec string;
    `report`, the `prune` result, is kept beside them as its figures. `directory` must be new or one
    torchspeed wrote (`torchspeed.outputs`): a folder holding anything else is refused, and an earlier
    pruned model there is replaced only with `overwrite=True`. The two files are published as a set
    (`pruned.json` last), so an interrupted save never leaves a mix that loads.
    """
    if isinstance(spec, str):
        spec = ModelSpec.parse(spec)
    if not isinstance(spec, ModelSpec):
        raise ValueError("save_pruned needs the unpruned model's spec: torchspeed.models.spec_of(original) (for a "
                         "model made by torchspeed.models.create) or a spec string such as 'nets.py:make_net'")
    recover_published(directory, "pruned.json")  # a killed earlier save: its previous set put back first
    out = claim_output_dir(directory, "prune", overwrite=overwrite, flag="directory", replaces=PRUNED_FILES)
    sizes = {name: {a: (list(v) if isinstance(v := getattr(m, a), tuple) else v) for a in attrs}
             for name, m in model.named_modules() for cls, attrs in _SIZE_ATTRS.items() if type(m) is cls}
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    meta = {"spec": spec.to_dict(), "sizes": sizes, "report": report.to_dict() if report is not None else None}

    def write(tmp: str) -> None:
        torch.save(state, os.path.join(tmp, "model.pt"))
        write_json(os.path.join(tmp, "pruned.json"), meta)

    publish_files(directory, write, last="pruned.json", replaces=PRUNED_FILES)
    out.record(*PRUNED_FILES)


def load_pruned(directory: str, *, model: nn.Module | None = None, spec: ModelSpec | str | None = None,
                trust_code: bool = False) -> nn.Module:
    """The pruned model `save_pruned` wrote: the architecture built, each layer resized, the weights
    loaded (`weights_only=True`), in eval mode.

    The folder is data, never code. The architecture it names is built on its word only when it is a
    torchvision or timm model. Your own architecture is built only when you name it: pass `model=` (a
    freshly built unpruned instance; it is resized in place), `spec=` (the spec you pruned, e.g.
    'nets.py:make_net'; the folder's keyword arguments apply when it names the same one), or
    `trust_code=True` for a folder you trust. Keyword arguments read from the folder may not name a
    file outside it.
    """
    directory = published_set(os.fspath(directory), "pruned.json")  # during a save: the previous whole set
    meta_path = os.path.join(directory, "pruned.json")
    saved, sizes = _read_pruned_meta(meta_path)
    model = _pruned_architecture(directory, saved, model, spec, trust_code)
    weights = os.path.join(directory, "model.pt")
    state = load_torch_file(weights, what="the pruned model's weights")
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{weights!r} is not a state dict of tensors: run `torchspeed prune` again")
    modules = dict(model.named_modules())
    _resize_layers(modules, sizes, meta_path)
    for key, tensor in state.items():  # give every parameter and buffer its pruned shape
        owner, _, leaf = key.rpartition(".")
        module = modules.get(owner)
        current = getattr(module, leaf, None) if module is not None else None
        if isinstance(current, nn.Parameter):
            setattr(module, leaf, nn.Parameter(torch.empty_like(tensor), requires_grad=current.requires_grad))
        elif isinstance(current, torch.Tensor):
            module.register_buffer(leaf, torch.empty_like(tensor))
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"the weights in {directory!r} do not fit {type(model).__name__}: "
                         f"{str(e).strip().splitlines()[0]}") from None
    return model.eval()


def _read_pruned_meta(meta_path: str) -> tuple[ModelSpec, dict[str, dict[str, Any]]]:
    """The architecture spec and the layer sizes `pruned.json` names; ValueError naming it otherwise."""
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        spec, sizes = ModelSpec.from_dict(meta["spec"], where=meta_path), meta["sizes"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"{meta_path}: not a pruned model written by torchspeed ({e}); run `torchspeed prune` "
                         "again") from None
    sizes_ok = isinstance(sizes, dict) and all(
        isinstance(attrs, dict) and all(_is_size(v) for v in attrs.values()) for attrs in sizes.values())
    if not sizes_ok:
        raise ValueError(f"{meta_path}: its 'sizes' are not layer sizes (integers) written by torchspeed; run "
                         "`torchspeed prune` again")
    return spec, sizes


def _is_size(value: Any) -> bool:
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    return whole(value) or (isinstance(value, list) and all(whole(v) for v in value))


def _pruned_architecture(directory: str, saved: ModelSpec, model: nn.Module | None, spec: ModelSpec | str | None,
                         trust_code: bool) -> nn.Module:
    """The unpruned model to resize: the caller's `model`, the caller's `spec` built, or the folder's
    spec built when it names a library model (or the caller trusts the folder's code)."""
    where = os.path.join(directory, "pruned.json")
    if model is not None and spec is not None:
        raise ValueError("load_pruned takes model= or spec=, not both")
    if model is not None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model= must be the unpruned nn.Module, got {type(model).__name__}")
        return model
    if spec is not None:
        chosen = ModelSpec.parse(spec) if isinstance(spec, str) else spec
        if not isinstance(chosen, ModelSpec):
            raise ValueError(f"spec= must be a model spec string or a ModelSpec, got {type(spec).__name__}")
        if (chosen.source, chosen.name) == (saved.source, saved.name):  # the folder's arguments, yours winning
            saved.check_saved(where, "Pass the arguments yourself: ts.compress.load_pruned(dir, spec=..., model=...)")
            chosen = ModelSpec(chosen.source, chosen.name, {**saved.kwargs, **chosen.kwargs})
    elif saved.runs_user_code and not trust_code:
        raise ValueError(
            f"{where} names your own code ({saved.source} {saved.name!r}) as the architecture; building it would "
            "run that code, so it is not done on the folder's word. Pass the unpruned architecture yourself: "
            f"ts.compress.load_pruned({directory!r}, spec='nets.py:make_net') or model=make_net(), or pass "
            "trust_code=True if you trust this folder")
    else:
        saved.check_saved(where, "Pass the arguments yourself: ts.compress.load_pruned(dir, spec=..., model=...)")
        chosen = _library_spec(saved, where) if saved.from_library else saved
    return _build_unpruned(chosen, where)


def _library_spec(saved: ModelSpec, where: str) -> ModelSpec:
    """A library spec read from a folder, accepted only when its name is a model the library lists (no
    hub or local-directory names that would fetch or read anything)."""
    try:
        parsed = ModelSpec.parse(f"{saved.source}:{saved.name}")
    except (ValueError, ImportError) as e:
        raise ValueError(f"{where}: {e}") from None
    if parsed.source != saved.source:
        raise ValueError(f"{where} names {saved.source} model {saved.name!r}, which {saved.source} does not list")
    return ModelSpec(parsed.source, parsed.name, saved.kwargs)


def _build_unpruned(spec: ModelSpec, where: str) -> nn.Module:
    try:
        return create(spec)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where}: cannot build {spec.name!r} with {dict(spec.kwargs)}: "
                         f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None


def _resize_layers(modules: dict[str, nn.Module], sizes: dict[str, dict[str, Any]], meta_path: str) -> None:
    """Set each layer's size attributes as `pruned.json` records them; only the size attributes of the
    layer's own type (`_SIZE_ATTRS`) may be set."""
    for name, attrs in sizes.items():
        if name not in modules:
            raise ValueError(f"{meta_path}: layer {name!r} is not in the architecture; it changed since pruning")
        allowed = _SIZE_ATTRS.get(type(modules[name]), ())
        for attr, value in attrs.items():
            if attr not in allowed:
                raise ValueError(f"{meta_path}: {attr!r} of layer {name!r} is not a size of a "
                                 f"{type(modules[name]).__name__}; run `torchspeed prune` again")
            setattr(modules[name], attr, tuple(value) if isinstance(value, list) else value)
