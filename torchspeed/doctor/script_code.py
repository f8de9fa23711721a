"""What doctor reads of the script's own code. In the script's process: where a call came from (the
first frame that is neither torch nor torchspeed), how many steps the script plans (a step-count
variable, or epochs x len(loader), read in its frames), which library drives the loop (a Hugging Face
`Trainer`), and which of its own functions makes the batches its model is fed (the assignment in the
loop's source). In the parent: that optimizer call written again with one argument added
(`with_keyword`), so the code a fix proposes is the script's own line. Pure Python (ast, frames): the
parent imports it without torch.
"""
from __future__ import annotations

import ast
import linecache
import math
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

__all__ = ["BatchFunction", "batch_function", "caller", "driver", "planned_steps", "where", "with_keyword"]

# frames of these packages are never the script's own (wrappers, hooks, runpy's runner)
_NOT_THE_SCRIPT = ("torch", "torchspeed", "contextlib", "functools", "runpy", "typing", "importlib", "threading")
# variables that hold a run's length in optimizer steps, and in epochs, as scripts commonly name them
STEP_NAMES = ("max_iters", "max_iter", "max_steps", "total_steps", "num_steps", "n_steps", "num_iters",
              "num_iterations", "n_iters", "iterations", "iters", "train_steps", "training_steps",
              "num_training_steps", "steps")
EPOCH_NAMES = ("epochs", "num_epochs", "n_epochs", "max_epochs", "num_train_epochs")
CONFIG_NAMES = ("args", "config", "cfg", "conf", "opt", "hparams", "training_args")  # argparse / config objects


def _package(frame: types.FrameType) -> str:
    return str(frame.f_globals.get("__name__") or "").split(".")[0]


def _frames() -> list[types.FrameType]:
    """The stack, innermost first."""
    f: types.FrameType | None = sys._getframe(1)
    out = []
    while f is not None:
        out.append(f)
        f = f.f_back
    return out


def caller() -> types.FrameType | None:
    """The innermost frame of the stack that is neither torch's nor torchspeed's: the code that made the
    call being observed (the script, or a library such as transformers that the script drives)."""
    return next((f for f in _frames() if _package(f) not in _NOT_THE_SCRIPT), None)


def where(frame: types.FrameType | None) -> dict[str, Any] | None:
    """{"file", "line", "function", "package"} of a frame, as reports name a call site."""
    if frame is None:
        return None
    return {"file": frame.f_code.co_filename, "line": frame.f_lineno, "function": frame.f_code.co_name,
            "package": _package(frame)}


def driver() -> str | None:
    """"transformers.Trainer" when a Hugging Face Trainer runs the loop (its code is on the stack): its
    options, not the script's lines, are then what a fix changes."""
    return "transformers.Trainer" if any(str(f.f_globals.get("__name__")).startswith("transformers.trainer")
                                         for f in _frames()) else None


def _count(value: Any, epochs: bool = False) -> bool:
    ok = (int, float) if epochs else (int,)
    return isinstance(value, ok) and not isinstance(value, bool) and value >= (1 if epochs else 2)


def _fields(obj: Any) -> dict[str, Any]:
    """The named settings of an argparse Namespace, a SimpleNamespace, a dataclass or a dict."""
    if isinstance(obj, dict):
        return obj
    if hasattr(obj, "__dataclass_fields__") or type(obj).__name__ in ("Namespace", "SimpleNamespace"):
        return dict(vars(obj))
    return {}


