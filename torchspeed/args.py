"""Argument conventions shared by the API and the command line."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["as_list"]


def as_list(value: str | Iterable[Any] | None, *, name: str = "argument") -> list[str] | None:
    """A list argument given as a list/tuple or a comma string ('torch,onnxruntime'); None stays None.

    Names are stripped; empty items dropped; an empty result is an error naming `name`.
    """
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    out = [str(v).strip() for v in items if str(v).strip()]
    if not out:
        raise ValueError(f"{name} is empty: give a comma list or a list of names")
    return out
