"""A real notebook, executed in a real IPython kernel, against a real mesh."""

from __future__ import annotations

import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


def _notebook(cells: list[str]):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _run(nb, env: dict) -> list:
    old = dict(os.environ)
    os.environ.update(env)
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
