"""What `optimize` returns: one `VariantRow` per variant (built, skipped, failed, rejected or passed,
with what it measured) and the `OptimizeResult` table that picks `.best` by the objective."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console

from torchspeed.deprecated import renamed
from torchspeed.infer.runners import RUNTIME_KEY, Runner
from torchspeed.measure import busy_warning
from torchspeed.tables import print_table

__all__ = ["VariantRow", "OptimizeResult"]


@dataclass
class VariantRow:
    """One row of the table: a variant, whether it passed its checks, and what it measured."""

    name: str
    runtime: str
    precision: str
    exact: bool
    label: str = ""
    status: str = "pending"        # ok | rejected | failed | skipped
    reason: str = ""
    max_rel_error: float | None = None
    rel_l2_error: float | None = None
    metric: float | None = None
    metric_drop: float | None = None
    latency_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # batch -> p50/p90/throughput
    size_mb: float | None = None
    build_s: float | None = None
    runner: Runner | None = field(default=None, repr=False)
    input_shape: list[int] | dict[str, list[int]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "ok"

    @property
    def backend(self) -> str:
        """The old name of `runtime`."""
        renamed("VariantRow.backend", "VariantRow.runtime")
        return self.runtime

    def p50_ms(self, batch: int) -> float:
        return self.latency_ms.get(batch, {}).get("p50_ms", math.nan)

    def __call__(self, x: Any) -> torch.Tensor:
        if self.runner is None:
            raise ValueError(f"variant {self.name!r} has no runnable model ({self.status}: {self.reason})")
        return self.runner(x)

    def save(self, directory: str | os.PathLike) -> str:
        """Write a self-describing artifact (model file + manifest.json) that `ts.infer.load` runs."""
        if self.runner is None:
            raise ValueError(f"variant {self.name!r} cannot be saved: {self.status}: {self.reason}")
        if isinstance(self.input_shape, dict):
            shape: Any = {k: [None, *v[1:]] for k, v in self.input_shape.items()}
        else:
            shape = [None, *self.input_shape[1:]]
        measured = self.to_dict()
        measured[RUNTIME_KEY] = measured.pop("runtime")  # a manifest names the runtime by the artifact format's key
        return self.runner.save(directory, manifest_extra={"name": self.name, "input_shape": shape,
                                                           "measured": measured})

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "runtime": self.runtime, "precision": self.precision, "exact": self.exact,
            "label": self.label, "status": self.status, "reason": self.reason,
            "max_rel_error": self.max_rel_error, "rel_l2_error": self.rel_l2_error, "metric": self.metric,
            "metric_drop": self.metric_drop, "latency_ms": {str(b): v for b, v in self.latency_ms.items()},
            "size_mb": self.size_mb, "build_s": self.build_s, **({"extra": self.extra} if self.extra else {}),
        }


@dataclass
class OptimizeResult:
    """The full table (rejected, failed and skipped variants too) and `.best`, the chosen row."""

    table: list[VariantRow]
    batch_sizes: tuple[int, ...]
    objective: str
    baseline_metric: float | None
    threads: int
    unavailable: dict[str, str]
    _workdir: Any = field(default=None, repr=False)  # keeps exported files alive while the result lives
    others_cores: float | None = None  # most cores other processes used while one batch size was timed
    remembered: str | None = None  # "remembered from <date> (<figure>)": the winner recalled, checked again, not timed

    @property
    def busy_warning(self) -> str | None:
        """A sentence saying the variants were timed on a busy machine (the choice may be noise), else None."""
        return busy_warning(self.others_cores)

    @property
    def objective_batch(self) -> int:
        """The batch size the objective is judged at: the first ('latency') or the largest ('throughput')."""
        return self.batch_sizes[0] if self.objective == "latency" else max(self.batch_sizes)

    @property
    def best(self) -> VariantRow | None:
        """The passed, timed row that wins the objective at `objective_batch`: lowest p50 ('latency') or
        highest throughput ('throughput'); None if none passed."""
        passed = [r for r in self.table if r.passed and r.latency_ms]
        b = self.objective_batch
        if self.objective == "latency":
            return min(passed, key=lambda r: r.p50_ms(b), default=None)
        return max(passed, key=lambda r: r.latency_ms[b]["throughput"] or 0.0, default=None)

    def __getitem__(self, name: str) -> VariantRow:
        for r in self.table:
            if r.name == name:
                return r
        raise KeyError(f"no variant named {name!r}; have {[r.name for r in self.table]}")

    def fastest_at(self, batch: int, passed_only: bool = True) -> VariantRow | None:
        """The row with the lowest p50 at `batch` (among those that passed, unless `passed_only=False`)."""
        pool = [r for r in self.table if (r.passed or not passed_only) and not math.isnan(r.p50_ms(batch))]
        return min(pool, key=lambda r: r.p50_ms(batch), default=None)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "best": best.name if best else None, "objective": self.objective,
            "batch_sizes": list(self.batch_sizes), "baseline_metric": self.baseline_metric,
            "threads": self.threads, "unavailable": self.unavailable, "others_cores": self.others_cores,
            "busy_warning": self.busy_warning, "remembered": self.remembered,
            "candidates": [r.to_dict() for r in self.table],
        }

    def rows(self) -> list[list[Any]]:
        base = self.table[0] if self.table else None
        best = self.best
        out = []
        for r in self.table:
            if r.status == "skipped":
                continue
            row: list[Any] = [r.name + (" *" if r is best else ""), r.status]
            for b in self.batch_sizes:
                p = r.p50_ms(b)
                row += [None if math.isnan(p) else p,
                        None if (math.isnan(p) or base is None or math.isnan(base.p50_ms(b))) else base.p50_ms(b) / p]
            row += [r.metric_drop if r.metric_drop is not None else r.rel_l2_error, r.size_mb,
                    r.reason[:70] if r.reason else ""]
            out.append(row)
        return out

    def columns(self) -> list[str]:
        cols = ["variant", "status"]
        for b in self.batch_sizes:
            cols += [f"p50 ms (b{b})", f"x (b{b})"]
        return cols + ["drop / err", "MB", "note"]

    def print(self, console: Any = None) -> None:
        console = console or Console()
        best = self.best
        print_table(f"optimize: {self.threads} threads, best = {best.name if best else 'none'}",
                    self.columns(), self.rows(), console)
        skipped = [f"{r.name} ({r.reason})" for r in self.table if r.status == "skipped"]
        if skipped:
            console.print("skipped: " + "; ".join(skipped), highlight=False)
        if self.busy_warning:
            console.print(f"note: {self.busy_warning}", highlight=False)
        if self.remembered:
            console.print(f"note: {self.remembered}: only the winner was built and checked again (its accuracy "
                          "too), its timings are the remembered ones; refresh=True / --refresh measures again",
                          highlight=False)
