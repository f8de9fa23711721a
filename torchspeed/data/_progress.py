"""`progress=` in the data area: a bool or a callable taking a message."""
from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["say"]


def say(progress: bool | Callable[[str], None] | None) -> Callable[[str], None]:
    """`progress` as a function taking a message: the callable itself, stderr for True, silence for False."""
    if callable(progress):
        return progress
    if progress:
        return lambda text: print(text, file=sys.stderr, flush=True)
    return lambda text: None
