"""Decisions remembered: what a measuring entry point chose, kept in torchspeed's cache.

Measuring takes seconds (accelerate's trials, the loader's tuning, optimize's search) and the answer
depends only on a few things: the machine (`runtime.machine_key`: CPU, cores, ISA, GPUs, torch
version), the model's structure, the batch's shapes, the options allowed and the world size. Keyed
by exactly those, the second run of the same script on the same machine decides from what the first
measured, in well under a second, and says so ("remembered from 2026-11-24 (bf16, 41.2 ms/step)");
`refresh=True` measures again and replaces the entry.

One JSON file per decision under `cache_dir("decisions", kind)`, written atomically. What is read
back is data, checked before any caller sees it: a file over `Limits` (bytes, nesting, items, text) is
not read whole, and every entry must match its kind's schema (`SCHEMAS`: types and allowed values of
each field, one table for every decision torchspeed keeps). One that does not check out is dropped,
logged once, and measured again, never trusted. `read_json` and `check` are the same reader for the
other caches torchspeed keeps. Nothing here is pickled.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from torchspeed import ranks
from torchspeed.atomic import write_json
from torchspeed.runtime import FLOAT_PRECISIONS, cache_dir, machine_key

__all__ = ["Memory", "decision_key", "recall", "remember", "forget", "recall_or_measure", "model_fingerprint",
           "shapes_of", "Limits", "SCHEMAS", "read_json", "check"]

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


# ---------------------------------------------------------------- what is read back is data, checked
@dataclass(frozen=True)
class Limits:
    """How much a file read back may hold: its bytes, the nesting of its JSON, the items of one list or
    object, the characters of one string. A file over them is refused before it costs more."""

    bytes: int = 1 << 20
    depth: int = 16
    items: int = 10_000
    text: int = 1 << 16


DECISION_LIMITS = Limits()
_LARGEST_INT = 1 << 63
_COUNT = range(0, 1 << 16)  # a count of workers or threads
_TEXT_LINE = re.compile(r"[^\x00-\x1f\x7f]{0,300}")  # printed as it is: no control characters (terminal escapes)
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")

# The schema of each kind of decision, as its encoder writes it. Notation: a type (int is never a bool;
# float takes an int; numbers are finite); None (null); a frozenset (one of these values); a range (an
# int in it); a compiled pattern (a str it matches whole); a tuple (any one of these); [spec] (a list of
# them); {field: spec} (an object with these fields, a name ending in "?" may be missing, other fields
# are left to the caller's decode); {str: spec} (an object of any names).
_LOADER_ROW = {"num_workers": _COUNT, "threads": _COUNT, "prefetch_factor": (_COUNT, None),
               "persistent_workers": bool, "pin_memory": bool, "items_per_s": float, "final?": bool}
SCHEMAS: dict[str, Any] = {
    "accelerate": {"precision": frozenset(FLOAT_PRECISIONS), "channels_last": bool, "compile": bool,
                   "tf32": (bool, None), "cudnn_benchmark": (bool, None), "logits_width": (range(1, 1 << 31), None)},
    "decoder": {"decoder": str, "table": [{"decoder": str, "us_per_image": (float, None), "psnr_db?": (float, None),
                                           "threads?": (_COUNT, None), "error?": str, "busy_warning?": (str, None)}]},
    "loader": {"num_workers": _COUNT, "prefetch_factor": (_COUNT, None), "persistent_workers": bool,
               "pin_memory": bool, "throughput": float, "table": [_LOADER_ROW], "threads": _COUNT,
               "tuning_s?": float, "others_cores?": (float, None), "waited_s?": float, "remembered?": (str, None)},
    "loader_step": {"setting": [_COUNT]},
    "memory_plan": {"micro_batch": range(1, 1 << 31), "accumulation": range(1, 1 << 31),
                    "effective_batch": range(1, 1 << 31), "predicted_peak_bytes": range(0, 1 << 62),
                    "budget_bytes": range(1, 1 << 62), "fixed_bytes": range(0, 1 << 62),
                    "per_sample_bytes": range(0, 1 << 62), "checkpointed": range(0, 1 << 16),
                    "checkpointed_names": [str], "linear": bool, "source": str, "device": str, "margin": float},
    "optimize": {"winner": str, "runtime": (str, None), "precision": (str, None),
                 "latency_ms": {str: {str: {str: (float, None)}}}},
}
_ENTRY = {"version": int, "parts": Any, "figure": _TEXT_LINE, "measured_on": _DATE, "kind?": str, "machine?": Any}


def read_json(path: str | os.PathLike, limits: Limits = DECISION_LIMITS) -> Any:
    """The JSON document in `path`, read only when it holds at most `limits.bytes` (a larger file is not
    read whole). ValueError saying what is wrong (too large, not JSON, NaN or Infinity, nested past
    recursion); OSError when it cannot be read."""
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open, a device never end
        raise ValueError("not a regular file")
    with open(path, "rb") as f:
        data = f.read(limits.bytes + 1)
    if len(data) > limits.bytes:
        raise ValueError(f"larger than {limits.bytes:,} bytes")
    try:
        return json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"not JSON ({str(e)[:80]})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON holds")


def check(value: Any, schema: Any = Any, limits: Limits = DECISION_LIMITS, where: str = "") -> None:
    """ValueError naming the first place where `value` (plain JSON, as `read_json` gives it) is not what
    `schema` says (see `SCHEMAS` for the notation; Any: any JSON), or goes past `limits`."""
    _check(value, schema, limits, where or "the document", 0)


def _check(v: Any, schema: Any, limits: Limits, where: str, depth: int) -> None:
    if depth > limits.depth:
        raise ValueError(f"{where} is nested deeper than {limits.depth}")
    kind = type(v)
    if kind not in (dict, list, str, int, float, bool, type(None)):
        raise ValueError(f"{where} is a {kind.__name__}, not JSON")
    if kind in (dict, list, str) and len(v) > (limits.text if kind is str else limits.items):
        raise ValueError(f"{where} holds {len(v):,} {'characters' if kind is str else 'items'}, over the limit of "
                         f"{limits.text if kind is str else limits.items:,}")
    if (kind is float and not math.isfinite(v)) or (kind is int and abs(v) >= _LARGEST_INT):
        raise ValueError(f"{where} = {v!r} is out of range")
    if not _matches(v, schema):
        raise ValueError(f"{where} = {_short(v)} is not {_describe(schema)}")
    if kind is dict:
        if not all(type(k) is str for k in v):
            raise ValueError(f"{where} has a key that is not text")
        fields = {} if not isinstance(schema, dict) or str in schema else {n.rstrip("?"): s for n, s in schema.items()}
        for name, spec in schema.items() if isinstance(schema, dict) and str not in schema else ():
            if name.rstrip("?") not in v and not name.endswith("?"):
                raise ValueError(f"{where} has no {name!r}")
        for k, item in v.items():
            spec = schema[str] if isinstance(schema, dict) and str in schema else fields.get(k, Any)
            _check(item, spec, limits, f"{where}.{k}", depth + 1)
    elif kind is list:
        spec = schema[0] if isinstance(schema, list) else Any
        for i, item in enumerate(v):
            _check(item, spec, limits, f"{where}[{i}]", depth + 1)


def _matches(v: Any, schema: Any) -> bool:
    """Whether `v` is of `schema`'s kind at this level (what it holds is checked by `_check`)."""
    if schema is Any:
        return True
    if schema is None:
        return v is None
    if isinstance(schema, tuple):
        return any(_matches(v, s) for s in schema)
    if schema is float:
        return type(v) in (int, float)
    if isinstance(schema, type):
        return type(v) is schema
    if isinstance(schema, range):
        return type(v) is int and v in schema
    if isinstance(schema, frozenset):
        return any(type(v) is type(c) and v == c for c in schema)
    if isinstance(schema, re.Pattern):
        return type(v) is str and schema.fullmatch(v) is not None
    if isinstance(schema, list):
        return type(v) is list
    if isinstance(schema, dict):
        return type(v) is dict
    raise TypeError(f"not a schema: {schema!r}")


