"""What a task process starts and leaves running dies with it, on both runtimes: when a
default task's process ends after its result, and when a kept ``isolation="job"``
process is closed (its slot moves to another job). A timeout or cancel already killed
the whole group; a task that finished left its children running."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from gpumesh import wire
from gpumesh.protocol import TaskGrant
from gpumesh.worker import procs
from gpumesh.worker.executor import Executor
from gpumesh.worker.spawn import SpawnExecutor

from ..conftest import alive, function_blob, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="processes read through /proc")

RUNTIMES = [pytest.param(Executor, id="fork", marks=pytest.mark.skipif(
    bool(procs.fork_missing()), reason="no fork runtime here")), pytest.param(SpawnExecutor, id="spawn")]


@pytest.fixture(params=RUNTIMES)
def ex(request, tmp_path):
    e = request.param(spool=tmp_path / "spool")
    yield e
    e.close()


@pytest.fixture
def strays():
    """Pids the tests' tasks started: killed at the end whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def _run(ex, tmp_path, fn, *, isolation="task", job=None, slot=0):
    h, path = function_blob(tmp_path, fn)
    ex.new_output()
    grant = TaskGrant(os.urandom(8).hex(), "-", h, timeout=60, isolation=isolation, job_id=job)
    out = ex.run(grant, path, b"".join(bytes(c) for c in wire.dumps(((), {})).chunks), slot=slot)
    assert out.status == "ok", out.error
    return wire.loads(out.payload)


def _start_sleeper():
    import os
    import subprocess
    return os.getpid(), subprocess.Popen(["sleep", "300"]).pid  # left running on purpose


def test_a_finished_tasks_children_die_with_its_process(ex, tmp_path, strays):
    task, child = _run(ex, tmp_path, _start_sleeper)
    strays.append(child)
    wait_for(lambda: not alive(task), 10, "the task process to end")
    wait_for(lambda: not alive(child), 10, "the process the task started to be killed")


def test_a_kept_process_takes_its_children_when_it_is_closed(ex, tmp_path, strays):
    task, child = _run(ex, tmp_path, _start_sleeper, isolation="job", job="jA")
    strays.append(child)
    # Kept for job A's next task: what it started lives on with it.
    assert alive(task) and alive(child)
    # The slot runs job B's task: job A's process is closed, and its children with it.
    other, other_child = _run(ex, tmp_path, _start_sleeper, isolation="job", job="jB")
    strays.append(other_child)
    assert other != task
    wait_for(lambda: not alive(task), 10, "job A's process to be closed")
    wait_for(lambda: not alive(child), 10, "the process job A's task started to be killed")
    assert alive(other_child)  # job B's process is kept, with what it started
