"""What the docs tell users to install is this project, and enough to run every example."""

from __future__ import annotations

import re
import sys
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


# That the Quickstart's install line covers every example's imports: tests/unit/test_docs.py.


def test_numpy_is_a_core_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "numpy" in {_name(r) for r in project["dependencies"]}
