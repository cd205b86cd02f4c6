"""docs/cli.md's environment table names exactly the ``GPUMESH_*`` variables src/ reads.

The scan is of the syntax tree, not of text: every string literal that is a whole
``GPUMESH_*`` name (``os.environ.get("GPUMESH_X")``, ``os.getenv(...)``,
``os.environ["GPUMESH_X"]``, ``envvar="GPUMESH_X"``, ``NAME_ENV = "GPUMESH_X"`` constants)
and every keyword argument named ``GPUMESH_*`` (``dict(os.environ, GPUMESH_X="1")``).
Names that only appear inside prose (docstrings, messages) are not variables and are not
counted. Where the code reads a variable with a literal default, the table's default
must be that value.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "gpumesh"
CLI_DOC = ROOT / "docs" / "cli.md"

NAME = re.compile(r"^GPUMESH_[A-Z0-9_]+$")
IN_CELL = re.compile(r"GPUMESH_[A-Z0-9_]+")
SECTION = "## Environment variables"


def _is_environ_get(func: ast.expr) -> bool:
    """``os.environ.get``, ``environ.get`` or ``os.getenv`` / ``getenv``."""
    if isinstance(func, ast.Attribute) and func.attr == "get":
        base = func.value
        return (isinstance(base, ast.Attribute) and base.attr == "environ") or (
            isinstance(base, ast.Name) and base.id == "environ")
    if isinstance(func, ast.Attribute) and func.attr == "getenv":
        return True
    return isinstance(func, ast.Name) and func.id == "getenv"


def scan_source(text: str) -> tuple[set[str], dict[str, str]]:
    """(every GPUMESH_* name the source uses as a value or keyword, {name: literal default}
    for reads of the form ``environ.get("GPUMESH_X", "default")``)."""
    names: set[str] = set()
    defaults: dict[str, str] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.match(node.value):
            names.add(node.value)
        elif isinstance(node, ast.keyword) and node.arg and NAME.match(node.arg):
            names.add(node.arg)
        if (isinstance(node, ast.Call) and _is_environ_get(node.func) and len(node.args) >= 2
                and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args[:2])
                and NAME.match(node.args[0].value) and node.args[1].value):
            defaults[node.args[0].value] = node.args[1].value
    return names, defaults


def scan_src() -> tuple[set[str], dict[str, str]]:
    names: set[str] = set()
    defaults: dict[str, str] = {}
    for path in sorted(SRC.rglob("*.py")):
        n, d = scan_source(path.read_text(encoding="utf-8"))
        names |= n
        defaults.update(d)
    return names, defaults


def doc_table() -> dict[str, list[str]]:
    """{variable: its row's cells} from the table under docs/cli.md's SECTION heading."""
    text = CLI_DOC.read_text(encoding="utf-8")
    assert SECTION in text, f"docs/cli.md has no {SECTION!r} section"
    body = text.split(SECTION, 1)[1]
    body = re.split(r"^## ", body, flags=re.M)[0]
    rows: dict[str, list[str]] = {}
    header: list[str] | None = None
    for line in body.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(cells[0]) <= set("-: "):
            continue  # the separator row
        for name in IN_CELL.findall(cells[0]):
            assert name not in rows, f"{name} has two rows in docs/cli.md"
            rows[name] = cells
    assert header and header[:3] == ["variable", "default", "unit"], header
    return rows


def test_scanner_finds_every_way_the_code_names_a_variable():
    src = '''
import os
A = os.environ.get("GPUMESH_A", "10")
B = os.getenv("GPUMESH_B")
C = os.environ["GPUMESH_C"]
D_ENV = "GPUMESH_D"
env = dict(os.environ, GPUMESH_E="1")
@click.option("--x", envvar="GPUMESH_F")
def f(): """Mentions GPUMESH_PROSE=1 in a docstring, and "GPUMESH_G" quoted."""
msg = f"set GPUMESH_H={1}"
'''
    names, defaults = scan_source(src)
    assert names == {"GPUMESH_A", "GPUMESH_B", "GPUMESH_C", "GPUMESH_D", "GPUMESH_E", "GPUMESH_F"}
    assert defaults == {"GPUMESH_A": "10"}


def test_the_scan_of_src_sees_the_known_variables():
    names, defaults = scan_src()
    # one of each kind: a limits.py read, a constant, a keyword, a click envvar
    assert {"GPUMESH_WORKER_TTL", "GPUMESH_DISCOVERY", "GPUMESH_EXIT_WITH_PARENT",
            "GPUMESH_LOG_JSON"} <= names
    assert defaults["GPUMESH_WORKER_TTL"] == "10"
    assert defaults["GPUMESH_SYNC"] == "NORMAL"


def test_every_variable_read_in_src_has_a_row_in_docs_cli():
    names, _ = scan_src()
    missing = sorted(names - set(doc_table()))
    assert not missing, f"read in src/ but not in docs/cli.md's {SECTION!r} table: {missing}"


def test_every_row_of_docs_cli_is_read_in_src():
    names, _ = scan_src()
    stale = sorted(set(doc_table()) - names)
    assert not stale, f"in docs/cli.md's {SECTION!r} table but never read in src/: {stale}"


def test_each_documented_default_is_the_codes_default():
    _, defaults = scan_src()
    rows = doc_table()
    wrong = {name: (rows[name][1], code) for name, code in defaults.items()
             if name in rows and rows[name][1].strip("`") != code}
    assert not wrong, f"docs/cli.md default vs the code's (doc, code): {wrong}"


def test_every_row_has_a_default_and_a_meaning():
    for name, cells in doc_table().items():
        assert len(cells) == 5, (name, cells)
        assert cells[1], f"{name} has no default in docs/cli.md"
        assert cells[4], f"{name} has no meaning in docs/cli.md"
