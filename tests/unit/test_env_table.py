"""docs/cli.md's environment table is gpumesh.limits' settings table, and src/ reads no
setting behind its back.

Both ways, cell by cell: every variable of :func:`gpumesh.limits.env_rows` (the settings
with a variable, and :data:`~gpumesh.limits.OTHER_VARIABLES`) has a row with the same
default, unit, users and meaning, and every row names one of them.

The scan of src/ is of the syntax tree, not of text: every string literal that is a whole
``GPUMESH_*`` name (``os.environ.get("GPUMESH_X")``, ``os.getenv(...)``,
``os.environ["GPUMESH_X"]``, ``envvar="GPUMESH_X"``, ``NAME_ENV = "GPUMESH_X"`` constants)
and every keyword argument named ``GPUMESH_*`` (``dict(os.environ, GPUMESH_X="1")``).
Names that only appear inside prose (docstrings, messages) are not variables and are not
counted. Every name the scan finds must be in the table, and an environment read
(``environ.get``/``getenv``/``environ[...]``/``environ.pop``) of a *setting's* variable
may only happen in limits.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gpumesh import limits

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "gpumesh"
CLI_DOC = ROOT / "docs" / "cli.md"

NAME = re.compile(r"^GPUMESH_[A-Z0-9_]+$")
IN_CELL = re.compile(r"`([A-Z][A-Z0-9_]+)`")
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


def scan_source(text: str) -> set[str]:
    """Every GPUMESH_* name the source uses as a value or keyword."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.match(node.value):
            names.add(node.value)
        elif isinstance(node, ast.keyword) and node.arg and NAME.match(node.arg):
            names.add(node.arg)
    return names


def scan_src() -> set[str]:
    names: set[str] = set()
    for path in sorted(SRC.rglob("*.py")):
        names |= scan_source(path.read_text(encoding="utf-8"))
    return names


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
    assert header == ["variable", "default", "unit", "used by", "meaning"], header
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
    names = scan_source(src)
    assert names == {"GPUMESH_A", "GPUMESH_B", "GPUMESH_C", "GPUMESH_D", "GPUMESH_E", "GPUMESH_F"}


def test_the_scan_of_src_sees_the_known_variables():
    names = scan_src()
    # one of each kind: a limits.py setting, a constant, a keyword, a click envvar
    assert {"GPUMESH_WORKER_TTL", "GPUMESH_DISCOVERY", "GPUMESH_EXIT_WITH_PARENT",
            "GPUMESH_LOG_JSON"} <= names


def _environ_reads(text: str) -> set[str]:
    """Variables ``text`` reads from the environment by name: ``environ.get(X)``,
    ``getenv(X)``, ``environ[X]``, ``environ.pop(X)``, where X is a literal or a
    module-level ``NAME = "GPUMESH_..."`` constant of the same file."""
    tree = ast.parse(text)
    consts = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
              for t in node.targets if isinstance(t, ast.Name)}

    def name_of(arg: ast.expr) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return consts.get(arg.id)
        return None

    def is_environ(e: ast.expr) -> bool:
        return (isinstance(e, ast.Attribute) and e.attr == "environ") or (
            isinstance(e, ast.Name) and e.id == "environ")

    found: set[str] = set()
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if _is_environ_get(f) or (isinstance(f, ast.Attribute) and f.attr == "pop"
                                      and is_environ(f.value)):
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            arg = node.slice
        name = name_of(arg) if arg is not None else None
        if name:
            found.add(name)
    return found


def test_the_read_scanner_sees_literals_and_module_constants():
    src = '''
import os
X_ENV = "GPUMESH_X"
a = os.environ.get("GPUMESH_A", "1")
b = os.getenv(X_ENV)
c = os.environ["GPUMESH_C"]
d = os.environ.pop("GPUMESH_D", None)
os.environ["GPUMESH_E"] = "1"
f = limits.setting("GPUMESH_F")
'''
    assert _environ_reads(src) == {"GPUMESH_A", "GPUMESH_X", "GPUMESH_C", "GPUMESH_D", "GPUMESH_E"}


