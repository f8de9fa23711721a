"""The one model factory: every API and command builds a model by name through `create`.

A model spec is one of
- a torchvision name: `resnet18` (torchvision first, then timm) or `torchvision:resnet18`;
- a timm name: `timm:vit_tiny_patch16_224`;
- the user's own architecture: `package.module:factory` (importable) or `path/to/file.py:factory`;
  `factory` is a class or a function returning an `nn.Module`.

Models are randomly initialised (nothing is downloaded); `weights=` fills them from a state-dict file,
read with `torch.load(weights_only=True)`. The spec is recorded on the model (`spec_of`) so a saved torch
artifact can rebuild the architecture and load its weights without unpickling any code.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import os
import sys
from typing import Any

from torch import nn

__all__ = ["create", "arch_spec", "spec_of", "load_weights", "parse_kwargs", "default_input_shape", "HOW_TO_NAME"]

HOW_TO_NAME = ("name a torchvision model (resnet18), a timm model (timm:NAME), or your own architecture as "
               "package.module:factory or path/to/file.py:factory")


def _torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models())


def _timm() -> Any:
    try:
        import timm
    except ImportError:
        return None
    return timm


def is_factory_spec(spec: str) -> bool:
    """`pkg.mod:factory` or `file.py:factory` (a callable of the user's own, for a model or a Dataset):
    anything before the colon but a library prefix."""
    where, sep, factory = spec.rpartition(":")
    if not (sep and where and factory) or where.lower() in ("tv", "torchvision", "timm"):
        return False
    return where.endswith(".py") or all(part.isidentifier() for part in where.split("."))


def arch_spec(spec: str, **kwargs: Any) -> dict[str, Any]:
    """Resolve a model spec to {'source', 'name', 'kwargs'} without building it.

    `source` is 'torchvision', 'timm', 'module' or 'file'. Unknown names raise ValueError with close
    matches ("did you mean").
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a model spec must be a non-empty string, got {spec!r}: {HOW_TO_NAME}")
    spec = spec.strip()
    if is_factory_spec(spec):
        where, _, factory = spec.rpartition(":")
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise FileNotFoundError(f"model file {where!r} (from {spec!r}) does not exist")
            return {"source": "file", "name": f"{os.path.abspath(where)}:{factory}", "kwargs": kwargs}
        return {"source": "module", "name": spec, "kwargs": kwargs}
    if spec.endswith((".py", ".pt", ".pth", ".pt2", ".onnx", ".ckpt", ".safetensors")) or os.sep in spec:
        raise ValueError(f"{spec!r} is a file, not a model spec: {HOW_TO_NAME}; weights go in a separate "
                         "state-dict file (weights=... / --weights)")
    source, _, name = spec.rpartition(":")
    source = {"tv": "torchvision"}.get(source.lower(), source.lower())
    if source not in ("", "torchvision", "timm"):
        raise ValueError(f"unknown model source {source!r} in {spec!r}: {HOW_TO_NAME}")
    tv = _torchvision_names()
    if source in ("", "torchvision") and name in tv:
        return {"source": "torchvision", "name": name, "kwargs": kwargs}
    timm = _timm() if source in ("", "timm") else None
    if timm is not None and timm.is_model(name):
        return {"source": "timm", "name": name, "kwargs": kwargs}
    if source == "timm" and timm is None:
        raise ImportError(f"{spec!r} needs timm: pip install 'torchspeed[compress]'")
    known = sorted(set(tv) | (set(timm.list_models()) if timm is not None else set()))
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown model {spec!r}: {HOW_TO_NAME}{hint}")


def load_callable(spec: str, what: str = "model") -> Any:
    """The callable a `package.module:factory` or `path/file.py:factory` spec names (for a model, a
    Dataset, ...); `what` words the errors. The current directory is importable, as for `python -m`."""
    if not isinstance(spec, str) or not is_factory_spec(spec.strip()):
        raise ValueError(f"{spec!r} is not a {what} factory: name it as package.module:factory or "
                         "path/to/file.py:factory")
    return _user_factory(arch_spec(spec.strip()), what)


def _user_factory(spec: dict[str, Any], what: str = "model") -> Any:
    where, _, factory = spec["name"].rpartition(":")
    if spec["source"] == "file":
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
            raise ValueError(f"cannot import module {where!r} for {what} {spec['name']!r} ({e}); is it "
                             "installed, on PYTHONPATH, or in the current directory?") from None
    fn = getattr(module, factory, None)
    if fn is None or not callable(fn):
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(factory, public, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"{where!r} has no callable {factory!r}{hint}")
    return fn


def create(spec: str | dict[str, Any], *, weights: str | None = None, **kwargs: Any) -> nn.Module:
    """A model from a spec (see the module docstring) or an `arch_spec` dict, in eval mode.

    `kwargs` go to the constructor (e.g. `num_classes=10`); `weights` is a state-dict file.
    """
    spec = arch_spec(spec, **kwargs) if isinstance(spec, str) else {**spec, "kwargs": {**spec.get("kwargs", {}), **kwargs}}
    kw = spec.get("kwargs", {})
    source = spec["source"]
    if source == "torchvision":
        import torchvision

        model = torchvision.models.get_model(spec["name"], weights=None, **kw)
    elif source == "timm":
        timm = _timm()
        if timm is None:
            raise ImportError(f"timm:{spec['name']} needs timm: pip install 'torchspeed[compress]'")
        model = timm.create_model(spec["name"], pretrained=False, **kw)
    elif source in ("module", "file"):
        try:
            model = _user_factory(spec)(**kw)
        except TypeError as e:
            raise ValueError(f"calling {spec['name']}(**{kw}) failed: {e}") from None
        if not isinstance(model, nn.Module):
            raise ValueError(f"{spec['name']} returned a {type(model).__name__}, not a torch.nn.Module")
    else:
        raise ValueError(f"unknown model source {source!r}")
    if weights is not None:
        load_weights(model, weights)
    model._torchspeed_arch = spec  # lets torch-runtime artifacts record how to rebuild it
    return model.eval()


def spec_of(model: nn.Module) -> dict[str, Any] | None:
    """The spec a model was built from by `create`, or None for a model built some other way."""
    return getattr(model, "_torchspeed_arch", None)


def load_weights(model: nn.Module, path: str) -> nn.Module:
    """Fill `model` from a state-dict file (torch.save'd; read with weights_only=True, never unpickled).

    Accepts a plain state dict, a torchspeed checkpoint (`{"model": ...}`) or a Lightning checkpoint
    (`{"state_dict": ...}`, its `model.` prefix removed).
    """
    from torchspeed.safeload import load_torch_file

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
