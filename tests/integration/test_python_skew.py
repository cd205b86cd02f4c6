"""Code shipped by value goes only to workers of the caller's Python minor version.

A worker on another Python minor version runs in a virtualenv of that Python with this
gpumesh installed from the coordinator's own wheel (the way a second machine gets it).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpumesh import TaskFailed, Unsatisfiable, accelerate
from gpumesh._version import __version__

from ..conftest import Mesh

HERE = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _other_python() -> tuple[str, str] | None:
    """(path, full version) of an installed CPython 3.10+ of another minor version."""
    seen = []
    for m in range(10, 15):
        if (exe := shutil.which(f"python3.{m}")) is not None:
            seen.append(exe)
    pyenv = Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser() / "versions"
    seen += [str(p / "bin" / "python") for p in sorted(pyenv.glob("3.*"))]
    for exe in seen:
        try:
            out = subprocess.run([exe, "-c", "import platform; print(platform.python_version())"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            continue
        parts = out.split(".")
        if len(parts) == 3 and parts[0] == "3" and int(parts[1]) >= 10 and f"3.{parts[1]}" != HERE:
            return exe, out
    return None


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """A coordinator with one worker on another Python minor version -> (mesh, version)."""
    found = _other_python()
    if found is None:
        pytest.skip(f"no CPython 3.10+ other than {HERE} is installed (python3.X on PATH or "
                    "pyenv), so no worker of another Python minor version can be started")
    exe, version = found
    root = tmp_path_factory.mktemp("pyskew")
    mesh = Mesh(root)
    mesh.start()
    started: list[subprocess.Popen] = []
    try:
        venv = root / f"python{version}"
        subprocess.run([exe, "-m", "venv", str(venv)], check=True, timeout=120)
        wheel = f"{mesh.url}/v1/dist/gpumesh-{__version__}-py3-none-any.whl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", wheel],
                           env=env, capture_output=True, text=True, timeout=480)
        if r.returncode != 0 and "No matching distribution" in r.stderr:
            pytest.skip(f"the dependencies for Python {version} cannot be installed here: {r.stderr[-300:]}")
        assert r.returncode == 0, r.stdout + r.stderr
        worker_env = dict(mesh.env)
        worker_env.pop("PYTHONPATH", None)
        log = root / "other-python-worker.log"
        with open(log, "ab") as fh:
            p = subprocess.Popen([str(venv / "bin" / "gpumesh"), "join", mesh.url], env=worker_env,
                                 stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        started.append(p)
        mesh.wait_alive(1)
        yield mesh, version
    finally:
        for p in started:  # the other Python's worker, by its pid
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        mesh.stop()


@pytest.mark.timeout(600)
def test_by_value_call_with_only_another_python_is_refused_at_once(skewed):
    mesh, version = skewed
    assert [w["python"] for w in mesh.workers() if w["alive"]] == [version]
    m = mesh.client()

    @accelerate(m)
    def closure(x):  # defined in a function: shipped by value (bytecode)
        return x + 1

    with pytest.raises(Unsatisfiable) as e:
        closure(1)
    msg = str(e.value)
    assert f"the caller runs Python {HERE}" in msg
    assert f"Python {version}" in msg and "ships code by value" in msg
    with pytest.raises(Unsatisfiable):
        closure.map([1, 2, 3])
    with pytest.raises(Unsatisfiable):
        accelerate(m)(lambda: 1)()
    # Code shipped by reference (an importable module's function) runs there as always.
    assert accelerate(m)(platform.python_version)() == version


@pytest.mark.timeout(600)
def test_by_value_call_goes_to_the_worker_of_the_callers_python(skewed):
    mesh, version = skewed
    mesh.add_worker()  # this interpreter's Python
    try:
        m = mesh.client()

        @accelerate(m)
        def which_python(i):
            import platform as _p
            return i, _p.python_version()

        got = which_python.map(list(range(8)))
        assert got == [(i, platform.python_version()) for i in range(8)]
        # by reference, both workers may take it; by value only ours did
        pythons = sorted(w["python"] for w in mesh.workers() if w["alive"])
        assert pythons == sorted([version, platform.python_version()])
    finally:
        mesh.procs[-1].stop()


@pytest.mark.timeout(600)
def test_code_made_by_a_worker_of_another_python_is_refused_naming_both_versions(skewed):
    # The other direction: a function shipped by reference runs on any Python, and what it
    # returns may hold code made there (contextmanager's inner function, by value): refused
    # before it loads, as it could crash this interpreter when called.
    mesh, version = skewed
    m = mesh.client()
    make = accelerate(m)(contextlib.contextmanager)
    with pytest.raises(TaskFailed) as e:
        make(os.getcwd)
    text = str(e.value)
    minor = ".".join(version.split(".")[:2])
    assert f"whose bytecode is Python {minor}'s" in text, text
    assert f"this process runs Python {platform.python_version()}" in text, text
    assert "Return plain data" in text, text


@pytest.mark.timeout(600)
def test_a_function_of_the_callers_own_module_goes_by_value_so_only_to_its_python(
        skewed, tmp_path, monkeypatch):
    # gpumesh.localcode sends a module that is the caller's own code (here: a file in a
    # directory only this process has on sys.path) by value: bytecode, so this Python only.
    mesh, version = skewed
    name = "gm_local_only_here"
    (tmp_path / f"{name}.py").write_text("def add_one(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    import importlib
    mod = importlib.import_module(name)
    try:
        m = mesh.client()
        with pytest.raises(Unsatisfiable) as e:
            accelerate(m)(mod.add_one)(1)
        assert "ships code by value" in str(e.value) and f"Python {version}" in str(e.value)
        mesh.add_worker()  # this interpreter's Python: it runs there
        try:
            assert accelerate(m)(mod.add_one).map([1, 2, 3]) == [2, 3, 4]
        finally:
            mesh.procs[-1].stop()
    finally:
        sys.modules.pop(name, None)
