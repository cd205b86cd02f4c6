"""The function host keeps one task process forked ahead of its task (runner._Spare):
every task still gets a process of its own, a spare that dies idle is replaced, and
modules the host preloads reach the next task's process."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from gpumesh import wire
from gpumesh.protocol import TaskGrant
from gpumesh.worker.executor import Executor

from ..conftest import wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _whoami():
    import os
    import sys
    return os.getpid(), os.getppid(), os.getpgid(0), "wave" in sys.modules


def _children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return {int(p) for p in fh.read().split()}


@pytest.fixture
def run(tmp_path):
    ex = Executor(spool=tmp_path / "spool")
    blobs = {}

    def run_fn(fn):
        payload = wire.dumps(fn, code=True)
        h = payload.sha256()
        if h not in blobs:
            blobs[h] = tmp_path / h
            blobs[h].write_bytes(b"".join(bytes(c) for c in payload.chunks))
        args = b"".join(bytes(c) for c in wire.dumps(((), {})).chunks)
        out = ex.run(TaskGrant(os.urandom(8).hex(), "-", h, timeout=30), str(blobs[h]), args)
        assert out.status == "ok", out.error
        return wire.loads(out.payload)

    yield run_fn
    ex.close()


def test_each_task_gets_its_own_ready_process_and_a_dead_spare_is_replaced(run):
    pid1, host, group1, _ = run(_whoami)
    pid2, host2, group2, _ = run(_whoami)
    assert host2 == host and pid1 != pid2 != host          # one host, a process per task
    assert (group1, group2) == (pid1, pid2)                # each task leads its own group
    # Between tasks the host holds exactly one idle child: the next task's process.
    spare = wait_for(lambda: _children(host) - {pid1, pid2}, 10, 'the spare')
    assert len(spare) == 1
    (spare,) = spare
    wait_for(lambda: os.getpgid(spare) == spare, 10, 'the spare to lead its group')         # it sets itself up before any task
    pid3, _, _, _ = run(_whoami)
    assert pid3 == spare                                   # ...and it ran the next task
    # A spare killed while idle is reaped and replaced; tasks go on.
    idle = wait_for(lambda: _children(host) - {pid1, pid2, pid3}, 10, 'a new spare')
    (idle,) = idle
    os.kill(idle, signal.SIGKILL)
    wait_for(lambda: idle not in _children(host), 10, 'the killed spare to be reaped')       # reaped by the host
    pid4, host4, _, _ = run(_whoami)
    assert host4 == host and pid4 not in {idle, pid1, pid2, pid3}


def test_modules_a_task_imported_are_loaded_before_the_next_task_of_that_function(run):
    def task():
        import sys
        seen = "wave" in sys.modules
        import wave  # noqa: F401
        return seen

    if "wave" in sys.modules:
        pytest.skip("wave is already imported by the test process")
    assert run(task) is False                 # the first task pays the import itself
    # The host preloads it and replaces its spare; the next process starts with it loaded.
    assert wait_for(lambda: run(task), 10, 'the preloaded module') is True