def planned_steps(batches_per_epoch: int | None = None) -> dict[str, Any] | None:
    """How many optimizer steps the script means to run, read in the variables of the frames on the stack
    (the loop's, the script's globals, a library's training loop): a step-count name (`max_iters`,
    `max_steps`, ...) first, else epochs x `batches_per_epoch` (the training loader's length).
    {"steps", "source"} or None when nothing says."""
    frames = [f for f in _frames() if _package(f) not in _NOT_THE_SCRIPT]
    scopes = []
    for f in frames:
        here = f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}"
        local = f.f_locals
        scopes.append((here, "", local))
        scopes += [(here, f"{c}.", _fields(local[c])) for c in CONFIG_NAMES if c in local]
    for here, prefix, names in scopes:
        for n in STEP_NAMES:
            if _count(names.get(n)):
                return {"steps": int(names[n]), "source": f"{prefix}{n} = {names[n]} ({here})"}
    if batches_per_epoch:
        for here, prefix, names in scopes:
            for n in EPOCH_NAMES:
                if _count(names.get(n), epochs=True):
                    steps = math.ceil(names[n] * batches_per_epoch)
                    return {"steps": steps, "source": f"{prefix}{n} = {names[n]} x len(loader) = {batches_per_epoch} "
                                                       f"({here})"}
    return None


@dataclass
class BatchFunction:
    """A function of the script that makes its batches, and where it is bound (a module's globals or an
    object's attribute), so it can be wrapped in place for the rest of the run."""

    owner: Any  # a globals dict, or the object holding the attribute
    name: str
    fn: Any
    label: str

    def replace(self, new: Any) -> Any:
        """Bind `new` where the function was; returns the undo."""
        if isinstance(self.owner, dict):
            self.owner[self.name] = new
            return lambda: self.owner.__setitem__(self.name, self.fn)
        own = self.name in vars(self.owner)  # a module's function, or one stored on the instance
        setattr(self.owner, self.name, new)
        return lambda: setattr(self.owner, self.name, self.fn) if own else delattr(self.owner, self.name)


def _source_tree(path: str) -> ast.Module | None:
    lines = linecache.getlines(path)
    if not lines:
        return None
    try:
        return ast.parse("".join(lines), path)
    except SyntaxError:
        return None


