"""Where a training step's time goes: phase accounting and the verdict.

Phases are exclusive: entering a nested phase (a `.to()` copy inside data loading) pauses the
enclosing one, so the phases of a step add up to no more than its wall time; the rest is `other`
(Python in the loop, logging, host work the hooks do not see). This module imports no torch.
"""
from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PHASES", "PhaseClock", "busy_time", "verdict"]

# the contract's phases, then `eval` (forward passes under no_grad / in eval mode, kept apart so an
# evaluation inside a step window is not mistaken for training compute)
PHASES = ("data", "copy", "forward", "backward", "optimizer", "other")
EXTRA_PHASES = ("eval",)


class PhaseClock:
    """Exclusive time per phase between step boundaries.

    `sync` (e.g. torch.cuda.synchronize) is called before every reading, so queued GPU work is
    charged to the phase that queued it.
    """

    def __init__(self, sync: Callable[[], None] | None = None):
        self.sync = sync
        self._stack: list[list] = []  # [phase, slice start]
        self._window = dict.fromkeys(PHASES[:-1] + EXTRA_PHASES, 0.0)
        self._window_start: float | None = None

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    @property
    def current(self) -> str | None:
        return self._stack[-1][0] if self._stack else None

    @property
    def depth(self) -> int:
        """How many phases are open: what `unwind` closes back down to after an exception."""
        return len(self._stack)

    def enter(self, phase: str) -> None:
        now = self._now()
        if self._window_start is None:
            self._window_start = now
        if self._stack:
            top = self._stack[-1]
            self._window[top[0]] += now - top[1]
        self._stack.append([phase, now])

    def exit(self) -> None:
        if not self._stack:
            return
        now = self._now()
        phase, t0 = self._stack.pop()
        self._window[phase] += now - t0
        if self._stack:
            self._stack[-1][1] = now

    def unwind(self, depth: int = 0) -> None:
        """Close phases left open (an exception skipped their exit) down to `depth`."""
        while len(self._stack) > depth:
            self.exit()

    def boundary(self) -> tuple[float, dict[str, float]] | None:
        """End the step window now: (wall seconds, seconds per phase incl. `other`), and start the next."""
        now = self._now()
        if self._window_start is None:
            self._window_start = now
            return None
        for slot in self._stack:  # charge open phases up to now and keep them open
            self._window[slot[0]] += now - slot[1]
            slot[1] = now
        wall = now - self._window_start
        phases = dict(self._window)
        phases["other"] = max(0.0, wall - sum(phases.values()))
        self._window = dict.fromkeys(self._window, 0.0)
        self._window_start = now
        return wall, phases


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: time a device was busy when its kernels (or
    streams) overlap and leave idle gaps; summing them would count overlaps twice and, summing event
    spans, the gaps too."""
    total, end = 0.0, None
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def verdict(phases: dict[str, float], wall_s: float, gpu_busy_s: float | None = None,
            host_syncs_per_step: float | None = None, data_source: str | None = None) -> tuple[str, list[str]]:
    """data-bound, compute-bound or overhead-bound, with the evidence (shares of the step time).

    Input pipeline = waiting in next(loader) (or `data_source`, e.g. the script's own batch function) +
    host-to-device copies. Compute = forward, backward, optimizer (and evaluation). Overhead = the rest:
    Python in the loop, launches, host syncs.
    """
    if wall_s <= 0:
        return "compute-bound", ["no time was measured"]
    data = phases.get("data", 0.0) + phases.get("copy", 0.0)
    compute = sum(phases.get(p, 0.0) for p in ("forward", "backward", "optimizer", "eval"))
    other = phases.get("other", 0.0)
    ds, cs, os_ = data / wall_s, compute / wall_s, other / wall_s
    evidence = [
        f"input pipeline {ds:.0%} of step time ({data_source or 'waiting in next(loader)'} "
        f"{phases.get('data', 0.0) / wall_s:.0%}, "
        f"host-to-device copies {phases.get('copy', 0.0) / wall_s:.0%})",
        f"compute {cs:.0%} (forward {phases.get('forward', 0.0) / wall_s:.0%}, backward "
        f"{phases.get('backward', 0.0) / wall_s:.0%}, optimizer {phases.get('optimizer', 0.0) / wall_s:.0%})",
        f"other {os_:.0%} (Python in the loop, launches, host syncs)",
    ]
    launch_bound = False
    if gpu_busy_s is not None:
        busy = gpu_busy_s / wall_s
        evidence.append(f"the GPU was busy {busy:.0%} of the step")
        launch_bound = busy < 0.5 and ds < 0.25
    if host_syncs_per_step:
        evidence.append(f"{host_syncs_per_step:.1f} host syncs (.item()/.cpu()/.tolist()/float()/bool()) per step")
    if ds >= 0.25 and ds >= os_:
        evidence.insert(0, "the model waits for data: on a GPU this is the 'memory full, utilisation near 0%' symptom")
        return "data-bound", evidence
    if os_ >= 0.35 or launch_bound:
        return "overhead-bound", evidence
    return "compute-bound", evidence
