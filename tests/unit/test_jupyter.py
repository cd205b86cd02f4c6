"""``%load_ext gpumesh`` and ``%%mesh`` in an in-process IPython shell (no kernel, no mesh:
``GPUMESH_LOCAL=1`` runs every call here). The real-kernel tests are in
tests/integration/test_notebook.py."""

from __future__ import annotations

import linecache
import re

import pytest

from gpumesh import jupyter

pytest.importorskip("IPython")


@pytest.fixture
def shell(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext gpumesh")
    yield sh
    sh.run_cell("%unload_ext gpumesh")
    for name in ("mesh", "double", "triple", "square", "value", "bad", "zero"):
        sh.user_ns.pop(name, None)


def _ours(sh) -> tuple[int, int]:
    return (sum(t is jupyter.mark_cell for t in sh.input_transformers_cleanup),
            sum(isinstance(t, jupyter.WrapFunctions) for t in sh.ast_transformers))


def test_a_mesh_cell_wraps_its_functions_as_they_are_defined(shell):
    res = shell.run_cell("%%mesh\ndef double(x):\n    return 2 * x\n"
                         "kind = type(double).__name__\ndouble.map([1, 2])\n")
    assert res.success, res.error_in_exec
    assert res.result == [2, 4]  # the cell's last expression is its result
    assert shell.user_ns["kind"] == "RemoteFunction"


def test_only_a_mesh_cell_is_rewritten(shell):
    res = shell.run_cell("def triple(x):\n    return 3 * x\n'__gpumesh_mesh_cell__'\n")
    assert res.success and type(shell.user_ns["triple"]).__name__ == "function"
    res = shell.run_cell("async def square(x):\n    return x * x\n")
    assert res.success and type(shell.user_ns["square"]).__name__ == "function"
    res = shell.run_cell("%%mesh\nasync def square(x):\n    return x * x\n")
    assert res.success and type(shell.user_ns["square"]).__name__ == "function"
    # a generator function, which @mesh refuses (a task cannot send a generator back),
    # stays a plain function of the kernel too, rather than failing the whole cell
    res = shell.run_cell("%%mesh\ndef square(n):\n    yield from (i * i for i in range(n))\n"
                         "list(square(3))\n")
    assert res.success, res.error_in_exec
    assert res.result == [0, 1, 4] and type(shell.user_ns["square"]).__name__ == "function"


def test_the_magic_called_directly_runs_the_body_like_a_cell(shell):
    value = shell.run_cell_magic("mesh", "", "def double(x):\n    return 2 * x\ndouble(21)\n")
    assert value == 42
    assert type(shell.user_ns["double"]).__name__ == "RemoteFunction"
    with pytest.raises(ZeroDivisionError):
        shell.run_cell_magic("mesh", "", "1 / 0\n")
    # options are refused, whichever way the magic is reached
    from IPython.core.error import UsageError
    with pytest.raises(UsageError, match="takes no options"):
        shell.run_cell_magic("mesh", "--gpu", "x = 1\n")
    res = shell.run_cell("%%mesh --gpu\ndef double(x):\n    return 2 * x\n")
    assert not res.success and isinstance(res.error_in_exec, UsageError)


def _shown(capsys) -> str:
    """What IPython printed (its tracebacks), colours left out."""
    return re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)


def test_a_mesh_cells_traceback_lists_its_mesh_line_not_the_marker(shell, capsys):
    res = shell.run_cell("%%mesh\nzero = 0\n1 / zero\n")
    assert isinstance(res.error_in_exec, ZeroDivisionError)
    listing = _shown(capsys)
    assert "      1 %%mesh\n      2 zero = 0\n----> 3 1 / zero" in listing, listing
    assert jupyter.MARKER not in listing, listing
    # the magic called directly: its cell text is listed with the %%mesh line too
    with pytest.raises(ZeroDivisionError):
        shell.run_cell_magic("mesh", "", "zero = 0\n1 / zero\n")
    cells = [e[2] for e in linecache.cache.values() if len(e) == 4 and e[2]]
    assert ["%%mesh\n", "zero = 0\n", "1 / zero\n"] in cells
    assert not any(jupyter.MARKER in lines[0] for lines in cells)


def test_a_mesh_functions_traceback_names_its_cell_as_ipython_does(shell, capsys):
    # GPUMESH_LOCAL=1: the call runs here on the inline backend, whose traceback text is
    # a worker's (the function's frame named by its code's file name: the cell's)
    res = shell.run_cell("%%mesh\ndef bad(x):\n    y = 0\n    return x / y\nbad(1)\n")
    assert isinstance(res.error_in_exec, ZeroDivisionError)
    remote = res.error_in_exec.__cause__.tb
    (n,) = {count for name, count in shell.compile._filename_map.items()
            if "bad(1)" in "".join(linecache.getlines(name))}  # the cell's In[] number
    assert f"  Cell In[{n}], line 4, in bad\n    return x / y\n" in remote, remote
    assert "ipython-input" not in remote and "File " not in remote, remote
    shown = _shown(capsys)
    assert f"Cell In[{n}], line 4, in bad" in shown and jupyter.MARKER not in shown, shown


def test_an_own_mesh_variable_is_kept_and_does_not_matter(shell):
    shell.user_ns["mesh"] = "my own"
    shell.run_cell("%reload_ext gpumesh")
    assert shell.user_ns["mesh"] == "my own"
    assert _ours(shell) == (1, 1)  # reloading never stacks a second copy
    res = shell.run_cell("%%mesh\ndef double(x):\n    return 2 * x\ndouble(4)\n")
    assert res.success and res.result == 8


def test_unload_stops_the_rewriting(shell):
    shell.run_cell("%unload_ext gpumesh")
    assert _ours(shell) == (0, 0)
    res = shell.run_cell("%%mesh\ndef double(x):\n    return 2 * x\n")
    assert "double" not in shell.user_ns
    assert "Cell magic `%%mesh` not found" in str(res.error_in_exec)
    shell.run_cell("%load_ext gpumesh")
    assert _ours(shell) == (1, 1)


class _Handle:
    """Stands in for the front end: what IPython's display handle was asked to show."""

    def __init__(self, first: dict):
        self.shown = [first]

    def update(self, bundle: dict, raw: bool = False) -> None:
        assert raw
        self.shown.append(bundle)


def test_the_notebook_bar_counts_from_the_batch_start_and_redraws_sparingly(monkeypatch):
    import time

    import IPython.display

    from gpumesh.client import progress

    handles: list[_Handle] = []
    monkeypatch.setattr(IPython.display, "display",
                        lambda bundle, raw, display_id: handles.append(_Handle(bundle)) or handles[-1])
    started = time.monotonic() - 10  # the batch began 10 s before its bar showed
    bar = progress.NotebookBar(started=started)
    bar.add_task("train", total=10_000)
    t0 = time.monotonic()
    bar.start()
    for done in range(1, 10_001):
        bar.update(0, completed=done, rate="ignored")
    bar.stop()
    took = time.monotonic() - t0
    (handle,) = handles
    first, last = handle.shown[0]["text/plain"], handle.shown[-1]["text/plain"]
    assert first.startswith("train ....................   0%  0/10000 done  (10s)"), first
    assert last.startswith("train #################### 100%  10000/10000 done  (1"), last
    assert "ETA" not in last
    assert 'value="10000" max="10000"' in handle.shown[-1]["text/html"]
    # one redraw per refresh period at most, plus the first and the last: not one per result
    assert len(handle.shown) <= took / progress.NOTEBOOK_REFRESH_S + 2, len(handle.shown)
