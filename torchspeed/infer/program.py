"""A torch variant of a model that has no name to rebuild it by (your own `nn.Module`, not made from a
spec) saved as a program: `torch.export` captures its graph and weights into `program.pt2`, and
loading needs neither pickle nor your code.

`torch.export.load` alone is not safe on a file from elsewhere: it unpickles tensor subclasses,
custom objects and (when reading them with `weights_only=True` fails) the sample inputs, runs AOTInductor
libraries packed beside the graph, resolves node targets by attribute path from `torch`, evaluates
shape expressions with sympy and compiles shape guards as Python. So `load_program` first checks the
archive (plain tensors only, sample inputs readable with `weights_only=True`, every node one of
torch's own operators, shape expressions and guards plain arithmetic on sizes, nothing else packed)
and hands torch a copy rebuilt from the checked entries alone, the per-node metadata (source lines)
left out.
"""
from __future__ import annotations

import copy
import io
import json
import math
import operator
import os
import re
import warnings
import zipfile
from typing import Any

import torch
from torch import nn

from torchspeed.batches import BatchFormat, batch_size, map_tensors
from torchspeed.infer.export import grow_batch
from torchspeed.infer.fuse import fuse_conv_bn
from torchspeed.runtime import process_as_found
from torchspeed.safeload import UnsafeFileError

__all__ = ["PROGRAM_FILE", "ProgramModule", "export_program", "save_program", "load_program", "check_program"]

PROGRAM_FILE = "program.pt2"
_MODEL = "model"  # the one program's name inside the archive (torch.export.save's)
_HOW_TO = ("create the model with torchspeed.models.create(...) (or pass spec= to optimize), or save an "
           "ONNX Runtime / OpenVINO variant instead")


class ProgramModule(nn.Module):
    """An exported program run as a module, taking the inputs the model took (a dict's entries as
    keywords, named by `keys`, since the program takes them by position) and returning logits.

    Its graph was captured in eval mode, so `train()` / `eval()` only set the flag (the graph refuses
    them); `example` is what it was exported with, so a loaded winner can be saved again."""

    def __init__(self, graph: nn.Module, example: tuple[Any, ...], keys: list[str] | None = None):
        super().__init__()
        self.graph, self.example, self.keys = graph, example, keys
        self.training = False

    def train(self, mode: bool = True) -> ProgramModule:
        self.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.keys is not None and kwargs:
            missing = [k for k in self.keys if k not in kwargs]
            if missing or args:
                raise ValueError(f"the program takes the inputs {self.keys} by name; got {sorted(kwargs)}"
                                 f"{' and positional ones' if args else ''}")
            args = tuple(kwargs[k] for k in self.keys)
        return self.graph(*args)


class _Logits(nn.Module):
    """The model called with positional inputs (a dict's values in `keys` order: torch.export's
    guards on keyword inputs do not run in torch 2.14), followed by its batch format's logits rule, so
    the program returns a tensor (a logits function of the user's cannot be saved, its result can)."""

    def __init__(self, model: nn.Module, batch_format: BatchFormat, keys: list[str] | None = None):
        super().__init__()
        self.model, self.format, self.keys = model, batch_format, keys

    def forward(self, *args: Any) -> Any:
        out = self.model(**dict(zip(self.keys, args))) if self.keys is not None else self.model(*args)
        return self.format.logits_of(out)


def _call_args(example: Any) -> tuple[tuple[Any, ...], list[str] | None]:
    """The model's inputs as positional arguments, and the keys of a dict's (`BatchFormat.forward`
    passes a dict as keywords, a tuple as positional arguments, anything else as one argument). A
    loaded program stands for its own example (the one it was exported with)."""
    if isinstance(example, ProgramModule):
        return example.example, example.keys
    if isinstance(example, dict):
        return tuple(example.values()), list(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), None
    return (example,), None


def _batch_dims(args: tuple[Any, ...]) -> Any:
    """`dynamic_shapes` for `_Logits(*args)`: dimension 0 of every tensor is one dynamic batch size
    (keyed by tensor, since a signature of `*args` has no names to key them by)."""
    shapes = torch.export.ShapesCollection()
    batch = torch.export.Dim("batch")

    def mark(t: torch.Tensor) -> None:
        if t.ndim:
            shapes[t] = {0: batch}
    map_tensors(mark, args)
    return shapes


