"""Version skew is one clear line: both versions and the command that installs the
coordinator's gpumesh from the coordinator, never a pickle or JSON traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from gpumesh import versions
from gpumesh._version import __version__

from ..conftest import free_port, wait_for

OLD = "0.0.9"
#: Runs the gpumesh CLI as if it were version argv[1] (the rest are its arguments).
AS_VERSION = ("import sys, gpumesh._version as v; v.__version__ = sys.argv[1]; "
              "from gpumesh.cli import main; sys.argv = ['gpumesh'] + sys.argv[2:]; main()")


def _wheel_cmd(url: str, version: str = __version__) -> str:
    return f"pip install {url}/v1/dist/gpumesh-{version}-py3-none-any.whl"


def test_user_agent_and_refusal_line():
    assert versions.parse_agent(versions.USER_AGENT) == (__version__, sys.version.split()[0])
    assert versions.parse_agent("python-urllib3/2.2.1") is None
    assert versions.parse_agent(None) is None
    assert versions.python_minor("3.12.1") == "3.12" and versions.python_minor("x") == ""
    line = versions.refusal("worker", OLD, __version__, "http://192.0.2.10:8000/")
    assert line == (f"this worker runs gpumesh {OLD} and the coordinator at http://192.0.2.10:8000/ "
                    f"runs gpumesh {__version__}: install the coordinator's on this machine with: "
                    f"{_wheel_cmd('http://192.0.2.10:8000')}")


def test_worker_of_another_version_is_refused_with_one_line(make_mesh):
    mesh = make_mesh(workers=0)
    r = subprocess.run([sys.executable, "-c", AS_VERSION, OLD, "join", mesh.url], env=mesh.env,
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"this worker runs gpumesh {OLD}" in lines[0]
    assert f"runs gpumesh {__version__}" in lines[0]
    assert lines[0].endswith(_wheel_cmd(mesh.url))
    assert mesh.workers() == []  # refused before it joined


def test_caller_of_another_version_is_refused_not_run_locally(make_mesh):
    mesh = make_mesh(workers=1)
    code = ("import sys, gpumesh._version as v; v.__version__ = sys.argv[1]\n"
            "from gpumesh import GPUMesh, accelerate, VersionMismatch\n"
            "m = GPUMesh(sys.argv[2], token=sys.argv[3])\n"
            "@accelerate(m)\n"
            "def f(x):\n    return x + 1\n"
            "for call in (lambda: f(1), m.workers):\n"
            "    try:\n        call()\n        print('RAN')\n"
            "    except VersionMismatch as e:\n        print('REFUSED', e)\n")
    r = subprocess.run([sys.executable, "-c", code, OLD, mesh.url, mesh.token], env=mesh.env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert len(out) == 2 and all(line.startswith("REFUSED ") for line in out), r.stdout
    for line in out:
        assert f"this caller runs gpumesh {OLD}" in line and f"gpumesh {__version__}" in line
        assert line.endswith(_wheel_cmd(mesh.url))
    assert "running locally" not in r.stderr


def test_newer_caller_checks_an_older_coordinator_itself(tmp_path, make_mesh):
    """The caller reads the coordinator's version from /v1/health: it needs no help from
    the coordinator's own check (which an older coordinator may lack)."""
    port = free_port()
    mesh = make_mesh(workers=0)  # only for its environment
    with open(tmp_path / "old.log", "ab") as fh:
        p = subprocess.Popen([sys.executable, "-c", AS_VERSION, OLD, "serve", "--port", str(port),
                              "--no-self-worker", "--data-dir", str(tmp_path / "old-data")],
                             env=mesh.env, stdout=fh, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _health(url), 30, "the old coordinator")
        from gpumesh import GPUMesh, VersionMismatch, accelerate
        m = GPUMesh(url, token=mesh.token)

        @accelerate(m)
        def f(x):
            return x

        with pytest.raises(VersionMismatch) as e:
            f(1)
        assert str(e.value) == (f"this caller runs gpumesh {__version__} and the coordinator at "
                                f"{url} runs gpumesh {OLD}: install the coordinator's on this "
                                f"machine with: {_wheel_cmd(url, OLD)}")
    finally:
        p.terminate()
        p.wait(20)


def _health(url: str):
    try:
        with urllib.request.urlopen(f"{url}/v1/health", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def test_the_other_gpumesh_on_pypi_gets_the_line_its_worker_prints(make_mesh):
    """PyPI's gpumesh 3.x worker: probes GET /api/workers, then POST /api/register, and
    prints the ``error`` of a 426 answer as the reason it cannot join."""
    mesh = make_mesh(workers=0)
    headers = {"Content-Type": "application/json", "X-Auth-Token": mesh.token,
               "User-Agent": f"Python-urllib/{sys.version_info[0]}.{sys.version_info[1]}"}
    probe = urllib.request.Request(f"{mesh.url}/api/workers", headers=headers, method="GET")
    with urllib.request.urlopen(probe, timeout=10) as r:
        assert r.status == 200 and json.loads(r.read())["workers"] == []
    body = json.dumps({"hostname": "b", "protocol_version": 2, "device": "cpu"}).encode()
    reg = urllib.request.Request(f"{mesh.url}/api/register", data=body, headers=headers, method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(reg, timeout=10)
    assert e.value.code == 426
    line = json.loads(e.value.read())["error"]
    assert "\n" not in line
    assert "PyPI's 'gpumesh' is another project" in line
    assert f"runs gpumesh {__version__}" in line and line.endswith(_wheel_cmd(mesh.url))
    assert mesh.workers() == []
