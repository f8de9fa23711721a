"""Argument conventions shared by the API and the command line."""
from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["as_list", "progress_fn", "positive_number", "SECONDS_RULE"]

SECONDS_RULE = "a measuring budget must be a positive number of seconds"


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


def positive_number(value: Any, name: str, unit: str | None = "seconds", *, zero: bool = False) -> float:
    """`value` as a float when it is a finite number above 0 (or 0 itself with `zero`), else one
    ValueError naming `name`: nan and inf are refused with the rest, since a budget of either never
    ends (`unit` "seconds": "a measuring budget must be a positive number of seconds")."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and (
        value > 0 or (zero and value == 0))
    if not ok:
        of = f" of {unit}" if unit else ""
        rule = SECONDS_RULE if unit == "seconds" else f"it must be a positive, finite number{of}"
        raise ValueError(f"{name} = {value!r}: {rule}{' (or 0)' if zero else ''}")
    return float(value)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _silent(message: str) -> None:
    pass


def progress_fn(progress: bool | Callable[[str], Any] | None) -> Callable[[str], Any]:
    """The `progress=` convention: a callable taking a message is used as given, True prints messages
    on stderr, False/None says nothing."""
    if progress is None or progress is False:
        return _silent
    if progress is True:
        return _stderr
    if callable(progress):
        return progress
    raise ValueError(f"progress must be True, False or a callable taking a message, got {type(progress).__name__}")