def _fixed_batch(ep: torch.export.ExportedProgram) -> int | None:
    """None when the program's batch dimension is dynamic, else the batch size it is fixed at."""
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in ep.graph_signature.user_inputs:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.ndim:
                return None if isinstance(val.shape[0], torch.SymInt) else int(val.shape[0])
    return None


def export_program(model: nn.Module, example: Any, batch_format: BatchFormat | dict | None = None,
                   fuse: bool = False) -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """`model` (a copy, eval mode, Conv+BN folded when `fuse`) captured by `torch.export` on `example`
    (its inputs: a tensor, or a dict / tuple of tensors), returning logits; and what the program is
    (the manifest's `program` field: fused, the batch size it fixes or None for any, a dict's keys).

    The export runs on the example grown to 2 rows, since torch.export fixes a dimension seen at size 1;
    a model that fixes its batch size is exported at the example's. ValueError naming why when
    torch.export cannot capture the model (data-dependent control flow, ...) and what to do instead."""
    if example is None:
        raise ValueError("this torch variant cannot be saved without pickle: its architecture has no name, and its "
                         "runner has no example input to capture it with torch.export (TorchRunner(..., example=x)). "
                         "Give one, or " + _HOW_TO)
    args, keys = _call_args(example)
    if isinstance(model, ProgramModule):  # a loaded program: exported again as it is (eval, fused or not)
        wrapped = _Logits(model.graph, BatchFormat())
        fuse = False
    else:
        source = fuse_conv_bn(model) if fuse else copy.deepcopy(model).eval()
        wrapped = _Logits(source, BatchFormat(logits=BatchFormat.of(batch_format).logits), keys)
        wrapped.training = False
    gen = torch.Generator().manual_seed(0)
    grown = map_tensors(lambda t: grow_batch(t, 2, gen) if t.ndim else t, args) if batch_size(args) < 2 else args
    problem: Exception | None = None
    for inputs, dynamic in ((grown, True), (args, False)):
        try:
            with process_as_found():  # torch.export's first use sets TORCHINDUCTOR_CACHE_DIR and a warning filter
                ep = torch.export.export(wrapped, inputs, dynamic_shapes=_batch_dims(inputs) if dynamic else None)
        except Exception as e:  # noqa: BLE001 - any capture failure: tried once more at the example's own size
            problem = problem or e
            continue
        return ep, {"fused": bool(fuse), "batch": _fixed_batch(ep), "inputs": keys,
                    "torch": torch.__version__.split("+")[0]}
    first = (str(problem).strip().splitlines() or [type(problem).__name__])[0][:300]
    data_dependent = any(w in str(problem) for w in ("data-dependent", "data dependent", "GuardOnDataDependent"))
    why = (" (its control flow depends on the values of its inputs, e.g. `if x.sum() > 0`: write it with "
           "torch.where / torch.cond, or keep it out of forward)" if data_dependent else "")
    raise ValueError(f"this torch variant cannot be saved without pickle: torch.export could not capture "
                     f"{type(model).__name__}{why}: {type(problem).__name__}: {first}. To save it, {_HOW_TO}") from None


def save_program(model: nn.Module, example: Any, path: str, batch_format: BatchFormat | dict | None = None,
                 fuse: bool = False) -> dict[str, Any]:
    """Export `model` (see `export_program`) into the archive `path`; returns what the program is
    (the manifest's `program` field)."""
    ep, info = export_program(model, example, batch_format, fuse)
    with open(path, "wb") as f:  # a file object: a full disk is an OSError
        torch.export.save(ep, f)
    return info


# ----------------------------------------------------------------------------------------- reading
_ROOT_FILES = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
_WEIGHTS_CONFIG = f"data/weights/{_MODEL}_weights_config.json"
_CONSTANTS_CONFIG = f"data/constants/{_MODEL}_constants_config.json"
_GRAPH = f"models/{_MODEL}.json"
_SAMPLE = f"data/sample_inputs/{_MODEL}.pt"
_TENSOR_FILE = re.compile(r"data/(weights/weight|constants/tensor)_\d+")
_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SYMBOL = re.compile(r"[a-z]{1,4}\d+")  # torch's shape symbols: s0, u3, ...
# numbers, names, quoted shape symbols or numbers (sympy's srepr: Symbol('s33', positive=True)), operators
_EXPR_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?(?:e[+-]?\d+)?)|([A-Za-z][A-Za-z0-9_]*)|'(?:[a-z]{1,4}\d+|[-+0-9.e]+)'"
                         r"|(\*\*|//|[-+*/%(),<>=!]=?))")
