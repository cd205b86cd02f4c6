"""What ``GPUMesh.start_coordinator`` and ``GPUMesh.add_worker`` leave behind: processes a
script started stop when it exits (unless ``detach=True``), and so do their log files,
unless a process failed (then its log is kept and named)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from gpumesh import GPUMesh, StartFailed
from gpumesh.client import processes
from ..conftest import alive, descendants, free_port, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads processes from /proc")

#: A program that starts a coordinator (with its self-worker) and a worker, prints their
#: PIDs, and ends, once told on stdin, without stop().
SCRIPT = textwrap.dedent("""
    import sys
    from gpumesh import GPUMesh
    detach = sys.argv[2] == "detach"
    c = GPUMesh.start_coordinator(port=int(sys.argv[1]), detach=detach)
    w = GPUMesh.add_worker(c.url, token=c.token, detach=detach)
    print(c.process.pid, w.process.pid, flush=True)
    sys.stdin.readline()
""")


def _env(tmp_path: Path) -> dict:
    (tmp_path / "home").mkdir(exist_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"),
               GPUMESH_CONFIG=str(tmp_path / "config.json"))
    for name in ("GPUMESH_URL", "GPUMESH_TOKEN", "GPUMESH_LOCAL", "GPUMESH_HOST",
                 "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    return env


def _logs(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "tmp").glob("gpumesh-*.log"))


def _run_script(tmp_path: Path, mode: str) -> tuple[list[int], subprocess.Popen]:
    """Start SCRIPT; returns the PIDs of everything it started (the coordinator, its
    self-worker and the worker, with their children) and the script, still running."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, str(script), str(free_port()), mode], env=_env(tmp_path),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    line = p.stdout.readline()
    if not line:
        p.kill()
        raise AssertionError(f"the script did not start its mesh: {p.communicate()[1]}")
    coordinator, worker = (int(x) for x in line.split())
    pids = [coordinator, worker, *descendants(coordinator), *descendants(worker)]
    assert len(pids) >= 3, pids  # (the coordinator's self-worker among them)
    assert all(alive(pid) for pid in pids)
    assert len(_logs(tmp_path)) == 2
    return pids, p


def test_a_script_that_exits_without_stop_leaves_no_process_and_no_log(tmp_path):
    pids, script = _run_script(tmp_path, "own")
    try:
        t0 = time.monotonic()
        _, err = script.communicate("\n", timeout=30)
        assert script.returncode == 0, err
        wait_for(lambda: not any(alive(pid) for pid in pids), 15,
                 lambda: f"the processes the script started to end: {[p for p in pids if alive(p)]}")
        assert time.monotonic() - t0 < 30
        assert _logs(tmp_path) == []
        assert "Traceback" not in err, err
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_detached_processes_outlive_the_script_and_keep_their_logs(tmp_path):
    pids, script = _run_script(tmp_path, "detach")
    try:
        _, err = script.communicate("\n", timeout=30)
        assert script.returncode == 0, err
        time.sleep(1)
        # (the coordinator and the worker; their children come and go: a join's benchmark)
        assert all(alive(pid) for pid in pids[:2]), [p for p in pids[:2] if not alive(p)]
        logs = _logs(tmp_path)
        assert len(logs) == 2
        assert {n.split("-")[1] for n in logs} == {"coordinator", "worker"}
    finally:
        for pid in pids[:2]:  # the worker and the coordinator (its self-worker with it)
            if alive(pid):
                os.kill(pid, signal.SIGINT)
        wait_for(lambda: not any(alive(pid) for pid in pids), 20, "the detached processes to stop")


