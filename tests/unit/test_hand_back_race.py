"""A kill that comes after a task has answered does not throw its answer away.

``gpumesh pause --now`` (and a GPU its owner wants back) kills the running tasks and hands
them back to be run again; a task whose answer was already on its way has finished, so
its result stands, or it would run to completion twice (a fresh user caught 1 hand-back
in 7 doing so, with 5 ms tasks). Real executors of both runtimes, and a real script; the
kill is made to land between the task's answer and the agent's reading of it."""

from __future__ import annotations

import os
import sys

import pytest

from gpumesh import wire
from gpumesh.protocol import TaskGrant
from gpumesh.worker import framing
from gpumesh.worker.executor import Executor
from gpumesh.worker.spawn import SpawnExecutor

from ..conftest import function_blob

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="both runtimes run here on Linux")


def _mark_and_return(path):
    with open(path, "a") as fh:
        fh.write("ran\n")
    return "value"


def _kill_once_answered(monkeypatch, ex, name):
    """Patch ``framing.name`` (the agent's reads from a task process) to kill the running
    task, as the owner's hand-back does, once its answer's head has been read."""
    real = getattr(framing, name)
    killed = []

    def read_then_kill(*a, **kw):
        out = real(*a, **kw)
        head = bytes(out[0] if isinstance(out, tuple) else out)
        if not killed and b'"status"' in head:  # (not a spawned process's load reply)
            killed.extend(ex.running())
            for task_id in killed:
                ex.cancel(task_id)  # what Lending._owner_tick does for a hand-back
        return out
    monkeypatch.setattr(framing, name, read_then_kill)
    return killed


@pytest.mark.parametrize("runtime, read", [(Executor, "recv_blob_fds"), (SpawnExecutor, "recv_blob")])
def test_an_answer_read_as_the_kill_lands_stands(tmp_path, monkeypatch, runtime, read):
    ex = runtime(spool=tmp_path / "spool")
    try:
        h, path = function_blob(tmp_path, _mark_and_return)
        marks = tmp_path / "marks"
        body = b"".join(bytes(c) for c in wire.dumps(((str(marks),), {})).chunks)
        killed = _kill_once_answered(monkeypatch, ex, read)
        ex.new_output()
        out = ex.run(TaskGrant(os.urandom(8).hex(), "-", h, timeout=60), path, body)
        assert killed, "the kill landed while the task was running"
        assert out.status == "ok", out.error
        assert wire.loads(out.payload) == "value"
        assert marks.read_text() == "ran\n"
    finally:
        ex.close()


def test_a_script_that_ended_on_its_own_before_the_kill_stands(tmp_path, monkeypatch):
    from gpumesh.worker import scripts
    ex = Executor(spool=tmp_path / "spool")
    script = tmp_path / "s.py"
    script.write_text("import json, sys\nprint(json.dumps({'got': json.load(sys.stdin)}))\n")
    real_wait = scripts.subprocess.Popen.wait

    def wait_then_kill(proc, timeout=None):
        code = real_wait(proc, timeout)  # ended on its own...
        for task_id in ex.running():
            ex.cancel(task_id)  # ...and the hand-back's kill comes just after
        return code
    monkeypatch.setattr(scripts.subprocess.Popen, "wait", wait_then_kill)
    try:
        out = ex.run_script("t" * 12, str(script), b"[1, 2]", timeout=60)
        assert out.status == "ok", out.error
        assert bytes(out.payload) == b'{"got": [1, 2]}'
    finally:
        ex.close()