# shape guards torch compiles into the loaded module: sizes and strides of its inputs compared
_GUARD_TOKEN = re.compile(r"\s*(?:L|\['[A-Za-z_][A-Za-z0-9_]*'\]|\[\d+\]|\.(?:size|stride)\(\)|\.storage_offset\(\)|\d+"
                          r"|==|!=|<=|>=|<|>|\+|-|\*|//|%|\(|\)|and\b|or\b|not\b)")
_SYMPY_NAMES = {
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "TruncToFloat", "TruncToInt",
    "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "Max", "Min", "Abs", "Eq", "Ne", "Lt", "Le", "Gt", "Ge",
    "And", "Or", "Not", "oo", "int_oo", "Integer", "Rational", "Float", "floor", "ceiling", "True", "False",
    "true", "false", "Symbol", "Add", "Mul", "Pow", "positive", "negative", "nonnegative", "nonpositive",
    "integer", "real", "finite", "zero", "nonzero", "precision"}


def _damaged(path: str, what: str) -> ValueError:
    return ValueError(f"the program {path!r} is damaged or not one torchspeed wrote ({what}); re-save the artifact")


def _unsafe(path: str, what: str) -> UnsafeFileError:
    return UnsafeFileError(f"the program {path!r} {what}, which torchspeed never loads because it could run code; "
                           "re-save the artifact with torchspeed")


def _operator_ok(target: str) -> bool:
    """A node target torch resolves to one of its own operators (no attribute path out of them)."""
    parts = target.split(".")
    if not all(_OP_NAME.fullmatch(p) and not p.startswith("__") for p in parts):
        return False
    if parts[:2] == ["torch", "ops"] and len(parts) == 5 and parts[2] in ("aten", "prims", "higher_order"):
        return True
    if parts[:2] == ["torch", "ops"] and len(parts) == 4 and parts[2] == "higher_order":
        return True
    module = {"_operator": operator, "math": math}.get(parts[0])
    if module is not None and len(parts) == 2:
        return not parts[1].startswith("_") and callable(getattr(module, parts[1], None))
    return len(parts) == 2 and parts[0] == "torch" and parts[1].startswith(("sym_", "_sym_"))


def _expr_ok(expr: str) -> bool:
    """A shape expression of numbers, shape symbols, arithmetic and torch's sympy functions only."""
    pos = 0
    while pos < len(expr):
        m = _EXPR_TOKEN.match(expr, pos)
        if m is None or m.end() == pos:
            return expr[pos:].strip() == ""
        name = m.group(2)
        if name is not None and name not in _SYMPY_NAMES and not _SYMBOL.fullmatch(name):
            return False
        pos = m.end()
    return True


def _guard_ok(code: str) -> bool:
    """A guard comparing the inputs' sizes and strides with numbers and each other, nothing else."""
    pos = 0
    while pos < len(code):
        m = _GUARD_TOKEN.match(code, pos)
        if m is None or m.end() == pos:
            return code[pos:].strip() == ""
        pos = m.end()
    return True


def _walk(obj: Any, path: str, found: list[tuple[str, Any]]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, k, found)
    elif isinstance(obj, list):
        for v in obj:
            _walk(v, path, found)
    else:
        found.append((path, obj))


