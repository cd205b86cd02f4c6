"""Routing: mesh when it can, local when it cannot, never local once a job was accepted."""

from __future__ import annotations

import os
import threading
import time

import pytest

from gpumesh import AuthError, GPUMesh, MeshError, accelerate
from gpumesh.client import pipeline

from ..conftest import TOKEN, free_port


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch):
    """Notices print once per process; give each test its own 'process'."""
    monkeypatch.setattr(pipeline, "_notices", set())
    monkeypatch.delenv("GPUMESH_LOCAL", raising=False)


def _square(x):
    return x * x


def run_within(seconds, thunk):
    box: dict = {}

    def run():
        try:
            box["v"] = thunk()
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"no answer within {seconds}s"
    return box


# ---------------------------------------------------------------- mesh down ----------

def test_closed_port_runs_locally_with_one_notice(capsys):
    m = GPUMesh(f"http://127.0.0.1:{free_port()}", token=TOKEN)
    seen = []

    @accelerate(m)
    def f(x):
        seen.append(x)  # a copy of the list, as on a worker (the inline backend's round trip)
        return x * x, os.getpid()  # runs in this very process

    t0 = time.monotonic()
    assert f(3) == (9, os.getpid())
    assert f.map([{"x": i} for i in range(5)]) == [(i * i, os.getpid()) for i in range(5)]
    assert f(4) == (16, os.getpid())
    assert time.monotonic() - t0 < 15
    assert seen == []  # the caller's objects are not the function's: same as on the mesh
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "running locally" in ln]
    assert len(lines) == 1, err
    assert lines[0].startswith("[gpumesh] ")
    assert m.url in lines[0]


def test_closed_port_workers_raises_mesh_error():
    m = GPUMesh(f"http://127.0.0.1:{free_port()}", token=TOKEN)
    box = run_within(15, m.workers)
    assert isinstance(box.get("e"), MeshError)
    assert "cannot reach" in str(box["e"])


def test_zero_workers_runs_locally(start_empty_coordinator, capsys):
    url, token = start_empty_coordinator()
    m = GPUMesh(url, token=token)
    assert m.workers() == []

    @accelerate(m)
    def f(x):
        return x * x, os.getpid()

    assert f(3) == (9, os.getpid())
    assert [v for v, _ in f.map([{"x": i} for i in range(5)])] == [0, 1, 4, 9, 16]
    err = capsys.readouterr().err
    notices = [ln for ln in err.splitlines() if "no live worker" in ln]
    assert len(notices) == 1, err
    assert "running locally" in notices[0]


def test_zero_workers(start_empty_coordinator):
    """shared/cases c24's pytest part, on this suite's fixture."""
    url, token = start_empty_coordinator()
    m = GPUMesh(url, token=token)
    f = accelerate(m)(_square)
    box = run_within(30, lambda: (f(3), f.map([{"x": i} for i in range(5)])))
    assert "e" not in box, f"with zero workers the call raised {box.get('e')!r}"
    assert box["v"] == (9, [0, 1, 4, 9, 16])


def test_frozen_coordinator_does_not_hang(capsys):
    import socket
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(16)
    try:
        m = GPUMesh(f"http://127.0.0.1:{frozen.getsockname()[1]}", token=TOKEN)
        f = accelerate(m)(_square)
        box = run_within(20, lambda: f(3))
        assert box.get("v") == 9
        assert "running locally" in capsys.readouterr().err
    finally:
        frozen.close()


# ---------------------------------------------------------------- wrong token --------

@pytest.mark.parametrize("bad", [TOKEN + "-wrong", "wrong token ü€"])
def test_wrong_token_is_auth_error_never_local(shared_mesh, bad, capsys):
    m = GPUMesh(shared_mesh.url, token=bad)
    box = run_within(10, m.workers)
    e = box.get("e")
    assert isinstance(e, AuthError), box
    assert "token" in str(e) and "refused" in str(e)
    ran = []

    @accelerate(m)
    def double(n):
        ran.append(n)
        return n * 2

    box = run_within(20, lambda: double(21))
    assert isinstance(box.get("e"), AuthError), box
    assert "token" in str(box["e"])
    with pytest.raises(AuthError):
        double.map([1, 2])
    assert ran == []  # never silently run here
    assert "running locally" not in capsys.readouterr().err
    # a few typos do not lock the right token out
    assert len(GPUMesh(shared_mesh.url, token=shared_mesh.token).workers()) == 2


