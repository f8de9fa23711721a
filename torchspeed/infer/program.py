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
left out. Nothing in it is unbounded: every tensor member is used, each tensor fits the member it is
read from (checked before torch allocates it), shape expressions are evaluated in bounded time (no
`**`, no precision argument, small literals) and parse within `PARSE_LIMIT_S`.
"""
from __future__ import annotations

import ast
import collections
import copy
import io
import json
import math
import operator
import os
import re
import shutil
import time
import warnings
import zipfile
import zlib
from typing import Any

import torch
from torch import nn

from torchspeed.batches import BatchFormat, batch_size, map_tensors
from torchspeed.infer.export import grow_batch
from torchspeed.infer.fuse import fuse_conv_bn
from torchspeed.runtime import import_as_found, process_as_found
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
_NUMBER = re.compile(r"[-+]?\d{1,40}(?:\.\d{0,40})?(?:e[-+]?\d{1,3})?")  # a number's text (Float('1.5'))
# shape guards torch compiles into the loaded module: sizes and strides of its inputs compared
_GUARD_TOKEN = re.compile(r"\s*(?:L|\['[A-Za-z_][A-Za-z0-9_]*'\]|\[\d+\]|\.(?:size|stride)\(\)|\.storage_offset\(\)|\d+"
                          r"|==|!=|<=|>=|<|>|\+|-|\*|//|%|\(|\)|and\b|or\b|not\b)")
# what a shape expression (sympy's srepr) may name: torch's sympy functions and sympy's arithmetic, the
# symbols' assumptions, and constants; powers and shifts only by a small literal exponent
_FUNCTIONS = {
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "TruncToFloat", "TruncToInt",
    "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "Max", "Min", "Abs", "Eq", "Ne", "Lt", "Le", "Gt", "Ge",
    "And", "Or", "Not", "Integer", "Rational", "Float", "floor", "ceiling", "Symbol", "Add", "Mul", "Pow"}
_TORCH_FUNCTIONS = ("FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt",
                    "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
                    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity")  # torch's own
_POWERS = {"Pow", "PowByNatural", "FloatPow", "LShift"}
_ASSUMPTIONS = {"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero", "nonzero"}
_CONSTANTS = {"oo", "int_oo", "True", "False", "true", "false"}
_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)
_COMPARISONS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_LARGEST_LITERAL = 1 << 64  # sizes, strides and torch's "infinity" (sys.maxsize) fit
_LARGEST_EXPONENT = 64
_TEXT_LIMIT = 4096  # characters of one shape expression or guard (torch's are a few dozen)
_JSON_LIMIT = 256 << 20  # bytes of the graph or a tensor index read
_SAMPLE_LIMIT = 64 << 20  # bytes of the sample inputs (an example batch)
_MEMBERS_LIMIT = 1 << 20
PARSE_LIMIT_S = 60.0  # the time torch may take to parse the program's shape expressions; a program over it is refused
_ZIP_ERRORS = (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError, ValueError, zlib.error)


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


def _parsed(text: Any) -> ast.expr | None:
    """`text` parsed as one Python expression, or None (not text, too long, not an expression)."""
    if not isinstance(text, str) or len(text) > _TEXT_LIMIT:
        return None
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _literal(node: ast.AST, limit: int = _LARGEST_LITERAL) -> bool:
    """A number literal of bounded size (an int below `limit`, a finite float)."""
    if not isinstance(node, ast.Constant) or type(node.value) not in (int, float):
        return False
    return abs(node.value) < limit if type(node.value) is int else math.isfinite(node.value)


def _expr_ok(expr: Any) -> bool:
    """A shape expression (sympy's srepr) of numbers, shape symbols, arithmetic and torch's sympy
    functions only, each evaluated in bounded time: no `**`, powers and shifts by a small literal only,
    no precision argument, literals of bounded size."""
    node = _parsed(expr)
    try:
        return node is not None and _expr_node_ok(node)
    except RecursionError:  # a chain of thousands of terms
        return False


def _expr_node_ok(node: ast.AST, scale: int = 1) -> bool:
    """`_expr_ok` for one node; `scale`: the product of the exponents of the powers it is inside (at most
    `_LARGEST_EXPONENT`, so that nested powers cannot build a number of billions of digits)."""
    def ok(*nodes: ast.AST) -> bool:
        return all(_expr_node_ok(n, scale) for n in nodes)

    if isinstance(node, ast.Constant):
        return _literal(node) or type(node.value) is bool
    if isinstance(node, ast.Name):
        return node.id in _CONSTANTS or _SYMBOL.fullmatch(node.id) is not None
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _ARITHMETIC) and ok(node.left, node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)) and ok(node.operand)
    if isinstance(node, ast.Compare):
        return all(isinstance(op, _COMPARISONS) for op in node.ops) and ok(node.left, *node.comparators)
    if isinstance(node, ast.BoolOp):
        return ok(*node.values)
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS):
        return False
    name, args, keywords = node.func.id, node.args, node.keywords
    if any(isinstance(a, ast.Starred) for a in args) or any(k.arg is None for k in keywords):
        return False
    if name == "Symbol":  # Symbol('s33', integer=True, positive=True)
        return (len(args) == 1 and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)
                and _SYMBOL.fullmatch(args[0].value) is not None
                and all(k.arg in _ASSUMPTIONS and isinstance(k.value, ast.Constant) and type(k.value.value) is bool
                        for k in keywords))
    if keywords:
        return False
    if name in ("Integer", "Float"):  # one number, its text at most; no precision (a second argument)
        return len(args) == 1 and (_literal(args[0]) or (
            isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)
            and _NUMBER.fullmatch(args[0].value) is not None))
    if name in _POWERS:  # Pow(x, Integer(2)): an integer literal exponent, nested ones multiplied
        exponent = args[1] if len(args) == 2 else None
        if isinstance(exponent, ast.Call) and isinstance(exponent.func, ast.Name) and exponent.func.id == "Integer" \
                and len(exponent.args) == 1 and not exponent.keywords:
            exponent = exponent.args[0]
        if not (isinstance(exponent, ast.Constant) and type(exponent.value) is int):
            return False
        inner = scale * max(abs(exponent.value), 1)
        return inner <= _LARGEST_EXPONENT and _expr_node_ok(args[0], inner)
    return ok(*args)


def _guard_ok(code: Any) -> bool:
    """A guard comparing the inputs' sizes and strides with numbers and each other, nothing else: the
    words of `_GUARD_TOKEN`, no `**`, literals of bounded size."""
    node = _parsed(code)
    if node is None:
        return False
    pos = 0
    while pos < len(code):
        m = _GUARD_TOKEN.match(code, pos)
        if m is None or m.end() == pos:
            if code[pos:].strip():
                return False
            break
        pos = m.end()
    return not any(isinstance(n, (ast.Pow, ast.LShift)) or (isinstance(n, ast.Constant) and type(n.value) is int
                                                               and not _literal(n)) for n in ast.walk(node))


def _leaves(obj: Any) -> list[tuple[str, Any]]:
    """Every leaf of a JSON document with the key it is under (a list's items under the list's key)."""
    found, stack = [], [("", obj)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.items())
        elif isinstance(value, list):
            stack.extend((key, v) for v in value)
        else:
            found.append((key, value))
    return found


def _itemsizes() -> dict[int, int]:
    """Bytes per element of each dtype as torch.export's tensor index numbers it."""
    out = {}
    serde = import_as_found("torch._export.serde.serialize")  # imports inductor: its env and warning filter put back
    for code, dtype in serde._SERIALIZE_TO_TORCH_DTYPE.items():  # noqa: SLF001 - the archive's own numbering
        if isinstance(dtype, torch.dtype):
            out[int(code)] = dtype.itemsize
    return out


def _plain_int(value: Any) -> int:
    """A concrete size in a tensor index ({"as_int": n}); ValueError for anything else."""
    n = value.get("as_int") if isinstance(value, dict) and len(value) == 1 else None
    if type(n) is not int or not 0 <= n < _LARGEST_LITERAL:
        raise ValueError(f"{str(value)[:40]} is not a size")
    return n


def _bytes_needed(meta: Any) -> int:
    """The bytes a tensor of this index entry reads from its member: its storage offset plus its
    furthest element, in its dtype's size (0 when it has no element). ValueError when it is not plain."""
    tm = meta.get("tensor_meta")
    if not isinstance(tm, dict) or not isinstance(tm.get("sizes"), list) or not isinstance(tm.get("strides"), list):
        raise ValueError("no sizes")
    sizes, strides = [_plain_int(s) for s in tm["sizes"]], [_plain_int(s) for s in tm["strides"]]
    itemsize = _ITEMSIZES.get(tm.get("dtype")) if type(tm.get("dtype")) is int else None
    if itemsize is None or len(sizes) != len(strides):
        raise ValueError("no dtype, or strides not matching its sizes")
    if 0 in sizes:
        return 0
    return (_plain_int(tm.get("storage_offset")) + sum((n - 1) * s for n, s in zip(sizes, strides)) + 1) * itemsize


def _check_index(path: str, config: Any, folder: str, members: dict[str, int]) -> set[str]:
    """The tensor members the index `config` of `folder` ("weights", "constants") uses, each checked:
    plain tensors only (no pickle), and each tensor's declared size within its member's real size
    (a tensor torch would allocate from a member too small for it is refused before anything is)."""
    items = config.get("config") if isinstance(config, dict) else None
    if not isinstance(items, dict):
        raise _damaged(path, "a tensor index has no config")
    used = set()
    for name, meta in items.items():
        member = f"data/{folder}/{meta.get('path_name')}" if isinstance(meta, dict) else ""
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False or not _TENSOR_FILE.fullmatch(member) \
                or not member.startswith(f"data/{folder}/"):
            raise _unsafe(path, f"holds {str(name)[:80]!r} as a pickled object, not a plain tensor")
        if member not in members:
            raise _damaged(path, f"{str(name)[:80]!r} is stored in {member}, which is missing")
        try:
            needed = _bytes_needed(meta)
        except ValueError as e:
            raise _damaged(path, f"{str(name)[:80]!r} has no plain size: {e}") from None
        if needed > members[member]:
            raise _damaged(path, f"{str(name)[:80]!r} declares {needed:,} bytes but {member} holds "
                                 f"{members[member]:,}")
        used.add(member)
    return used


def _read_entries(path: str) -> tuple[dict[str, bytes], dict[str, int]]:
    """(the small entries, read; the tensor members' sizes, not read) of the archive, names relative
    to its one root folder. Nothing is read before its size is known to be within its limit."""
    try:
        archive = zipfile.ZipFile(path)
    except _ZIP_ERRORS as e:
        raise _damaged(path, f"not a readable zip archive: {str(e)[:120]}") from None
    with archive:
        infos = [i for i in archive.infolist() if not i.is_dir()]
        if len(infos) > _MEMBERS_LIMIT:
            raise _damaged(path, f"{len(infos):,} entries")
        if len({i.filename.split("/", 1)[0] for i in infos}) != 1 or any("/" not in i.filename for i in infos):
            raise _damaged(path, "its entries are not in one folder")
        known = _ROOT_FILES | {_WEIGHTS_CONFIG, _CONSTANTS_CONFIG, _GRAPH, _SAMPLE}
        rel = {i.filename.split("/", 1)[1]: i for i in infos}
        other = sorted(n for n in rel if n not in known and not _TENSOR_FILE.fullmatch(n))
        if other:
            raise _unsafe(path, f"packs {other[0]!r} besides the graph and its tensors (compiled code or pickled data)")
        members = {n: i.file_size for n, i in rel.items() if _TENSOR_FILE.fullmatch(n)}
        entries = {}
        for n, info in rel.items():
            limit = _SAMPLE_LIMIT if n == _SAMPLE else _JSON_LIMIT
            if n in members:
                continue
            if info.file_size > limit:
                raise _damaged(path, f"{n} holds {info.file_size:,} bytes, over the limit of {limit:,}")
            try:
                entries[n] = archive.read(info)
            except _ZIP_ERRORS as e:
                raise _damaged(path, f"{n} cannot be read: {str(e)[:120]}") from None
    return entries, members
def _parse_time_ok(exprs: list[str], limit_s: float) -> bool:
    """Whether torch parses `exprs` (each occurrence) within `limit_s`: each distinct expression parsed
    once as torch does, its time counted once per occurrence; stops as soon as the sum is over."""
    sympy, functions = import_as_found("sympy"), import_as_found("torch.utils._sympy.functions")
    namespace = {n: getattr(functions, n) for n in _TORCH_FUNCTIONS if hasattr(functions, n)}
    spent = 0.0
    for expr, count in collections.Counter(exprs).items():
        start = time.perf_counter()
        try:
            sympy.sympify(expr, locals=dict(namespace))
        except Exception:  # noqa: BLE001 - torch would fail on it too: its own error, named when loading
            pass
        spent += (time.perf_counter() - start) * count
        if spent > limit_s:
            return False
    return True


def check_program(path: str | os.PathLike) -> dict[str, bytes]:
    """The entries of the `torch.export.save` archive at `path` but its tensor members (names relative
    to its root folder), checked to hold nothing that could run code on load and nothing unbounded:
    UnsafeFileError naming what it holds otherwise, ValueError when it is damaged. Every tensor member
    is used by its index, each tensor's size fits its member (checked, not read), shape expressions
    and guards are plain arithmetic evaluated in bounded time and parse within `PARSE_LIMIT_S`. Node
    metadata is dropped from the graph."""
    path = os.fspath(path)
    entries, members = _read_entries(path)
    for needed in (_WEIGHTS_CONFIG, _CONSTANTS_CONFIG, _GRAPH, _SAMPLE):
        if needed not in entries:
            raise _damaged(path, f"{needed} missing")
    try:
        configs = [json.loads(entries[c]) for c in (_WEIGHTS_CONFIG, _CONSTANTS_CONFIG)]
        graph = json.loads(entries[_GRAPH])
    except (ValueError, RecursionError):
        raise _damaged(path, "a JSON entry is not valid JSON") from None
    used = _check_index(path, configs[0], "weights", members) | _check_index(path, configs[1], "constants", members)
    unused = sorted(set(members) - used)
    if unused:
        raise _damaged(path, f"it packs {unused[0]}, which no tensor uses")
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
    bad_guard = next((g for g in guards if not _guard_ok(g)), None) if isinstance(guards, list) else guards
    if bad_guard is not None:
        raise _unsafe(path, f"holds the guard {str(bad_guard)[:80]!r}, which is not a comparison of input sizes")
    nodes = module["graph"].get("nodes", [])
    for node in nodes if isinstance(nodes, list) else [None]:
        target = node.get("target") if isinstance(node, dict) else None
        if not isinstance(target, str) or not _operator_ok(target):
            raise _unsafe(path, f"calls {str(target)[:80]!r}, which is not one of torch's own operators")
        node["metadata"] = {}
    constraints = graph.get("range_constraints") or {}
    exprs = [v for k, v in _leaves(graph) if k == "expr_str"] + (list(constraints) if isinstance(constraints, dict)
                                                                   else [str(constraints)])
    bad = next((e for e in dict.fromkeys(exprs) if not _expr_ok(e)), None)
    if bad is not None:
        raise _unsafe(path, f"holds the shape expression {str(bad)[:80]!r}, which is not plain arithmetic")
    if not _parse_time_ok(exprs, PARSE_LIMIT_S):
        raise _damaged(path, f"its shape expressions would take torch over {PARSE_LIMIT_S:g} s to parse")
    entries[_GRAPH] = json.dumps(graph).encode()
    return entries


def load_program(path: str | os.PathLike, keys: list[str] | None = None) -> ProgramModule:
    """The program at `path` (checked by `check_program`) as a module: same inputs as the model it was
    exported from (`keys`: the names of a dict's, from the manifest), logits out. Nothing is unpickled
    and none of the model's Python code is needed."""
    path = os.fspath(path)
    entries = check_program(path)
    buffer = io.BytesIO()
    try:
        with zipfile.ZipFile(path) as source, zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
            for name, data in entries.items():  # only the checked entries reach torch
                z.writestr(f"{_MODEL}/{name}", data)
            root = source.namelist()[0].split("/", 1)[0]
            for info in source.infolist():  # the tensor members, copied through (never read whole)
                name = info.filename.split("/", 1)[1] if "/" in info.filename else ""
                if _TENSOR_FILE.fullmatch(name) and info.filename == f"{root}/{name}":
                    target = zipfile.ZipInfo(f"{_MODEL}/{name}")
                    target.file_size = info.file_size
                    with source.open(info) as src, z.open(target, "w", force_zip64=info.file_size > 1 << 30) as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
    except _ZIP_ERRORS as e:
        raise _damaged(path, f"a tensor member cannot be read: {str(e)[:120]}") from None
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


_ITEMSIZES = _itemsizes()
