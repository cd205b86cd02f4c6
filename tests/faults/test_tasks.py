"""Tasks that crash, hang, flood or cannot be pickled: a specific error, a healthy worker."""

from __future__ import annotations

import time

import pytest

import gpumesh
from gpumesh import accelerate

from ..conftest import alive, wait_for


def _sys_exit():
    import sys
    sys.exit(3)


def _os_exit():
    import os
    import sys
    print("last words", file=sys.stderr, flush=True)
    os._exit(7)


def _segfault():
    import ctypes
    ctypes.string_at(0)


def _sigkill_self():
    import os
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


def _memory_error():
    return bytearray(2**62)


def _generator():
    return (i for i in range(3))


def _lock():
    import threading
    return threading.Lock()


def _unpicklable_exception():
    import threading

    class Holder(Exception):
        guard = threading.Lock()  # its class cannot be pickled: it cannot travel
    raise Holder("holds a lock")


def _flood():
    import sys
    line = "x" * 1023
    for _ in range(64 * 1024):
        print(line)
    for _ in range(16 * 1024):
        print(line, file=sys.stderr)
    sys.stdout.write("no trailing newline")
    return "flooded"


def _no_newline():
    import sys
    sys.stdout.write("partial line")
    return "ok"


CASES = [
    # (function, exception type, text the error must contain)
    (_sys_exit, gpumesh.RemoteError, "sys.exit(3)"),
    (_os_exit, gpumesh.TaskCrashed, "code 7"),
    (_segfault, gpumesh.TaskCrashed, "SIGSEGV"),
    (_sigkill_self, gpumesh.TaskCrashed, "SIGKILL"),
    (_memory_error, MemoryError, ""),
    (_generator, gpumesh.RemoteError, "generator"),
    (_lock, gpumesh.RemoteError, "lock"),
    (_unpicklable_exception, gpumesh.RemoteError, "holds a lock"),
]


@pytest.mark.parametrize("fn,exc,text", CASES, ids=[c[0].__name__ for c in CASES])
def test_task_fault_gives_a_specific_error_and_the_worker_keeps_serving(shared_mesh, fn, exc, text):
    client = shared_mesh.client(output=False)
    before = shared_mesh.alive()
    started = time.monotonic()
    with pytest.raises(exc) as info:
        accelerate(client)(fn)()
    assert time.monotonic() - started < 10
    assert text in str(info.value)
    assert shared_mesh.alive() == before
    assert accelerate(client)(lambda x: x + 1)(41) == 42


def test_crash_error_carries_the_stderr_tail(shared_mesh):
    with pytest.raises(gpumesh.TaskCrashed) as info:
        accelerate(shared_mesh.client(output=False))(_os_exit)()
    assert "last words" in str(info.value)


def test_user_errors_are_not_retried(shared_mesh, tmp_path):
    marker = tmp_path / "runs"

    def fails(path):
        with open(path, "a") as fh:
            fh.write("x")
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        accelerate(shared_mesh.client(output=False))(fails)(str(marker))
    assert marker.read_text() == "x"


def test_flood_of_output_and_missing_newline(shared_mesh, capfd):
    client = shared_mesh.client(output=True)
    assert accelerate(client)(_flood)() == "flooded"
    assert accelerate(client)(_no_newline)() == "ok"
    captured = capfd.readouterr()
    out, err = captured.out, captured.err
    assert "partial line" in out  # a last line without newline is still printed
    # 64 MiB of stdout is forwarded up to the cap, then said to be cut; a caller that prints
    # slower than the task writes is told how much it missed instead of stalling the task
    assert "output beyond 16 MiB not forwarded" in out or "were dropped" in err
    assert out.count("x" * 1023) >= 1024


def test_timeout_kills_the_whole_process_tree(shared_mesh, tmp_path):
    marker = tmp_path / "child"

    def hang(path):
        import subprocess
        import sys
        import time
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(100)"
        child = subprocess.Popen([sys.executable, "-c", code])
        with open(path, "w") as fh:
            fh.write(str(child.pid))
        time.sleep(100)

    f = accelerate(shared_mesh.client(output=False), timeout=3)(hang)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        f(str(marker))
    assert time.monotonic() - started < 5
    child = int(marker.read_text())
    wait_for(lambda: not alive(child), 2, "a child that ignores SIGTERM to end with the timeout")
