"""One coordinator per data directory: a second ``serve`` on a locked one exits 1."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from gpumesh.coordinator import datalock

from ..conftest import free_port


def test_lock_is_exclusive_and_names_the_holder(tmp_path):
    first = datalock.acquire(tmp_path)
    try:
        assert (tmp_path / datalock.LOCK_NAME).read_text() == f"{os.getpid()}\n"
        # flock belongs to the open file: a second open in this very process is refused too.
        with pytest.raises(datalock.DataDirLocked) as e:
            datalock.acquire(tmp_path)
        assert e.value.pid == os.getpid()
        assert f"process {os.getpid()}" in str(e.value) and str(tmp_path) in str(e.value)
        # The refused attempt must not have erased the holder's pid.
        assert (tmp_path / datalock.LOCK_NAME).read_text() == f"{os.getpid()}\n"
    finally:
        first.release()
    again = datalock.acquire(tmp_path)  # released: free to take
    again.release()


def test_lock_is_dropped_when_its_process_is_killed(tmp_path):
    code = ("import sys, time; from gpumesh.coordinator import datalock; "
            f"datalock.acquire({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(datalock.DataDirLocked) as e:
            datalock.acquire(tmp_path)
        assert e.value.pid == p.pid
        p.kill()
        p.wait(10)
        datalock.acquire(tmp_path).release()  # the kernel released it with the process
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_second_serve_on_the_same_data_dir_exits_1_and_leaves_config_alone(make_mesh):
    mesh = make_mesh(workers=0)
    config = mesh.root / "config.json"
    before = (config.read_bytes(), config.stat().st_mtime_ns)
    port = free_port()
    time.sleep(0.05)  # a rewrite now would show in mtime_ns
    r = subprocess.run([sys.executable, "-m", "gpumesh", "serve", "--port", str(port),
                        "--data-dir", str(mesh.root / "data"), "--no-self-worker"],
                       env=mesh.env, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"process {mesh.coordinator.p.pid}" in lines[0]
    assert str(mesh.root / "data") in lines[0]
    assert "config saved" not in r.stdout and "recovered" not in r.stdout
    assert (config.read_bytes(), config.stat().st_mtime_ns) == before
    with pytest.raises(httpx.ConnectError):  # it never listened
        httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2)
    assert mesh.workers() == []  # the first coordinator is unharmed


def test_serve_restarts_on_a_data_dir_whose_holder_was_killed(make_mesh):
    mesh = make_mesh(workers=0)
    mesh.kill_coordinator()  # SIGKILL: no clean shutdown, the lock file stays behind
    assert (mesh.root / "data" / datalock.LOCK_NAME).exists()
    new = mesh.restart()
    assert new.p.poll() is None
    assert (mesh.root / "data" / datalock.LOCK_NAME).read_text() == f"{new.p.pid}\n"


def test_start_coordinator_on_a_locked_data_dir_raises_a_mesh_error(make_mesh, monkeypatch):
    """GPUMesh.start_coordinator failing is a MeshError (StartFailed, still a RuntimeError)
    in Python's words: the parameter data_dir=, not serve's --data-dir; nothing is started,
    and a second coordinator never answers in its place."""
    from gpumesh import GPUMesh, MeshError, StartFailed
    m = make_mesh()
    monkeypatch.setenv("GPUMESH_CONFIG", str(m.root / "other-config.json"))
    monkeypatch.setattr(tempfile, "tempdir", str(m.root))  # (its kept log: not in /tmp)
    port = free_port()
    with pytest.raises(MeshError) as e:
        GPUMesh.start_coordinator(port=port, token=m.token, self_worker=False,
                                  data_dir=str(m.root / "data"))
    assert type(e.value) is StartFailed and isinstance(e.value, RuntimeError)
    assert str(e.value) == (f"the data directory {m.root / 'data'} is in use by another "
                            f"coordinator (process {m.coordinator.p.pid}); stop it first, or "
                            f"pass data_dir= with another directory; nothing was started")
    with pytest.raises(httpx.ConnectError):  # it never listened
        httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2)


def test_start_coordinators_other_refusals_name_its_parameters():
    # what serve says if it exits anyway (it checks again, and more): its flags as the
    # parameters of start_coordinator
    from gpumesh.client.processes import as_parameters
    assert as_parameters("Error: cannot write to the data directory /x (Permission denied); "
                         "pass --data-dir with a writable directory") == (
        "Error: cannot write to the data directory /x (Permission denied); pass data_dir= "
        "with a writable directory")
    assert as_parameters("drop --no-self-worker, or pass --port 80 --host h --tls") == (
        "drop self_worker=False, or pass port= 80 host= h --tls")
