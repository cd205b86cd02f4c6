"""A whole mesh under a Python that looks like Windows' (tests/winsurface/sitecustomize.py).

Coordinator, worker, task processes and callers all run without os.fork, killpg, setsid,
getuid, memfd, AF_UNIX, descriptor passing, SIGKILL/SIGSTOP/SIGCONT/SIGALRM and the
POSIX-only modules. The worker therefore picks the spawn runtime by itself. The mesh
runs examples/grid_search.py, some shared cases, a timeout, a crash and a cancel, and
leaves no process behind. What this does not prove: see the sitecustomize docstring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ..conftest import Mesh, wait_for

ROOT = Path(__file__).resolve().parents[2]
SURFACE = ROOT / "tests" / "winsurface"
CASES = ROOT.parent / "shared" / "cases"
#: Shared cases run here (light sizes: spawn pays an interpreter per task).
WIN_CASES = {"c02": {}, "c06": {}, "c09": {"GPUMESH_CASE_BIG_MB": "8"},
             "c12": {"GPUMESH_CASE_LEAK_MB": "16", "GPUMESH_CASE_LEAK_N": "8"},
             "c14": {"GPUMESH_CASE_FLOOD_MB": "8"}, "c15": {}, "c20": {}, "c22": {}}


def _env(base: dict) -> dict:
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SURFACE), env.get("PYTHONPATH")) if p)
    env.pop("GPUMESH_RUNTIME", None)  # the worker must choose spawn by itself
    return env


@pytest.fixture(scope="module")
def win_mesh(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("winsurface"))
    m.env = _env(m.env)
    m.start()
    m.add_worker(slots=2)
    yield m
    m.stop()


def _caller(m: Mesh, tmp_path: Path, args: list[str], extra: dict | None = None, timeout=240):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = _env({k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")})
    env.update(HOME=str(home), GPUMESH_CONFIG=str(tmp_path / "config.json"), GPUMESH_URL=m.url,
               GPUMESH_TOKEN=m.token, PYTHONUNBUFFERED="1", **(extra or {}))
    return subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _gone(pids, within: float = 20) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_the_worker_runs_the_spawn_runtime_because_fork_is_missing(win_mesh):
    out = win_mesh.procs[-1].output()
    assert "[worker] runtime: spawn (default here: this Python lacks os.fork" in out


def test_grid_search_example(win_mesh, tmp_path):
    r = _caller(win_mesh, tmp_path, [str(ROOT / "examples" / "grid_search.py")])
    assert r.returncode == 0, r.stderr
    assert "connected to coordinator" in r.stderr  # it ran on the mesh, not locally
    # its output is deterministic: the same as a run in this process's own Python
    local = subprocess.run([sys.executable, str(ROOT / "examples" / "grid_search.py")],
                           env=dict(os.environ, GPUMESH_LOCAL="1"), capture_output=True,
                           text=True, timeout=240, cwd=tmp_path)
    assert local.returncode == 0 and "\nbest: {" in local.stdout, local.stderr
    assert r.stdout == local.stdout


@pytest.mark.skipif(not CASES.is_dir(), reason="no shared cases directory")
@pytest.mark.parametrize("prefix", sorted(WIN_CASES))
def test_shared_case(win_mesh, tmp_path, prefix):
    path = sorted(CASES.glob(f"{prefix}_*.py"))[0]
    r = _caller(win_mesh, tmp_path, [str(path)],
                dict(WIN_CASES[prefix], GPUMESH_CASE_WATCHDOG_S="200"))
    assert r.returncode == 0 and f"OK [{prefix}]" in r.stdout, r.stdout + r.stderr


def test_timeout_crash_and_cancel_kill_whole_trees(win_mesh, tmp_path):
    r = _caller(win_mesh, tmp_path, [str(SURFACE / "faults_caller.py"), str(tmp_path)])
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["surface"] == [False, False, False]  # the task itself saw Windows' surface
    assert "timeout of 3s" in rep["timeout"]
    assert "exited with code 5" in rep["crash"]
    assert rep["cancelled"] == 1 and rep["cancel"].startswith("Cancelled")
    assert _gone(rep["timeout_pids"]), "the timed-out task's process tree survived"
    assert _gone(rep["cancel_pids"]), "the cancelled task's process tree survived"


def test_stopping_the_mesh_leaves_no_process_behind(win_mesh):
    tree = []
    for p in win_mesh.procs:
        proc = psutil.Process(p.p.pid)
        tree += [proc.pid] + [c.pid for c in proc.children(recursive=True)]
    assert len(tree) > 3  # coordinator, worker, and the worker's spare task processes
    win_mesh.stop()
    assert _gone(tree), [p for p in tree if psutil.pid_exists(p)]
    wait_for(lambda: True, 1, "")


#: Imports every gpumesh module (the superset of what serve, join, a task process and a
#: caller load), then reports what failed and which POSIX-only modules got loaded anyway.
IMPORT_ALL = """
import importlib, json, pkgutil, sys
import gpumesh
bad = {}
for m in pkgutil.walk_packages(gpumesh.__path__, "gpumesh."):
    try:
        importlib.import_module(m.name)
    except BaseException as e:
        bad[m.name] = f"{type(e).__name__}: {e}"
posix = sorted(n for n in ("fcntl", "resource", "pwd", "grp", "termios") if n in sys.modules)
print(json.dumps({"n": len(sys.modules), "bad": bad, "posix": posix}))
"""


def test_every_gpumesh_module_imports_without_posix_only_modules(tmp_path):
    env = _env({k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")})
    env["HOME"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", IMPORT_ALL], env=env, capture_output=True,
                       text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["bad"] == {}
    assert rep["posix"] == []
    # the surface was really in force (sitecustomize loaded; fcntl refused)
    probe = subprocess.run([sys.executable, "-c", "import fcntl"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode == 1 and "(tests/winsurface)" in probe.stderr


def test_the_cli_commands_load_under_the_surface(tmp_path):
    # every command's --help imports its module and what it needs to parse its flags
    env = _env({k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")})
    env["HOME"] = str(tmp_path)
    for command in ("serve", "join", "submit", "doctor", "workers", "pause", "token"):
        r = subprocess.run([sys.executable, "-m", "gpumesh", command, "--help"], env=env,
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("Usage: "), (command, r.stderr)
