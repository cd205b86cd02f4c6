"""The spawn runtime (gpumesh.worker.spawn): the executor interface without fork.

Each test drives a real SpawnExecutor: real interpreters, real sockets on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from gpumesh import wire
from gpumesh.protocol import TaskGrant
from gpumesh.limits import HANDOFF_MIN_BYTES
from gpumesh.worker import procs
from gpumesh.worker.executor import Executor, make_executor
from gpumesh.worker.spawn import SpawnExecutor

from ..conftest import alive, function_blob, wait_for


@pytest.fixture
def ex(tmp_path):
    e = SpawnExecutor(spool=tmp_path / "spool")
    yield e
    e.close()




def _call(ex, tmp_path, fn, *args, task_id=None, **kw):
    h, path = function_blob(tmp_path, fn)
    body = b"".join(bytes(c) for c in wire.dumps((args, {})).chunks)
    ex.new_output()
    grant = {k: kw.pop(k) for k in ("result_format", "isolation", "job_id") if k in kw}
    return ex.run(TaskGrant(task_id or os.urandom(8).hex(), "-", h, timeout=kw.pop("timeout", 60),
                            **grant), path, body, **kw)


def _value(out):
    assert out.status == "ok", out.error
    return wire.loads(out.payload)


def _pid(_=None):
    import os
    return os.getpid()


def _state(x):
    import sys
    seen = getattr(sys, "_gpumesh_test_seen", [])
    seen.append(x)
    sys._gpumesh_test_seen = seen
    return list(seen)


def test_each_task_runs_in_a_fresh_process_that_is_gone_afterwards(ex, tmp_path):
    pids = [_value(_call(ex, tmp_path, _pid)) for _ in range(3)]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert _value(_call(ex, tmp_path, _state, 1)) == [1]
    assert _value(_call(ex, tmp_path, _state, 2)) == [2]  # no state carried over
    assert not any(alive(p) for p in pids)


def test_a_spare_loaded_with_the_function_is_ready_before_the_next_task(ex, tmp_path):
    _value(_call(ex, tmp_path, _pid))
    h, _ = function_blob(tmp_path, _pid)
    spares = ex._spares[h]
    assert len(spares) == 1
    spare = spares[0]
    assert spare.connected.wait(60)
    assert _value(_call(ex, tmp_path, _pid)) == spare.pid  # the next task took it


def _slow_import(x):
    import gpumesh_slow_mod  # noqa: F401 - takes SLOW_S to import (tests/unit/test_spawn_runtime)
    return x


def test_a_heavy_import_is_paid_while_the_previous_task_runs(ex, tmp_path, monkeypatch):
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "gpumesh_slow_mod.py").write_text("import time\ntime.sleep(1.0)\n")
    monkeypatch.setenv("PYTHONPATH", str(mod))
    t0 = time.monotonic()
    assert _value(_call(ex, tmp_path, _slow_import, 1)) == 1
    first = time.monotonic() - t0
    assert first >= 1.0
    h, _ = function_blob(tmp_path, _slow_import)
    assert "gpumesh_slow_mod" in ex._imports[h][0]  # learned from the first task
    time.sleep(2.5)  # the spare was told to import it: give it time to have done so
    t0 = time.monotonic()
    assert _value(_call(ex, tmp_path, _slow_import, 2)) == 2
    assert time.monotonic() - t0 < 1.0  # the import was paid ahead, not by this task


def _big(n):
    return b"\x05" * n


def _size(data):
    return len(data), data[:2], data[-1:]


def test_big_results_and_arguments_travel_as_spool_files(ex, tmp_path):
    out = _call(ex, tmp_path, _big, HANDOFF_MIN_BYTES + 3)
    assert out.status == "ok" and isinstance(out.payload, memoryview)
    assert wire.loads(out.payload) == b"\x05" * (HANDOFF_MIN_BYTES + 3)
    arg = os.urandom(HANDOFF_MIN_BYTES * 2)
    assert _value(_call(ex, tmp_path, _size, arg)) == (len(arg), arg[:2], arg[-1:])
    left = [p for p in os.listdir(ex.spool) if p.endswith(".part")]
    assert left == []


def _crash(code):
    import os
    os._exit(code)


def _sleep(s):
    import subprocess
    import sys
    import time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(s)


def _raise():
    raise KeyError("nope")


def test_crash_exit_code_timeout_and_raise(ex, tmp_path):
    out = _call(ex, tmp_path, _crash, 7)
    assert out.status == "error" and out.error["type"] == "TaskCrashed"
    assert out.error["code"] == 7 and "exited with code 7" in out.error["message"]
    out = _call(ex, tmp_path, _sleep, 60, timeout=1.5)
    assert out.error["kind"] == "timeout" and out.error["type"] == "TaskTimeout"
    grandchild = int(open(ex.output_paths()[0]).read().split()[0])
    assert _wait_gone(grandchild)  # the whole tree was killed
    out = _call(ex, tmp_path, _raise)
    assert out.status == "error" and out.error["kind"] == "raised"
    assert isinstance(wire.loads(out.payload), KeyError)


def _wait_gone(pid: int, within: float = 10) -> bool:
    return wait_for(lambda: not alive(pid), within, f"process {pid} to end")


def test_cancel_kills_the_task_tree(ex, tmp_path):
    got = {}
    t = threading.Thread(target=lambda: got.update(out=_call(ex, tmp_path, _sleep, 60,
                                                             task_id="t-cancel")))
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            text = open(ex.output_paths()[0].replace(str(threading.get_ident()),
                                                     str(t.ident))).read()
        except OSError:
            text = ""
        if text.strip():
            break
        time.sleep(0.05)
    grandchild = int(text.split()[0])
    assert ex.cancel("t-cancel") is True
    t.join(30)
    assert got["out"].error["kind"] == "cancelled"
    assert _wait_gone(grandchild)


def test_a_function_that_cannot_load_is_an_unpickle_error(ex, tmp_path):
    path = tmp_path / ("0" * 64)
    path.write_bytes(b"not a pickle")
    ex.new_output()
    out = ex.run(TaskGrant("t1", "-", "0" * 64, timeout=30), str(path), b"")
    assert out.status == "error" and out.error["kind"] == "unpickle"


def _job_task(mode):
    import os
    import time
    if mode == "crash":
        os._exit(3)
    if mode == "sleep":
        time.sleep(30)
    return os.getpid()


def test_job_isolation_keeps_one_process_per_slot_and_job(ex, tmp_path):
    def call(mode, job="jB", **kw):
        return _call(ex, tmp_path, _job_task, mode, isolation="job", job_id=job, slot=0, **kw)

    a = [_value(call("pid", "jA")) for _ in range(3)]
    assert len(set(a)) == 1
    b = _value(call("pid"))
    assert b not in a  # never reused across jobs
    assert _wait_gone(a[0])  # the slot moved on: job A's process is closed
    # a crash costs only its process: the slot gets a new one for the job's next task
    out = call("crash")
    assert out.error["type"] == "TaskCrashed" and out.error["code"] == 3
    c = _value(call("pid"))
    assert c != b
    assert _value(call("pid")) == c
    out = call("sleep", timeout=1)
    assert out.error["kind"] == "timeout"
    d = _value(call("pid"))
    assert d != c and _wait_gone(c)


def test_job_isolation_through_the_fork_executor(tmp_path):
    if procs.fork_missing():
        pytest.skip("no fork runtime here")
    ex = Executor(spool=tmp_path / "spool")
    try:
        pids = {_value(_call(ex, tmp_path, _pid, isolation="job", job_id="j1", slot=1))
                for _ in range(3)}
        assert len(pids) == 1
        assert _value(_call(ex, tmp_path, _state, 5, isolation="job", job_id="j1", slot=1)) == [5]
        assert _value(_call(ex, tmp_path, _state, 6, isolation="job", job_id="j1", slot=1)) == [5, 6]
        assert len({_value(_call(ex, tmp_path, _pid)) for _ in range(2)}) == 2
    finally:
        ex.close()
    assert not any(alive(p) for p in pids)


def test_choose_runtime(monkeypatch):
    monkeypatch.delenv("GPUMESH_RUNTIME", raising=False)
    if sys.platform.startswith("linux"):
        assert procs.choose_runtime() == ("fork", "default on Linux")
    assert procs.choose_runtime("spawn") == ("spawn", "--runtime=spawn")
    monkeypatch.setenv("GPUMESH_RUNTIME", "spawn")
    assert procs.choose_runtime() == ("spawn", "$GPUMESH_RUNTIME=spawn")
    assert procs.choose_runtime("fork")[0] == "fork"  # the flag wins
    assert isinstance(make_executor(None), SpawnExecutor)
    monkeypatch.setenv("GPUMESH_RUNTIME", "thread")
    with pytest.raises(ValueError, match="must be 'fork' or 'spawn'"):
        procs.choose_runtime()
    monkeypatch.setattr(os, "fork", None, raising=False)
    monkeypatch.delattr(os, "fork")
    with pytest.raises(ValueError, match="lacks os.fork"):
        procs.choose_runtime("fork")
    monkeypatch.delenv("GPUMESH_RUNTIME")
    name, why = procs.choose_runtime()
    assert name == "spawn" and "os.fork" in why


def test_task_processes_end_when_the_agent_is_killed(tmp_path):
    """An agent killed outright (SIGKILL) cannot close its executor: its spares and a
    running task (and what it started) end by themselves."""
    import signal
    import subprocess
    import textwrap
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(f"""
        import os, threading
        from pathlib import Path
        from gpumesh import wire
        from gpumesh.protocol import TaskGrant
        from gpumesh.worker.spawn import SpawnExecutor

        def hold():
            import subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            print(child.pid, flush=True)
            time.sleep(600)

        payload = wire.dumps(hold, code=True)
        blob = Path({str(tmp_path)!r}) / payload.sha256()
        blob.write_bytes(b"".join(bytes(c) for c in payload.chunks))
        args = b"".join(bytes(c) for c in wire.dumps(((), {{}})).chunks)
        ex = SpawnExecutor(spool=Path({str(tmp_path)!r}) / "spool")

        def run():
            ex.new_output()
            ex.run(TaskGrant("t", "-", payload.sha256()), str(blob), args)
        threading.Thread(target=run).start()
        threading.Event().wait()
    """))
    agent = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    try:
        out = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not out:
            outs = list((tmp_path / "spool").glob("*.out")) if (tmp_path / "spool").exists() else []
            out = outs and outs[0].read_text().strip()
            time.sleep(0.1)
        assert out, "the task did not start"
        import psutil
        tree = [p.pid for p in psutil.Process(agent.pid).children(recursive=True)]
        grandchild = int(out.split()[0])
        assert grandchild in tree and len(tree) >= 3  # task, its child, spares
    finally:
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
    assert all(_wait_gone(p) for p in tree)


def test_a_task_cancelled_before_its_process_connected_ends_at_once(ex, tmp_path):
    """A cancel that kills a process still starting must not leave the slot waiting for a
    connection that never comes."""
    h, path = function_blob(tmp_path, _pid)
    body = b"".join(bytes(c) for c in wire.dumps(((), {})).chunks)
    got = {}
    real = ex._spawn

    def slow_spawn(fn_hash=None):  # every process is stopped before it can connect
        child = real(fn_hash)
        os.kill(child.pid, signal.SIGSTOP)
        return child
    ex._spawn = slow_spawn
    t = threading.Thread(target=lambda: got.update(out=ex.run(TaskGrant("t-early", "-", h, timeout=60), path, body)))
    t.start()
    deadline = time.monotonic() + 10
    while "t-early" not in ex.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert ex.cancel("t-early")
    t.join(30)
    assert not t.is_alive() and time.monotonic() - t0 < 20
    assert got["out"].error["kind"] == "cancelled"


def test_a_crash_is_worded_alike_on_both_runtimes():
    from gpumesh.worker import procs
    assert procs.crash_message(-11) == "the task process was killed by SIGSEGV"
    assert procs.crash_message(-9) == "the task process was killed by SIGKILL"
    assert procs.crash_message(3) == "the task process exited with code 3 before returning a result"
