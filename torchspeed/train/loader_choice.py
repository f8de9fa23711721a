"""A loader's worker/thread counts chosen with the training step in the loop.

`fast_loader(..., num_workers="auto")` keeps the counts fastest for the loader alone, but a training
step needs the same cores: on a small machine the loader's threads (or workers) can slow the step more
than their batches help. So whoever knows the step (accelerate() given the loader, the Trainer, the
recipe, the bench) times the setting measured alone and the less parallel ones, each feeding a few
real steps, interleaved, and keeps a more parallel one only when it is faster by a margin.

`choose_counts` does it for a `loader_contract.Recountable` whose `settings` say its counts were
measured alone (train never imports torchspeed.data), puts the model, optimizer, GradScaler and every
RNG back, remembers the choice (kind "loader_step") and gives rank 0's to every rank under torchrun.
`step_candidates`, `time_fed_steps` and `choose_loader_with_step` serve callers that build their own loaders.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed import ranks, remembered
from torchspeed.args import progress_fn
from torchspeed.loader_contract import Recountable, Resumable, conforms, release_workers
from torchspeed.measure import OthersLoad, busy_warning, wait_for_quiet_machine
from torchspeed.runtime import synchronize, usable_cores
from torchspeed.train.step_timer import trial_state_kept
from torchspeed.train.wrapping import DeviceLoader

__all__ = ["LoaderStepResult", "LoaderStepRow", "alone_counts", "choose_counts", "choose_loader_with_step",
           "data_identity", "step_candidates", "time_fed_steps"]

log = logging.getLogger(__name__)

KIND = "loader_step"  # the remembered decisions' kind

# loaders returned by choose_counts: their counts are chosen already (a second caller leaves them)
_CHOSEN: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclass
class LoaderStepRow:
    """One loader setting timed feeding real training steps: seconds per step (median of the rounds)."""

    num_workers: int
    threads: int
    step_s: float | None           # median seconds per training step fed by this loader (None: remembered)
    rounds_s: list[float] = field(default_factory=list)  # seconds per step in each interleaved round
    decision: str = ""

    @property
    def setting(self) -> str:
        return _setting(self.num_workers, self.threads)

    def to_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "threads": self.threads, "setting": self.setting,
                "step_s": self.step_s, "rounds_s": self.rounds_s, "decision": self.decision}


@dataclass
class LoaderStepResult:
    """The loader setting chosen with the training step in the loop, and every candidate's step time.

    A loader tuned alone takes every core it can; beside a training step that needs the same cores,
    fewer loader threads can make the step faster. `remembered` holds the "remembered from ..." line
    when the choice was recalled instead of measured; `alone` the setting measured without the step."""

    num_workers: int
    threads: int
    table: list[LoaderStepRow] = field(default_factory=list)
    others_cores: float | None = None  # cores other processes used while the candidates were timed
    remembered: str | None = None
    alone: tuple[int, int] | None = None  # (num_workers, threads) the loader measured fastest alone

    @property
    def busy_warning(self) -> str | None:
        return busy_warning(self.others_cores)

    @property
    def setting(self) -> str:
        return _setting(self.num_workers, self.threads)

    def describe(self) -> str:
        """'num_workers=0, threads=1 (0.412 s/step with the step in the loop; 2 settings timed)'."""
        if self.remembered:
            return f"{self.setting} ({self.remembered})"
        best = next((r for r in self.table if (r.num_workers, r.threads) == (self.num_workers, self.threads)), None)
        figure = f"{best.step_s:.3g} s/step with the step in the loop; " if best and best.step_s else ""
        return f"{self.setting} ({figure}{len(self.table)} setting(s) timed)"

    def to_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "threads": self.threads, "setting": self.setting,
                "table": [r.to_dict() for r in self.table], "others_cores": self.others_cores,
                "remembered": self.remembered, "alone": list(self.alone) if self.alone else None}


def _setting(num_workers: int, threads: int) -> str:
    return f"num_workers={num_workers}" + (f", threads={threads}" if num_workers == 0 else "")


def step_candidates(num_workers: int, threads: int) -> list[tuple[int, int]]:
    """The loader settings worth timing with the step in the loop, least parallel first: from the setting
    that measured fastest alone (`num_workers`, `threads`) down to one thread of this process, halving
    (more parallelism than the loader alone can use only takes cores from the step)."""
    def ladder(n: int) -> list[int]:
        out = {n}
        while n > 1:
            n //= 2
            out.add(n)
        return sorted(out)

    if num_workers == 0:
        return [(0, t) for t in ladder(max(1, threads))]
    return [(0, 1)] + [(w, 1) for w in ladder(num_workers)]


def time_fed_steps(contenders: Mapping[str, tuple[Any, Callable[[Any], Any]]], *, steps: int = 2, rounds: int = 2,
                   device: Any = None) -> tuple[dict[str, list[float]], float | None]:
    """Seconds per training step of each contender, a (loader, step) pair, timed interleaved: (each
    contender's seconds per step in each round, the cores other processes used meanwhile).

    Each round runs every contender in turn (the order rotated) on a fresh pass of its loader: the first
    batch untimed, then `steps` steps each followed by the next batch (the wait the step did not hide);
    the pass is then closed, so no loader's threads fill its queue on the next contender's cores (and
    start its own next round with batches made for free)."""
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    others = OthersLoad()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            loader, step = contenders[name]
            it = iter(loader)
            try:
                batch = next(it)
                if device is not None:
                    synchronize(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(batch)
                    batch = next(it)  # the batch after each step: what the loader made while it ran
                if device is not None:
                    synchronize(device)
                times[name].append((time.perf_counter() - t0) / steps)
            finally:
                _close(it)
    return times, others.cores()


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


def choose_loader_with_step(make_loader: Callable[[int, int], Any], step: Callable[[Any], Any],
                            candidates: list[tuple[int, int]], *, steps: int = 2, rounds: int = 2,
                            margin: float = 0.03, device: Any = None,
                            built: Mapping[tuple[int, int], Any] | None = None,
                            progress: bool | Callable[[str], Any] = False,
                            agree: Callable[[int], int] | None = None) -> tuple[Any, LoaderStepResult]:
    """(The loader under which `step(batch)`, one real training step, runs fastest, the result), timed
    by `time_fed_steps` after one untimed step (first-step costs are no candidate's); the other loaders'
    workers are stopped. `candidates`: (num_workers, threads), least parallel first (`step_candidates`);
    a more parallel one is kept only when faster by more than `margin` (noise never buys threads that
    compete with the step). `make_loader(num_workers, threads)` builds one unless `built` has it;
    `agree(index)` makes this process's choice every process's (rank 0's under torchrun). The steps
    change the model: the caller puts it back (`step_timer.trial_state_kept`)."""
    say = progress_fn(progress)
    built = built or {}
    loaders = {c: built[c] if c in built else make_loader(*c) for c in candidates}
    rows = [LoaderStepRow(w, t, None) for w, t in candidates]
    if len(candidates) == 1:
        rows[0].decision = "chosen (the only candidate)"
        return loaders[candidates[0]], LoaderStepResult(*candidates[0], table=rows)
    wait_for_quiet_machine(max_s=3.0)
    say(f"choosing the loader with the training step in the loop ({len(candidates)} settings, "
        f"{rounds} x {steps} steps each, interleaved)")
    it = iter(loaders[candidates[0]])
    try:
        step(next(it))  # warm-up, untimed
    finally:
        _close(it)
    times, others = time_fed_steps({r.setting: (loaders[c], step) for r, c in zip(rows, candidates)},
                                   steps=steps, rounds=rounds, device=device)
    for r in rows:
        r.rounds_s = times[r.setting]
        r.step_s = float(statistics.median(r.rounds_s))
    best = rows[0]
    for r in rows[1:]:
        if r.step_s < best.step_s * (1 - margin):
            best = r
    if agree is not None:
        best = rows[agree(rows.index(best))]
    for r in rows:
        r.decision = ("chosen" if r is best else
                      f"{r.step_s / best.step_s:.2f}x the chosen step time" if r.step_s >= best.step_s else
                      f"within {100 * margin:.0f}% of a less parallel setting: not worth its cores")
    for c, loader in loaders.items():
        if c != (best.num_workers, best.threads):
            release_workers(loader)
    result = LoaderStepResult(best.num_workers, best.threads, table=rows, others_cores=others)
    log.info("loader with the step in the loop: %s; %s", result.describe(),
             "; ".join(f"{r.setting} {r.step_s:.3g} s/step" for r in rows))
    if result.busy_warning:
        log.warning("loader with the step in the loop: %s", result.busy_warning)
    return loaders[(best.num_workers, best.threads)], result


def alone_counts(loader: Any) -> tuple[int, int] | None:
    """(num_workers, threads) of a loader whose counts were measured alone and that can be rebuilt
    with others (a `Recountable` whose `settings`, the measurement, are not None); None for counts the
    user fixed, a loader of another kind, or one whose counts were chosen with the step already."""
    inner = _inner(loader)
    settings = getattr(inner, "settings", None)
    if settings is None or not conforms(inner, Recountable) or inner in _CHOSEN:
        return None
    workers = int(inner.num_workers)
    threads = int(getattr(inner, "threads", getattr(settings, "threads", 1))) if workers == 0 else 1
    return workers, threads


def _inner(loader: Any) -> Any:
    """The user's loader inside accelerate()'s DeviceLoader."""
    return loader.loader if isinstance(loader, DeviceLoader) else loader


def data_identity(loader: Recountable) -> dict[str, Any]:
    """What a remembered choice knows the data by: the loader's own `identity()` (the data, batch,
    crop, decoder and device its batches depend on)."""
    return {"identity": _inner(loader).identity()}


def _possible(setting: Any) -> bool:
    """Whether a remembered (num_workers, threads) can still run here (no more than the cores allow)."""
    return (isinstance(setting, list) and len(setting) == 2 and all(isinstance(v, int) for v in setting)
            and 0 <= setting[0] <= usable_cores() + 1 and 1 <= setting[1] <= usable_cores() + 1)


def _position(loader: Any) -> Any:
    """The loader's position (its state_dict) when it keeps one, so the timing passes leave no trace."""
    return loader.state_dict() if conforms(loader, Resumable) else None


def choose_counts(loader: Any, step: Callable[[Any], Any], parts: Mapping[str, Any], *, model: nn.Module,
                  optimizer: torch.optim.Optimizer | None, scaler: Any = None, device: Any = None,
                  steps: int = 2, rounds: int = 2, refresh: bool = False,
                  progress: bool | Callable[[str], Any] = False) -> tuple[Any, LoaderStepResult]:
    """(The loader to train with, the result): `loader` (see `alone_counts`) with the counts under which
    `step(batch)`, one real training step of `model` with `optimizer`, runs fastest among the setting
    measured alone and the less parallel ones (`step_candidates`, each a `with_counts` of it), timed by
    `choose_loader_with_step`; the model, optimizer, `scaler`, RNG and loader position put back.

    `parts` (what the step's time depends on) with the alone setting and `data_identity` key the
    remembered choice, taken at once unless `refresh`; one timed on a busy machine is not remembered.
    Under torchrun rank 0's alone setting makes every rank's candidates, all ranks time them in step
    (a DDP step needs them all), and rank 0's choice is every rank's."""
    say = progress_fn(progress)
    e = ranks.env()
    own = alone_counts(loader)
    if own is None:
        raise ValueError("choose_counts needs a loader whose counts were measured alone (with_counts and settings)")
    alone = tuple(ranks.broadcast_ints(list(own))) if e.distributed else own
    position = _position(loader)
    left = len(loader) - (position["batches_done"] if isinstance(position, Mapping)
                          and isinstance(position.get("batches_done"), int) else 0)
    # a pass needs steps + 1 batches: a shorter epoch keeps the setting measured alone
    candidates = step_candidates(*alone) if left > steps + 1 else [alone]
    timed: dict[str, Any] = {}  # the loader chosen by timing (none when the choice was remembered)

    def measure() -> LoaderStepResult:
        timing = trial_state_kept(model, optimizer, scaler) if len(candidates) > 1 else contextlib.nullcontext()
        with timing:
            timed["loader"], result = choose_loader_with_step(
                lambda w, t: loader.with_counts(w, t), step, candidates, steps=steps, rounds=rounds, device=device,
                built={own: loader} if own == alone else None, progress=progress,
                agree=(lambda index: ranks.broadcast_ints([index])[0]) if e.distributed else None)
        return result

    def decode(memory: remembered.Memory) -> LoaderStepResult | None:
        setting = memory.decision.get("setting")
        return LoaderStepResult(*setting, remembered=memory.describe()) if _possible(setting) else None

    def encode(result: LoaderStepResult) -> tuple[dict[str, Any], str]:
        best = next(r for r in result.table if (r.num_workers, r.threads) == (result.num_workers, result.threads))
        return {"setting": [result.num_workers, result.threads]}, f"{result.setting}, {best.step_s:.3g} s/step"

    key = {**parts, "alone": list(alone), "data": data_identity(loader)} if len(candidates) > 1 else None
    result, memory = remembered.recall_or_measure(KIND, key, measure, decode=decode, encode=encode,
                                                  busy=lambda r: r.busy_warning, refresh=refresh,
                                                  what="loader with the step in the loop")
    result.alone = alone
    if memory is None:  # timed: the loaders timed are put back at the position
        picked = timed["loader"]
        touched = list({id(loader): loader, id(picked): picked}.values())
    else:  # remembered: no pass, no step
        setting = (result.num_workers, result.threads)
        picked = loader if setting == own else loader.with_counts(*setting)
        touched = [] if picked is loader else [picked]
        if picked is not loader:
            release_workers(loader)
    if position is not None:
        for each in touched:
            each.load_state_dict(position)
    say(f"loader with the step in the loop: {result.describe()}")
    _CHOSEN.add(_inner(picked))
    return picked, result