def test_missing_token_is_auth_error(shared_mesh, monkeypatch, tmp_path):
    monkeypatch.delenv("GPUMESH_TOKEN", raising=False)
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "none.json"))
    m = GPUMesh(shared_mesh.url)
    assert m.token is None
    with pytest.raises(AuthError, match="token"):
        m.workers()


# ---------------------------------------------------------------- accepted job -------

def wait_until(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_coordinator_killed_after_accept_never_runs_locally(make_mesh, monkeypatch):
    mesh = make_mesh(workers=1)
    client = mesh.client()

    def refuse(backend, job):
        raise AssertionError("an accepted job was re-run locally")
    monkeypatch.setattr(pipeline.InlineBackend, "run", refuse)

    @accelerate(client)
    def slow(x):
        import os as _os
        import time as _t
        _t.sleep(3)
        return x * 2, _os.getpid()

    box: dict = {}

    def call():
        try:
            box["v"] = slow(21)
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    th = threading.Thread(target=call, daemon=True)
    th.start()
    # the job is accepted once a worker is running it
    wait_until(lambda: any(w["running"] for w in mesh.workers()), 10, "the task to start")
    mesh.kill_coordinator()
    time.sleep(0.5)
    assert th.is_alive() and not box  # the caller waits; it did not fall back
    mesh.restart()
    th.join(30)
    assert not th.is_alive(), "the call did not finish after the coordinator came back"
    assert "e" not in box, repr(box.get("e"))
    value, pid = box["v"]
    assert value == 42
    assert pid != os.getpid()
    # the mesh keeps working after the restart
    wait_until(lambda: mesh.alive() == 1, 15, "the worker to re-join")
    box = run_within(20, lambda: slow.map([5]))
    assert [v for v, _ in box["v"]] == [10], box
    client.close()


def test_connected_notice_once(shared_mesh, capsys):
    m = shared_mesh.client()

    @accelerate(m)
    def f(x):
        return x + 1

    assert f(1) == 2
    assert f.map([1, 2]) == [2, 3]
    err = capsys.readouterr().err
    assert err.count(f"[gpumesh] connected to coordinator at {shared_mesh.url}") == 1, err
    assert "running locally" not in err
    m.close()


def test_a_refused_token_is_never_announced_as_connected(shared_mesh, capsys):
    m = GPUMesh(shared_mesh.url, token="not-the-token-" + "x" * 32)
    with pytest.raises(AuthError):
        accelerate(m)(abs)(-1)
    assert "connected" not in capsys.readouterr().err
    m.close()


def test_a_mesh_without_workers_says_one_line(make_mesh, capsys):
    mesh = make_mesh(workers=0)
    m = mesh.client()
    assert accelerate(m)(abs)(-3) == 3   # runs here
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[gpumesh]")]
    assert err == [f"[gpumesh] no live worker in the mesh at {mesh.url}; running locally"]
    m.close()


def test_gpumesh_local_with_mesh_down_needs_no_probe(capsys, monkeypatch):
    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    m = GPUMesh(f"http://127.0.0.1:{free_port()}", token=TOKEN)
    f = accelerate(m)(_square)
    assert f.map([1, 2, 3]) == [1, 4, 9]
    err = capsys.readouterr().err
    assert "GPUMESH_LOCAL=1" in err
    assert "unreachable" not in err


CALLER_SCRIPT = r"""
import os, sys, time
from gpumesh import GPUMesh, accelerate, MeshUnavailable
m = GPUMesh(os.environ["GPUMESH_URL"], token=os.environ["GPUMESH_TOKEN"])
caller = os.getpid()

@accelerate(m)
def slow(x):
    import os as _os, time as _t
    if _os.getpid() == caller:
        print("RAN-LOCALLY", flush=True)
    _t.sleep(5)
    return x

t0 = time.monotonic()
try:
    print("VALUE", slow(1), flush=True)
except MeshUnavailable as e:
    print(f"MESH-UNAVAILABLE after {time.monotonic() - t0:.1f}s: {e}", flush=True)
"""


def test_coordinator_gone_for_good_is_an_error_not_a_local_run(make_mesh, tmp_path):
    mesh = make_mesh(workers=1)
    env = dict(mesh.env, GPUMESH_URL=mesh.url, GPUMESH_RECONNECT_TIMEOUT="2", GPUMESH_OUTPUT="0")
    script = tmp_path / "caller.py"
    script.write_text(CALLER_SCRIPT)
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: any(w["running"] for w in mesh.workers()), 15, "the task to start")
        mesh.kill_coordinator()
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "MESH-UNAVAILABLE" in out, out
    assert "RAN-LOCALLY" not in out and "VALUE" not in out, out
    assert mesh.url in out
