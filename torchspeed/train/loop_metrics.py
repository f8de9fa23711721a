"""What the training loop measures and shows: losses kept on the device and read at reading points
(`LossMeter`), samples/s over a span (`Span`), the metrics file (`MetricsLog`, CSV or JSONL) and the
progress on rank 0 (`Progress`: a rich bar, or text lines to a callable).
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as Bar

from torchspeed.atomic import atomic_write

__all__ = ["MetricsLog", "LossMeter", "Progress", "Span", "epoch_line", "LOG_COLUMNS"]

LOG_COLUMNS = ("epoch", "step", "train_loss", "val_loss", "val_acc", "lr", "samples_per_s")


class MetricsLog:
    """Rows of metrics kept in memory and rewritten atomically to CSV or JSONL (by the extension)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = os.fspath(path) if path else None
        if self.path and not self.path.endswith((".csv", ".jsonl")):
            raise ValueError(f"log_path {self.path!r} must end in .csv or .jsonl")
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def restore(self, up_to_step: int) -> None:
        """On resume: keep the rows already logged up to the checkpoint's step."""
        if not self.path or not os.path.isfile(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            if self.path.endswith(".jsonl"):
                rows = [json.loads(line) for line in f if line.strip()]
            else:
                rows = [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(f)]
        self.rows = [r for r in rows if r.get("step") is not None and r["step"] <= up_to_step]

    def flush(self) -> None:
        if not self.path:
            return
        with atomic_write(self.path, "w") as f:
            if self.path.endswith(".jsonl"):
                for r in self.rows:
                    f.write(json.dumps(r) + "\n")
            else:
                w = csv.DictWriter(f, fieldnames=LOG_COLUMNS, extrasaction="ignore")
                w.writeheader()
                w.writerows(self.rows)


def _number(text: str | None) -> int | float | None:
    """A CSV cell as it was written: an int stays an int (epoch, step), a float a float, empty is None."""
    if text in ("", None):
        return None
    try:
        return int(text)
    except ValueError:
        return float(text)


class LossMeter:
    """Training losses kept on the device, read to the host in one transfer at reading points.

    Each micro-batch's loss is kept (detached, 0-d) with where it happened; `read()` stacks the
    pending ones, reads them at once, raises FloatingPointError naming the first NaN/inf one (unless
    a GradScaler handles those: then they are skipped and left out of the means), and adds the rest
    to the epoch's and the log interval's sample-weighted sums.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, int, tuple[int, int, int]]] = []
        self.epoch_sum = self.since_sum = 0.0
        self.epoch_n = self.since_n = 0

    def add(self, loss: torch.Tensor, samples: int, where: tuple[int, int, int]) -> None:
        """`where` = (optimizer step, epoch, batch), 1-based, for the error message."""
        self.pending.append((loss.detach().float().reshape(()), samples, where))

    def read(self, nonfinite_is_error: bool) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        values = torch.stack([t for t, _, _ in pending]).tolist()
        for v, (_, k, (step, epoch, batch)) in zip(values, pending):
            if not math.isfinite(v):
                if nonfinite_is_error:
                    raise FloatingPointError(
                        f"loss is {v} at step {step} (epoch {epoch}, batch {batch}); lower the learning rate, "
                        "clip gradients (max_grad_norm=...), or check the inputs for NaN/inf (the loss is read "
                        "every log_every_n_steps steps and at epoch ends, so training went on until then)")
                continue
            self.epoch_sum += v * k
            self.since_sum += v * k
            self.epoch_n += k
            self.since_n += k

    def interval_mean(self) -> float:
        """Mean loss since the previous call (NaN when every loss since was skipped); restarts the interval."""
        mean = self.since_sum / self.since_n if self.since_n else math.nan
        self.since_sum, self.since_n = 0.0, 0
        return mean

    def start_epoch(self) -> None:
        """A new epoch: its sums and the first log interval start at zero (the epoch's row was the last)."""
        self.epoch_sum, self.epoch_n = 0.0, 0
        self.since_sum, self.since_n = 0.0, 0


class Progress:
    """Progress on rank 0: a rich bar (progress=True), short text lines to a callable, or nothing."""

    def __init__(self, progress: bool | Callable[[str], None]):
        self.bar = None
        self.say = progress if callable(progress) else None
        if progress is True:
            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                           TextColumn("{task.fields[info]}"), transient=False)
            self.bar.start()
        self.task = None

    def epoch(self, description: str, total: int | None, done: int) -> None:
        if self.bar is not None:
            self.task = self.bar.add_task(description, total=total, completed=done, info="")

    def advance(self) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, advance=1)

    def report(self, epoch: int, step: int, loss: float, rate: float) -> None:
        """At a reading point: the loss and samples/s since the previous one."""
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, info=f"loss {loss:.4f}  {rate:,.0f} samples/s")
        if self.say is not None:
            self.say(f"epoch {epoch} step {step} loss {loss:.4g} {rate:,.0f} samples/s")

    def line(self, text: str) -> None:
        if self.say is not None:
            self.say(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@dataclass
class Span:
    """Samples trained on since `t0` (an epoch, an optimizer step, a metrics row) and their rate."""

    samples: int = 0
    t0: float = field(default_factory=time.perf_counter)

    def rate(self, world_size: int, now: float) -> float:
        """Samples per second over every rank (each rank trains as many)."""
        return self.samples * world_size / max(now - self.t0, 1e-9)


def epoch_line(row: dict[str, Any]) -> str:
    """'epoch 1 step 8 train_loss 0.693 val_loss 0.65 val_acc 0.75 ...': an epoch's row as one line."""
    return " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