def _scope(frame: types.FrameType) -> list[ast.stmt]:
    """The statements of the function (or module) the frame runs."""
    tree = _source_tree(frame.f_code.co_filename)
    if tree is None:
        return []
    if frame.f_code.co_name == "<module>":
        return tree.body
    first = frame.f_code.co_firstlineno
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and first in (
                node.lineno, *(d.lineno for d in node.decorator_list)):
            return node.body
    return []


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Every statement of a scope, in nested blocks too, but not in nested functions or classes."""
    out = []
    for st in body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        out.append(st)
        for block in ("body", "orelse", "finalbody"):
            out += _statements(getattr(st, block, None) or [])
        for h in getattr(st, "handlers", None) or []:
            out += _statements(h.body)
    return out


def _target_names(t: ast.expr) -> set[str]:
    if isinstance(t, ast.Name):
        return {t.id}
    if isinstance(t, (ast.Tuple, ast.List)):
        return set().union(*(_target_names(e) for e in t.elts)) if t.elts else set()
    if isinstance(t, ast.Starred):
        return _target_names(t.value)
    return set()


def _assigning_calls(body: list[ast.stmt], names: set[str], hops: int = 2) -> list[ast.Call]:
    """The calls whose results are assigned to `names` in the scope; through `x = batch[0]` or
    `x, y = batch` to the call that made `batch` (up to `hops` such steps)."""
    calls, via = [], set()
    for st in _statements(body):
        targets = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AnnAssign) else []
        if not any(_target_names(t) & names for t in targets) or st.value is None:
            continue
        value = st.value
        if isinstance(value, ast.Call):
            calls.append(value)
        elif isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name):
            via.add(value.value.id)
        elif isinstance(value, ast.Name):
            via.add(value.id)
    if via - names and hops > 0:
        calls += _assigning_calls(body, via - names, hops - 1)
    return calls


def _lookup(frame: types.FrameType, name: str) -> Any:
    return frame.f_locals[name] if name in frame.f_locals else frame.f_globals.get(name)


def _own_function(fn: Any) -> bool:
    """A Python function of the script or its project, not of torch / numpy (x.to(...), np.stack(...))."""
    fn = getattr(fn, "__func__", fn)
    return isinstance(fn, types.FunctionType) and not str(getattr(fn, "__module__", "")).split(".")[0] in (
        *_NOT_THE_SCRIPT, "numpy")


def batch_function(frame: types.FrameType, inputs: list[Any]) -> BatchFunction | None:
    """The script's own function whose result is what `frame` (the loop calling the model) passes to the
    model as `inputs` (`X, Y = get_batch("train")` ... `model(X, Y)`), found in the loop's source and
    bound where it can be replaced (a global name, a module's or an object's attribute); None when the
    batches come from elsewhere (a loader, a local function, an iterator)."""
    names = {n for n, v in frame.f_locals.items() if any(v is x for x in inputs)}
    if not names:
        return None
    module_level = frame.f_code.co_name == "<module>"
    for call in _assigning_calls(_scope(frame), names):
        func = call.func
        label = f"{ast.unparse(func)}() ({os.path.basename(frame.f_code.co_filename)}:{call.lineno})"
        if isinstance(func, ast.Name):
            fn = _lookup(frame, func.id)
            local = not module_level and func.id in frame.f_code.co_varnames + frame.f_code.co_cellvars
            if _own_function(fn) and not local and frame.f_globals.get(func.id) is fn:
                return BatchFunction(frame.f_globals, func.id, fn, label)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = _lookup(frame, func.value.id)
            fn = getattr(base, func.attr, None)
            if _own_function(fn) and (isinstance(base, types.ModuleType) or hasattr(base, "__dict__")) \
                    and not isinstance(base, type):
                return BatchFunction(base, func.attr, fn, label)
    return None


# ====================================================================== parent side: the script's own call, edited
def _offset(lines: list[bytes], line: int, col: int) -> int:
    return sum(len(x) for x in lines[:line - 1]) + col


def _callee(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def with_keyword(path: str, line: int, callee: str, keyword: str, value: str) -> str | None:
    """The statement of `path` that calls `callee` at `line` (e.g. `torch.optim.AdamW(groups, lr=lr)`),
    rewritten with `keyword=value` added, or its value replaced where the call already passes it:
    everything else (the parameter groups, the other arguments) as the script wrote it. None when the
    file or the call cannot be read."""
    try:
        with open(path, "rb") as f:
            src = f.read()
        tree = ast.parse(src, path)
    except (OSError, SyntaxError, ValueError):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n.func) == callee
             and n.lineno <= line <= (n.end_lineno or n.lineno)]
    if not calls:
        return None
    call = max(calls, key=lambda n: (n.lineno, n.col_offset))  # the innermost
    stmt = min((s for s in ast.walk(tree) if isinstance(s, ast.stmt) and s.lineno <= call.lineno
                and (s.end_lineno or 0) >= (call.end_lineno or 0)), key=lambda s: (s.end_lineno or 0) - s.lineno)
    lines = src.splitlines(keepends=True)
    start, end = _offset(lines, call.lineno, call.col_offset), _offset(lines, call.end_lineno, call.end_col_offset)
    text = src[start:end]
    given = next((k for k in call.keywords if k.arg == keyword), None)
    if given is not None:
        a = _offset(lines, given.value.lineno, given.value.col_offset) - start
        b = _offset(lines, given.value.end_lineno, given.value.end_col_offset) - start
        new = text[:a] + value.encode() + text[b:]
    else:
        head = text[:-1].rstrip()  # up to the closing parenthesis
        arg = f"{keyword}={value}".encode()
        arg = arg if head.endswith(b"(") else b" " + arg + b"," if head.endswith(b",") else b", " + arg
        new = head + arg + text[len(head):]  # a trailing comma kept where the call had one
    s0, s1 = _offset(lines, stmt.lineno, stmt.col_offset), _offset(lines, stmt.end_lineno, stmt.end_col_offset)
    out = (src[s0:start] + new + src[end:s1]).decode("utf-8", "replace")
    indent = " " * stmt.col_offset
    return "\n".join(x[len(indent):] if x.startswith(indent) else x for x in out.splitlines())
