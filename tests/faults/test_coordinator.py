"""Coordinator restarts, cancellation and retention."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import gpumesh
from gpumesh import accelerate, handoff

from ..conftest import alive, default_signals, files_under, wait_for


def _pids(path):
    try:
        return [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return []


def test_coordinator_sigkill_and_restart_during_map(fault_mesh):
    m = fault_mesh(workers=2)

    @accelerate(m.client(output=False))
    def step(i):
        import time
        time.sleep(0.15)
        return i * i

    box: dict = {}

    def run():
        try:
            box["v"] = step.map(range(40))
        except BaseException as e:  # noqa: BLE001
            box["e"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    time.sleep(1.0)
    m.coordinator.stop(signal.SIGKILL)
    time.sleep(1.0)
    m.start()  # same port, same data directory
    th.join(60)
    assert box.get("v") == [i * i for i in range(40)], box.get("e")
    # the workers came back by themselves
    wait_for(lambda: m.alive() == 2, 10, "both workers to be alive")


def test_keyboard_interrupt_in_the_caller_kills_remote_tasks(fault_mesh, tmp_path):
    m = fault_mesh(workers=2)
    marker = tmp_path / "pids"
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        from gpumesh import GPUMesh, accelerate
        m = GPUMesh({m.url!r}, token={m.token!r}, output=False)

        @accelerate(m)
        def hang(i):
            import os, time
            with open({str(marker)!r}, "a") as fh:
                fh.write(f"{{os.getpid()}}\\n")
            time.sleep(100)

        hang.map(range(4))
    """))
    env = dict(m.env)
    caller = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE,
                              preexec_fn=default_signals)
    wait_for(lambda: len(_pids(marker)) == 2, 20, "both tasks to start")
    caller.send_signal(signal.SIGINT)
    caller.wait(10)
    # one line says what became of the job (the traceback says only where the caller was)
    said = [line for line in caller.stderr.read().decode().splitlines() if "interrupted" in line]
    assert len(said) == 1 and said[0].startswith("[gpumesh] interrupted: job "), said
    assert said[0].endswith("cancelled on the mesh; its 4 unfinished task(s) stop there"), said
    pids = _pids(marker)
    wait_for(lambda: not any(alive(p) for p in pids), 2.0, "the remote tasks to end after Ctrl+C")
    # nothing else of that job runs afterwards
    time.sleep(0.5)
    assert len(_pids(marker)) == 2


def test_keyboard_interrupt_during_a_waiting_submit_still_says_the_job_was_cancelled(
        fault_mesh, tmp_path):
    # After the mesh's first call, a call's submit also waits for its first result (one
    # round trip): a Ctrl+C then lands inside the submit, and must say what became of the
    # job all the same (a fresh user's notebook said nothing).
    m = fault_mesh(workers=1)
    marker = tmp_path / "pids"
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        from gpumesh import GPUMesh, accelerate
        m = GPUMesh({m.url!r}, token={m.token!r}, output=False)

        @accelerate(m)
        def hang(i):
            import os, time
            if i:
                with open({str(marker)!r}, "a") as fh:
                    fh.write(f"{{os.getpid()}}\\n")
                time.sleep(100)
            return i

        hang(0)  # the mesh's first call: announced from here on
        hang(1)
    """))
    caller = subprocess.Popen([sys.executable, str(script)], env=dict(m.env), stderr=subprocess.PIPE,
                              preexec_fn=default_signals)
    try:
        wait_for(lambda: len(_pids(marker)) == 1, 20, "the hanging call to start")
        caller.send_signal(signal.SIGINT)
        caller.wait(10)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
    said = [line for line in caller.stderr.read().decode().splitlines() if "interrupted" in line]
    assert len(said) == 1 and said[0].startswith("[gpumesh] interrupted: job "), said
    assert said[0].endswith("cancelled on the mesh; its 1 unfinished task(s) stop there"), said
    wait_for(lambda: not any(alive(p) for p in _pids(marker)), 5.0, "the task to end after Ctrl+C")


def test_keyboard_interrupt_counts_only_the_tasks_it_stopped(fault_mesh, tmp_path):
    # 3 of the 6 tasks end at once: the notice says 3 stop, not "its 6 task(s)"
    m = fault_mesh(workers=1, slots=3)
    marker = tmp_path / "pids"
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        from gpumesh import GPUMesh, accelerate
        m = GPUMesh({m.url!r}, token={m.token!r}, output=False)

        @accelerate(m)
        def some_hang(i):
            import os, time
            if i % 2:
                with open({str(marker)!r}, "a") as fh:
                    fh.write(f"{{os.getpid()}}\\n")
                time.sleep(100)
            return i

        some_hang.map(range(6))
    """))
    caller = subprocess.Popen([sys.executable, str(script)], env=dict(m.env), stderr=subprocess.PIPE,
                              preexec_fn=default_signals)
    try:
        wait_for(lambda: len(_pids(marker)) == 3, 20, "the three hanging tasks to start")
        (job,) = m.client(output=False).jobs()
        assert job["counts"] == {"done": 3, "leased": 3}, job
        caller.send_signal(signal.SIGINT)
        caller.wait(10)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
    said = [line for line in caller.stderr.read().decode().splitlines() if "interrupted" in line]
    assert said == [f"[gpumesh] interrupted: job {job['id']} cancelled on the mesh; its 3 "
                    f"unfinished task(s) stop there (3 of 6 had already ended)"], said
    (job,) = m.client(output=False).jobs()
    assert job["counts"] == {"done": 3, "cancelled": 3}, job


