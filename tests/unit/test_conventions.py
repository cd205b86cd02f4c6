"""Conventions a reviewer would otherwise check by eye (docs/architecture.md, STYLE):
modules stay small, gpumesh's modules import each other in one direction, and the public
API is exactly the documented ``__all__``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import gpumesh

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = SRC / "gpumesh"

#: A module over this many lines holds more than one job; split it (STYLE: "keep modules
#: under ~800 lines, one job each").
MAX_MODULE_LINES = 800


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def test_no_module_over_the_line_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert len(sizes) > 50  # the whole package was found
    over = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert over == {}, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {over}"


# ---------------------------------------------------------------- import cycles -------

def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_nodes(body: list[ast.stmt]):
    """The import statements that run when the module is imported: those at its top level,
    including inside try/if/with blocks, but not in functions or classes' methods, and
    not under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_time_nodes(node.body)
            yield from _import_time_nodes(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _import_time_nodes(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _import_time_nodes(node.body)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the gpumesh modules its import runs import. ``import a.b.c`` runs ``a``,
    ``a.b`` and ``a.b.c``; ``from a.b import c`` runs ``a.b.c`` when that is a module, else
    takes ``c`` from ``a.b`` (which must then be initialised). A package that contains the
    importing module is being imported already: reaching it as a prefix is no cycle."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        deps: set[str] = set()
        for node in _import_time_nodes(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(name, is_package, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep not in modules or dep == name:
                        continue
                    if i < len(parts) and name.startswith(dep + "."):
                        continue  # a package above the importer: importing it already
                    deps.add(dep)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_finds_a_cycle_and_skips_what_does_not_run_at_import(tmp_path):
    def package(files: dict[str, str]) -> dict[str, Path]:
        out = {}
        for rel, text in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            parts = list(Path(rel).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
        return out

    mods = package({
        "p/__init__.py": "",
        "p/a.py": "from . import b\n",
        "p/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
                  "def f():\n    from .a import x\n",
        "p/c.py": "try:\n    from .d import y\nexcept ImportError:\n    pass\n",
        "p/d.py": "import p.c\n",
        # a package importing its submodules, which import each other: no cycle
        "q/__init__.py": "from . import x, y\n",
        "q/x.py": "from .y import z\n",
        "q/y.py": "z = 1\n",
        # a submodule taking a name its package defines after importing it: a cycle
        "r/__init__.py": "from . import m\nVALUE = 1\n",
        "r/m.py": "from . import VALUE\n",
    })
    graph = import_graph(mods)
    assert graph["p.a"] == {"p.b"} and graph["p.b"] == set()
    assert graph["q"] == {"q.x", "q.y"} and graph["q.x"] == {"q.y"}
    assert find_cycle({k: graph[k] for k in ("p", "p.a", "p.b", "q", "q.x", "q.y")}) is None
    assert find_cycle({k: v for k, v in graph.items() if k.startswith("p")}) == ["p.c", "p.d", "p.c"]
    assert find_cycle({k: v for k, v in graph.items() if k.startswith("r")}) == ["r", "r.m", "r"]


def test_no_import_cycles():
    graph = import_graph(_modules())
    # the graph is the real one: top-level imports, relative ones resolved
    assert {"gpumesh.errors", "gpumesh.limits"} <= graph["gpumesh.transport"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle at import time: " + " -> ".join(cycle)


# ---------------------------------------------------------------- public API ----------

#: The whole public API (STYLE: the package's ``__all__`` is the API, pinned by a test).
#: A name added or removed here is an API change: document it in README.md or docs/.
PUBLIC_API = [
    "GPUMesh",
    "accelerate",
    "mesh",
    "RemoteFunction",
    "MeshError",
    "AuthError",
    "LockedOut",
    "RequestRejected",
    "MeshUnavailable",
    "WireError",
    "PayloadTooLarge",
    "VersionMismatch",
    "Unsatisfiable",
    "TaskFailed",
    "RemoteError",
    "TaskCrashed",
    "WorkerLost",
    "Cancelled",
    "TaskTimeout",
    "StartFailed",
    "EngineCannotExpress",
    "RemoteTraceback",
    "load_ipython_extension",
    "unload_ipython_extension",
    "__version__",
]


def test_all_is_exactly_the_public_api():
    assert gpumesh.__all__ == PUBLIC_API
    assert sorted(dir(gpumesh)) == sorted(PUBLIC_API)
    ns: dict = {}
    exec("from gpumesh import *", ns)
    assert set(ns) - {"__builtins__"} == set(PUBLIC_API)
    with pytest.raises(AttributeError, match="no attribute 'does_not_exist'"):
        gpumesh.does_not_exist  # noqa: B018


def test_every_public_name_imports_and_is_the_defining_modules():
    from gpumesh import errors, jupyter
    from gpumesh.client import mesh as mesh_mod
    from gpumesh.client import remote
    home = {"GPUMesh": mesh_mod, "accelerate": remote, "mesh": remote, "RemoteFunction": remote,
            "load_ipython_extension": jupyter, "unload_ipython_extension": jupyter}
    for name in PUBLIC_API:
        value = getattr(gpumesh, name)
        assert value is not None, name
        if name == "__version__":
            assert re.fullmatch(r"\d+\.\d+\.\d+", value)
        else:
            assert value is getattr(home.get(name, errors), name), name


def test_every_error_class_is_public_and_drawn_in_the_tree():
    from gpumesh import errors
    defined = {n for n, v in vars(errors).items()
               if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == errors.__name__}
    assert defined <= set(PUBLIC_API), defined - set(PUBLIC_API)
    drawn = set(re.findall(r"^\s*(?:[│├└─ ]*)([A-Z][A-Za-z]+)\s{2,}", errors.__doc__, re.M))
    assert {n for n in defined if issubclass(getattr(errors, n), gpumesh.MeshError)} == drawn
    for name in defined - {"RemoteTraceback"}:
        assert issubclass(getattr(gpumesh, name), gpumesh.MeshError), name
    for name in ("RemoteError", "TaskCrashed", "WorkerLost", "Cancelled"):
        assert issubclass(getattr(gpumesh, name), gpumesh.TaskFailed), name
    assert issubclass(gpumesh.TaskTimeout, TimeoutError)


def _doc_code() -> str:
    """Every code span and code block of README.md and docs/*.md."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    return "\n".join(blocks + spans)


def test_every_public_name_is_documented():
    code = _doc_code()
    missing = [n for n in PUBLIC_API if not re.search(rf"(?<![\w.]){re.escape(n)}\b", code)
               and not re.search(rf"\bgpumesh\.{re.escape(n)}\b", code)]
    assert missing == [], f"public names no code in README.md or docs/ shows: {missing}"


def test_engine_cannot_express_is_public_and_cheap():
    """README, scaling.md and why-not-ray-or-dask.md name EngineCannotExpress as a
    gpumesh error: `from gpumesh import EngineCannotExpress` works, is the class the
    engines raise (still importable from where it was defined before), and loads no
    client code (the engines' module imports the HTTP client)."""
    import subprocess
    import sys

    from gpumesh.client.backends import base
    from gpumesh.client.backends import dask as dask_backend
    assert gpumesh.EngineCannotExpress is base.EngineCannotExpress is dask_backend.EngineCannotExpress
    assert issubclass(gpumesh.EngineCannotExpress, gpumesh.MeshError)
    assert issubclass(gpumesh.EngineCannotExpress, ValueError)
    code = ("import sys; from gpumesh import EngineCannotExpress; "
            "print(sorted(m for m in sys.modules if m.startswith('gpumesh.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60).stdout
    assert "gpumesh.errors" in loaded and "gpumesh.client" not in loaded, loaded
