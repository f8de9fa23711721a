"""Decisions remembered: what a measuring entry point chose, kept in torchspeed's cache.

Measuring takes seconds (accelerate's trials, the loader's tuning, optimize's search) and the answer
depends only on a few things: the machine (`runtime.machine_key`: CPU, cores, ISA, GPUs, torch
version), the model's structure, the batch's shapes, the options allowed and the world size. Keyed
by exactly those, the second run of the same script on the same machine decides from what the first
measured, in well under a second, and says so ("remembered from 2026-11-24 (bf16, 41.2 ms/step)");
`refresh=True` measures again and replaces the entry.

One JSON file per decision under `cache_dir("decisions", kind)`, written atomically; a damaged or
foreign file is ignored (measured again), never trusted. Nothing here is pickled.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from torchspeed import ranks
from torchspeed.atomic import write_json
from torchspeed.runtime import cache_dir, machine_key

__all__ = ["Memory", "decision_key", "recall", "remember", "forget", "recall_or_measure", "model_fingerprint",
           "shapes_of"]

log = logging.getLogger(__name__)
T = TypeVar("T")

VERSION = 1


@dataclass(frozen=True)
class Memory:
    """One remembered decision: what was chosen (`decision`, plain JSON), a short figure that says why
    ("bf16 + channels_last, 41.2 ms/step") and when it was measured (ISO date)."""

    kind: str
    decision: dict[str, Any]
    figure: str
    measured_on: str

    def describe(self) -> str:
        """'remembered from 2026-11-24 (bf16, 41.2 ms/step)': the line a caller logs instead of measuring."""
        return f"remembered from {self.measured_on} ({self.figure})"


def _canonical(parts: Mapping[str, Any]) -> str:
    return json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))


def decision_key(kind: str, parts: Mapping[str, Any]) -> str:
    """A short key for one decision: `kind` ("accelerate", "loader", "optimize"), this machine and the
    `parts` the decision depends on (JSON-able values; anything else is keyed by its str)."""
    blob = _canonical({"kind": kind, "version": VERSION, "machine": machine_key(), "parts": dict(parts)})
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _path(kind: str, parts: Mapping[str, Any]) -> str:
    if not kind.isidentifier():
        raise ValueError(f"decision kind must be a plain name, got {kind!r}")
    return os.path.join(cache_dir("decisions", kind), f"{decision_key(kind, parts)}.json")


def recall(kind: str, parts: Mapping[str, Any]) -> Memory | None:
    """The decision remembered for `parts` on this machine, or None (never measured, damaged, or kept
    by another version of this format)."""
    try:
        with open(_path(kind, parts), encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != VERSION \
                or data.get("parts") != json.loads(_canonical(parts)) or not isinstance(data.get("decision"), dict):
            return None
        return Memory(kind, dict(data["decision"]), str(data["figure"]), str(data["measured_on"]))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # damaged or foreign: measured again
        return None


def remember(kind: str, parts: Mapping[str, Any], decision: Mapping[str, Any], figure: str) -> Memory:
    """Keep `decision` (plain JSON) for `parts` on this machine, replacing what was there (atomic write).
    A cache that cannot be written costs only the memory: the caller's result is unaffected."""
    memory = Memory(kind, dict(decision), figure, datetime.date.today().isoformat())
    payload = {"version": VERSION, "kind": kind, "parts": json.loads(_canonical(parts)), "decision": memory.decision,
               "figure": figure, "measured_on": memory.measured_on, "machine": machine_key()}
    try:
        write_json(_path(kind, parts), payload)
    except OSError:
        pass
    return memory


def recall_or_measure(kind: str, parts: Mapping[str, Any] | None, measure: Callable[[], T], *,
                      decode: Callable[[Memory], T | None], encode: Callable[[T], tuple[Mapping[str, Any], str] | None],
                      busy: Callable[[T], Any] = lambda value: False, refresh: bool = False,
                      what: str | None = None, logger: logging.Logger | None = None) -> tuple[T, Memory | None]:
    """The decision for `parts`: remembered, or measured now and remembered; with the memory it came
    from (None: measured now).

    `decode` turns a remembered decision into the caller's value, or None (or a ValueError, TypeError,
    KeyError, AttributeError) when it no longer applies or was edited into nonsense: it is then
    measured again, never trusted. `encode` gives the plain-JSON decision and the figure that says why
    ("bf16, 41.2 ms/step"), or None when nothing was chosen (nothing is kept). A value measured on a busy machine (`busy(value)` true) is used but not
    remembered: a choice made on noise is measured again next time. `parts` None: measured, not kept.
    Under torchrun with a process group, rank 0 recalls and every rank takes what it found (when rank 0
    remembers, no rank measures; otherwise every rank measures, as the caller's `measure` arranges);
    only rank 0 writes. What happened is logged at INFO on `logger` (the caller's; default this module's)
    as "<what>: remembered from <date> (<figure>)" or why it was measured again (DEBUG: not kept, busy).
    """
    what, log_ = what or kind, logger or log
    e, together = ranks.env(), ranks.active()
    memory = None if parts is None or refresh or (together and not e.is_main) else recall(kind, parts)
    if together and parts is not None and not refresh:
        found = ranks.broadcast_json(None if memory is None else
                                     [memory.decision, memory.figure, memory.measured_on])
        memory = None if found is None else Memory(kind, dict(found[0]), str(found[1]), str(found[2]))
    if memory is not None:
        try:
            value = decode(memory)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as error:
            log_.info("%s: the remembered decision is not usable (%s); measuring again", what, error)
            value = None
        if value is not None:
            log_.info("%s: %s", what, memory.describe())
            return value, memory
    value = measure()
    if parts is None:
        return value, None
    if busy(value):
        log_.debug("%s: not remembered (timed on a busy machine)", what)  # the busy WARNING was said when timed
    elif e.is_main and (kept := encode(value)) is not None:
        remember(kind, parts, *kept)
    return value, None


def forget(kind: str | None = None) -> int:
    """Remove the remembered decisions (of one `kind`, or all); how many files were removed."""
    root = cache_dir("decisions")
    if kind is not None and (not kind or os.sep in kind or kind in (".", "..")):
        raise ValueError(f"not a kind of remembered decision: {kind!r}")
    kinds = [kind] if kind else sorted(os.listdir(root))
    removed = 0
    for k in kinds:
        folder = os.path.join(root, k)
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if name.endswith(".json"):
                os.remove(os.path.join(folder, name))
                removed += 1
    return removed


def model_fingerprint(model: torch.nn.Module) -> str:
    """What a decision about `model` depends on: its class, its module tree (repr: layer types and their
    settings) and every parameter's and buffer's name, shape and dtype. Weights' values are not part of
    it (training changes them, not the speed)."""
    h = hashlib.sha256()
    h.update(f"{type(model).__module__}.{type(model).__qualname__}\n{model!r}\n".encode())
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}\n".encode())
    return h.hexdigest()[:24]


def shapes_of(x: Any) -> Any:
    """The shapes and dtypes of a (nested) batch, as plain JSON: the part of a batch a speed decision
    depends on."""
    if isinstance(x, torch.Tensor):
        return [list(x.shape), str(x.dtype).replace("torch.", ""), x.device.type]
    if isinstance(x, Mapping):
        return {str(k): shapes_of(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return [shapes_of(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return type(x).__name__
    return type(x).__qualname__
