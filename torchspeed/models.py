"""The one model factory: every API and command builds a model by name through `create`.

A model spec is one of
- a torchvision name: `resnet18` (torchvision first, then timm) or `torchvision:resnet18`;
- a timm name: `timm:vit_tiny_patch16_224`;
- the user's own architecture: `package.module:factory` (importable) or `path/to/file.py:factory`;
  `factory` is a class or a function returning an `nn.Module`.

Models are randomly initialised (nothing is downloaded); `weights=` fills them from a state-dict file,
read with `torch.load(weights_only=True)`. A spec resolves to a `ModelSpec` value, which `create`
records on the model (`spec_of`) so a saved torch artifact can rebuild the architecture and load its
weights without unpickling any code.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from torchspeed.optional import optional
from torchspeed.runtime import import_as_found
from torchspeed.safeload import load_torch_file

__all__ = ["ModelSpec", "create", "build", "spec_of", "load_weights", "parse_kwargs", "default_input_shape", "HOW_TO_NAME"]

HOW_TO_NAME = ("name a torchvision model (resnet18), a timm model (timm:NAME), or your own architecture as "
               "package.module:factory or path/to/file.py:factory")


def _torchvision() -> Any:
    """torchvision, imported on first use: its import sets TORCHINDUCTOR_CACHE_DIR and a warning filter,
    put back so that the caller's process stays as it was."""
    return import_as_found("torchvision")


def _torchvision_names() -> list[str]:
    torchvision = _torchvision()
    return sorted(torchvision.models.list_models())


def _timm() -> Any:
    """timm when it is installed (its names then count as model names), else None."""
    try:
        return optional("timm", "timm", "timm:NAME models")
    except ImportError:
        return None


def is_factory_spec(spec: str) -> bool:
    """`pkg.mod:factory` or `file.py:factory` (a callable of the user's own, for a model or a Dataset):
    anything before the colon but a library prefix."""
    where, sep, factory = spec.rpartition(":")
    if not (sep and where and factory) or where.lower() in ("tv", "torchvision", "timm"):
        return False
    return where.endswith(".py") or all(part.isidentifier() for part in where.split("."))


SOURCES = ("torchvision", "timm", "module", "file")
_SPEC_ATTR = "_torchspeed_spec"  # where `create` records the spec on a model; read through spec_of


