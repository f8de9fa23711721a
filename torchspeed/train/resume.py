"""Exact resume: a run that stops (a crash, a preemption, max_steps) continues as if it never stopped.

Beside the weights and the optimizer (`checkpoint.py` is the file format) a checkpoint holds the loop's
position, every rank's generators now and at the epoch's start, the loader's generator or position, the
GradScaler, scheduler and callbacks, and the epoch's sample order (`data_order`: another number of ranks
can continue it). `ExactResume` writes and reads that state, starts each epoch's pass where it must and
holds the run's Checkpoint directories; it is handed what is trained (`Trained`), never the Trainer.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from torchspeed import ranks
from torchspeed.loader_contract import EpochOrdered, Resumable, conforms
from torchspeed.runtime import rng_state, set_rng_state
from torchspeed.train import checkpoint as ckpt
from torchspeed.train import distributed
from torchspeed.train.callbacks import Callback, Checkpoint
from torchspeed.train.data_order import remaining_share, sampler_order, with_sampler

__all__ = ["ExactResume", "Trained", "own_rng"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trained:
    """What a checkpoint holds besides the loop's position: the plain model (its weights), the
    optimizer, the GradScaler and the scheduler (None when there is none); `sharded` under FSDP (the
    model and optimizer then go through torch.distributed.checkpoint)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    scheduler: Any
    sharded: bool = False


