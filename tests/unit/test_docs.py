"""The README: its Quickstart installs what its own examples need, and its **Errors**
paragraph names the errors a call raises."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _names(reqs: list[str], extras: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for r in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(\[([^\]]*)\])?", r)
        if m.group(1) == "gpumesh":  # an extra naming other extras
            for e in (m.group(3) or "").split(","):
                out |= _names(extras[e.strip()], extras)
        else:
            out.add(m.group(1).lower().replace("-", "_"))
    return out


def _optional_imports(tree: ast.AST) -> set[ast.AST]:
    """Imports inside ``try:`` blocks that handle ``ImportError``/``ModuleNotFoundError``:
    an example that says what to install when a heavy package (torch) is missing."""
    out: set[ast.AST] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = set()
        for handler in node.handlers:
            types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            caught |= {t.id for t in types if isinstance(t, ast.Name)}
        if caught & {"ImportError", "ModuleNotFoundError"}:
            for stmt in node.body:
                out |= {n for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def test_quickstart_install_covers_the_examples_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    m = re.search(r"pip install -e '?\.(?:\[([^\]]*)\])?'?", (ROOT / "README.md").read_text())
    assert m, "the Quickstart has no `pip install -e .` line"
    installed = _names(project["dependencies"], extras)
    for e in (m.group(1) or "").split(","):
        if e.strip():
            installed |= _names(extras[e.strip()], extras)
    for script in sorted((ROOT / "examples").glob("*.py")):
        tree = ast.parse(script.read_text())
        optional = _optional_imports(tree)
        for node in ast.walk(tree):
            if node in optional:
                continue
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for mod in mods:
                top = mod.split(".")[0]
                if top in sys.stdlib_module_names or top == "gpumesh":
                    continue
                assert top.lower() in installed, f"{script.name} imports {top}, which the Quickstart does not install"


def test_the_readme_errors_paragraph_names_every_error_a_call_raises():
    import gpumesh
    from gpumesh import errors
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^\* \*\*Errors\*\*:(.*?)^\* ", text, re.M | re.S)
    assert m, "README.md has no **Errors** paragraph"
    named = set(re.findall(r"`(?:gpumesh\.)?([A-Z][A-Za-z]+)`", m.group(1)))
    classes = {n for n in gpumesh.__all__ if isinstance(getattr(gpumesh, n), type)
               and issubclass(getattr(gpumesh, n), errors.MeshError)}
    # Raised by the wire and transport layers, not by a call's outcome: documented in
    # docs/architecture.md (WireError) and docs/threat-model.md (PayloadTooLarge).
    elsewhere = {"WireError", "PayloadTooLarge"}
    assert classes - elsewhere - named == set()
    assert "TaskFailed" in named


def _docker_commands(text: str) -> list[list[str]]:
    """The ``docker ...`` commands of the ```bash blocks of ``text``, continuation lines
    joined and comments dropped, as argument lists."""
    import shlex
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["docker"]:
                out.append(words)
    return out


def _option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def test_the_readme_docker_recipe_joins_the_coordinator_at_an_address_it_has():
    section = re.search(r"^## Docker\n(.*?)^## ", (ROOT / "README.md").read_text(), re.M | re.S).group(1)
    commands = _docker_commands(section)
    runs = [w for w in commands if w[1:2] == ["run"]]
    coordinator = next(w for w in runs if "serve" in w)
    worker = next(w for w in runs if "join" in w)
    # Both on one network the recipe creates (not the default bridge, whose DNS does not
    # answer container names), and the worker joins the coordinator by its name there.
    network = _option(coordinator, "--network")
    assert network and network not in ("bridge", "host")
    assert ["docker", "network", "create", network] in commands
    assert _option(worker, "--network") == network
    url = worker[worker.index("join") + 1]
    assert url == f"http://{_option(coordinator, '--name')}:8732"
    # one image tag in the README, the Dockerfile's header and compose's default
    tag = next(w for w in commands if w[1:3] == ["build", "-t"])[3]
    assert tag == "gpumesh:0.1.0"
    assert tag in coordinator and tag in worker
    header = "".join(line for line in (ROOT / "Dockerfile").read_text().splitlines(True)
                     if line.startswith("#"))
    assert f"docker build -t {tag} ." in header
    assert "docker build -t gpumesh ." not in header
    assert f"image: ${{GPUMESH_IMAGE:-{tag}}}" in (ROOT / "docker-compose.yaml").read_text()


def _help_texts():
    """``(command path, help text)`` of ``gpumesh`` and every command and subcommand."""
    import click

    from gpumesh.cli import main

    todo = [(("gpumesh",), main, None)]
    while todo:
        path, cmd, parent = todo.pop()
        ctx = click.Context(cmd, info_name=path[-1], parent=parent)
        yield " ".join(path), cmd.get_help(ctx)
        if isinstance(cmd, click.Group):
            todo += [((*path, name), sub, ctx) for name, sub in cmd.commands.items()]


def test_the_cli_help_says_where_the_documents_it_names_are():
    # An installed user has the wheel, which holds no docs/: a help text that names a
    # document says it is in the source tree (and the sdist, which ships docs/:
    # tests/integration/test_distribution.py), and the document exists.
    named = 0
    for command, text in _help_texts():
        flat = " ".join(text.split())
        for m in re.finditer(r"docs/[\w.-]+\.md", flat):
            named += 1
            assert (ROOT / m.group(0)).is_file(), (command, m.group(0))
            assert "source tree" in flat[m.end():m.end() + 60], (command, flat[m.start():m.end() + 60])
    assert named >= 2  # gpumesh --help (docs/cli.md) and join --help (docs/owner.md)


def test_the_help_gives_the_data_dir_and_worker_toml_places_inline():
    texts = dict(_help_texts())
    serve, join = " ".join(texts["gpumesh serve"].split()), " ".join(texts["gpumesh join"].split())
    for text in (serve, join):
        assert "~/Library/Application Support/gpumesh" in text and "%LOCALAPPDATA%\\gpumesh" in text
    assert "[default: ~/.gpumesh; on macOS" in serve
    assert "~/.gpumesh/worker.toml" in join and "named as the flags with _ for -" in join


def _api_table() -> set[tuple[str, str]]:
    """(method, path) of each row of docs/architecture.md's HTTP API table, the path as
    the app registers it but with every parameter written ``{}`` (the table says ``{id}``
    or ``<version>``, the routes ``{jid}`` or ``{name}``), and no query string."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## HTTP API", 1)[1].split("\n## ", 1)[0]
    rows = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.fullmatch(r"[A-Z]+(/[A-Z]+)*", cells[0]):
            continue
        for path in re.findall(r"`([^`]+)`", cells[1]):
            path = "/v1" + path.split("?", 1)[0]
            path = "/".join("{}" if "{" in seg or "<" in seg else seg for seg in path.split("/"))
            rows |= {(method, path) for method in cells[0].split("/")}
    return rows


def test_the_http_api_table_lists_every_route():
    """Every route the coordinator serves under /v1 has a row (the ones /v1/openapi.json
    lists: a test in tests/security checks that those are the app's), and no row names a
    route it does not serve."""
    from gpumesh.coordinator import routes  # noqa: F401 - registers the endpoints
    from gpumesh.coordinator.routes.base import ordered
    served = {(m, re.sub(r"\{[^}]+\}", "{}", ep.path)) for ep in ordered() for m in ep.methods}
    documented = _api_table()
    assert served - documented == set(), "routes the table lacks"
    assert documented - served == set(), "rows for routes not served"


def test_status_row_names_every_task_mark():
    """cli.md's `gpumesh status` row names each mark a task line can start with, and
    the state it stands for (it listed three, and pending tasks print a fourth)."""
    from gpumesh.cli.views import MARKS, task_lines
    row = next(line for line in (ROOT / "docs" / "cli.md").read_text().splitlines()
               if line.startswith("| `gpumesh status JOB"))
    for state, (mark, _) in MARKS.items():
        assert f"`{mark}` {state}" in row, (mark, state)
    (pending,) = task_lines({"tasks": [{"id": "t1", "state": "pending", "cost": 1.0,
                                        "worker_id": None}]})
    other = pending.split()[0]
    assert other not in {m for m, _ in MARKS.values()} and f"`{other}` not yet final" in row
    assert "`[pending]`" in row and "`[leased]` (running)" in row


def test_the_performance_notes_cite_files_that_exist():
    """Each `name.py` the performance notes and the benchmarks' README cite is a file of
    the repository (src/, benchmarks/, examples/, tests/, scripts/), so a reader can
    rerun what a figure came from (one cited `cpu_per_task.py`, never committed)."""
    files = [p.relative_to(ROOT).as_posix() for d in ("src", "benchmarks", "examples", "tests", "scripts")
             for p in (ROOT / d).rglob("*.py")]
    for doc in ("docs/performance.md", "benchmarks/README.md"):
        cited = set(re.findall(r"`([A-Za-z0-9_./-]+\.py)\b", (ROOT / doc).read_text()))
        missing = sorted(n for n in cited if not any(f == n or f.endswith("/" + n) for f in files))
        assert missing == [], f"{doc} cites files the repository lacks: {missing}"


def test_the_readme_shows_examples_demo_py_as_it_is():
    """README's Quickstart quotes examples/demo.py under its name: the same text (its
    first line's comment had drifted)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^`examples/demo\.py`:\n\n```python\n(.*?)^```", text, re.M | re.S)
    assert m, "README.md no longer quotes examples/demo.py"
    assert m.group(1) == (ROOT / "examples" / "demo.py").read_text()
