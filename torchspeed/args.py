"""Argument conventions shared by the API and the command line."""
from __future__ import annotations

import math
import numbers
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["as_list", "progress_fn", "positive_number", "byte_size", "SECONDS_RULE"]

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


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_BYTES = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def byte_size(value: Any, name: str) -> int:
    """A size in bytes given as a number of bytes or a string with a unit ("8GiB", "500MB", "1.5 gb", "2e9"):
    GiB/MiB/KiB are powers of 1024, GB/MB/KB (and G/M/K) of 1000. Anything else, nan, inf, or not above 0
    bytes is one ValueError naming `name`."""
    if isinstance(value, str):
        m = _BYTES.fullmatch(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _BYTE_UNITS:
            raise ValueError(f"{name} = {value!r}: give a size such as 8GiB, 500MB or a number of bytes "
                             "(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        number = float(m.group(1)) * _BYTE_UNITS[unit]
    else:
        number = positive_number(value, name, "bytes")
    if not (math.isfinite(number) and number >= 1):
        raise ValueError(f"{name} = {value!r}: a memory size must be at least 1 byte")
    return int(number)


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
