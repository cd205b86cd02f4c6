"""A real notebook, executed in a real IPython kernel, against a real mesh."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


def _notebook(cells: list[str]):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _run(nb, env: dict, bar: bool = False) -> list:
    """Run ``nb`` in a real kernel with ``env`` set; its cells' outputs. A ``.map`` that
    takes longer than the progress bar's delay (a busy machine: a parallel suite, CI) adds
    the bar to its cell's output, so it is off (``GPUMESH_PROGRESS=0``) unless ``bar``:
    the one test whose subject it is."""
    old = dict(os.environ)
    os.environ.update(env if bar else {"GPUMESH_PROGRESS": "0", **env})
    try:
        # ipykernel's built-in "python3" spec runs the kernel with this very interpreter
        # (the environment that has gpumesh installed)
        client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                         resources={"metadata": {"path": os.getcwd()}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    return [cell.get("outputs", []) for cell in nb.cells]


def _text(outputs) -> str:
    parts = []
    for o in outputs:
        if o.get("output_type") == "stream" and o.get("name") == "stdout":
            parts.append(o["text"])
        elif o.get("output_type") in ("execute_result", "display_data"):
            parts.append(o["data"].get("text/plain", ""))
        elif o.get("output_type") == "error":
            parts.append(f"ERROR {o['ename']}: {o['evalue']}")
    return "".join(parts)


def test_mesh_cell_magic_in_a_real_kernel(shared_mesh):
    env = {"GPUMESH_URL": shared_mesh.url, "GPUMESH_TOKEN": shared_mesh.token,
           "GPUMESH_CASE_CALLER": "kernel"}
    nb = _notebook([
        "%load_ext gpumesh",
        # the notebook already has its own `mesh`: the extension must leave it alone
        "mesh = 'my own variable'",
        "%%mesh\n"
        "import os\n"
        "FACTOR = 2\n"
        "def preprocess(chunk_id, rows):\n"
        "    where = 'local' if os.environ.get('GPUMESH_CASE_CALLER') else 'remote'\n"
        "    return {'chunk': chunk_id, 'rows': rows * FACTOR, 'where': where}\n",
        "print(preprocess.map([{'chunk_id': i, 'rows': 100 + i} for i in range(3)]))",
        "FACTOR = 3\nprint(preprocess(chunk_id=9, rows=1))",
        # running the same %%mesh cell again must not wrap twice
        "%%mesh\n"
        "def preprocess(chunk_id, rows):\n"
        "    return chunk_id + rows\n",
        "print(type(preprocess).__name__, type(preprocess.__wrapped__).__name__, preprocess(1, 2))",
        "print(mesh)",
    ])
    outputs = _run(nb, env)
    texts = [_text(o) for o in outputs]
    assert "ERROR" not in "".join(texts), texts
    assert texts[3].strip() == str([{"chunk": i, "rows": (100 + i) * 2, "where": "remote"}
                                    for i in range(3)])
    assert texts[4].strip() == str({"chunk": 9, "rows": 3, "where": "remote"})
    assert texts[6].strip() == "RemoteFunction function 3"
    assert texts[7].strip() == "my own variable"


# The README's (and the spec's) notebook example, character for character.
SPEC_CELL = (
    "%%mesh\n"
    "def preprocess(chunk_id, rows):\n"
    '    return {"chunk": chunk_id, "rows": rows * rows}\n'
    "\n"
    'results = preprocess.map([{"chunk_id": i, "rows": 100 + i} for i in range(6)])\n'
)
SPEC_VALUES = [{"chunk": i, "rows": (100 + i) * (100 + i)} for i in range(6)]
README = Path(__file__).resolve().parents[2] / "README.md"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _stderr(outputs) -> str:
    return "".join(o["text"] for o in outputs
                   if o.get("output_type") == "stream" and o.get("name") == "stderr")


def _errors(outputs) -> list[dict]:
    return [o for o in outputs if o.get("output_type") == "error"]


def _traceback(error: dict) -> str:
    return _ANSI.sub("", "\n".join(error["traceback"]))


def _jobs(m) -> dict[str, dict]:
    r = httpx.get(f"{m.url}/v1/jobs", params={"limit": 1000},
                  headers={"authorization": f"Bearer {m.token}"}, timeout=10)
    r.raise_for_status()
    return {j["id"]: j for j in r.json()}


def test_the_spec_cell_runs_verbatim_on_the_mesh(shared_mesh):
    assert SPEC_CELL in README.read_text()  # the cell tested is the one users read
    before = _jobs(shared_mesh)
    nb = _notebook([
        "%load_ext gpumesh",
        SPEC_CELL,
        "print(results)",
        # %load_ext also gave the notebook a bare @mesh decorator
        "@mesh\ndef square(x):\n    return x * x\n",
        "print(type(square).__name__, square.map([1, 2, 3]))",
        # the [notebook] extra's DataFrame support, through the injected mesh
        "df = mesh.results_to_dataframe(results)\ndf.shape, list(df.columns), int(df['rows'].sum())",
    ])
    outputs = _run(nb, {"GPUMESH_URL": shared_mesh.url, "GPUMESH_TOKEN": shared_mesh.token})
    assert not any(_errors(o) for o in outputs), outputs
    assert _text(outputs[1]) == ""  # an assignment shows nothing, as in any cell
    assert _text(outputs[2]).strip() == str(SPEC_VALUES)
    assert _text(outputs[4]).strip() == "RemoteFunction [1, 4, 9]"
    assert _text(outputs[5]) == f"((6, 2), ['chunk', 'rows'], {sum(v['rows'] for v in SPEC_VALUES)})"
    assert "running locally" not in "".join(_stderr(o) for o in outputs)
    # and the cell's .map was one job of six tasks on the mesh, not a local run
    new = [j for jid, j in _jobs(shared_mesh).items() if jid not in before]
    assert sorted((j["name"], j["n_tasks"]) for j in new) == [("preprocess", 6), ("square", 3)], new


def test_the_spec_cell_runs_verbatim_with_the_mesh_unreachable(tmp_path):
    # nothing listens on this port: every call runs in the kernel, with the same values
    url = f"http://127.0.0.1:{free_port()}"
    nb = _notebook(["%load_ext gpumesh", SPEC_CELL, "print(results)"])
    outputs = _run(nb, {"GPUMESH_URL": url, "GPUMESH_TOKEN": "t" * 32,
                        "GPUMESH_CONFIG": str(tmp_path / "config.json")})
    assert not any(_errors(o) for o in outputs), outputs
    assert _text(outputs[2]).strip() == str(SPEC_VALUES)
    assert f"coordinator at {url} is unreachable; running locally" in _stderr(outputs[1])


def test_mesh_cells_redefined_and_changed_globals_take_effect(shared_mesh):
    # shared/cases/c02 written as %%mesh cells: each cell calls its function itself, and
    # the value of the last expression is the cell's result, as in any cell
    env = {"GPUMESH_URL": shared_mesh.url, "GPUMESH_TOKEN": shared_mesh.token,
           "GPUMESH_CASE_CALLER": "kernel"}
    nb = _notebook([
        "%load_ext gpumesh",
        "%%mesh\n"
        "import os\n"
        "FACTOR = 2\n"
        "def score(x):\n"
        "    return x * FACTOR, 'local' if os.environ.get('GPUMESH_CASE_CALLER') else 'remote'\n"
        "print('defined')\n"
        "score(5)\n",
        "FACTOR = 3\nscore(5)",
        "%%mesh\n"
        "def score(x):\n"
        "    return x * FACTOR + 1, 'local' if os.environ.get('GPUMESH_CASE_CALLER') else 'remote'\n"
        "score(5)\n",
        "score.map([{'x': 1}, {'x': 2}])",
    ])
    outputs = _run(nb, env)
    assert not any(_errors(o) for o in outputs), outputs
    assert _text(outputs[1]) == "defined\n(10, 'remote')"
    assert _text(outputs[2]) == "(15, 'remote')"
    assert _text(outputs[3]) == "(16, 'remote')"
    assert _text(outputs[4]) == "[(4, 'remote'), (7, 'remote')]"
    results = [o for o in outputs[1] if o["output_type"] == "execute_result"]
    assert len(results) == 1 and results[0]["execution_count"] == 2


def test_mesh_cell_errors_name_the_users_lines_and_stop_run_all(shared_mesh):
    env = {"GPUMESH_URL": shared_mesh.url, "GPUMESH_TOKEN": shared_mesh.token}
    nb = _notebook([
        "%load_ext gpumesh",
        # line 5 of this cell (the %%mesh line is line 1) raises on the worker
        "%%mesh\n"
        "def check(x):\n"
        "    if x == 2:\n"
        "        y = 0\n"
        "        return x / y\n"
        "    return x\n"
        "check.map([1, 2, 3])\n",
        "print('after')",
    ])
    with pytest.raises(nbclient.exceptions.CellExecutionError):
        _run(nb, env)
    (error,) = _errors(nb.cells[1].outputs)
    assert error["ename"] == "ZeroDivisionError"
    tb = _traceback(error)
    # the worker's traceback names the cell as IPython does, with the user's line and its text
    assert re.search(r"\n  Cell In\[2\], line 5, in check\n    return x / y\n", tb), tb
    assert "ipykernel_" not in tb and "__gpumesh_mesh_cell__" not in tb, tb
    assert "----> 7 check.map([1, 2, 3])" in tb, tb  # the caller's side, the user's line
    # then one frame of gpumesh's, the .map that raised the task's exception; the frames
    # below it (mesh, pipeline, decoding) are taken off its traceback (client/remote.py)
    assert tb.count("gpumesh/client/") == 1 and "gpumesh/client/remote.py" in tb, tb
    for internal in ("mesh.py", "pipeline.py", "calls.py"):
        assert f"gpumesh/client/{internal}" not in tb, tb
    assert nb.cells[2].outputs == []  # Run All stopped at the failing cell

    nb = _notebook([
        "%load_ext gpumesh",
        "%%mesh\nzero = 0\nrows = 10 / zero\n",
    ])
    with pytest.raises(nbclient.exceptions.CellExecutionError):
        _run(nb, env)
    (error,) = _errors(nb.cells[1].outputs)
    tb = _traceback(error)
    assert error["ename"] == "ZeroDivisionError", tb
    # the cell as the user wrote it: its %%mesh line, not gpumesh's marker
    assert "      1 %%mesh\n      2 zero = 0\n----> 3 rows = 10 / zero" in tb, tb
    assert "__gpumesh_mesh_cell__" not in tb, tb
    assert "run_cell_magic" not in tb, tb  # only the user's own frames


def test_map_progress_in_a_notebook_is_a_bar_not_a_widget_warning(shared_mesh):
    env = {"GPUMESH_URL": shared_mesh.url, "GPUMESH_TOKEN": shared_mesh.token}
    nb = _notebook([
        "%load_ext gpumesh",
        # four 1 s tasks on two one-slot workers: past the bar's 1 s delay
        "%%mesh\n"
        "import time\n"
        "def slow(i):\n"
        "    time.sleep(1.0)\n"
        "    return i\n",
        "print(slow.map(range(4)))",
    ])
    outputs = _run(nb, env, bar=True)
    cell = outputs[2]
    assert not _errors(cell), cell
    everything = str(cell)
    assert "ipywidgets" not in everything, everything
    assert _text([o for o in cell if o["output_type"] == "stream"]) == "[0, 1, 2, 3]\n"
    bars = [o["data"]["text/plain"] for o in cell if o["output_type"] == "display_data"]
    # the bar stays in the output at its final state, like a notebook progress bar does
    assert len(bars) == 1 and re.search(r"^slow .*100%\s+4/4 done", bars[0]), cell


def test_a_gpumesh_named_mesh_is_the_one_mesh_cells_use(shared_mesh, tmp_path):
    # as in the spec's quick demo: the notebook's own `mesh = GPUMesh(url, token=...)`; the
    # default mesh points nowhere, so a call that used it would run in the kernel
    env = {"GPUMESH_URL": f"http://127.0.0.1:{free_port()}", "GPUMESH_TOKEN": "t" * 32,
           "GPUMESH_CONFIG": str(tmp_path / "config.json"), "GPUMESH_CASE_CALLER": "kernel"}
    nb = _notebook([
        "from gpumesh import GPUMesh\n"
        f"mesh = GPUMesh({shared_mesh.url!r}, token={shared_mesh.token!r})",
        "%load_ext gpumesh",
        "%%mesh\n"
        "import os\n"
        "def where(i):\n"
        "    return i, 'local' if os.environ.get('GPUMESH_CASE_CALLER') else 'remote'\n"
        "where.map([1, 2])\n",
        "print(mesh)",
    ])
    outputs = _run(nb, env)
    assert not any(_errors(o) for o in outputs), outputs
    assert _text(outputs[2]) == "[(1, 'remote'), (2, 'remote')]"
    assert _text(outputs[3]).strip() == f"GPUMesh({shared_mesh.url!r})"
    assert "running locally" not in _stderr(outputs[2])