def test_cancel_a_job_from_python_and_the_cli(fault_mesh, tmp_path):
    m = fault_mesh(workers=1)
    client = m.client(output=False)
    marker = tmp_path / "pids"

    @accelerate(client)
    def hang(path):
        import time
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(100)

    box: dict = {}

    def run():
        try:
            box["v"] = hang(str(marker))
        except BaseException as e:  # noqa: BLE001
            box["e"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    wait_for(lambda: _pids(marker), 20, "the task to start")
    job = next(j for j in client.jobs() if j["state"] == "active")
    out = subprocess.run([sys.executable, "-m", "gpumesh", "cancel", job["id"]], env=m.env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "cancelled 1 task" in out.stdout
    wait_for(lambda: not alive(_pids(marker)[0]), 2.0, "the cancelled task's process to end")
    th.join(10)
    assert isinstance(box.get("e"), gpumesh.Cancelled), box
    assert client.status(job["id"])["state"] == "cancelled"


def test_finished_jobs_are_deleted_after_retention(fault_mesh):
    m = fault_mesh(workers=1, GPUMESH_RETENTION_HOURS=str(1 / 3600), GPUMESH_PURGE_INTERVAL="0.5")
    client = m.client(output=False)
    big = b"x" * (2 * 2**20)  # over the inline limit: stored as files
    assert accelerate(client)(lambda b: len(b))(big) == len(big)
    blobs = m.root / "data" / "blobs"

    def files():  # (a released payload's file may wait in the handoff pool: no job's data)
        return [p for p in files_under(blobs) if p.name != handoff.PROBE
                and not handoff.FREE.fullmatch(p.name) and not handoff.HELD.fullmatch(p.name)]
    wait_for(lambda: client.jobs() == [] and files() == [], 10, lambda: (client.jobs(), files()))


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux")
def test_results_are_fenced_by_lease(fault_mesh):
    """A result under a lease that is no longer current is refused and changes nothing."""
    import httpx

    from gpumesh import wire
    m = fault_mesh(workers=0)
    h = {"authorization": f"Bearer {m.token}"}
    wid = httpx.post(f"{m.url}/v1/workers", json={"hostname": "fake"}, headers=h).json()["id"]
    client = m.client(output=False)
    fn = wire.dumps(lambda: 1)
    job_meta = {"job_id": "abcdef012345", "fn": fn.sha256(), "fn_inline": True, "n_tasks": 1}
    import json
    chunks, _ = wire.pack_frames([json.dumps(job_meta).encode(), fn, wire.dumps(((), {}))])
    assert httpx.post(f"{m.url}/v1/jobs", content=b"".join(chunks), headers=h).status_code == 200

    def lease():
        body = httpx.post(f"{m.url}/v1/workers/{wid}/lease", json={"slots": 1, "wait": 1},
                          headers=h).content
        return json.loads(bytes(wire.unpack_frames(body)[0]))["tasks"]

    first = lease()[0]
    httpx.delete(f"{m.url}/v1/workers/{wid}", headers=h)  # lost: the task is re-queued
    wid = httpx.post(f"{m.url}/v1/workers", json={"hostname": "fake2"}, headers=h).json()["id"]
    second = lease()[0]
    assert second["task_id"] == first["task_id"] and second["lease_id"] != first["lease_id"]

    def post(lease_id, value):
        chunks, _ = wire.pack_frames([b'{"status": "ok"}', wire.dumps(value)])
        return httpx.post(f"{m.url}/v1/tasks/{first['task_id']}/result",
                          params={"lease": lease_id}, content=b"".join(chunks), headers=h)

    assert post(first["lease_id"], "stale").status_code == 409
    assert post(second["lease_id"], "fresh").status_code == 200
    assert post(second["lease_id"], "again").status_code == 409
    body = httpx.get(f"{m.url}/v1/jobs/abcdef012345/results", headers=h).content
    frames = wire.unpack_frames(body)
    assert wire.loads(frames[1]) == "fresh"
    del client


def test_restart_without_token_keeps_the_saved_one_and_its_workers(fault_mesh):
    """serve restarted with no --token/$GPUMESH_TOKEN reuses the token the config holds
    for this coordinator: its joined worker reconnects and runs a call (a new token
    would answer it 401 and it would exit)."""
    import json
    m = fault_mesh(workers=1)
    worker = m.procs[-1]
    m.env = {k: v for k, v in m.env.items() if k != "GPUMESH_TOKEN"}
    m.restart()
    wait_for(lambda: worker.p.poll() is None and m.alive() == 1, 30, "the worker to reconnect")

    @accelerate(m.client(output=False))
    def double(x):
        return 2 * x

    assert double(21) == 42
    assert worker.p.poll() is None, worker.output()
    assert json.loads((m.root / "config.json").read_text())["token"] == m.token
    restarted = m.coordinator.output().split("Ctrl+C to stop", 1)[1]  # the second run's lines
    assert f"reusing the token saved for {m.url}" in restarted
    assert m.token not in restarted and "--token=<your token>" in restarted
