"""A function job outlives its caller by at most GPUMESH_CALLER_TIMEOUT (coordinator/
callers.py): a caller killed with SIGKILL, or one that gave up on a coordinator that
was down, leaves no job running behind its back; a live caller that is slow to read an
.imap keeps its job through its keepalive (client/keepalive.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from gpumesh import accelerate

from ..conftest import Mesh, wait_for

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL of the caller")

#: The coordinator's caller timeout in these tests (s).
CALLER_TIMEOUT = 3


def _mesh(tmp_path, slots: int = 2) -> Mesh:
    m = Mesh(tmp_path / "mesh")
    m.env["GPUMESH_CALLER_TIMEOUT"] = str(CALLER_TIMEOUT)
    m.start()
    m.add_worker(slots=slots)
    return m


def _marks(path) -> int:
    try:
        return len(path.read_text().split())
    except OSError:
        return 0


def _caller(m: Mesh, tmp_path, n: int, extra_env: dict | None = None) -> tuple[subprocess.Popen, object]:
    """A caller process mapping ``n`` one-second tasks that each append a mark first."""
    marks = tmp_path / "marks"
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        from gpumesh import GPUMesh, accelerate
        m = GPUMesh({m.url!r}, token={m.token!r}, output=False)

        @accelerate(m)
        def work(i):
            import time
            with open({str(marks)!r}, "a") as fh:
                fh.write(f"{{i}}\\n")
            time.sleep(1.0)
            return i

        print(work.map(range({n})), flush=True)
    """))
    env = dict(m.env, **(extra_env or {}))
    caller = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    return caller, marks


def _job(m: Mesh) -> dict:
    (job,) = [j for j in m.client().jobs() if j["name"] == "work"]
    return job


def test_a_killed_callers_job_is_cancelled_and_released(tmp_path):
    m = _mesh(tmp_path)
    try:
        caller, marks = _caller(m, tmp_path, 40)
        try:
            wait_for(lambda: _marks(marks) >= 2, timeout=60)
        finally:
            caller.kill()  # SIGKILL: no cancel, no release from the caller
            caller.communicate(timeout=10)
        killed = time.monotonic()
        jid, watcher = _job(m)["id"], m.client()
        # Someone watching the job (gpumesh status reads its results) is not its caller.
        wait_for(lambda: watcher.status(jid)["state"] == "cancelled", timeout=CALLER_TIMEOUT + 15)
        took = time.monotonic() - killed
        assert took < CALLER_TIMEOUT + 10, took  # (the sweeper looks every second)
        job = _job(m)
        assert job["released"] is True
        ran = _marks(marks)
        time.sleep(2)
        assert _marks(marks) == ran < 40  # nothing of it runs any more
        tasks = m.client().status(job["id"])["tasks"]
        cancelled = [t for t in tasks if t["state"] == "cancelled"]
        assert cancelled and all("its caller was not heard from" in t["error"]["message"]
                                 for t in cancelled)
    finally:
        m.stop()


def test_a_killed_caller_on_the_coordinators_machine_is_given_up_before_the_timeout(tmp_path):
    # A notebook kernel restarted with SIGKILL on the coordinator's machine: its process is
    # gone, so its job ends after LOCAL_GONE_S unheard, not after GPUMESH_CALLER_TIMEOUT.
    from gpumesh.coordinator.callers import LOCAL_GONE_S
    m = Mesh(tmp_path / "mesh")
    m.env["GPUMESH_CALLER_TIMEOUT"] = "600"
    m.start()
    m.add_worker(slots=2)
    try:
        caller, marks = _caller(m, tmp_path, 400)  # (200 s of work on 2 slots: still running)
        try:
            wait_for(lambda: _marks(marks) >= 2, timeout=60)
        finally:
            caller.kill()
            caller.communicate(timeout=10)
        killed = time.monotonic()
        jid, watcher = _job(m)["id"], m.client()
        wait_for(lambda: watcher.status(jid)["state"] == "cancelled", timeout=LOCAL_GONE_S + 30)
        assert time.monotonic() - killed < LOCAL_GONE_S + 25  # far below the 600 s timeout
        tasks = m.client().status(jid)["tasks"]
        cancelled = [t for t in tasks if t["state"] == "cancelled"]
        assert cancelled and all(f"(pid {caller.pid} on this machine) has exited"
                                 in t["error"]["message"] for t in cancelled)
    finally:
        m.stop()


def test_a_caller_that_gave_up_during_an_outage_leaves_nothing_to_run(tmp_path):
    m = _mesh(tmp_path, slots=1)
    try:
        # The caller gives up 1 s after losing the coordinator (MeshUnavailable) and exits.
        caller, marks = _caller(m, tmp_path, 12, {"GPUMESH_RECONNECT_TIMEOUT": "1"})
        try:
            wait_for(lambda: _marks(marks) >= 1, timeout=60)
            m.kill_coordinator()
            _, err = caller.communicate(timeout=30)
        finally:
            if caller.poll() is None:
                caller.kill()
        assert caller.returncode != 0 and b"MeshUnavailable" in err, err.decode()[-2000:]
        m.restart()
        started = _marks(marks)  # (the task running at the kill may still finish)
        jid, watcher = _job(m)["id"], m.client()
        assert watcher.status(jid)["waiting"].startswith("waiting for its caller")
        wait_for(lambda: watcher.status(jid)["state"] == "cancelled", timeout=CALLER_TIMEOUT + 15)
        time.sleep(1.5)
        assert _marks(marks) <= started + 1 < 12  # no task started after the restart...
        assert _job(m)["released"] is True
        assert "wait for their callers" in m.coordinator.output()  # ...and it said why
    finally:
        m.stop()


def test_a_slow_imap_reader_keeps_its_job(tmp_path):
    m = _mesh(tmp_path, slots=1)
    try:
        client = m.client(output=False)

        @accelerate(client)
        def step(i):
            import time
            time.sleep(0.4)
            return i * i

        it = step.imap(range(8))
        first = next(it)
        time.sleep(CALLER_TIMEOUT + 1.5)  # no poll meanwhile: only the keepalive speaks
        assert sorted([first, *it]) == [(i, i * i) for i in range(8)]  # (index, value) each
    finally:
        m.stop()
