"""Tokens on the command line: refused when short, never visible in ps, never printed twice."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import TOKEN, Proc, descendants, free_port
from tests.security.conftest import WORKER_TOKEN, proc_memory_texts

HINT = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'


def run_cli(args, env, timeout=30):
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ, HOME=str(tmp_path / "home"), GPUMESH_CONFIG=str(tmp_path / "config.json"))
    for k in ("GPUMESH_TOKEN", "GPUMESH_WORKER_TOKEN", "GPUMESH_URL", "GPUMESH_FINGERPRINT"):
        e.pop(k, None)
    return e


def serve_args(tmp_path, *extra):
    return ["serve", "--port", str(free_port()), "--data-dir", str(tmp_path / "data"),
            "--no-self-worker", *extra]


@pytest.mark.parametrize("flags, what", [
    (["--token", "short-token"], "the token is 11 characters; at least 16"),
    (["--token", "a" * 15], "the token is 15 characters; at least 16"),
    (["--token", TOKEN, "--worker-token", "tiny"], "the worker token is 4 characters; at least 16"),
    (["--token", TOKEN, "--worker-token", TOKEN], "the worker token must differ from the main token"),
])
def test_weak_tokens_are_refused_with_one_line_and_a_recipe(env, tmp_path, flags, what):
    r = run_cli(serve_args(tmp_path, *flags), env)
    assert r.returncode == 2  # a bad flag value: a usage error (docs/cli.md)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"Error: {what}")
    if "characters" in what:
        assert HINT in lines[0]
    for value in flags[1::2]:  # the refused token itself is never echoed
        assert value not in r.stdout + r.stderr


def test_short_token_from_the_environment_is_refused_too(env, tmp_path):
    r = run_cli(serve_args(tmp_path), dict(env, GPUMESH_TOKEN="hunter2"))
    assert r.returncode == 2 and "at least 16" in r.stderr and HINT in r.stderr
    assert "hunter2" not in r.stderr + r.stdout


def test_sixteen_characters_are_enough(env, tmp_path):
    port = free_port()
    p = Proc(["serve", "--port", str(port), "--data-dir", str(tmp_path / "d"), "--no-self-worker",
              "--token", "p" * 16], env, tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 30
        while "Ctrl+C" not in p.output() and time.monotonic() < deadline:
            assert p.p.poll() is None, p.output()
            time.sleep(0.05)
        assert "Ctrl+C" in p.output()
    finally:
        p.stop()


def _run_tasks_on_both_workers(url: str, serve_pid: int, join_pid: int) -> None:
    from gpumesh import GPUMesh, accelerate

    def nap(s):
        import time
        time.sleep(s)
        return s

    def has_zygote(agent_pid: int) -> bool:
        return any(b"gpumesh.worker.runner" in proc_memory_texts(p) for p in descendants(agent_pid))

    self_worker = [p for p in descendants(serve_pid) if b"join" in proc_memory_texts(p)]
    assert self_worker, "no self-worker process"
    mesh = GPUMesh(url, token=TOKEN)
    try:
        f = accelerate(mesh)(nap)
        deadline = time.monotonic() + 60
        while not (has_zygote(self_worker[0]) and has_zygote(join_pid)):
            assert time.monotonic() < deadline, "a worker never started its zygote"
            assert f.map([0.2] * 6) == [0.2] * 6
    finally:
        mesh.close()


def test_tokens_are_hidden_from_ps_in_serve_join_and_the_self_worker(env, tmp_path):
    """``--token=...`` on the command line and ``$GPUMESH_WORKER_TOKEN`` in the environment
    are overwritten in /proc/PID/cmdline and /proc/PID/environ of every gpumesh process."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    coord = Proc(["serve", "--port", str(port), "--data-dir", str(tmp_path / "d"),
                  f"--token={TOKEN}"], dict(env, GPUMESH_WORKER_TOKEN=WORKER_TOKEN),
                 tmp_path / "serve.log")
    worker = None
    try:
        deadline = time.monotonic() + 60
        while "joined mesh" not in coord.output() and time.monotonic() < deadline:
            assert coord.p.poll() is None, coord.output()
            time.sleep(0.1)
        assert "joined mesh" in coord.output(), coord.output()
        worker = Proc(["join", url, "--token", WORKER_TOKEN], env, tmp_path / "join.log")
        deadline = time.monotonic() + 60
        while "joined mesh" not in worker.output() and time.monotonic() < deadline:
            assert worker.p.poll() is None, worker.output()
            time.sleep(0.1)
        # Each worker starts its zygote (and function hosts) with its first function task:
        # run tasks until both have one, so those processes are checked too.
        _run_tasks_on_both_workers(url, coord.p.pid, worker.p.pid)
        pids = [coord.p.pid, worker.p.pid] + descendants(coord.p.pid) + descendants(worker.p.pid)
        assert len(pids) >= 5  # serve, self-worker, its zygote, join, its zygote (+ hosts)
        for pid in pids:
            seen = proc_memory_texts(pid)
            if not seen and not os.path.exists(f"/proc/{pid}"):
                continue  # a task process that has just exited
            assert seen, pid
            assert TOKEN.encode() not in seen, pid
            assert WORKER_TOKEN.encode() not in seen, pid
        cmdline = open(f"/proc/{coord.p.pid}/cmdline", "rb").read()
        assert b"--token=" + b"*" * len(TOKEN) in cmdline
        out = coord.output() + worker.output()
        assert TOKEN not in out and WORKER_TOKEN not in out
    finally:
        if worker is not None:
            worker.stop()
        coord.stop()
    out = coord.output() + worker.output()
    assert TOKEN not in out and WORKER_TOKEN not in out  # nor in what they logged on the way out


def test_generated_token_is_printed_once_and_only_by_serve(env, tmp_path):
    port = free_port()
    coord = Proc(["serve", "--port", str(port), "--data-dir", str(tmp_path / "d")], env,
                 tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 60
        while "joined mesh" not in coord.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        out = coord.output()
        tok = [ln.split("Token:", 1)[1].strip() for ln in out.splitlines() if "Token:" in ln]
        assert len(tok) == 1 and len(tok[0]) >= 43
        banner, after = out.split("Ctrl+C to stop", 1)
        assert tok[0] in banner and tok[0] not in after, out  # shown once, in the banner
        r = run_cli(["workers", "--url", f"http://127.0.0.1:{port}"], env)
        assert r.returncode == 0 and tok[0] not in r.stdout + r.stderr
        for pid in [coord.p.pid] + descendants(coord.p.pid):
            assert tok[0].encode() not in proc_memory_texts(pid), pid
    finally:
        coord.stop()
    assert tok[0] not in coord.output().split("Ctrl+C to stop", 1)[1]