def check_program(path: str | os.PathLike) -> dict[str, bytes]:
    """The entries of the `torch.export.save` archive at `path` (names relative to its root folder),
    checked to hold nothing that could run code on load: UnsafeFileError naming what it holds
    otherwise, ValueError when it is damaged. Node metadata is dropped from the graph."""
    path = os.fspath(path)
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if not n.endswith("/")]
            entries = {n: z.read(n) for n in names}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise _damaged(path, f"not a readable zip archive: {str(e)[:120]}") from None
    if len({n.split("/", 1)[0] for n in names}) != 1 or any("/" not in n for n in names):
        raise _damaged(path, "its entries are not in one folder")
    entries = {n.split("/", 1)[1]: data for n, data in entries.items()}
    known = _ROOT_FILES | {_WEIGHTS_CONFIG, _CONSTANTS_CONFIG, _GRAPH, _SAMPLE}
    other = sorted(n for n in entries if n not in known and not _TENSOR_FILE.fullmatch(n))
    if other:
        raise _unsafe(path, f"packs {other[0]!r} besides the graph and its tensors (compiled code or pickled data)")
    for needed in (_WEIGHTS_CONFIG, _CONSTANTS_CONFIG, _GRAPH, _SAMPLE):
        if needed not in entries:
            raise _damaged(path, f"{needed} missing")
    try:
        configs = [json.loads(entries[c]) for c in (_WEIGHTS_CONFIG, _CONSTANTS_CONFIG)]
        graph = json.loads(entries[_GRAPH])
    except ValueError:
        raise _damaged(path, "a JSON entry is not valid JSON") from None
    for config in configs:
        items = config.get("config") if isinstance(config, dict) else None
        if not isinstance(items, dict):
            raise _damaged(path, "a tensor index has no config")
        for name, meta in items.items():
            if not isinstance(meta, dict) or meta.get("use_pickle") is not False \
                    or not _TENSOR_FILE.fullmatch(f"data/{'weights' if config is configs[0] else 'constants'}/"
                                                  f"{meta.get('path_name')}"):
                raise _unsafe(path, f"holds {name!r} as a pickled object, not a plain tensor")
    try:
        with warnings.catch_warnings():  # the pickle protocol of a file not torch's: refused below, not warned about
            warnings.simplefilter("ignore")
            torch.load(io.BytesIO(entries[_SAMPLE]), weights_only=True)
    except Exception:  # noqa: BLE001 - torch.export.load would retry it unpickling freely
        raise _unsafe(path, "holds sample inputs that are pickled Python objects") from None
    module = graph.get("graph_module") if isinstance(graph, dict) else None
    if not isinstance(module, dict) or not isinstance(module.get("graph"), dict):
        raise _damaged(path, "no graph")
    guards = graph.get("guards_code") or []
    bad_guard = next((g for g in guards if not isinstance(g, str) or not _guard_ok(g)), None) \
        if isinstance(guards, list) else guards
    if bad_guard is not None:
        raise _unsafe(path, f"holds the guard {str(bad_guard)[:80]!r}, which is not a comparison of input sizes")
    for node in module["graph"].get("nodes", []):
        target = node.get("target") if isinstance(node, dict) else None
        if not isinstance(target, str) or not _operator_ok(target):
            raise _unsafe(path, f"calls {str(target)[:80]!r}, which is not one of torch's own operators")
        node["metadata"] = {}
    found: list[tuple[str, Any]] = []
    _walk(graph, "", found)
    exprs = [v for k, v in found if k == "expr_str"] + list((graph.get("range_constraints") or {}).keys())
    bad = next((e for e in exprs if not isinstance(e, str) or not _expr_ok(e)), None)
    if bad is not None:
        raise _unsafe(path, f"holds the shape expression {str(bad)[:80]!r}, which is not plain arithmetic")
    entries[_GRAPH] = json.dumps(graph).encode()
    return entries


def load_program(path: str | os.PathLike, keys: list[str] | None = None) -> ProgramModule:
    """The program at `path` (checked by `check_program`) as a module: same inputs as the model it was
    exported from (`keys`: the names of a dict's, from the manifest), logits out. Nothing is unpickled
    and none of the model's Python code is needed."""
    path = os.fspath(path)
    entries = check_program(path)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:  # only the checked entries reach torch
        for name, data in entries.items():
            z.writestr(f"{_MODEL}/{name}", data)
    buffer.seek(0)
    try:
        with process_as_found():
            ep = torch.export.load(buffer)
    except Exception as e:  # noqa: BLE001 - torch's deserializer errors vary: one line naming the file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"the program {path!r} cannot be loaded by this torch {torch.__version__} (saved by "
                         f"another version, or damaged? re-save the artifact): {first}") from None
    if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
        raise _damaged(path, "its manifest's input names are not a list of names")
    return ProgramModule(ep.module(), tuple(ep.example_inputs[0]), keys)
