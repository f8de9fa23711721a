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
`quick=True` must keep the suite within its share of `torchspeed bench --quick`'s 8 minutes: a suite
reads its share from `torchspeed.bench.budget` and fits its measurement windows into what is left.
Rows of the data, train and infer suites also name the ceiling they are judged against ("ceiling":
"decode", "fp32", "bf16", "int8") and, for compute, the work per item ("flops_per_item", counted
with torch.utils.flop_counter; "batch" for "ms" rows): the runner adds "achieved" and
"pct_of_ceiling" (see `torchspeed.bench.ceilings`).
"""
from __future__ import annotations

import importlib
from types import ModuleType

SUITE_NAMES = ("data", "train", "infer", "compress", "design")
# Not suites but run like one (in its own process, before them): the machine's ceilings.
MODULES = {"ceilings": "torchspeed.bench.ceilings"}
UNDER_CEILINGS = ("data", "train", "infer")  # the suites whose rows are judged against a ceiling


def load(name: str) -> ModuleType | None:
    """The suite module, or None if that suite has not been built into this version."""
    if name not in SUITE_NAMES and name not in MODULES:
        raise ValueError(f"unknown benchmark suite {name!r}; choose from {', '.join(SUITE_NAMES)} or all")
    module = MODULES.get(name, f"torchspeed.bench.suites.{name}")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return None
        raise


def available() -> list[str]:
    return [n for n in SUITE_NAMES if load(n) is not None]