def _generator_of(loader: Any) -> torch.Generator | None:
    """The loader's own torch.Generator (a DataLoader's shuffling draws from it), if it has one."""
    gen = getattr(loader, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def _put_back(saved: Mapping[str, Any], gen: torch.Generator | None) -> None:
    """Every generator as `saved` holds them: the process's (`rng`) and the loader's (`generator`, if kept)."""
    set_rng_state(saved["rng"])
    if saved.get("generator") is not None and gen is not None:
        gen.set_state(saved["generator"])


def _set_epoch(loader: Any, epoch: int) -> None:
    """Start epoch `epoch`'s order: the loader's own `set_epoch` (a FastLoader, webdataset's, any user
    loader that reshuffles by epoch), else its sampler's (a DataLoader's DistributedSampler)."""
    if callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(epoch)
    elif callable(getattr(getattr(loader, "sampler", None), "set_epoch", None)):
        loader.sampler.set_epoch(epoch)


def own_rng(state: dict[str, Any], e: ranks.DistEnv) -> dict[str, Any]:
    """The checkpoint's state with this rank's generators where resuming reads them (`rng`, and
    `epoch_start["rng"]` mid-epoch), from `rng_ranks` (each rank's, once): its own entry in a world of
    the size that wrote it, else rank 0's (another world resumes only at an epoch's end); checkpoints of
    older versions, with rank 0's at the top level too, are used as written when the world differs."""
    every = state.get("rng_ranks") or []
    if len(every) != e.world_size:
        if "rng" in state or not every:
            return state
        every = every[:1] * e.world_size
    mine = every[e.rank]
    start = state.get("epoch_start")
    if start is not None and mine.get("epoch_start_rng") is not None:
        start = dict(start, rng=mine["epoch_start_rng"])
    return dict(state, rng=mine["rng"], epoch_start=start)


class ExactResume:
    """One Trainer's checkpoints and resumes. `position` is the loop's counters as a checkpoint holds
    them (epoch, batches_done, global_step, skipped_steps, history, run_id); `finished` is set while
    an epoch's pass is over but the loop has not moved on (a checkpoint then starts the next epoch)."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = callbacks
        self.finished = False
        self.epoch_start: dict[str, Any] | None = None  # the generators when this epoch's iterator was made
        self.loaded: dict[str, Any] | None = None  # the checkpoint being resumed, with this rank's generators
        # an epoch continued by another number of ranks than began it: its order, what was read, where
        # this world's count of batches starts, this rank's part (see continue_elsewhere)
        self.rest: dict[str, Any] | None = None

    # ---------------------------------------------------------------- the run's directories
    def _checkpoints(self) -> list[Checkpoint]:
        return [cb for cb in self.callbacks if isinstance(cb, Checkpoint)]

    def claim(self, run_id: str, resuming: bool) -> None:
        """Rank 0 takes every Checkpoint directory for run `run_id` (refusing another run's, see Checkpoint)."""
        if ranks.env().is_main:
            for cb in self._checkpoints():
                cb.claim(run_id, resuming=resuming)

    def release(self) -> None:
        for cb in self._checkpoints():
            cb.release()

    def refuse_foreign_ahead(self, run_id: str | None, step: int, last_step: float) -> None:
        """Before the first batch: a checkpoint of another run under a step this run may save
        (after `step`, up to `last_step`) is named and refused, never overwritten."""
        if not ranks.env().is_main:
            return
        for cb in self._checkpoints():
            ahead = [p for s, p in ckpt.foreign(cb.directory, run_id) if step < s <= last_step]
            if ahead:
                raise ValueError(
                    f"checkpoint directory {cb.directory!r} holds {os.path.basename(ahead[0])}, which is not this "
                    f"run's (run {run_id}), under a step this run would write: it is never overwritten; move "
                    "it out of that directory, or write this run's checkpoints elsewhere")

    def last_of_run(self) -> tuple[str, list[tuple[int, str]]]:
        """resume='last': (the Checkpoint callback's directory, its run's checkpoints); refused when
        there is none (see checkpoint.resumable)."""
        dirs = [cb.directory for cb in self._checkpoints()]
        if not dirs:
            raise ValueError("resume='last' needs a Checkpoint callback (its directory is searched); "
                             "or pass the checkpoint's path")
        return dirs[0], ckpt.resumable(dirs[0], "resume='last'", "fit without resume to start a new run there "
                                       "(Checkpoint(..., overwrite=True) deletes the checkpoints it holds)")

    def auto(self) -> str | None:
        """resume='auto': "last" when the Checkpoint directory holds a checkpoint of its run, else None
        (a new run, which still refuses another run's checkpoints there), saying which."""
        dirs = [cb.directory for cb in self._checkpoints()]
        if not dirs:
            raise ValueError("resume='auto' needs a Checkpoint callback (its directory is searched)")
        try:
            ckpt.resumable(dirs[0], "resume='auto'", "starting a new run")
        except FileNotFoundError as e:
            log.info("%s", e)
            return None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        log.info("resume='auto': continuing the run in %s (run %s) from its newest checkpoint%s", dirs[0],
                 ckpt.read_run(dirs[0]), f" (torchrun restart {restart} of job {os.environ.get('TORCHELASTIC_RUN_ID')})"
                 if restart and restart != "0" else "")
        return "last"

    # ---------------------------------------------------------------- writing
    def rng_of_this_rank(self) -> dict[str, Any]:
        """This process's generators now and at the start of the epoch (each rank has its own: under
        DDP, rank r's dropout draws from cuda:r's generator, which only rank r's process holds)."""
        start = None if self.finished or self.epoch_start is None else self.epoch_start["rng"]
        return {"rng": rng_state(), "epoch_start_rng": start}

    def state(self, position: Mapping[str, Any], loader: Any, trained: Trained, include_model: bool = True,
              rng_ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Everything needed to continue exactly (see Trainer.state_dict): tensors and plain types only."""
        epoch, done = (position["epoch"] + 1, 0) if self.finished else (position["epoch"], position["batches_done"])
        started = None if self.finished else self.epoch_start
        state: dict[str, Any] = {
            "format": ckpt.FORMAT,
            "epoch": epoch,
            "batches_done": done,
            "global_step": position["global_step"],
            "skipped_steps": position["skipped_steps"],
            "rng_ranks": rng_ranks if rng_ranks is not None else [self.rng_of_this_rank()],
            "generator": gen.get_state() if (gen := _generator_of(loader)) is not None else None,
            # the loader's generator when this epoch's iterator was made (the RNG's: rng_ranks)
            "epoch_start": None if started is None else {"generator": started["generator"]},
            "loader": loader.state_dict() if conforms(loader, Resumable) and not self.finished else None,
            "scaler": trained.scaler.state_dict() if trained.scaler is not None else None,
            "scheduler": trained.scheduler.state_dict() if trained.scheduler is not None else None,
            "callbacks": [cb.state_dict() for cb in self.callbacks],
            "history": position["history"],
            "world_size": ranks.env().world_size,
            # how this epoch's samples are ordered and how many of them were read: another number of
            # ranks continues the epoch from it (None at an epoch's end, or for an order it cannot map)
            "order": None if self.finished else self._order_now(loader, done),
            "run_id": position["run_id"],
        }
        if include_model:
            state["model"] = trained.module.state_dict()
            state["optimizer"] = trained.optimizer.state_dict()
        return state

    def _order_now(self, loader: Any, batches_done: int) -> dict[str, Any] | None:
        """This epoch's order (`data_order.sampler_order`) with the samples of it read so far."""
        if self.rest is not None:
            r = self.rest
            read = ranks.env().world_size * (batches_done - r["first"]) * r["batch_size"]
            return {**r["order"], "consumed": r["consumed"] + read, "remapped": True}
        order = sampler_order(loader)
        if order is None:
            return None
        return {**order, "consumed": order["world_size"] * batches_done * order["batch_size"]}

    def save(self, directory: str, position: Mapping[str, Any], loader: Any, trained: Trained) -> str:
        """A full checkpoint of step `position["global_step"]` in `directory` (rank 0 writes it; every
        rank under FSDP, sharded): every rank's generators gathered (all take part). Returns its path."""
        every = distributed.gather_states(self.rng_of_this_rank())
        main = ranks.env().is_main
        if trained.sharded:
            return ckpt.save_sharded(directory, position["global_step"], trained.module, trained.optimizer,
                                     self.state(position, loader, trained, include_model=False, rng_ranks=every), main)
        path = os.path.join(directory, ckpt.checkpoint_name(position["global_step"]))
        if main:
            ckpt.save_file(path, self.state(position, loader, trained, rng_ranks=every))
        distributed.barrier()
        return path

    # ---------------------------------------------------------------- reading
    def load(self, resume: str | os.PathLike, trained: Trained) -> tuple[str, dict[str, Any]]:
        """Load the checkpoint `resume` names into `trained` and the callbacks: (its path, its state with
        this rank's generators, the loop's position). A directory or "last": its run's newest checkpoint
        that passes its check (`checkpoint.load_newest`; "last" with none of the directory's run is a
        FileNotFoundError naming any other run's there). An explicit file is loaded or refused."""
        resume = os.fspath(resume)
        if resume == "last":
            directory, found = self.last_of_run()
        elif os.path.isdir(resume) and not os.path.isfile(os.path.join(resume, ".metadata")):
            directory, found = resume, ckpt.candidates(resume)
            if not found:
                raise FileNotFoundError(f"no complete checkpoint (step-*.pt with its record) in {resume!r}")
        else:
            if not os.path.exists(resume):
                raise FileNotFoundError(f"checkpoint {resume!r} does not exist")
            return resume, self.restore(resume, ckpt.load_file(resume), trained)
        path, state = ckpt.load_newest(found, directory)
        return path, self.restore(path, state, trained)

    def restore(self, path: str, state: dict[str, Any], trained: Trained) -> dict[str, Any]:
        """Put checkpoint `path`'s `state` into `trained` and the callbacks; the state with this rank's
        generators (kept for the next pass, see epoch_iterator)."""
        if not state.get("rng_ranks") and "rng" not in state:
            raise ValueError(f"checkpoint {path!r} holds no RNG state, so training cannot continue exactly from it "
                             "(written by another version of torchspeed?); start a new run")
        world = ranks.env()
        order = state.get("order")
        self.rest = None
        if state.get("epoch_start") is not None and (state.get("world_size", 1) != world.world_size
                                                     or (order or {}).get("remapped")):
            if order is None:
                raise ValueError(f"checkpoint {path!r} was written by {state['world_size']} processes mid-epoch, "
                                 "by a loader whose order cannot be mapped to another number of processes (a "
                                 "DistributedSampler's can: a DataLoader under torchrun); resume it with the same "
                                 f"number ({world.world_size} now), or from an epoch-end checkpoint")
            self.rest = {"order": order, "path": path}
        if trained.sharded or "model" not in state:
            # sharded: DCP reshards for this world (any number of ranks, FSDP or not, or one process)
            ckpt.load_sharded(path, trained.module, trained.optimizer)
        else:
            try:
                trained.module.load_state_dict(state["model"])
            except RuntimeError as e:
                first = _first_mismatch(trained.module, state["model"], e)
                raise ValueError(f"checkpoint {path!r} does not fit this model: {first} (a changed model? resume "
                                 "with the model that wrote it, or start a new run)") from None
            trained.optimizer.load_state_dict(state["optimizer"])
        if state["scaler"] is not None and trained.scaler is not None:
            trained.scaler.load_state_dict(state["scaler"])
        if state["scheduler"] is not None and trained.scheduler is not None:
            trained.scheduler.load_state_dict(state["scheduler"])
        if len(state["callbacks"]) == len(self.callbacks):
            for cb, s in zip(self.callbacks, state["callbacks"]):
                cb.load_state_dict(s)
        self.loaded = own_rng(state, world)
        return self.loaded

    def continue_elsewhere(self, loader: Any, n_batches: int | None, epoch: int) -> int:
        """A checkpoint written mid-epoch by another number of ranks (or during such an epoch): this
        rank reads its part of the samples nobody had read (`data_order.remaining_share`), through
        the loader's settings, and the epoch's batch count is this world's (its first batches counted
        as done: returns how many). Its last batch may be smaller, drop_last or not: no remaining
        sample is left out."""
        order, path = self.rest["order"], self.rest["path"]
        world = ranks.env()
        itself = conforms(loader, EpochOrdered)  # continues the epoch itself (a FastLoader)
        if not (itself or isinstance(loader, DataLoader) and loader.batch_size) or n_batches is None:
            raise ValueError(
                f"checkpoint {path!r} was written by {order['world_size']} processes mid-epoch; continuing that "
                f"epoch with {world.world_size} maps the samples left to the ranks through a torch DataLoader "
                f"or a FastLoader, and this loader is a {type(loader).__name__}: resume with {order['world_size']} "
                "processes, or from an epoch-end checkpoint")
        share = remaining_share(order, order["consumed"], world.world_size, world.rank)
        b = loader.batch_size
        left = -(-len(share) // b)  # a last, smaller batch rather than samples left out (even under drop_last)
        done = max(0, n_batches - left)
        self.rest = {"order": order, "consumed": order["consumed"], "first": done, "batch_size": b,
                     "share": share, "left": left}
        if not itself:  # a DataLoader: one with its settings reads this rank's part
            self.rest["loader"] = with_sampler(loader, share, drop_last=False)
        log.info("continuing epoch %d (begun by %d process(es)) with %d: %d of its samples read, %d batch(es) left "
                 "on each rank", epoch + 1, order["world_size"], world.world_size, min(order["consumed"], order["n"]),
                 left)
        return done

    # ---------------------------------------------------------------- an epoch's pass
    def epoch_iterator(self, loader: Any, epoch: int, batches_done: int) -> tuple[Iterator[Any], int]:
        """(This epoch's batches, how many of them were trained on before). The first pass after a
        resume continues with the next unseen batch, every generator as at the checkpoint; any other
        starts the epoch, noting the generators for the checkpoints taken during it."""
        resume, self.loaded = self.loaded, None
        skip = batches_done if resume else 0
        gen = _generator_of(loader)
        if resume and self.rest is not None:  # another number of ranks: this rank's part of what is left
            _set_epoch(loader, epoch)
            set_rng_state(resume["rng"])
            self._start(gen)
            if "loader" in self.rest:
                return iter(self.rest["loader"]), skip
            if not self.rest["left"]:
                return iter(()), skip
            loader.continue_epoch(self.rest["order"]["epoch"], self.rest["first"], self.rest["share"])
            return iter(loader), skip
        if resume:
            if resume.get("loader") is not None and conforms(loader, Resumable):
                loader.load_state_dict(resume["loader"])  # a FastLoader knows its own position
                self.epoch_start = resume.get("epoch_start")
                set_rng_state(resume["rng"])
                n = len(loader) if hasattr(loader, "__len__") else None
                return (iter(()) if n is not None and skip >= n else iter(loader)), skip  # done: validate next
            # generators as they were when this epoch's iterator was made; at an epoch boundary, the
            # checkpoint's are this epoch's starting point
            _put_back(resume["epoch_start"] if skip and resume.get("epoch_start") is not None else resume, gen)
        _set_epoch(loader, epoch)
        self._start(gen)
        it = iter(loader)
        for i in range(skip):  # replay the batches already trained on (same order, same augmentation)
            try:
                next(it)
            except StopIteration:
                raise ValueError(f"cannot resume at batch {skip} of epoch {epoch}: the loader has only {i}") from None
        if resume and skip:
            _put_back(resume, gen)  # then every generator exactly as at the checkpoint
        return it, skip

    def _start(self, gen: torch.Generator | None) -> None:
        """Note the generators as this epoch's iterator is made (what a checkpoint taken during it holds)."""
        self.epoch_start = {"rng": rng_state(), "generator": gen.get_state() if gen is not None else None}


def _first_mismatch(module: nn.Module, saved: Mapping[str, Any], error: Exception) -> str:
    """The first key where the checkpoint's weights and the model's differ, as a few words: one line in
    place of torch's list of every missing, unexpected and resized key."""
    own = module.state_dict()
    saved = saved if isinstance(saved, Mapping) else {}
    for key in own:
        if key not in saved:
            return f"the model's {key!r} is not in it"
    for key, value in saved.items():
        if key not in own:
            return f"its {key!r} is not in the model"
        mine = own[key]
        if isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor) and value.shape != mine.shape:
            return f"{key!r} is {list(value.shape)} in it and {list(mine.shape)} in the model"
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
