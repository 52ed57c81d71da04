"""The tree is the architecture of design §1: layers that import only downwards, no import circles,
and nothing outside the engine that reaches into an engine's insides.

The graph is built from the source with ``ast``; nothing is imported. Imports under
``if TYPE_CHECKING:`` never run, so they cannot close a circle, but they still may not point
upwards: a lower layer does not even name a higher one's types.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tawpipe"

# Design §1, bottom to top. A module may import its own unit and the units on lower floors.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("version", "lazy", "atomic", "_C", "_nccl"),
    ("ops",),
    ("models",),
    ("plan",),
    ("cost",),
    ("sim",),
    ("runtime",),
    ("engine",),
    ("io",),
    ("commands",),
    ("cluster",),
    ("simulate",),
    ("train",),
    ("bench",),
    ("cli",),
    ("", "__main__"),  # the package root: the public API
)
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _unit(module: str) -> str:
    """The first component below ``tawpipe`` ('' for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def _imports(module: str) -> list[tuple[str, bool, int]]:
    """(imported tawpipe module, runs at import time or later, line) for every import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    typing_only = _type_checking_lines(tree)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # "from pkg import name": the module pkg.name if there is one, else pkg itself
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES or a.name in ("_C", "_nccl")]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        for t in targets:
            if t == "tawpipe" or t.startswith("tawpipe."):
                out.append((t, node.lineno not in typing_only, node.lineno))
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def test_every_unit_has_a_floor():
    units = {_unit(m) for m in MODULES}
    assert units <= FLOOR.keys(), f"add to FLOORS (and design §1): {sorted(units - FLOOR.keys())}"


def test_no_import_goes_up_a_layer():
    upward = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t} ({_unit(m) or 'root'} -> {_unit(t) or 'root'})"
              for m, imports in GRAPH.items() for t, _, line in imports
              if _unit(t) != _unit(m) and FLOOR[_unit(t)] > FLOOR[_unit(m)]]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_circles():
    edges = {m: sorted({t for t, runs, _ in imports if runs and t in MODULES and t != m}) for m, imports in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_graph_is_read():
    """The checks above are only as good as the graph: known edges must be in it."""
    assert ("tawpipe.plan.actions", True) in {(t, r) for t, r, _ in GRAPH["tawpipe.plan.plan"]}
    assert any(t == "tawpipe.engine.engine" and not runs for t, runs, _ in GRAPH["tawpipe.io.safetensors"])
    assert any(t == "tawpipe.ops" for t, _, _ in GRAPH["tawpipe.engine.storage"])


def _sources_outside_the_engine() -> list[Path]:
    files = [p for d in ("tawpipe", "tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]
    return [p for p in files if PACKAGE / "engine" not in p.parents]


ENGINE_LIKE = re.compile(r"(^|_)(engine|eng)s?$")


def _reaches_in(node: ast.AST) -> bool:
    """``x.storage``, or ``engine._private`` / ``self.engine._private``."""
    if not isinstance(node, ast.Attribute):
        return False
    owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
    private = node.attr.startswith("_") and not node.attr.startswith("__")
    return node.attr == "storage" or (private and bool(ENGINE_LIKE.search(owner)))


@pytest.mark.parametrize("path", _sources_outside_the_engine(), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_outside_the_engine_reaches_into_it(path):
    """No ``.storage``, and no ``_private`` attribute of an engine object, outside tawpipe/engine/:
    everything else uses the engine's public methods."""
    found = [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(path.read_text())) if _reaches_in(n)]
    assert not found, f"{path.relative_to(ROOT)} reaches into an engine: {found}"


def test_the_reach_check_catches_what_it_should():
    caught = "engine.storage.bufs\nself.engine._comms\nx.engine._state\neng._failed"
    passed = "engine.step(b)\nengine.__class__\nhandle._finish()\nself._comms"
    assert sum(map(_reaches_in, ast.walk(ast.parse(caught)))) == 4
    assert not any(map(_reaches_in, ast.walk(ast.parse(passed))))


# A module over 700 lines or a function over 80 does more than one job: split it by job.
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def _functions(node: ast.AST, prefix: str = "") -> list[tuple[str, ast.AST]]:
    """(qualified name, node) of every function and method below ``node``, nested ones included."""
    out = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + child.name
            if not isinstance(child, ast.ClassDef):
                out.append((name, child))
            out += _functions(child, name + ".")
        else:
            out += _functions(child, prefix)
    return out


def _oversized() -> dict[str, int]:
    """Every module and function of tawpipe/ over its limit, with its length in lines."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel, text = path.relative_to(ROOT).as_posix(), path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found[rel] = len(text.splitlines())
        for name, fn in _functions(ast.parse(text)):
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES:
                found[f"{rel}::{name}"] = fn.end_lineno - fn.lineno + 1
    return found


def test_no_module_or_function_is_too_long():
    over = _oversized()
    assert not over, (f"over {MAX_MODULE_LINES} lines (a module) or {MAX_FUNCTION_LINES} (a function, from its "
                      f"def): split by job: {over}")


def test_the_size_check_measures_what_it_should():
    tree = ast.parse("def f():\n    def g():\n        pass\nclass C:\n    async def m(self):\n        return 1\n")
    assert [(name, fn.end_lineno - fn.lineno + 1) for name, fn in _functions(tree)] == [("f", 3), ("f.g", 2),
                                                                                          ("C.m", 2)]