def _describe(schema: Any) -> str:
    if isinstance(schema, tuple):
        return " or ".join(_describe(s) for s in schema)
    if isinstance(schema, range):
        return f"an integer in [{schema.start}, {schema.stop - 1}]"
    if isinstance(schema, frozenset):
        return "one of " + ", ".join(sorted(map(repr, schema)))
    if isinstance(schema, re.Pattern):
        return "a line of text" if schema is _TEXT_LINE else "a date" if schema is _DATE else "text of its form"
    if isinstance(schema, (list, dict)):
        return "a list" if isinstance(schema, list) else "an object"
    return {None: "null", bool: "true or false", int: "an integer", float: "a number", str: "text"}.get(schema, "JSON")


def _short(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, (dict, list)) else type(v).__name__
    return text if len(text) <= 60 else text[:57] + "..."


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
    """The decision remembered for `parts` on this machine, or None (never measured, kept by another
    version of this format, or damaged: then dropped and logged, see `recall_or_measure`)."""
    memory, damage = _recall(kind, parts)
    if damage:
        log.info("%s: %s", kind, damage)
    return memory


def _recall(kind: str, parts: Mapping[str, Any]) -> tuple[Memory | None, str | None]:
    """(the decision remembered for `parts`, None) or (None, why the file holding it was dropped)."""
    path = _path(kind, parts)
    try:
        found = os.stat(path)
        data = read_json(path)
        check(data, _ENTRY, where="the entry")
        if data["version"] != VERSION:
            return None, None  # another version of this format: replaced when measured again
        check(data.get("decision"), SCHEMAS.get(kind, {}), where="the decision")
    except OSError:  # none (or an unreadable cache): measured
        return None, None
    except ValueError as e:
        try:
            if os.stat(path).st_ino == found.st_ino:  # not another process's newer entry
                os.remove(path)
        except OSError:
            pass
        return None, f"the remembered decision {path} is damaged ({e}): dropped; measuring again"
    if data["parts"] != json.loads(_canonical(parts)):
        return None, None  # a hash collision, or a file copied from elsewhere: never trusted
    return Memory(kind, dict(data["decision"]), data["figure"], data["measured_on"]), None


