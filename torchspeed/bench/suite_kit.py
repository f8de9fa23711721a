"""What a suite's `run` is made of besides its own measurements: progress lines that also time the
suite's phases, and the budget shared among the timing windows still to come, each window's timing
made into a row."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torchspeed.args import progress_fn
from torchspeed.bench.budget import Budget, time_in_window
from torchspeed.bench.rows import Row


class Phases:
    """A suite's progress callback: each message is shown and starts a phase, whose seconds are kept in
    `seconds` (the suite's JSON reports where its time went)."""

    def __init__(self, progress: bool | Callable[[str], Any] = False):
        self.say = progress_fn(progress)
        self.seconds: dict[str, float] = {}
        self.name, self.t = "start", time.perf_counter()

    def __call__(self, text: str) -> None:
        now = time.perf_counter()
        self.seconds[self.name] = round(self.seconds.get(self.name, 0.0) + now - self.t, 1)
        self.name, self.t = text, now
        self.say(text)


class Windows:
    """A suite's budget shared equally among the measurements still to come: `parts` counts them by kind
    (e.g. rows=5, setup=2), and each row timed takes its window from what is left."""

    def __init__(self, budget: Budget, say: Callable[[str], Any], **parts: float):
        self.budget, self.say, self.parts = budget, say, dict(parts)

    def to_come(self) -> float:
        return sum(self.parts.values())

    def finish(self, part: str) -> None:
        """The measurements of `part` are over: nothing more is set aside for them."""
        self.parts[part] = 0

    def rate_row(self, technique: str, fn: Callable[[], Any], what: str, *, items: float, unit: str,
                 device: Any = None, part: str = "rows", **columns: Any) -> Row:
        """`fn` timed in its share of the budget (`budget.time_in_window`), as a row of `unit`/s."""
        from torchspeed.measure import OthersLoad

        window = self.budget.share(self.to_come())
        self.say(f"timing {technique} ({window:.0f} s window)")
        load = OthersLoad()
        t = time_in_window(fn, window, name=technique, items=items, unit=unit, device=device)
        self.parts[part] -= 1
        others = load.cores()
        return Row.rate(technique, t, what, f"{unit}/s", others_cores=round(others, 2) if others is not None else None,
                        **columns)


def cpu_suite_notes() -> list[str]:
    """The note a suite measured on the CPU adds where a GPU is present, so no reader takes its figures
    for the GPU's."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [f"measured on the CPU ({torch.get_num_threads()} threads): this suite's models run there; "
            f"the GPU ({torch.cuda.get_device_name()}) is not used"]
