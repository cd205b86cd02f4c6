"""A task whose process dies without a result (os._exit, a signal) runs again, up to
GPUMESH_MAX_ATTEMPTS attempts in all, preferring another worker; an exception the
function raises is its answer and is never re-run (unless retry_on names it)."""

from __future__ import annotations

import pytest

import gpumesh
from gpumesh import accelerate

pytestmark = pytest.mark.skipif(__import__("sys").platform == "win32", reason="POSIX signals")


def test_a_crash_runs_again_on_another_worker_until_it_succeeds(fault_mesh, tmp_path):
    m = fault_mesh(workers=2)
    runs = tmp_path / "runs"
    mesh = m.client(output=False)

    @accelerate(mesh)
    def flaky(path):
        import os
        import signal
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        n = len(open(path).read().split())
        if n == 1:
            os._exit(3)
        if n == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    assert flaky(str(runs)) == 3
    job = mesh.jobs()[0]
    (task,) = mesh.status(job["id"])["tasks"]
    assert task["state"] == "done" and task["attempts"] == 3, task
    history = task["history"]
    assert [h["attempt"] for h in history] == [1, 2], history
    assert "exited with code 3" in history[0]["error"]["message"], history
    assert "SIGKILL" in history[1]["error"]["message"], history
    assert history[0]["ended"] == "crashed; run again (attempt 2 of at most 3)", history
    # each re-run went to the other worker of the two
    assert history[0]["worker"] != history[1]["worker"], history


def test_a_task_that_always_crashes_fails_after_three_attempts_naming_them(fault_mesh, tmp_path):
    mesh = fault_mesh(workers=1).client(output=False)
    runs = tmp_path / "runs"

    @accelerate(mesh)
    def die(path):
        import os
        os.write(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), b"x")
        os._exit(5)

    with pytest.raises(gpumesh.TaskCrashed) as info:
        die(str(runs))  # one worker: the re-runs go to it again
    assert runs.read_text() == "xxx"
    text = str(info.value)
    assert "exited with code 5" in text and "attempt 3 of 3" in text, text
    (task,) = mesh.status(mesh.jobs()[0]["id"])["tasks"]
    assert [h["attempt"] for h in task["history"]] == [1, 2], task
    assert all("exited with code 5" in h["error"]["message"] for h in task["history"]), task


def test_an_exception_is_not_retried_but_one_retry_on_names_is(fault_mesh, tmp_path):
    m = fault_mesh(workers=1)
    mesh = m.client(output=False)

    def count_and_raise(path):
        with open(path, "a") as fh:
            fh.write("x")
        raise OSError("flaky disk")

    once = tmp_path / "once"
    with pytest.raises(OSError, match="flaky disk"):
        accelerate(mesh)(count_and_raise)(str(once))
    assert once.read_text() == "x"
    again = tmp_path / "again"
    with pytest.raises(OSError, match="flaky disk"):
        accelerate(mesh, retries=1, retry_on=OSError)(count_and_raise)(str(again))
    assert again.read_text() == "xx"
