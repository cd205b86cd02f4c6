"""Which coordinator the saved config names (what ``from gpumesh import mesh`` and
``gpumesh join`` without a URL use): a second coordinator does not take it over while
the saved one runs, ``GPUMesh.start_coordinator`` never writes it, a stale one is
replaced; and ``start_coordinator`` on a busy port fails, starting nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from gpumesh import GPUMesh, StartFailed

from ..conftest import Mesh, Proc, children, free_port, wait_for


def _second(a: Mesh, root, name: str) -> Mesh:
    """A mesh of its own (port, data dir) sharing ``a``'s HOME and config file."""
    b = Mesh(root / name)
    b.env.update(HOME=a.env["HOME"], GPUMESH_CONFIG=a.env["GPUMESH_CONFIG"])
    return b


def _saved(a: Mesh) -> dict:
    return json.loads(open(a.env["GPUMESH_CONFIG"]).read())


def _workers_without_a_url(env: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if k not in ("GPUMESH_URL", "GPUMESH_TOKEN")}
    return subprocess.run([sys.executable, "-m", "gpumesh", "workers", "--json"], env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_second_coordinator_leaves_the_saved_config_to_the_running_one(tmp_path):
    a = Mesh(tmp_path / "a").start()
    b = _second(a, tmp_path, "b")
    try:
        assert _saved(a)["url"] == a.url
        b.start()
        out = wait_for(lambda: "Ctrl+C" in b.coordinator.output() and b.coordinator.output(), 15,
                       "b's banner")
        assert _saved(a) == {"url": a.url, "token": a.token}
        assert (f"[gpumesh] config left as it is: {a.env['GPUMESH_CONFIG']} names the coordinator "
                f"at {a.url}, which is running; callers of this one need --url {b.url}") in out
        assert "config saved" not in out
        b.stop()
        # after the second one stops, a caller with nothing but the saved config still
        # reaches the first one
        r = _workers_without_a_url(a.env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == []
        # the saved coordinator gone, a new one replaces the stale entry
        a.stop()
        c = _second(a, tmp_path, "c").start()
        try:
            assert _saved(a)["url"] == c.url
            assert f"config saved to {a.env['GPUMESH_CONFIG']}" in c.coordinator.output()
        finally:
            c.stop()
    finally:
        b.stop()
        a.stop()


@pytest.mark.parametrize("saved", [True, False])
def test_start_coordinator_never_writes_the_saved_config(tmp_path, monkeypatch, saved):
    config = tmp_path / "config.json"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPUMESH_CONFIG", str(config))
    for name in ("GPUMESH_URL", "GPUMESH_TOKEN", "GPUMESH_HOST"):
        monkeypatch.delenv(name, raising=False)
    mine = {"url": "http://127.0.0.1:9", "token": "t" * 43}  # nobody answers there: stale
    if saved:
        config.write_text(json.dumps(mine))
    port = free_port()
    handle = GPUMesh.start_coordinator(port=port, data_dir=str(tmp_path / "data"), self_worker=False)
    try:
        assert GPUMesh(handle.url, token=handle.token).workers() == []
        if saved:
            assert json.loads(config.read_text()) == mine
        else:
            assert not config.exists()
        log = handle.log_tail()
        # no word of saving, keeping or reusing a config (its banner's re-run line does
        # name the --no-save-config it was started with)
        assert "[gpumesh] config" not in log and "reusing the token saved" not in log, log
        assert "--no-save-config" in log
    finally:
        handle.stop()
    # started again in this process without a token, it keeps its token
    again = GPUMesh.start_coordinator(port=port, data_dir=str(tmp_path / "data"), self_worker=False)
    again.stop()
    assert again.token == handle.token


def test_start_coordinator_on_a_busy_port_fails_naming_it_and_starts_nothing(tmp_path, monkeypatch):
    other = Mesh(tmp_path / "other").start()
    try:
        monkeypatch.setenv("HOME", other.env["HOME"])
        monkeypatch.setenv("GPUMESH_CONFIG", other.env["GPUMESH_CONFIG"])
        before = set(children(os.getpid()))
        # the same token (the saved one for this URL): the other would even accept it
        with pytest.raises(StartFailed, match=rf"port {other.port} on 127\.0\.0\.1 is already in use"):
            GPUMesh.start_coordinator(port=other.port, data_dir=str(tmp_path / "mine"),
                                      self_worker=False)
        assert set(children(os.getpid())) == before  # no process was left running
        assert not (tmp_path / "mine").exists()
        assert other.coordinator.p.poll() is None  # and the other one is untouched
        # Had the port been free when checked and taken just after (a race), the health
        # answer of the other is not taken for ours: ours fails to bind, and says so.
        from gpumesh.client import processes
        monkeypatch.setattr(processes, "_port_in_use", lambda host, port: None)
        # (the failed start's log is kept: here, not in /tmp)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        with pytest.raises(StartFailed, match=rf"exited with code 1: .*port {other.port} is "
                                              r"already in use"):
            GPUMesh.start_coordinator(port=other.port, data_dir=str(tmp_path / "mine"),
                                      self_worker=False)
        wait_for(lambda: set(children(os.getpid())) <= before, 5, "no process left running")
        assert other.coordinator.p.poll() is None
    finally:
        other.stop()


def test_serve_no_save_config_leaves_it(tmp_path):
    m = Mesh(tmp_path / "m")
    m.coordinator = Proc(["serve", "--port", str(m.port), "--data-dir", str(m.root / "data"),
                          "--no-self-worker", "--no-save-config"], m.env, m.root / "coordinator.log")
    m.procs.append(m.coordinator)
    try:
        m.wait_health()
        assert not os.path.exists(m.env["GPUMESH_CONFIG"])
    finally:
        m.stop()
