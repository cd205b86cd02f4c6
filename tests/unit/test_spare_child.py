"""The function host keeps one task process forked ahead of its task (a spare, whose
socket it passes to the agent: runner._fork_spare): every task still gets a process of
its own, the task and its result go straight between agent and that process (the host is
off the path), a spare that dies idle is replaced, and modules the host preloads reach
the next task's process."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from gpumesh import wire
from gpumesh.protocol import TaskGrant
from gpumesh.worker.executor import Executor

from ..conftest import children, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _whoami():
    import os
    import sys
    return os.getpid(), os.getppid(), os.getpgid(0), "wave" in sys.modules


def _children(pid: int) -> set[int]:
    return set(children(pid))


@pytest.fixture
def run(tmp_path):
    ex = Executor(spool=tmp_path / "spool")
    blobs = {}

    def run_fn(fn, timeout=30, outcome=False):
        payload = wire.dumps(fn, code=True)
        h = payload.sha256()
        if h not in blobs:
            blobs[h] = tmp_path / h
            blobs[h].write_bytes(b"".join(bytes(c) for c in payload.chunks))
        args = b"".join(bytes(c) for c in wire.dumps(((), {})).chunks)
        out = ex.run(TaskGrant(os.urandom(8).hex(), "-", h, timeout=timeout), str(blobs[h]), args)
        if outcome:
            return out
        assert out.status == "ok", out.error
        return wire.loads(out.payload)

    run_fn.executor = ex  # type: ignore[attr-defined]
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


def test_a_task_and_its_result_skip_the_host_and_no_state_carries_over(run):
    def count(seen=[]):  # noqa: B006 - the state a reused process would carry over
        import os
        seen.append(1)
        return os.getpid(), os.getppid(), len(seen)

    pid1, host, n1 = run(count)
    spare = wait_for(lambda: _children(host) - {pid1}, 10, 'the spare')
    (spare,) = spare
    wait_for(lambda: os.getpgid(spare) == spare, 10, 'the spare to lead its group')
    # (and the agent to have its socket: the host passes it on just after the fork)
    hosts = list(run.executor._hosts.values())
    wait_for(lambda: [s.pid for h in hosts for s in h._spares] == [spare], 10, "the spare's socket")
    # With its host stopped, the next task still runs and answers: the agent hands it to
    # the spare and reads its result on the spare's own socket (through the host it
    # would wait for the host, and time out).
    os.kill(host, signal.SIGSTOP)
    try:
        pid2, host2, n2 = run(count, timeout=10)
        # No spare left, and the stopped host forks none: the task's timeout still holds.
        late = run(count, timeout=1, outcome=True)
    finally:
        os.kill(host, signal.SIGCONT)
    assert (pid2, host2) == (spare, host)
    assert (late.status, late.error["type"]) == ("error", "TaskTimeout")
    pid3, host3, n3 = run(count)                 # the host forked its replacement
    assert host3 == host and len({pid1, pid2, pid3}) == 3
    assert n1 == n2 == n3 == 1                   # each task saw only its own append


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


def test_a_spare_rehearses_its_task_path_on_a_private_socket_only_while_no_task_waits(
        monkeypatch):
    """runner._rehearse runs the task path on a stand-in (never the job's function) over
    a socket pair of its own: nothing reaches the agent's socket, and a task already
    waiting there is left untouched for the spare to run at once."""
    import socket

    from gpumesh.worker import framing, runner

    runner._prepare_rehearsal()
    assert runner._REHEARSAL_ARGS is not None
    calls = []
    monkeypatch.setattr(runner, "_stand_in", lambda *a, **k: calls.append((a, k)) or "done")
    agent_end, spare_end = socket.socketpair()
    try:
        agent_end.setblocking(False)
        runner._rehearse(spare_end)
        assert calls == [((0,), {})]                   # the stand-in ran, with its arguments
        with pytest.raises(BlockingIOError):
            agent_end.recv(1)                           # and the agent heard nothing of it
        # A task already waiting: no rehearsal, and its bytes stay for the spare.
        framing.send_frames(agent_end, [b'{"op": "run"}', b"args"])
        runner._rehearse(spare_end)
        assert calls == [((0,), {})]
        run, fds = framing.recv_blob_fds(spare_end)
        assert (bytes(run), fds, bytes(framing.recv_blob(spare_end))) == (b'{"op": "run"}', [], b"args")
    finally:
        agent_end.close()
        spare_end.close()


def test_a_failed_rehearsal_changes_nothing(monkeypatch):
    import socket

    from gpumesh.worker import framing, runner

    runner._prepare_rehearsal()

    def broken(*a, **k):
        raise MemoryError("stand-in")

    monkeypatch.setattr(runner, "run_task", broken)
    agent_end, spare_end = socket.socketpair()
    try:
        runner._rehearse(spare_end)                     # swallowed: the spare runs on
        framing.send_frames(agent_end, [b"x"])
        assert bytes(framing.recv_blob_fds(spare_end)[0]) == b"x"
    finally:
        agent_end.close()
        spare_end.close()


_SPECIALIZED = r"""
import dis, json, opcode
from gpumesh.worker import runner

def specialized(fn):
    # Names CPython gives the instructions it rewrote for the types it met (PEP 659):
    # absent from the plain opcode table.
    return {i.opname for i in dis.get_instructions(fn, adaptive=True)} - set(opcode.opmap)

before = specialized(runner.run_task)
runner._prepare_rehearsal()
runner._warm_host()
print(json.dumps([sorted(before), sorted(specialized(runner.run_task))]))
"""


@pytest.mark.skipif(sys.version_info < (3, 11), reason="specialization (PEP 659) came with 3.11")
def test_the_host_walks_the_task_path_so_its_children_inherit_specialized_code():
    """runner._warm_host, run once in a host before its first fork: the task path's
    bytecode (run_task's, among others) is specialized in the host, so every task process
    starts with it so (a fresh interpreter here, where nothing else ran it)."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", _SPECIALIZED], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    before, after = json.loads(out)
    # (3.12+ fuses some instruction pairs when a function is created: only what running
    # it adds counts; e.g. LOAD_GLOBAL_MODULE, CALL_PY_EXACT_ARGS)
    assert len(set(after) - set(before)) >= 3, (before, after)


def test_the_host_warm_up_stops_at_a_failure_and_leaves_no_descriptor_open(monkeypatch):
    from gpumesh.worker import runner

    runner._prepare_rehearsal()
    fds = set(os.listdir("/proc/self/fd"))
    runner._warm_host()
    left = set(os.listdir("/proc/self/fd")) - fds
    if left:  # (maybe another thread's file of this test process, open for a moment)
        time.sleep(0.2)
        left &= set(os.listdir("/proc/self/fd")) - fds
    assert left == set()                               # its socket pairs are closed
    walks = []

    def broken():
        walks.append(1)
        raise OSError("no socket pair")

    monkeypatch.setattr(runner, "_walk_task_path", broken)
    runner._warm_host()                                # swallowed: the host forks on
    assert walks == [1]                                # and stopped at the first failure