@dataclass(frozen=True)
class ModelSpec:
    """How to build an architecture: its source ('torchvision', 'timm', 'module' or 'file'), its name
    (a file spec's path made absolute) and the constructor's keyword arguments. JSON-safe through
    `to_dict`/`from_dict`, which is how saved artifacts and pruned folders name their architecture."""

    source: str
    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str, **kwargs: Any) -> ModelSpec:
        """Resolve a spec string without building the model. Unknown names raise ValueError with close
        matches ("did you mean")."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"a model spec must be a non-empty string, got {spec!r}: {HOW_TO_NAME}")
        spec = spec.strip()
        if is_factory_spec(spec):
            where, _, factory = spec.rpartition(":")
            if where.endswith(".py"):
                if not os.path.isfile(where):
                    raise FileNotFoundError(f"model file {where!r} (from {spec!r}) does not exist")
                return cls("file", f"{os.path.abspath(where)}:{factory}", kwargs)
            return cls("module", spec, kwargs)
        if spec.endswith((".py", ".pt", ".pth", ".pt2", ".onnx", ".ckpt", ".safetensors")) or os.sep in spec:
            raise ValueError(f"{spec!r} is a file, not a model spec: {HOW_TO_NAME}; weights go in a separate "
                             "state-dict file (weights=... / --weights)")
        source, _, name = spec.rpartition(":")
        source = {"tv": "torchvision"}.get(source.lower(), source.lower())
        if source not in ("", "torchvision", "timm"):
            raise ValueError(f"unknown model source {source!r} in {spec!r}: {HOW_TO_NAME}")
        tv = _torchvision_names()
        if source in ("", "torchvision") and name in tv:
            return cls("torchvision", name, kwargs)
        timm = (optional("timm", "timm", f"the model {spec!r}") if source == "timm" else _timm()) \
            if source in ("", "timm") else None
        if timm is not None and timm.is_model(name):
            return cls("timm", name, kwargs)
        known = sorted(set(tv) | (set(timm.list_models()) if timm is not None else set()))
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown model {spec!r}: {HOW_TO_NAME}{hint}")

    @classmethod
    def from_dict(cls, data: Any, where: str = "the manifest") -> ModelSpec:
        """The spec a saved file names; anything but {'source', 'name', 'kwargs'} of the right types is a
        ValueError naming `where`."""
        if (not isinstance(data, dict) or data.get("source") not in SOURCES or not isinstance(data.get("name"), str)
                or not isinstance(data.get("kwargs", {}), dict)):
            raise ValueError(f"{where} names no architecture: expected {{'source': one of {', '.join(SOURCES)}, "
                             f"'name': str, 'kwargs': dict}}, got {data!r}")
        return cls(data["source"], data["name"], dict(data.get("kwargs", {})))

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "name": self.name, "kwargs": dict(self.kwargs)}

    @property
    def runs_user_code(self) -> bool:
        """Building it imports the user's own code (a module or a file), not a library's."""
        return self.source in ("module", "file")

    @property
    def from_library(self) -> bool:
        return self.source in ("torchvision", "timm")

    def with_kwargs(self, **kwargs: Any) -> ModelSpec:
        """The same architecture with `kwargs` added (they win over the spec's own)."""
        return ModelSpec(self.source, self.name, {**self.kwargs, **kwargs})

    def check_saved(self, where: str, remedy: str) -> None:
        """Refuse, before anything is built, what a spec read from a saved folder may not do: name a library
        model by anything but its plain name (timm's 'hf-hub:' / 'local-dir:' prefixes fetch or read
        elsewhere), or pass a keyword argument naming a file, folder or URL (timm's checkpoint_path loads
        it): a saved folder is data and names no file outside itself. ValueError naming `where`, the
        kwarg and `remedy`. (Whether the folder may name the user's own code is the loader's rule.)"""
        if self.from_library and not _PLAIN_NAME.fullmatch(self.name):
            raise ValueError(f"{where} names the architecture {self.source}:{self.name!r}, not a plain model name (it "
                             f"would be fetched or read from elsewhere), so nothing was built. {remedy}")
        for key, value in (kv for k, v in self.kwargs.items() for kv in _strings(v, str(k))):
            if _names_a_file(key, value):
                raise ValueError(f"{where} passes {key}={value!r} to the model, naming a file: a saved folder may "
                                 f"name no file outside itself, so nothing was built. {remedy}")


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_FILE_KEY = re.compile(r"(^|_)(path|file|filename|dir|directory|url|uri|hub_id|checkpoint)$", re.IGNORECASE)


def _strings(value: Any, key: str) -> list[tuple[str, str]]:
    """(dotted key, string) for every string inside `value` (nested dicts and lists)."""
    if isinstance(value, str):
        return [(key, value)]
    if isinstance(value, dict):
        return [kv for k, v in value.items() for kv in _strings(v, f"{key}.{k}")]
    if isinstance(value, (list, tuple)):
        return [kv for i, v in enumerate(value) for kv in _strings(v, f"{key}[{i}]")]
    return []


def _names_a_file(key: str, value: str) -> bool:
    """A keyword argument's string that a constructor would take as a file, folder or URL: given under a
    key that says so (checkpoint_path, pretrained_file, cache_dir, url...), absolute, with a separator,
    '~' or a scheme, or the name of an existing file (identifier-like words such as 'avg' are not)."""
    if not value:
        return False
    if _FILE_KEY.search(key.rsplit(".", 1)[-1].split("[", 1)[0]):
        return True
    if os.path.isabs(value) or value.startswith("~") or value in (".", "..") or "://" in value:
        return True
    if "/" in value or os.sep in value or (os.altsep and os.altsep in value):
        return True
    return not value.isidentifier() and os.path.lexists(value)


def load_callable(spec: str, what: str = "model") -> Any:
    """The callable a `package.module:factory` or `path/file.py:factory` spec names (for a model, a
    Dataset, ...); `what` words the errors. The current directory is importable, as for `python -m`."""
    if not isinstance(spec, str) or not is_factory_spec(spec.strip()):
        raise ValueError(f"{spec!r} is not a {what} factory: name it as package.module:factory or "
                         "path/to/file.py:factory")
    return _user_factory(ModelSpec.parse(spec.strip()), what)


def _user_factory(spec: ModelSpec, what: str = "model") -> Any:
    where, _, factory = spec.name.rpartition(":")
    if spec.source == "file":
        mod_name = f"_torchspeed_user_{abs(hash(where))}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(mod_name, where)
            if loader_spec is None or loader_spec.loader is None:
                raise ValueError(f"cannot import {where!r} as a Python file")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(mod_name, None)
                raise
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:  # the `torchspeed` script's path lacks it
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise ValueError(f"cannot import module {where!r} for {what} {spec.name!r} ({e}); is it "
                             "installed, on PYTHONPATH, or in the current directory?") from None
    fn = getattr(module, factory, None)
    if fn is None or not callable(fn):
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(factory, public, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"{where!r} has no callable {factory!r}{hint}")
    return fn


def create(spec: str | ModelSpec, *, weights: str | None = None, **kwargs: Any) -> nn.Module:
    """A model from a spec string (see the module docstring) or a `ModelSpec`, in eval mode.

    `kwargs` go to the constructor (e.g. `num_classes=10`); `weights` is a state-dict file.
    """
    spec = ModelSpec.parse(spec, **kwargs) if isinstance(spec, str) else spec.with_kwargs(**kwargs)
    kw = dict(spec.kwargs)
    if spec.source == "torchvision":
        model = _torchvision().models.get_model(spec.name, weights=None, **kw)
    elif spec.source == "timm":
        timm = optional("timm", "timm", f"the model timm:{spec.name}")
        model = timm.create_model(spec.name, pretrained=False, **kw)
    elif spec.runs_user_code:
        try:
            model = _user_factory(spec)(**kw)
        except TypeError as e:
            raise ValueError(f"calling {spec.name}(**{kw}) failed: {e}") from None
        if not isinstance(model, nn.Module):
            raise ValueError(f"{spec.name} returned a {type(model).__name__}, not a torch.nn.Module")
    else:
        raise ValueError(f"unknown model source {spec.source!r}")
    if weights is not None:
        load_weights(model, weights)
    setattr(model, _SPEC_ATTR, spec)  # lets torch-runtime artifacts record how to rebuild it
    return model.eval()


def build(spec: str | ModelSpec, *, weights: str | None = None, model_kwargs: str | Mapping[str, Any] | None = None,
          **library_defaults: Any) -> nn.Module:
    """The model a command or recipe asks for by spec. `library_defaults` (e.g. num_classes; None values
    ignored) apply to torchvision / timm models only: the user's own factory gets just `model_kwargs`
    (a JSON object's text or a mapping), which wins over the defaults."""
    kwargs = parse_kwargs(model_kwargs) if isinstance(model_kwargs, str) or model_kwargs is None else dict(model_kwargs)
    parsed = ModelSpec.parse(spec) if isinstance(spec, str) else spec
    chosen = {k: v for k, v in library_defaults.items() if v is not None} if parsed.from_library else {}
    return create(parsed, weights=weights, **{**chosen, **kwargs})


def spec_of(model: nn.Module) -> ModelSpec | None:
    """The spec a model was built from by `create`, or None for a model built some other way."""
    spec = getattr(model, _SPEC_ATTR, None)
    return spec if isinstance(spec, ModelSpec) else None


def load_weights(model: nn.Module, path: str) -> nn.Module:
    """Fill `model` from a state-dict file (torch.save'd; read with weights_only=True, never unpickled).

    Accepts a plain state dict, a torchspeed checkpoint (`{"model": ...}`) or a Lightning checkpoint
    (`{"state_dict": ...}`, its `model.` prefix removed).
    """
    state = load_torch_file(path, what="weights file")
    if isinstance(state, dict):
        for key in ("model", "state_dict"):
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} holds a {type(state).__name__}, not a state dict")
    own = model.state_dict()
    if not set(state) & set(own):  # a common wrapper prefix (Lightning's "model.", DDP's "module.")
        for prefix in ("model.", "module.", "_orig_mod."):
            stripped = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if set(stripped) & set(own):
                state = stripped
                break
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"the weights in {path!r} do not fit {type(model).__name__}: "
                         f"{str(e).strip().splitlines()[0]}") from None
    return model


def parse_kwargs(text: str | None) -> dict[str, Any]:
    """`--model-kwargs` text: a JSON object (e.g. '{"num_classes": 10}')."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--model-kwargs must be a JSON object such as '{{\"num_classes\": 10}}': {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--model-kwargs must be a JSON object, got {type(value).__name__}")
    return value


def default_input_shape(model: nn.Module) -> tuple[int, ...] | None:
    """The input shape (batch 1) a model declares (timm's pretrained_cfg), else None."""
    cfg = getattr(model, "pretrained_cfg", None)
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    return (1, *size) if size else None
