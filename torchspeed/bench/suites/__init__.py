"""Benchmark suites: one module per suite, found by name.

A suite module defines:

    TITLE: str                      # one line, e.g. "Data loading: images/s into the model"
    def run(quick: bool, progress: bool | Callable[[str], None] = False) -> dict

`run` returns the suite's JSON: the figures it is judged by at the top level (e.g. `ratio`), "rows",
its table as `torchspeed.bench.rows.Row` objects written out (`Row.to_dict`), and optionally "notes"
(list of str) and "limits" (its goals against the machine's limits, met or not, and why). A row has
one meaning per column: technique, the measured median with its min and max and unit (e.g. "img/s"
or "ms"), ratio (speed-up over plain PyTorch, >1 is faster), cumulative, metric_drop (accuracy lost
vs the fp32 baseline) and what (one line, what it is); `headline` marks the row that sums the suite up
in the report's summary (default: the row with the largest cumulative or ratio). Rows of the data,
train and infer suites also name the ceiling they are judged against ("decode", "fp32", "bf16",
"int8") and, for compute, the work per item (`flops_per_item`, counted with
torch.utils.flop_counter; `batch` for "ms" rows): the orchestrator adds `achieved` and
`pct_of_ceiling` (see `torchspeed.bench.ceilings`).

`progress` follows the library's convention: a callable receives messages ("packing the store"),
True prints them, False is silent. `quick=True` must keep the suite within its share of
`torchspeed bench --quick`'s 8 minutes: a suite reads its share from `torchspeed.bench.budget` and
fits its measurement windows into what is left (`torchspeed.bench.suite_kit`).
"""
from __future__ import annotations

import importlib
from types import ModuleType

SUITE_NAMES = ("data", "train", "infer", "compress", "design")
# Not suites but run like one (in its own process, before them): the machine's ceilings.
MODULES = {"ceilings": "torchspeed.bench.ceilings"}
UNDER_CEILINGS = ("data", "train", "infer")  # the suites whose rows are judged against a ceiling


def load(name: str) -> ModuleType:
    """The module of suite `name` (or of the ceilings, which run like a suite)."""
    if name not in SUITE_NAMES and name not in MODULES:
        raise ValueError(f"unknown benchmark suite {name!r}; choose from {', '.join(SUITE_NAMES)} or all")
    return importlib.import_module(MODULES.get(name, f"torchspeed.bench.suites.{name}"))
