"""Callbacks: hooks into the Trainer's loop, plus EarlyStopping and Checkpoint.

A callback that keeps state across a run (EarlyStopping's best value and patience count) exposes
`state_dict()` / `load_state_dict()` with plain types, so it resumes exactly from a checkpoint.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from torchspeed.train import checkpoint as ckpt

if TYPE_CHECKING:
    from torchspeed.train.trainer import Trainer

__all__ = ["Callback", "EarlyStopping", "Checkpoint"]


class Callback:
    """Base class: override the hooks you need. Set `trainer.should_stop = True` to stop training.

    `on_step_end`'s metrics: `train_loss` is that step's loss as a 0-d tensor on the device (the
    Trainer does not read it every step; `float()` it to read it, at the cost of waiting for the
    device), `lr` and `samples_per_s` are floats. `on_validation_end`'s metrics are floats.
    """

    def on_train_start(self, trainer: Trainer) -> None: ...
    def on_train_end(self, trainer: Trainer) -> None: ...
    def on_epoch_start(self, trainer: Trainer) -> None: ...
    def on_epoch_end(self, trainer: Trainer) -> None: ...
    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None: ...
    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by more than `min_delta` for `patience` validation checks.

    Lightning's semantics: a check improves when `value < best - min_delta` (mode "min") or
    `value > best + min_delta` (mode "max"); patience counts validation checks, not epochs; a NaN or
    infinite monitored value stops at once. Metrics are all-reduced before the check, so every rank
    of a distributed run takes the same decision.
    """

    def __init__(self, monitor: str = "val_loss", mode: str = "min", patience: int = 10, min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping patience must be a positive integer, got {patience!r}")
        if min_delta < 0:
            raise ValueError(f"EarlyStopping min_delta must be >= 0, got {min_delta}")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0
        self.checks = 0
        self.stopped_at_check: int | None = None
        self.reason = ""

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:
            raise ValueError(f"EarlyStopping monitors {self.monitor!r} but validation logged only "
                             f"{sorted(metrics)}; pass monitor= one of those")
        value = float(metrics[self.monitor])
        self.checks += 1
        if not math.isfinite(value):
            self.reason = f"{self.monitor} = {value} is not finite"
        elif self._improved(value):
            self.best, self.wait = value, 0
            return
        else:
            self.wait += 1
            if self.wait < self.patience:
                return
            self.reason = (f"{self.monitor} did not improve on {self.best:.6g} by more than {self.min_delta:g} "
                           f"in {self.patience} validation checks")
        self.stopped_at_check = self.checks
        trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "checks": self.checks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait, self.checks = float(state["best"]), int(state["wait"]), int(state["checks"])


class Checkpoint(Callback):
    """Save the full training state to `directory` every `every_n_steps` optimizer steps, after every
    epoch and at the end of the run (also one stopped at `max_steps` mid-epoch), keeping the newest
    `keep_last` of this run. The model, optimizer, GradScaler, scheduler, every RNG, the position and the
    loader's, so `Trainer.fit(resume="last")` continues with the next unseen batch and gives the same
    parameters as an uninterrupted run (under deterministic mode); atomic, verified writes (`checkpoint`).

    The directory belongs to one run (its id in `run.json` and every checkpoint). A fit that does not
    resume is a new run: a directory holding another run's checkpoints is a ValueError before any data
    is read, unless `overwrite=True` (they are deleted). `resume="last"` continues the directory's own
    run (refused when it holds none of its checkpoints); pruning deletes only this run's checkpoints.
    """

    def __init__(self, directory: str | os.PathLike, every_n_steps: int | None = None, keep_last: int = 3,
                 overwrite: bool = False):
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"Checkpoint every_n_steps must be a positive integer or None, got {every_n_steps!r}")
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"Checkpoint keep_last must be a positive integer, got {keep_last!r}")
        self.directory, self.every_n_steps, self.keep_last = os.fspath(directory), every_n_steps, keep_last
        self.overwrite = bool(overwrite)
        self.saved: list[str] = []
        self._lock: Any = None
        self._started_at: int | None = None  # the optimizer step this fit started from
        self._saved_at: int | None = None    # the step of the newest checkpoint this callback saved

    def claim(self, run_id: str, resuming: bool = False) -> None:
        """Take the directory for run `run_id` (the Trainer calls this at the start of fit, on rank 0)."""
        if self._lock is None:
            self._lock = ckpt.claim(self.directory, run_id, overwrite=self.overwrite, resuming=resuming)

    def release(self) -> None:
        """Let the directory go (the Trainer calls this when fit ends, however it ends)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _save(self, trainer: Trainer) -> None:
        path = trainer.save_checkpoint(self.directory)
        self._saved_at = trainer.global_step
        if path and path not in self.saved:
            self.saved.append(path)
        if trainer.is_main:
            ckpt.prune(self.directory, self.keep_last, run_id=trainer.run_id)

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if self.every_n_steps and step % self.every_n_steps == 0:
            self._save(trainer)

    def on_epoch_end(self, trainer: Trainer) -> None:
        self._save(trainer)

    def on_train_start(self, trainer: Trainer) -> None:
        self._started_at, self._saved_at = trainer.global_step, None

    def on_train_end(self, trainer: Trainer) -> None:
        if trainer.global_step not in (self._started_at, self._saved_at):  # steps taken since the last save
            self._save(trainer)

    def last(self) -> str | None:
        """The newest complete checkpoint of the directory's run (None if there is none)."""
        return ckpt.last_checkpoint(self.directory)