def test_no_setting_is_read_from_the_environment_outside_limits():
    settings = {s.env for s in limits.SETTINGS.values() if s.env}
    behind = {}
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "limits.py" and path.parent == SRC:
            continue
        hits = _environ_reads(path.read_text(encoding="utf-8")) & settings
        if hits:
            behind[str(path.relative_to(SRC))] = sorted(hits)
    assert not behind, f"read with os.environ instead of limits.setting(): {behind}"


def test_every_gpumesh_variable_src_reads_by_name_is_in_the_table():
    """A ``GPUMESH_*`` variable read directly must be declared as one that is not a
    setting (with its reason) or be a setting."""
    known = set(limits.env_rows())
    unknown = {}
    for path in sorted(SRC.rglob("*.py")):
        hits = {n for n in _environ_reads(path.read_text(encoding="utf-8"))
                if n.startswith("GPUMESH_")} - known
        if hits:
            unknown[str(path.relative_to(SRC))] = sorted(hits)
    assert not unknown, unknown


def test_every_variable_named_in_src_is_in_the_settings_table():
    names = scan_src()
    missing = sorted(names - set(limits.env_rows()))
    assert not missing, f"named in src/ but not declared in gpumesh/limits.py: {missing}"


def test_every_table_variable_is_named_in_src():
    names = scan_src()
    stale = sorted(n for n in limits.env_rows() if n.startswith("GPUMESH_"))
    stale = [n for n in stale if n not in names]
    assert not stale, f"declared in gpumesh/limits.py but never named in src/: {stale}"


def _expected_table() -> str:
    lines = ["| variable | default | unit | used by | meaning |", "|---|---|---|---|---|"]
    lines += [f"| `{name}` | " + " | ".join(cells) + " |" for name, cells in limits.env_rows().items()]
    return "\n".join(lines)


def test_every_table_variable_has_a_row_in_docs_cli():
    missing = sorted(set(limits.env_rows()) - set(doc_table()))
    assert not missing, (f"in gpumesh/limits.py but not in docs/cli.md's {SECTION!r} table: "
                         f"{missing}; the table as limits.py has it:\n{_expected_table()}")


def test_every_row_of_docs_cli_is_in_the_table():
    stale = sorted(set(doc_table()) - set(limits.env_rows()))
    assert not stale, f"in docs/cli.md's {SECTION!r} table but not in gpumesh/limits.py: {stale}"


def test_each_row_of_docs_cli_says_what_the_table_says():
    rows = doc_table()
    wrong = {}
    for name, (default, unit, used_by, meaning) in limits.env_rows().items():
        if name in rows and rows[name][1:] != [default, unit, used_by, meaning]:
            wrong[name] = {"docs/cli.md": rows[name][1:],
                           "limits.py": [default, unit, used_by, meaning]}
    assert not wrong, (f"docs/cli.md differs from gpumesh/limits.py: {wrong}; the table as "
                       f"limits.py has it:\n{_expected_table()}")


def test_a_numeric_default_in_docs_cli_is_the_codes_value():
    """The default the doc shows, parsed as the variable would be, is the value the code
    uses while the variable is unset (e.g. GPUMESH_RETENTION_HOURS 24 -> 86400 s)."""
    rows = doc_table()
    checked = 0
    for s in limits.SETTINGS.values():
        text = rows[s.env][1].strip("`") if s.env else ""
        if s.env and re.fullmatch(r"[0-9.]+", text):
            assert s.parse(text) == s.value, (s.env, text, s.value)
            checked += 1
    assert checked >= 10  # the numbers: TTL, attempts, retention, sizes, timeouts, ...


def test_every_row_has_a_default_and_a_meaning():
    for name, cells in doc_table().items():
        assert len(cells) == 5, (name, cells)
        assert cells[1], f"{name} has no default in docs/cli.md"
        assert cells[4], f"{name} has no meaning in docs/cli.md"
