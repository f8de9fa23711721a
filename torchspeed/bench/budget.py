"""Time budgets: each suite gets seconds, not step counts, and fits its measurement windows into them.

A step count right on one machine is minutes too long on a slower one (a ResNet-18 training step at
batch 64 takes 1.5 s on one 2-core machine, 5-10 s on another), so windows are sized by measured time:
a contender's first call is timed, and the repeats that fit its window are taken (at least
`min_repeats`, so a median exists).

`make demo` (`torchspeed bench --quick`) aims to end the report QUICK_TARGET_S (8 minutes) after it starts,
about 9 with the install (under a minute through uv): a minute of margin under 10 on the slowest machine
seen (a 2-core AVX2 EPYC). A machine's first run builds
the demo photos and the demo model before the suites, outside their budgets (PREPARE_S, about what that
takes there), and measures the ceilings (QUICK_S["ceilings"]; read from the cache after: CACHED_S).
QUICK_S shares the rest among the parts, at most QUICK_LIMIT_S in all, a new suite's share included
(tests/test_bench_ceilings.py holds them to it). Where a slower machine's first run took so long to prepare
that the suites' shares would end the report after QUICK_TARGET_S, the suites that size their windows by a
budget get a cut share of it (`cut_share`, never under QUICK_FLOOR of it). Each share covers the suite's fixed
work (the train suite's accelerate trials, infer's variants, compress's fine-tune, design's checks), so a
share is at least what that took; the rest goes to measurement windows.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

QUICK_LIMIT_S = 325  # every part of `torchspeed bench --quick` together, the ceilings measured
QUICK_TARGET_S = 480  # all of `torchspeed bench --quick`, a machine's first run included: with the install (under a
# minute) 9 minutes, a minute of margin under 10 for the parts no budget sizes (the demo model, infer's variants)
QUICK_FLOOR = 0.5  # where the first run's preparation took longer, a suite's quick budget is cut to no less than this
# one-off work before the suites on a machine's first run (cached after): about this long on the slowest machine
PREPARE_S = {"demo photos": 60, "demo model": 105}
# seconds per part of `torchspeed bench --quick` and of the full report (the orchestrator's plan and time-left
# estimate too); a quick part reads from the cache what it measured once: about CACHED_S then
QUICK_S = {"ceilings": 20, "data": 45, "train": 75, "gpt": 60, "infer": 70, "compress": 40, "design": 15}
FULL_S = {"ceilings": 60, "data": 420, "train": 900, "gpt": 600, "infer": 900, "compress": 600, "design": 180}
CACHED_S = {"ceilings": 5}
ENV = "TORCHSPEED_BENCH_BUDGET_S"  # overrides a suite's budget (seconds), e.g. to try a suite quickly


def cut_share(budgets_s: float, fixed_s: float, spent_s: float, target_s: float | None = None) -> float:
    """The share of their budgets (`budgets_s` in all) the suites still to run get, so that the quick report
    ends by `target_s` (QUICK_TARGET_S) after `spent_s` already spent (a slower machine's first run: the demo photos and
    model) and `fixed_s` for the parts whose work is fixed: 1 where there is time, never under QUICK_FLOOR."""
    if budgets_s <= 0:
        return 1.0
    target = QUICK_TARGET_S if target_s is None else target_s
    return max(QUICK_FLOOR, min(1.0, (target - spent_s - fixed_s) / budgets_s))


def seconds_for(name: str, quick: bool) -> float:
    if os.environ.get(ENV):
        return float(os.environ[ENV])
    return float((QUICK_S if quick else FULL_S).get(name, 60))


class Budget:
    """Seconds left to a suite, and how to share them among the measurements still to come."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.start = time.perf_counter()

    @classmethod
    def of(cls, name: str, quick: bool, seconds: float | None = None) -> Budget:
        return cls(seconds if seconds is not None else seconds_for(name, quick))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def share(self, parts: float, floor: float = 0.0) -> float:
        """An equal share of what is left among `parts` measurements still to come (at least `floor`)."""
        return max(floor, self.left() / max(parts, 1.0))

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds


def time_in_window(fn: Callable[[], Any], window_s: float, *, name: str, items: float | None = None,
                   unit: str = "items", device: Any = None, min_repeats: int = 2, max_repeats: int = 20) -> Any:
    """`measure.time_callable` with its repeats fitted into `window_s`: the first (warm-up) call is
    timed and carries the one-off costs; then as many timed calls as fit, between `min_repeats` and
    `max_repeats`. Returns the Timing, with the warm-up seconds in `extra["first_s"]`."""
    from torchspeed.measure import time_callable

    from torchspeed.runtime import synchronize

    t0 = time.perf_counter()
    fn()
    if device is not None:
        synchronize(device)
    first = time.perf_counter() - t0
    per_call = first  # the first call is the slowest; the estimate errs on the side of the budget
    repeats = int(max(min_repeats, min(max_repeats, (window_s - first) / max(per_call, 1e-6))))
    t = time_callable(fn, name=name, warmup=0, repeats=repeats, items=items, unit=unit, device=device)
    t.extra["first_s"] = first
    return t