def _in_this_process(tmp_path: Path, monkeypatch) -> None:
    """This test process as SCRIPT's would be: its own home and temporary directory."""
    env = _env(tmp_path)
    for name in ("HOME", "GPUMESH_CONFIG"):
        monkeypatch.setenv(name, env[name])
    for name in ("GPUMESH_URL", "GPUMESH_TOKEN", "GPUMESH_LOCAL", "GPUMESH_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))


def test_handles_are_context_managers_that_stop_and_remove_their_logs(tmp_path, monkeypatch):
    _in_this_process(tmp_path, monkeypatch)
    with GPUMesh.start_coordinator(port=free_port(), self_worker=False) as c:
        with GPUMesh.add_worker(c.url, token=c.token) as w:
            assert isinstance(w, dict) and w["alive"] is True
            assert w.log_path.parent == tmp_path / "tmp"
            assert w.log_path.name.startswith("gpumesh-worker-")
            assert c.log_path.name.startswith("gpumesh-coordinator-")
            assert _logs(tmp_path) == sorted([c.log_path.name, w.log_path.name])
            assert [p for p in processes._owned if p is w or p is c] == [c, w]
        assert w.process.returncode == 0
        assert not w.log_path.exists()
        assert c.process.poll() is None
    assert c.process.returncode == 0
    assert _logs(tmp_path) == []
    assert not any(p is w or p is c for p in processes._owned)  # nothing left for atexit


def test_a_failed_start_keeps_its_log_and_names_it(tmp_path, monkeypatch):
    _in_this_process(tmp_path, monkeypatch)
    # A port taken after the check (a race): serve itself fails to bind and says so.
    monkeypatch.setattr(processes, "_port_in_use", lambda host, port: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartFailed) as e:
            GPUMesh.start_coordinator(port=port, self_worker=False)
    (log,) = (tmp_path / "tmp").glob("gpumesh-coordinator-*.log")
    message = str(e.value)
    assert message.startswith("the coordinator exited with code 1: ")
    assert message.endswith(f"(its whole log: {log})")
    assert f"port {port} is already in use" in log.read_text()
    assert f"port {port} is already in use" in message
    assert not any(getattr(p, "log_path", None) == log for p in processes._owned)
    # a worker that exits at once (its owner's rules file is wrong): the same
    rules = tmp_path / "home" / ".gpumesh" / "worker.toml"
    rules.parent.mkdir(parents=True, exist_ok=True)
    rules.write_text('hours = "whenever"\n')
    with GPUMesh.start_coordinator(port=free_port(), self_worker=False) as c:
        with pytest.raises(StartFailed) as e:
            GPUMesh.add_worker(c.url, token=c.token)
    (worker_log,) = (tmp_path / "tmp").glob("gpumesh-worker-*.log")
    message = str(e.value)
    assert message.startswith("the worker exited with code 2: ")
    assert message.endswith(f"(its whole log: {worker_log})")
    assert "hours" in worker_log.read_text() and "hours" in message
    assert "Usage: gpumesh" not in message
    # the coordinator that stopped cleanly left no log; the two that failed are kept
    assert _logs(tmp_path) == sorted([log.name, worker_log.name])


@pytest.mark.parametrize("call, error, words", [
    (lambda: GPUMesh.start_coordinator(port=70000), ValueError,
     "port= must be a whole number from 1 to 65535, got 70000"),
    (lambda: GPUMesh.start_coordinator(port="8000"), TypeError, "port= must be a whole number"),
    (lambda: GPUMesh.add_worker("http://127.0.0.1:9", token="t" * 32, slots=0), ValueError,
     "slots= must be a whole number from 1 to 1024, got 0"),
    (lambda: GPUMesh.add_worker("http://127.0.0.1:9", token="t" * 32, slots=True), TypeError,
     "slots= must be a whole number"),
])
def test_a_wrong_argument_is_refused_before_anything_starts(tmp_path, monkeypatch, call, error, words):
    _in_this_process(tmp_path, monkeypatch)
    with pytest.raises(error, match=words):
        call()
    assert _logs(tmp_path) == [] and not processes._owned


def test_a_worker_for_a_coordinator_that_refuses_or_is_gone_is_a_start_failure(tmp_path, monkeypatch):
    """In the words of add_worker's parameters (token=), not join's flags, as StartFailed."""
    _in_this_process(tmp_path, monkeypatch)
    with GPUMesh.start_coordinator(port=free_port(), self_worker=False) as c:
        with pytest.raises(StartFailed) as e:
            GPUMesh.add_worker(c.url, token="x" * 32)
        assert str(e.value).startswith("no worker was started: ")
        assert "token=" in str(e.value) and "--token" not in str(e.value)
    with pytest.raises(StartFailed, match="no worker was started: cannot reach the coordinator"):
        GPUMesh.add_worker(f"http://127.0.0.1:{free_port()}", token="x" * 32)
    assert _logs(tmp_path) == []


def test_a_commands_usage_lines_and_flags_are_put_in_python_words():
    text = ("Usage: gpumesh join [OPTIONS] [URL]\nTry 'gpumesh join --help' for help.\n\n"
            "Error: --cpu-slots 0 leaves this worker no slot; check --token")
    assert processes.as_parameters(text, processes._JOIN_PARAMETERS) == (
        "\nError: slots= 0 leaves this worker no slot; check token=")
