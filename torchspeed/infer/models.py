"""Models by name: a torchvision or timm architecture, randomly initialised (nothing is downloaded).

A name is `resnet18` (torchvision first, then timm), or explicitly `torchvision:resnet18` /
`timm:vit_tiny_patch16_224`. The same reference is written into saved torch artifacts, so `load`
can rebuild the architecture and fill it with saved weights without unpickling any code.
"""
from __future__ import annotations

import difflib
from typing import Any

from torch import nn

__all__ = ["create_model", "arch_spec"]


def _torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models())


def _timm_names() -> list[str]:
    try:
        import timm
    except ImportError:
        return []
    return sorted(timm.list_models())


def arch_spec(name: str, **kwargs: Any) -> dict[str, Any]:
    """Resolve a model name to {'source', 'name', 'kwargs'}; ValueError with close matches if unknown."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a model name must be a non-empty string, got {name!r}")
    source, _, arch = name.rpartition(":")
    tv, tm = _torchvision_names(), None
    if source in ("", "torchvision") and arch in tv:
        return {"source": "torchvision", "name": arch, "kwargs": kwargs}
    if source in ("", "timm"):
        tm = _timm_names()
        if arch in tm:
            return {"source": "timm", "name": arch, "kwargs": kwargs}
        if source == "timm" and not tm:
            raise ImportError("timm models need timm: pip install 'torchspeed[compress]'")
    if source not in ("", "torchvision", "timm"):
        raise ValueError(f"unknown model source {source!r} in {name!r}; use torchvision:NAME or timm:NAME")
    close = difflib.get_close_matches(arch, tv + (tm or []), n=4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown model {name!r}: not a torchvision or timm architecture and not a file{hint}")


def create_model(spec: str | dict[str, Any], **kwargs: Any) -> nn.Module:
    """A randomly initialised model from a name or an `arch_spec` dict, in eval mode."""
    spec = arch_spec(spec, **kwargs) if isinstance(spec, str) else spec
    if spec["source"] == "torchvision":
        import torchvision

        model = torchvision.models.get_model(spec["name"], weights=None, **spec.get("kwargs", {}))
    elif spec["source"] == "timm":
        import timm

        model = timm.create_model(spec["name"], pretrained=False, **spec.get("kwargs", {}))
    else:
        raise ValueError(f"unknown model source {spec['source']!r}")
    model._torchspeed_arch = spec  # lets torch-runtime artifacts record how to rebuild it
    return model.eval()
