"""Lazy public names for subpackages: `ts.data.pack` imports `torchspeed.data.packer` on first use,
so `import torchspeed` (and the CLI's `--help`) stays free of torch and the optional extras."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torchspeed.deprecated import NAMES, renamed


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` resolving `exports` (public name -> submodule) on first access."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        new = NAMES.get(f"{package}.{name}")
        if new is not None:
            renamed(f"{package}.{name}", f"{package}.{new}")
            return __getattr__(new)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
