"""The `progress=` convention of compress (and the benchmark suites above it): a bool or a callable
taking a message."""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _silent(message: str) -> None:
    pass


def progress_fn(progress: bool | Callable[[str], Any] | None) -> Callable[[str], Any]:
    """`progress(message)` as given, messages on stderr for True, nothing for False/None."""
    if progress is None or progress is False:
        return _silent
    if progress is True:
        return _stderr
    if callable(progress):
        return progress
    raise ValueError(f"progress must be True, False or a callable taking a message, got {type(progress).__name__}")
