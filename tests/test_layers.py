"""The house's layering, checked from the source: no upward import, no import between sibling areas,
no import cycle. The layer order is the one written in docs/architecture.md.

Every import counts, including those inside functions (a lazy import is still a dependency); only
imports under `if TYPE_CHECKING:` are ignored (they never run).
"""
from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
PACKAGE = os.path.join(ROOT, "torchspeed")

# Lowest first. Modules of one layer may not import each other's area (data, train and infer stand side by
# side), except within the floor, whose modules form a small graph of their own (checked for cycles). doctor
# is in layer 2: the fixes its --try measures are the other areas' features (fast_loader for the data fix).
LAYERS: list[set[str]] = [
    {"_lazy", "args", "atomic", "outputs", "safeload", "images", "tables", "measure", "memory", "runtime", "batches",
     "metrics", "models", "remembered", "ranks", "optional", "loader_contract", "deprecated"},
    {"data", "train", "infer"},
    {"compress", "recipes", "doctor"},
    {"bench"},
    {"cli"},
    {"__init__", "__main__"},
]
FLOOR = LAYERS[0]


def _area(module: str) -> str:
    """'torchspeed.data.loader' -> 'data'; 'torchspeed.runtime' -> 'runtime'; 'torchspeed' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(area: str) -> int:
    for i, names in enumerate(LAYERS):
        if area in names:
            return i
    raise AssertionError(f"torchspeed/{area} is in no layer: add it to LAYERS here and to docs/architecture.md")


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """The torchspeed modules `module` imports (resolving relative imports and `from pkg import sub`)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "torchspeed")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "torchspeed":
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torchspeed"
              and f"torchspeed.{node.attr}" in known):
            found.add(f"torchspeed.{node.attr}")  # `import torchspeed; torchspeed.data.x`: a dependency too
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m != module}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: {i for i in _imports(m, p, known) if i in known} for m, p in mods.items()}


def test_no_upward_or_sideways_import():
    bad = []
    for module, targets in _graph().items():
        src = _area(module)
        for t in targets:
            dst = _area(t)
            if src == dst or t == "torchspeed":
                continue
            ls, ld = _layer(src), _layer(dst)
            if ld > ls or (ld == ls and ls != 0):
                bad.append(f"{module} imports {t} ({src} is layer {ls}, {dst} layer {ld})")
    assert not bad, "layering broken:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    # Tarjan's strongly connected components; any component with more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _private_imports(module: str, path: str) -> list[str]:
    """`from torchspeed.x import _name` and `torchspeed.x._name` reads in `module` where x is another module."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchspeed") and node.module != module:
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_name():
    """A name another module needs is public in its home module (with a docstring saying why it exists)."""
    bad = [f"{m} imports {name}" for m, p in _modules().items() for name in _private_imports(m, p)]
    assert not bad, "private names used across modules:\n" + "\n".join(sorted(bad))


def test_architecture_doc_names_every_area():
    """docs/architecture.md describes each area and states the same layer order as LAYERS."""
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        doc = f.read()
    areas = {_area(m) for m in _modules()} - {"__init__", "__main__", "_lazy"}
    missing = [a for a in sorted(areas) if not re.search(rf"`{re.escape(a)}(/|\.py)?`", doc)]
    assert not missing, f"docs/architecture.md does not describe: {missing}"


def test_graph_sees_an_area_reached_through_the_package(tmp_path):
    """The checker itself: `import torchspeed` then `torchspeed.data.fast_loader` depends on data."""
    path = tmp_path / "m.py"
    path.write_text("import torchspeed\n\ndef f():\n    return torchspeed.data.fast_loader\n")
    assert "torchspeed.data" in _imports("torchspeed.train.m", str(path), {"torchspeed.data"})


@pytest.mark.parametrize("module", ["torchspeed.data.decoder_choice", "torchspeed.infer.search"])
def test_graph_sees_function_level_imports(module):
    """The checker itself: a lazy import inside a function is part of the graph (measure is imported there)."""
    assert "torchspeed.measure" in _graph()[module]


# Imports inside functions, outside cli/ and bench/ (where lazy imports keep `--help` fast and each suite
# in its own process, by design): none, but for these, each with its reason. Optional or heavy libraries
# go through `torchspeed.optional.optional`, which is a call, not an import statement.
INNER_IMPORTS_ALLOWED: dict[str, str] = {
    "torchspeed.measure": "doctor's parent process times and watches the machine's load through measure and "
                          "must not import torch (it launches the script): torch only where a CUDA device is timed",
    "torchspeed.doctor.bootstrap": "runs in the user's process before the script; under torchrun it ties the worker "
                                   "to its launcher (PR_SET_PDEATHSIG) before importing torch",
    "torchspeed.doctor.injection": "imports torchspeed.data only where --try's data fix swaps a loader, in the "
                                   "script's process: the diagnosis alone imports no other area",
}
MAX_LINES = 600


def _inner_imports(path: str) -> list[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    found.append((node.lineno, node.module or "."))
    return found


def test_library_modules_import_at_the_top():
    """The top of a library module shows what it uses: no import inside a function, but for the reasons
    listed in INNER_IMPORTS_ALLOWED (module -> why)."""
    bad = []
    for module, path in _modules().items():
        if _area(module) in ("cli", "bench") or module in INNER_IMPORTS_ALLOWED:
            continue
        bad += [f"{module}:{line} imports {name} inside a function" for line, name in _inner_imports(path)]
    assert not bad, "\n".join(sorted(bad))


def test_a_long_module_says_why_it_is_one_concept():
    """A module over MAX_LINES lines says in its docstring that it is one concept, and why it stays whole."""
    long = []
    for module, path in _modules().items():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > MAX_LINES and "one concept" not in doc.lower():
            long.append(f"{module}: {text.count(chr(10))} lines")
    assert not long, "long modules without a one-concept reason in their docstring:\n" + "\n".join(long)
