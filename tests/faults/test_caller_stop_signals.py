"""SIGTERM or SIGHUP to a caller that waits on the mesh cancels its job, as Ctrl+C does,
and the caller still ends by that signal; a program's own handler is left in charge."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ..conftest import alive, default_signals, wait_for

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

#: How long the task would sleep before writing its "finished" mark: far longer than the
#: test waits, so only a task left running could write it.
TASK_S = 6.0


def _pids(path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return []


def _caller(m, tmp_path, preamble: str = "", body: str = "work(1)") -> tuple[subprocess.Popen, object, object]:
    started, finished = tmp_path / "started", tmp_path / "finished"
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys
        from gpumesh import GPUMesh, accelerate
        {preamble}
        m = GPUMesh({m.url!r}, token={m.token!r}, output=False)

        @accelerate(m)
        def work(i):
            import os, time
            with open({str(started)!r}, "a") as fh:
                fh.write(f"{{os.getpid()}}\\n")
            time.sleep({TASK_S})
            with open({str(finished)!r}, "a") as fh:
                fh.write("done\\n")
            return i

        {body}
        print("returned", flush=True)
    """))
    caller = subprocess.Popen([sys.executable, str(script)], env=dict(m.env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              preexec_fn=default_signals)
    return caller, started, finished


def _terminated(m, tmp_path, preamble: str = "", body: str = "work(1)", tasks: int = 1,
                sig: int = signal.SIGTERM) -> tuple[subprocess.Popen, bytes, bytes, object, object]:
    """Start the caller, send it ``sig`` once its ``tasks`` run; ``(caller, stdout, stderr,
    started, finished)`` once it ended."""
    caller, started, finished = _caller(m, tmp_path, preamble, body)
    try:
        wait_for(lambda: len(_pids(started)) == tasks, 30, "the tasks to start")
        assert [j["state"] for j in m.client(output=False).jobs()] == ["active"] * tasks
        caller.send_signal(sig)
        out, err = caller.communicate(timeout=15)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
    return caller, out, err, started, finished


def _assert_cancelled_not_finished(m, started, finished, tasks: int = 1) -> None:
    pids = _pids(started)

    def states():
        return [j["state"] for j in m.client(output=False).jobs()]
    wait_for(lambda: states() == ["cancelled"] * tasks, 5, states)
    wait_for(lambda: not any(alive(p) for p in pids), 5, "the cancelled tasks' processes to end")
    time.sleep(TASK_S + 1)  # past the moment a task left running would have finished
    assert not finished.exists(), "a task ran to completion after its caller got SIGTERM"
    assert len(_pids(started)) == tasks  # and none was run again


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_cancels_the_callers_job_and_ends_it_by_the_signal(fault_mesh, tmp_path, sig):
    # SIGHUP: the terminal the caller ran in was closed
    m = fault_mesh(workers=1)
    caller, out, err, started, finished = _terminated(m, tmp_path, sig=sig)
    assert caller.returncode == -sig, (caller.returncode, err.decode())
    assert b"returned" not in out
    assert b"Traceback" not in err  # ended by the signal, not by an exception
    (job,) = m.client(output=False).jobs()
    # one line says so, as Ctrl+C's does
    assert (f"[gpumesh] {signal.Signals(sig).name}: job {job['id']} cancelled on the mesh; "
            f"its 1 unfinished task(s) stop there\n") in err.decode(), err.decode()
    _assert_cancelled_not_finished(m, started, finished)


def test_sigterm_also_cancels_a_job_waited_on_in_another_thread(fault_mesh, tmp_path):
    # Python runs the handler in the main thread: while it waits on the mesh too, the
    # handler cancels every job this process waits on, whichever thread waits.
    body = ("import threading\n"
            "        threading.Thread(target=work, args=(2,), daemon=True).start()\n"
            "        work(1)")
    m = fault_mesh(workers=1, slots=2)
    caller, out, err, started, finished = _terminated(m, tmp_path, body=body, tasks=2)
    assert caller.returncode == -signal.SIGTERM, (caller.returncode, err.decode())
    _assert_cancelled_not_finished(m, started, finished, tasks=2)


def test_sigterm_leaves_a_programs_own_handler_in_charge(fault_mesh, tmp_path):
    # The program's handler exits with its own status; that exit unwinds the call,
    # which cancels the job as Ctrl+C does.
    preamble = ("def on_term(signum, frame):\n"
                "            print('own handler', flush=True)\n"
                "            sys.exit(7)\n"
                "        signal.signal(signal.SIGTERM, on_term)")
    m = fault_mesh(workers=1)
    caller, out, err, started, finished = _terminated(m, tmp_path, preamble)
    assert caller.returncode == 7, (caller.returncode, err.decode())
    assert b"own handler" in out and b"returned" not in out
    _assert_cancelled_not_finished(m, started, finished)


def test_the_default_disposition_is_back_after_a_call(tmp_path):
    """The handler stands in only while a job is outstanding (here: none ever is, the
    call runs locally), and a program's own choice is never replaced."""
    script = tmp_path / "local.py"
    script.write_text(textwrap.dedent("""
        import signal
        from gpumesh import GPUMesh, accelerate
        from gpumesh.client import stopsignals as ss
        m = GPUMesh("http://127.0.0.1:9", token="t", output=False)
        seen = []

        @accelerate(m)
        def f(x):
            return x

        class FakeMesh:
            url, token, fingerprint = "http://127.0.0.1:9", "t", None
        with ss.outstanding(FakeMesh(), "j1"):
            seen.append(signal.getsignal(signal.SIGTERM) is ss._on_stop)
            seen.append(signal.getsignal(signal.SIGHUP) is ss._on_stop)
        seen.append(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
        seen.append(signal.getsignal(signal.SIGHUP) is signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
        with ss.outstanding(FakeMesh(), "j2"):
            seen.append(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)
            seen.append(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)
        seen.append(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)
        print(seen, f(3))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, "GPUMESH_LOCAL": "1"},
                         preexec_fn=default_signals)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[True,"] + ["True,"] * 5 + ["True]", "3"]


def _on_a_pty(argv: list[str], env: dict, until: bytes, sig: int, timeout: float = 60,
              ready=lambda: True) -> tuple[int, bytes]:
    """Run ``argv`` with a pseudo-terminal as its stdin, stdout and stderr (as a user's
    shell would), send it ``sig`` once its output holds ``until`` and ``ready()``;
    ``(exit status, everything it wrote)``."""
    import pty
    import select
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, env=env, stdin=slave, stdout=slave, stderr=slave,
                            preexec_fn=default_signals, close_fds=True)
    os.close(slave)
    out, sent = b"", False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sent and until in out and ready():
                proc.send_signal(sig)
                sent = True
            readable, _, _ = select.select([master], [], [], 0.2)
            if readable:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the pty
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None and sent:
                break
        assert sent, f"never saw {until!r}: {out.decode(errors='replace')}"
        return proc.wait(timeout=15), out
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


HIDE, SHOW = b"\x1b[?25l", b"\x1b[?25h"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_gives_the_terminal_its_cursor_back(fault_mesh, tmp_path, sig):
    # The .map progress bar hides the cursor while it draws; a caller ended by SIGTERM
    # or SIGHUP shows it again, as Ctrl+C's unwinding does, before it ends by the signal.
    # The tasks: the first 3 end at once, the rest wait: the notice counts only those.
    m = fault_mesh(workers=1, slots=4)
    script = tmp_path / "bar.py"
    script.write_text(textwrap.dedent(f"""
        from gpumesh import GPUMesh, accelerate
        m = GPUMesh({m.url!r}, token={m.token!r}, output=False)

        @accelerate(m)
        def work(i):
            import time
            if i >= 3:
                time.sleep(60)
            return i

        work.map(range(2000))
    """))
    def three_done():
        jobs = m.client(output=False).jobs()
        return bool(jobs) and jobs[0]["counts"].get("done") == 3
    status, out = _on_a_pty([sys.executable, str(script)], dict(m.env), HIDE, sig, ready=three_done)
    text = out.decode(errors="replace")
    assert status == -sig, text
    assert out.rfind(SHOW) > out.rfind(HIDE), text  # the cursor is shown after its last hiding
    (job,) = m.client(output=False).jobs()
    line = (f"[gpumesh] {signal.Signals(sig).name}: job {job['id']} cancelled on the mesh; its "
            f"1997 unfinished task(s) stop there (3 of 2000 had already ended)")
    assert line in text, text
    assert text.rfind(line) > out.decode(errors="replace").rfind(SHOW.decode())  # below the bar
    assert job["counts"] == {"done": 3, "cancelled": 1997}, job


def test_a_stop_signal_to_submit_wait_gives_the_cursor_back(fault_mesh, tmp_path):
    # gpumesh submit --wait waits on no job of its own process (the script job runs on,
    # detached), but its bar hides the cursor all the same
    m = fault_mesh(workers=1)
    script = tmp_path / "task.py"
    script.write_text("import time\ntime.sleep(60)\n")
    payloads = tmp_path / "payloads.json"
    payloads.write_text("[1, 2, 3]")
    status, out = _on_a_pty([sys.executable, "-m", "gpumesh", "submit", str(script), "--payloads",
                             str(payloads), "--wait"], dict(m.env), HIDE, signal.SIGTERM)
    assert status == -signal.SIGTERM, out.decode(errors="replace")
    assert out.rfind(SHOW) > out.rfind(HIDE), out.decode(errors="replace")
