"""The lines of the report's tables: one typed row per technique a suite measured (or did not run).

A suite returns its `Row`s as JSON (`to_dict`); the orchestrator adds `achieved` and `pct_of_ceiling`,
and the report reads them back with `Row.from_dict`, so a `results.json` of an earlier version renders
too. The first nine columns (`CORE`) are always written, the others only when the row has them (`None`:
no such column), except those a row type names in `ALWAYS`, written measured or not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

# units of a row whose figure is an accuracy, not a speed (the report shows it in the accuracy column)
ACCURACY_UNITS = ("top-1", "top-5", "accuracy")

# the columns every row writes, in the report's order
CORE = ("technique", "median", "min", "max", "unit", "ratio", "cumulative", "metric_drop", "what")


@dataclass
class Row:
    """One line of a suite's table.

    `median` is the measured figure in `unit` (None: not run or skipped, `what` says why), `min` and
    `max` its spread over the timed calls or passes; `ratio` is the speed-up over plain PyTorch (>1 is
    faster), `cumulative` the same for rows that each add one technique to the row above;
    `metric_drop` the accuracy lost against the fp32 baseline.
    """

    technique: str = ""
    median: float | None = None
    min: float | None = None
    max: float | None = None
    unit: str = ""
    ratio: float | None = None
    cumulative: float | None = None
    metric_drop: float | None = None
    what: str = ""
    headline: bool | None = None          # True: the row that sums the suite up in the report's summary
    ceiling: str | None = None            # the ceiling it is judged against: decode, fp32, bf16, int8
    flops_per_item: float | None = None   # work per item (torch.utils.flop_counter), for a compute ceiling
    batch: int | None = None              # batch size of an "ms" row (items per call)
    peer: bool | None = None              # True: a library set up by hand, measured beside torchspeed
    calls: int | None = None              # timed calls that fitted the row's window
    first_call_s: float | None = None     # seconds of the first (untimed) call, the one-off costs
    scale: bool | None = None             # True: a data row measured on a larger copy of the photos
    gflops: float | None = None           # GFLOPs of one call (the design suite's equal-FLOPs check)
    p90: float | None = None              # 90th percentile latency (ms rows of the infer suite)
    output_error: float | None = None     # relative L2 error of the output against fp32
    others_cores: float | None = None     # cores other processes used while the row was timed
    vs_above: str | None = None           # a row slower than the row above: what timing both again found
    remeasured: dict[str, Any] | None = None  # that re-measure's figures (interleaved, and steps on a batch in memory)
    achieved: float | None = None         # set by the orchestrator: the rate in the ceiling's unit
    pct_of_ceiling: float | None = None   # set by the orchestrator: 100 x achieved / ceiling

    ALWAYS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Row:
        """A row read back from a suite's JSON; keys this version does not know are left out."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        keep = set(CORE) | set(self.ALWAYS)
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name in keep or getattr(self, f.name) is not None}

    @classmethod
    def not_run(cls, technique: str, why: str, unit: str, **columns: Any) -> Row:
        """A row the suite did not measure, saying why (the report shows it without a figure)."""
        return cls(technique=technique, unit=unit, what=f"not run: {why}", **columns)

    @classmethod
    def skipped(cls, technique: str, why: str, unit: str, **columns: Any) -> Row:
        """A row with no figure because its library is missing or failed here."""
        return cls(technique=technique, unit=unit, what=f"skipped: {why}", **columns)

    @classmethod
    def in_ms(cls, technique: str, timing: Any, what: str, **columns: Any) -> Row:
        """A latency row from a `measure.Timing`: median, min and max of its calls in ms."""
        return cls(technique=technique, median=timing.median_s * 1e3, min=timing.min_s * 1e3,
                   max=timing.max_s * 1e3, unit="ms", what=what, **columns)

    @classmethod
    def rate(cls, technique: str, timing: Any, what: str, unit: str, **columns: Any) -> Row:
        """A throughput row from a `measure.Timing` of calls timed in a window: items/s, spread over the
        calls, how many calls and what the first one cost."""
        rates = timing.rates
        return cls(technique=technique, median=timing.throughput, min=min(rates), max=max(rates), unit=unit,
                   what=what, calls=len(rates), first_call_s=round(timing.extra["first_s"], 2), **columns)

    @property
    def speedup(self) -> float | None:
        """The row's speed-up in the summary: cumulative when it has one, else its ratio."""
        return self.cumulative or self.ratio

    @property
    def is_accuracy(self) -> bool:
        """Whether the row's figure is an accuracy (a distilled student's top-1) rather than a speed."""
        return self.unit in ACCURACY_UNITS

    @property
    def measured(self) -> bool:
        """Whether the row has a figure to plot."""
        return isinstance(self.median, (int, float))


@dataclass
class LatencyRow(Row):
    """A variant's latency at one batch size (the infer suite): median (p50), min, max and p90 in ms and
    the output error against fp32, every column written; a variant that was not timed has NaN figures."""

    ALWAYS: ClassVar[tuple[str, ...]] = ("p90", "output_error", "batch", "flops_per_item", "ceiling")

    @classmethod
    def of(cls, technique: str, lat: dict[str, float] | None, what: str, **columns: Any) -> LatencyRow:
        """From an `optimize` variant's latency entry at one batch size (None: not timed)."""
        nan = math.nan
        return cls(technique=technique, median=lat["p50_ms"] if lat else nan, min=lat["min_ms"] if lat else nan,
                   max=lat["max_ms"] if lat else nan, p90=lat["p90_ms"] if lat else nan, unit="ms", what=what,
                   **columns)


@dataclass
class ContenderRow(Row):
    """A loader timed in the data suite's interleaved rounds: it always says whether it is the headline
    and which ceiling it is judged against (None for a raw-pixel store, which decodes nothing)."""

    ALWAYS: ClassVar[tuple[str, ...]] = ("headline", "ceiling")


def rows_of(result: dict[str, Any]) -> list[Row]:
    """The rows of a suite's JSON (rows that are not objects left out)."""
    return [Row.from_dict(r) for r in result.get("rows", []) or [] if isinstance(r, dict)]


def to_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [r.to_dict() for r in rows]
