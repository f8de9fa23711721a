"""Benchmark suites: one module per suite, found by name.

A suite module defines:

    TITLE: str                      # one line, e.g. "Data loading: images/s into the model"
    def run(quick: bool, progress: bool | Callable[[str], None] = False) -> dict

`run` returns the suite's JSON: the figures it is judged by at the top level (e.g. `ratio`), "rows",
its table as `torchspeed.bench.rows.Row` objects written out (`Row.to_dict`; one meaning per column),
and optionally "notes" (list of str) and "limits" (its goals against the machine's limits, met or not,
and why). Rows of the suites in UNDER_CEILINGS name the ceiling they are judged against and, for
compute, the work per item: the orchestrator adds `achieved` and `pct_of_ceiling` (`bench.ceilings`).
`progress` follows the library's convention (a callable, True prints, False is silent). `quick=True`
keeps the suite within its share of `torchspeed bench --quick`'s 8 minutes: a suite reads its share
from `torchspeed.bench.budget` and fits its windows into what is left (`torchspeed.bench.suite_kit`).
"""
from __future__ import annotations

import importlib
from types import ModuleType

SUITE_NAMES = ("data", "train", "gpt", "infer", "compress", "design")
# Not suites but run like one (in its own process, before them): the machine's ceilings.
MODULES = {"ceilings": "torchspeed.bench.ceilings"}
UNDER_CEILINGS = ("data", "train", "gpt", "infer")  # the suites whose rows are judged against a ceiling


def load(name: str) -> ModuleType:
    """The module of suite `name` (or of the ceilings, which run like a suite)."""
    if name not in SUITE_NAMES and name not in MODULES:
        raise ValueError(f"unknown benchmark suite {name!r}; choose from {', '.join(SUITE_NAMES)} or all")
    return importlib.import_module(MODULES.get(name, f"torchspeed.bench.suites.{name}"))
