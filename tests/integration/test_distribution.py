"""What a user who installs a built wheel, or unpacks the sdist, gets: the wheel holds
the whole package (its py.typed marker and the dashboard's files included), and the sdist
the documents and examples the README and the CLI's help refer to.

Built as a user or a release would build them (``python -m build``: the sdist, then the
wheel from it), from a copy of this source tree (the build writes build/ and egg-info).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from gpumesh._version import __version__

ROOT = Path(__file__).resolve().parents[2]
#: What is not source: caches, environments, earlier builds.
NOT_SOURCE = (".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
              ".pytest_cache", ".mypy_cache", ".ruff_cache", ".demo")


def _files(root: Path) -> set[str]:
    """Every file under ``root``, relative to it, caches left out."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[set[str], set[str]]:
    """The names in the built wheel and (without the leading ``gpumesh-VERSION/``) sdist."""
    tmp = tmp_path_factory.mktemp("dist")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    r = subprocess.run([sys.executable, "-m", "build", "--outdir", str(tmp / "out"), str(src)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "satisfies the requirement setuptools" in r.stdout + r.stderr:
        pytest.skip("the build backend (setuptools) cannot be installed here: no package index")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    with zipfile.ZipFile(tmp / "out" / f"gpumesh-{__version__}-py3-none-any.whl") as whl:
        wheel = set(whl.namelist())
    prefix = f"gpumesh-{__version__}/"
    with tarfile.open(tmp / "out" / f"gpumesh-{__version__}.tar.gz") as tgz:
        sdist = {m.name[len(prefix):] for m in tgz.getmembers() if m.isfile()}
    return wheel, sdist


def test_the_wheel_holds_the_whole_package_and_its_py_typed_marker(built):
    wheel, _ = built
    assert "gpumesh/py.typed" in wheel  # PEP 561: the package is typed
    assert (ROOT / "src" / "gpumesh" / "py.typed").read_bytes() == b""
    package = {n for n in wheel if not n.startswith(f"gpumesh-{__version__}.dist-info/")}
    assert package == {f"gpumesh/{n}" for n in _files(ROOT / "src" / "gpumesh")}
    assert not any(n.startswith(("docs/", "examples/", "tests/")) for n in wheel)


def test_the_sdist_holds_the_docs_and_examples_the_help_and_readme_name(built):
    _, sdist = built
    for folder in ("docs", "examples"):
        expected = {f"{folder}/{n}" for n in _files(ROOT / folder)}
        assert expected and expected <= sdist, sorted(expected - sdist)
    assert {"README.md", "LICENSE", "pyproject.toml", "src/gpumesh/py.typed",
            "docs/cli.md", "docs/owner.md", "examples/demo.py"} <= sdist
    assert {f"src/{n}" for n in _files(ROOT / "src") if "egg-info" not in n} <= sdist
    assert not any(n.startswith(("tests/", ".venv", ".git/")) for n in sdist)