def remember(kind: str, parts: Mapping[str, Any], decision: Mapping[str, Any], figure: str) -> Memory:
    """Keep `decision` (plain JSON) for `parts` on this machine, replacing what was there (atomic write).
    A cache that cannot be written costs only the memory: the caller's result is unaffected."""
    memory = Memory(kind, dict(decision), figure, datetime.date.today().isoformat())
    payload = {"version": VERSION, "kind": kind, "parts": json.loads(_canonical(parts)), "decision": memory.decision,
               "figure": figure, "measured_on": memory.measured_on, "machine": machine_key()}
    try:
        write_json(_path(kind, parts), payload)
    except OSError:
        return memory
    if _recall(kind, parts)[1]:  # read back as the next run will: what would be dropped is not kept
        log.warning("%s: not remembered: the decision does not match its schema (torchspeed.remembered.SCHEMAS)", kind)
    return memory


def recall_or_measure(kind: str, parts: Mapping[str, Any] | None, measure: Callable[[], T], *,
                      decode: Callable[[Memory], T | None], encode: Callable[[T], tuple[Mapping[str, Any], str] | None],
                      busy: Callable[[T], Any] = lambda value: False, refresh: bool = False,
                      what: str | None = None, logger: logging.Logger | None = None) -> tuple[T, Memory | None]:
    """The decision for `parts`: remembered, or measured now and remembered; with the memory it came
    from (None: measured now).

    A remembered decision is first checked against its kind's schema (`SCHEMAS`, within `Limits`): one
    that does not check out is dropped, logged once, and measured again. `decode` then turns it into
    the caller's value, or None (or a ValueError, TypeError, LookupError, AttributeError) when it no
    longer applies: it is then measured again, never trusted. `encode` gives the plain-JSON decision
    and the figure that says why ("bf16, 41.2 ms/step"), or None when nothing was chosen (nothing is
    kept). A value measured on a busy machine (`busy(value)` true) is used but not remembered: a choice
    made on noise is measured again next time. `parts` None: measured, not kept.
    Under torchrun with a process group, rank 0 recalls and every rank takes what it found (when rank 0
    remembers, no rank measures; otherwise every rank measures, as the caller's `measure` arranges);
    only rank 0 writes. What happened is logged at INFO on `logger` (the caller's; default this module's)
    as "<what>: remembered from <date> (<figure>)" or why it was measured again (DEBUG: not kept, busy).
    """
    what, log_ = what or kind, logger or log
    e, together = ranks.env(), ranks.active()
    memory, damage = (None, None) if parts is None or refresh or (together and not e.is_main) else _recall(kind, parts)
    if damage:
        log_.info("%s: %s", what, damage)
    if together and parts is not None and not refresh:
        found = ranks.broadcast_json(None if memory is None else
                                     [memory.decision, memory.figure, memory.measured_on])
        memory = None if found is None else Memory(kind, dict(found[0]), str(found[1]), str(found[2]))
    if memory is not None:
        try:
            value = decode(memory)
        except (ValueError, TypeError, LookupError, AttributeError, RecursionError) as error:
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
