"""A loader's worker/thread counts chosen with the training step in the loop.

`fast_loader(..., num_workers="auto")` keeps the counts that make batches fastest with the loader
alone. A training step needs the same cores: on a small machine the loader's threads (or worker
processes) then slow the step down more than their batches speed training up. Whoever knows the step
(accelerate() given the loader, the Trainer, the recipe, the bench) times the setting measured alone
and the less parallel ones below it, each feeding a few real training steps, interleaved, and keeps
a more parallel one only when its steps are faster by a margin.

`choose_counts` is that choice for a loader that can be rebuilt with other counts (duck-typed: it
has `with_counts(num_workers, threads)` and its `settings` say the counts were measured alone; train
never imports torchspeed.data): the model, optimizer, GradScaler and every RNG are put back exactly
afterwards, the choice is remembered (`torchspeed.remembered`, kind "loader_step"), and under
torchrun rank 0's choice is every rank's. `step_candidates`, `time_fed_steps` and
`choose_loader_with_step` are the mechanism, for callers that build their loaders themselves.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchspeed import remembered
from torchspeed.args import progress_fn
from torchspeed.measure import OthersLoad, busy_warning, wait_for_quiet_machine
from torchspeed.runtime import rng_state, set_rng_state, synchronize, usable_cores
from torchspeed.train import distributed
from torchspeed.train.wrapping import DeviceLoader

__all__ = ["LoaderStepResult", "LoaderStepRow", "alone_counts", "choose_counts", "choose_loader_with_step",
           "data_identity", "release_workers", "step_candidates", "time_fed_steps", "training_state_kept"]

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


def release_workers(loader: Any) -> None:
    """Stop a loader's worker processes now instead of whenever it is collected, so the next candidate
    is timed on quiet cores (a FastLoader's DataLoader is its `dataloader`; a loader of threads has none)."""
    dl = getattr(loader, "dataloader", loader)
    it = getattr(dl, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
        dl._iterator = None


def time_fed_steps(contenders: Mapping[str, tuple[Any, Callable[[Any], Any]]], *, steps: int = 2, rounds: int = 2,
                   device: Any = None) -> tuple[dict[str, list[float]], float | None]:
    """Seconds per training step of each contender, a (loader, step) pair, timed interleaved.

    Each round runs every contender in turn (the order rotated round by round) on a fresh pass of its
    loader: its first batch is taken untimed (the pipeline starting), then `steps` steps are timed, each
    followed by taking the loader's next batch (the wait for data the step did not hide); the pass is
    then closed, so a paused loader's threads or workers never run while another contender is timed (a
    loader left running would fill its queue on the next contender's cores and start its own next
    round with batches made for free). Returns the seconds per step of each contender in each round,
    and the cores other processes used meanwhile."""
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
    """The loader setting under which `step(batch)` (one real training step) runs fastest, timed with
    `time_fed_steps` (candidates interleaved, each `rounds` x `steps` steps) after one untimed step
    (first-step costs: an optimizer's state, kernels chosen, a compile, are no candidate's).

    `candidates`: (num_workers, threads) pairs, least parallel first (`step_candidates`); a more
    parallel one is kept only when its steps are faster by more than `margin`, so noise never buys
    threads that compete with the step. `make_loader(num_workers, threads)` builds a candidate unless
    `built` has it. `agree(index)` turns this process's choice into the one every process takes
    (under torchrun: rank 0's). Returns (the chosen loader, the result); the other loaders' workers
    are stopped. The steps change the model: the caller puts it back (`training_state_kept`)."""
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


@contextlib.contextmanager
def training_state_kept(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                        scaler: Any = None) -> Iterator[None]:
    """Real training steps run inside (the model in train mode); afterwards the weights, buffers,
    optimizer state (momentum, step counts), GradScaler, every RNG and the train/eval mode are put back
    and the gradients cleared, so timing steps changes nothing about training."""
    saved = (copy.deepcopy(model.state_dict()),
             copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
             copy.deepcopy(scaler.state_dict()) if scaler is not None else None, rng_state(), model.training)
    model.train()
    try:
        yield
    finally:
        model.load_state_dict(saved[0])
        if optimizer is not None:
            optimizer.load_state_dict(saved[1])
            optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.load_state_dict(saved[2])
        for p in model.parameters():
            p.grad = None
        set_rng_state(saved[3])
        model.train(saved[4])


def alone_counts(loader: Any) -> tuple[int, int] | None:
    """(num_workers, threads) of a loader whose counts were measured alone and that can be rebuilt
    with others (`with_counts`, and `settings` not None); None for counts the user fixed, a loader of
    another kind, or one whose counts were chosen with the step already."""
    inner = _inner(loader)
    settings = getattr(inner, "settings", None)
    if settings is None or not callable(getattr(inner, "with_counts", None)) or inner in _CHOSEN:
        return None
    workers = int(getattr(inner, "num_workers", getattr(settings, "num_workers", 0)))
    threads = int(getattr(inner, "threads", getattr(settings, "threads", 1))) if workers == 0 else 1
    return workers, threads


def _inner(loader: Any) -> Any:
    """The user's loader inside accelerate()'s DeviceLoader."""
    return loader.loader if isinstance(loader, DeviceLoader) else loader


def _where(dataset: Any) -> str | None:
    """The folder or store a dataset reads (through a subset's or wrapper's `source`/`dataset`)."""
    for _ in range(4):
        for name in ("root", "path"):
            value = getattr(dataset, name, None)
            if isinstance(value, (str, os.PathLike)):
                return os.path.abspath(value)
        dataset = getattr(dataset, "source", None) or getattr(dataset, "dataset", None)
        if dataset is None:
            return None
    return None


def data_identity(loader: Any) -> dict[str, Any]:
    """What a remembered choice knows the data by: the loader's own `identity()` when it has one, else
    its kind, its dataset's kind, size and folder, the batch, the decoder and the device."""
    identity = getattr(loader, "identity", None)
    if callable(identity):
        return {"identity": identity()}
    dataset = getattr(loader, "dataset", None)
    try:
        samples = len(dataset) if dataset is not None else None
    except TypeError:
        samples = None
    return {"loader": type(loader).__qualname__, "dataset": type(dataset).__qualname__, "samples": samples,
            "where": _where(dataset), "batch_size": getattr(loader, "batch_size", None), "batches": len(loader),
            "decoder": str(getattr(loader, "decoder", None)), "device": str(getattr(loader, "device", None))}


def _possible(setting: Any) -> bool:
    """Whether a remembered (num_workers, threads) can still run here (no more than the cores allow)."""
    return (isinstance(setting, list) and len(setting) == 2 and all(isinstance(v, int) for v in setting)
            and 0 <= setting[0] <= usable_cores() + 1 and 1 <= setting[1] <= usable_cores() + 1)


def _position(loader: Any) -> Any:
    """The loader's position (its state_dict) when it keeps one, so the timing passes leave no trace."""
    return loader.state_dict() if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict") else None


def choose_counts(loader: Any, step: Callable[[Any], Any], parts: Mapping[str, Any], *, model: nn.Module,
                  optimizer: torch.optim.Optimizer | None, scaler: Any = None, device: Any = None,
                  steps: int = 2, rounds: int = 2, refresh: bool = False,
                  progress: bool | Callable[[str], Any] = False) -> tuple[Any, LoaderStepResult]:
    """`loader` (see `alone_counts`) with the counts under which `step(batch)`, one real training step
    of `model` with `optimizer`, runs fastest: the setting measured alone and the less parallel ones
    (`step_candidates`), each a `with_counts` of it, timed by `choose_loader_with_step`.

    `parts`: what the step's time depends on (model, batch shapes, precision, ...), the key of the
    remembered decision with the loader's alone setting and `data_identity`; a remembered choice is
    taken at once (no pass, no step) unless `refresh`; a choice timed on a busy machine is not
    remembered. The model, optimizer, `scaler`, RNG and the loader's position are put back as they
    were. Under torchrun rank 0's alone setting makes every rank's candidates, every rank times them
    in step (a DDP step needs them all), and rank 0's choice is every rank's.
    Returns (the loader to train with, the result)."""
    say = progress_fn(progress)
    e = distributed.env()
    own = alone_counts(loader)
    if own is None:
        raise ValueError("choose_counts needs a loader whose counts were measured alone (with_counts and settings)")
    alone = tuple(distributed.broadcast_ints(list(own))) if e.distributed else own
    position = _position(loader)
    left = len(loader) - (position["batches_done"] if isinstance(position, Mapping)
                          and isinstance(position.get("batches_done"), int) else 0)
    # a pass needs steps + 1 batches: a shorter epoch keeps the setting measured alone
    candidates = step_candidates(*alone) if left > steps + 1 else [alone]
    key = {**parts, "alone": list(alone), "data": data_identity(loader)}
    chosen = _recalled(key, refresh or len(candidates) == 1, e)
    if chosen is not None:
        setting, said = chosen
        result = LoaderStepResult(*setting, remembered=said, alone=alone)
        log.info("loader with the step in the loop: %s", said)
        say(f"loader with the step in the loop: {result.describe()}")
        picked = loader if setting == own else loader.with_counts(*setting)
        if picked is not loader:
            release_workers(loader)
            if position is not None:
                picked.load_state_dict(position)
        _CHOSEN.add(_inner(picked))
        return picked, result

    def agree(index: int) -> int:
        return distributed.broadcast_ints([index])[0]

    timing = training_state_kept(model, optimizer, scaler) if len(candidates) > 1 else contextlib.nullcontext()
    with timing:
        picked, result = choose_loader_with_step(
            lambda w, t: loader.with_counts(w, t), step, candidates, steps=steps, rounds=rounds, device=device,
            built={own: loader} if own == alone else None, progress=progress, agree=agree if e.distributed else None)
    result.alone = alone
    if position is not None:
        for each in {id(loader): loader, id(picked): picked}.values():
            each.load_state_dict(position)
    say(f"loader with the step in the loop: {result.describe()}")
    if len(candidates) > 1:
        if result.busy_warning:
            log.warning("loader with the step in the loop: not remembered (timed on a busy machine)")
        elif e.is_main:
            best = next(r for r in result.table if (r.num_workers, r.threads) == (result.num_workers, result.threads))
            remembered.remember(KIND, key, {"setting": [result.num_workers, result.threads]},
                                f"{result.setting}, {best.step_s:.3g} s/step")
    _CHOSEN.add(_inner(picked))
    return picked, result


def _recalled(key: Mapping[str, Any], skip: bool, e: distributed.DistEnv) -> tuple[tuple[int, int], str] | None:
    """The remembered setting and its line, or None (measure); under torchrun rank 0's finding is every
    rank's."""
    memory = None if skip else remembered.recall(KIND, key)
    ok = memory is not None and _possible(memory.decision.get("setting"))
    setting = tuple(memory.decision["setting"]) if ok else (0, 1)
    said = memory.describe() if ok else ""
    if e.distributed:
        found, w, t = distributed.broadcast_ints([int(ok), *setting])
        if not found:
            return None
        return (w, t), said if e.is_main else "as rank 0 remembered"
    return (setting, said) if ok else None
