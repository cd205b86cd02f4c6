"""What the docs tell users to install is this project, and enough to run every example."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    tomllib = pytest.importorskip("tomli")


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def test_docs_never_install_this_project_from_a_package_index():
    # PyPI's "gpumesh" is another project: `pip install gpumesh` would fetch it.
    # (``'gpumesh[gpu] @ http://.../v1/dist/...whl'`` names the coordinator's wheel: fine)
    index = re.compile(r"pip install\s+(?:-[-\w]+\s+)*['\"]?gpumesh\b(?!(?:\[[\w,]*\])?\s*@)")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not index.search(line), f"{path.name}:{n}: {line.strip()}"


def test_quickstart_install_line_covers_every_example():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if "venv" in ln and "pip install" in ln)
    extras = re.search(r"pip install (?:-e )?'?\.\[([\w,]+)\]'?", line)
    assert extras, line
    installed = {_name(r) for r in project["dependencies"]}
    for extra in extras.group(1).split(","):
        installed |= {_name(r) for r in project["optional-dependencies"][extra]}
    dists = metadata.packages_distributions()
    needed = {}
    for example in sorted((ROOT / "examples").glob("*.py")):
        for node in ast.walk(ast.parse(example.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                    else [])
            for mod in mods:
                top = mod.split(".")[0]
                if top in sys.stdlib_module_names or top == "gpumesh":
                    continue
                needed[top] = example.name
    assert needed, "the examples import nothing beyond the standard library?"
    for top, example in needed.items():
        names = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
        assert names & installed, f"{example} imports {top}, which {line!r} does not install"


def test_numpy_is_a_core_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "numpy" in {_name(r) for r in project["dependencies"]}
