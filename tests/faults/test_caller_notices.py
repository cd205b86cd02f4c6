"""What a waiting caller says on stderr: the "connected" line as soon as the mesh accepts
its first job (not with its first result), and both ends of a coordinator outage."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from ..conftest import wait_for


def test_caller_says_connected_at_once_and_reports_a_lost_and_returning_coordinator(
        fault_mesh, tmp_path):
    m = fault_mesh(workers=1)
    started, go, err = tmp_path / "started", tmp_path / "go", tmp_path / "caller.err"
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        from gpumesh import GPUMesh, accelerate
        m = GPUMesh({m.url!r}, token={m.token!r}, output=False)

        @accelerate(m)
        def work(i):
            import os, time
            open({str(started)!r}, "w").close()
            for _ in range(600):  # until the test says go (60 s at most)
                if os.path.exists({str(go)!r}):
                    break
                time.sleep(0.1)
            return i * 2

        print("result", work(21), flush=True)
    """))
    with open(err, "wb") as fh:
        caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                  stderr=fh, env=dict(m.env, GPUMESH_RECONNECT_TIMEOUT="120"))
    try:
        wait_for(started.exists, 30, "the task to start")
        # The submit no longer sits on the first result (up to LONG_POLL_S, 20 s) first.
        wait_for(lambda: f"[gpumesh] connected to coordinator at {m.url}\n" in err.read_text(),
                 5, err.read_text)
        assert "result" not in err.read_text()

        m.coordinator.stop(signal.SIGKILL)
        lost = (f"[gpumesh] lost the coordinator at {m.url} while waiting for job ")
        wait_for(lambda: lost in err.read_text(), 10, err.read_text)
        assert "retrying for up to 120s (GPUMESH_RECONNECT_TIMEOUT)" in err.read_text()
        assert "answers again" not in err.read_text()

        m.restart()
        go.touch()
        out, _ = caller.communicate(timeout=60)
    except BaseException:
        caller.kill()  # (by its pid: it is our child)
        caller.wait()
        raise
    text = err.read_text()
    assert out.decode().split() == ["result", "42"], text
    assert caller.returncode == 0, text
    lines = [ln for ln in text.splitlines() if ln.startswith("[gpumesh]")]
    # once each, in this order (the job id is the same in both lines)
    assert [ln.split(" at ")[0] for ln in lines] == [
        "[gpumesh] connected to coordinator", "[gpumesh] lost the coordinator",
        "[gpumesh] the coordinator"], text
    job = lines[1].split("waiting for job ")[1].split(";")[0]
    assert lines[2] == f"[gpumesh] the coordinator at {m.url} answers again; job {job} goes on"
