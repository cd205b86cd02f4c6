"""A second machine installs gpumesh from the coordinator itself, then joins it.

PyPI's ``gpumesh`` is another project: the only copy of *this* gpumesh another machine
can count on is the one the coordinator runs, served at ``GET /v1/dist/<wheel>``.
"""

from __future__ import annotations

import hashlib
import io
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

import gpumesh
from gpumesh import accelerate
from gpumesh._version import __version__
from gpumesh.cli.serve import banner
from gpumesh.coordinator import dist


WHEEL = f"gpumesh-{__version__}-py3-none-any.whl"


def test_wheel_name_and_install_command():
    assert dist.wheel_name() == WHEEL
    assert dist.install_command("http://192.0.2.10:8000/") == \
        f"pip install http://192.0.2.10:8000/v1/dist/{WHEEL}"


def test_banner_of_an_exposed_coordinator_prints_install_then_join():
    lines = banner("192.0.2.10", 8000, "t" * 32, show_token=False)
    install = [i for i, line in enumerate(lines) if "Install on ANOTHER machine" in line]
    join = [i for i, line in enumerate(lines) if "Join from ANOTHER machine" in line]
    assert len(install) == 1 and join == [install[0] + 1]
    assert lines[install[0]].split(": ", 1)[1] == f"pip install http://192.0.2.10:8000/v1/dist/{WHEEL}"


def test_coordinator_serves_its_own_wheel_without_a_token(make_mesh):
    mesh = make_mesh(workers=0)
    r = httpx.get(f"{mesh.url}/v1/dist/{WHEEL}", timeout=60)  # no Authorization header
    assert r.status_code == 200, r.text
    zf = zipfile.ZipFile(io.BytesIO(r.content))
    names = set(zf.namelist())
    info = f"gpumesh-{__version__}.dist-info"
    assert {"gpumesh/__init__.py", "gpumesh/coordinator/dist.py", "gpumesh/py.typed", f"{info}/METADATA",
            f"{info}/WHEEL", f"{info}/RECORD", f"{info}/entry_points.txt"} <= names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    # exactly the code this process runs
    src = Path(gpumesh.__file__).parent
    for name in ("__init__.py", "wire.py", "coordinator/app.py"):
        assert zf.read(f"gpumesh/{name}") == (src / name).read_bytes()
    meta = zf.read(f"{info}/METADATA").decode()
    assert "Name: gpumesh\n" in meta and f"Version: {__version__}\n" in meta
    assert "Tag: py3-none-any" in zf.read(f"{info}/WHEEL").decode()
    assert "gpumesh = gpumesh.cli:main" in zf.read(f"{info}/entry_points.txt").decode()
    record = zf.read(f"{info}/RECORD").decode().splitlines()
    assert len(record) == len(names)
    # cached under the data directory, and the same bytes on the next request
    cached = mesh.root / "data" / "dist" / WHEEL
    assert cached.read_bytes() == r.content
    again = httpx.get(f"{mesh.url}/v1/dist/{WHEEL}", timeout=60)
    assert hashlib.sha256(again.content).digest() == hashlib.sha256(r.content).digest()


@pytest.mark.parametrize("name", ["gpumesh-3.2.0-py3-none-any.whl", "gpumesh.tar.gz", "..%2Fgpumesh.db"])
def test_other_names_are_a_clear_404(make_mesh, name):
    mesh = make_mesh(workers=0)
    r = httpx.get(f"{mesh.url}/v1/dist/{name}", timeout=10)
    assert r.status_code == 404
    assert r.json()["error"] == "not_found"
    if "%2F" not in name:  # (one with a slash matches no route at all)
        assert f"serves {WHEEL}" in r.json()["message"]
    assert r.headers["content-type"].startswith("application/json")


def _pypi_reachable() -> bool:
    if os.environ.get("PIP_NO_INDEX"):
        return True  # a local index/wheelhouse serves the dependencies
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.timeout(600)
def test_fresh_virtualenv_installs_from_the_coordinator_and_joins(make_mesh, tmp_path):
    """The second machine: a new virtualenv that sees none of this one's packages."""
    if not _pypi_reachable():
        pytest.skip("the wheel's dependencies (cloudpickle, starlette, ...) come from PyPI, "
                    "which is not reachable from here")
    mesh = make_mesh(workers=0)
    venv = tmp_path / "machine-b"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMESH_", "PYTHON"))}
    url = f"{mesh.url}/v1/dist/{WHEEL}"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", url], env=env,
                       capture_output=True, text=True, timeout=480)
    assert r.returncode == 0, r.stdout + r.stderr
    where = subprocess.run([str(py), "-c", "import gpumesh; print(gpumesh.__file__)"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert where.stdout.splitlines()[0].startswith(str(venv)), where.stdout + where.stderr
    version = subprocess.run([str(venv / "bin" / "gpumesh"), "--version"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith(f"gpumesh {__version__} ")

    env.update(HOME=str(tmp_path / "home-b"), GPUMESH_TOKEN=mesh.token, GPUMESH_DISCOVERY="0")
    (tmp_path / "home-b").mkdir()
    log = tmp_path / "machine-b.log"
    with open(log, "ab") as fh:
        worker = subprocess.Popen([str(venv / "bin" / "gpumesh"), "join", mesh.url], env=env,
                                  stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
    try:
        mesh.wait_alive(1)

        @accelerate(mesh.client())
        def where_am_i(x):
            import sys as _sys
            import gpumesh as _g
            return x * 2, _sys.prefix, _g.__file__

        doubled, prefix, module = where_am_i(21)
        assert doubled == 42
        assert Path(prefix) == venv  # it ran in machine B's environment
        assert module.startswith(str(venv))
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    assert "joined mesh as" in log.read_text()
