"""Benchmark suites: one module per suite, found by name.

A suite module defines:

    TITLE: str                      # one line, e.g. "Data loading: images/s into the model"
    def run(quick: bool, progress: bool | Callable[[str], None] = False) -> dict

`run` returns the suite's JSON: the figures its issue names at the top level (e.g. `ratio`), plus
`"rows"`, a list of table rows for the report, each a dict with
    technique (str), median (float), min (float), max (float), unit (str, e.g. "img/s" or "ms"),
    ratio (float | None: speed-up over plain PyTorch, >1 is faster), cumulative (float | None),
    metric_drop (float | None: accuracy lost vs the fp32 baseline), what (str: one line, what it is)
optionally "headline": True on the row that sums the suite up in the report's summary (default: the
row with the largest cumulative or ratio), and optionally "notes" (list of str). `progress` follows the
library's convention: a callable receives messages ("packing the store"), True prints them, False is silent.
`quick=True` must keep the suite within its share of `torchspeed bench --quick`'s 8 minutes.
"""
from __future__ import annotations

import importlib
from types import ModuleType

SUITE_NAMES = ("data", "train", "infer", "compress", "design")


def load(name: str) -> ModuleType | None:
    """The suite module, or None if that suite has not been built into this version."""
    if name not in SUITE_NAMES:
        raise ValueError(f"unknown benchmark suite {name!r}; choose from {', '.join(SUITE_NAMES)} or all")
    try:
        return importlib.import_module(f"torchspeed.bench.suites.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"torchspeed.bench.suites.{name}":
            return None
        raise


def available() -> list[str]:
    return [n for n in SUITE_NAMES if load(n) is not None]
