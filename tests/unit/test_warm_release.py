"""Warm task processes are kept only while their function was used lately.

A worker keeps, per function, a warm process (the fork runtime's function host with its
spare child; the spawn runtime's spare loaded with the function) and, for the next new
function, a zygote or a generic spare. After ``WARM_IDLE_S`` (``GPUMESH_WARM_IDLE``)
without a task they exit, so an idle worker's memory goes back to what it was before its
first task; the next task starts them again. The setting is made short here; what is
asserted is which processes exist, never how fast anything is."""

from __future__ import annotations

import os
import sys

import pytest

from gpumesh import wire
from gpumesh.protocol import TaskGrant
from gpumesh.worker import executor as executor_mod
from gpumesh.worker import spawn as spawn_mod
from gpumesh.worker.executor import Executor
from gpumesh.worker.spawn import SpawnExecutor

from ..conftest import alive, descendants, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _whoami():
    import os
    return os.getpid(), os.getppid()


_BEFORE: set[int] = set()


def _descendants(pid: int) -> set[int]:
    """Every live (not zombie) process below ``pid`` that the test itself started: what
    was already running when it began (a session's shared mesh, in the whole suite) is
    not counted."""
    return {p for p in descendants(pid) if alive(p)} - _BEFORE


@pytest.fixture(autouse=True)
def _already_running():
    _BEFORE.clear()
    _BEFORE.update(p for p in descendants(os.getpid()) if alive(p))
    yield
    _BEFORE.clear()


def _runner(ex, tmp_path):
    blobs: dict = {}

    def run(fn):
        payload = wire.dumps(fn, code=True)
        h = payload.sha256()
        if h not in blobs:
            blobs[h] = tmp_path / h
            blobs[h].write_bytes(b"".join(bytes(c) for c in payload.chunks))
        args = b"".join(bytes(c) for c in wire.dumps(((), {})).chunks)
        ex.new_output()
        out = ex.run(TaskGrant(os.urandom(8).hex(), "-", h, timeout=60), str(blobs[h]), args)
        assert out.status == "ok", out.error
        return wire.loads(out.payload)
    return run


def test_fork_runtime_releases_host_spare_and_zygote_when_idle_and_starts_them_again(tmp_path, monkeypatch):
    monkeypatch.setattr(executor_mod, "WARM_IDLE_S", 1.0)
    ex = Executor(spool=tmp_path / "spool")
    try:
        assert _descendants(os.getpid()) == set()  # nothing before the first task
        run = _runner(ex, tmp_path)
        task, host = run(_whoami)
        zygote = ex._zygote.pid
        # Right after the task: the zygote, the function's host and its spare child.
        # (The task's own process may still be exiting: it is not counted.)
        kept = wait_for(lambda: d if len(d := _descendants(os.getpid()) - {task}) >= 3 else None,
                        10, "zygote, host and spare")
        assert {zygote, host} <= kept
        # Idle past the setting: all of them exit.
        wait_for(lambda: not _descendants(os.getpid()), 20, "the idle processes to exit")
        assert ex._zygote is None and not ex._hosts
        # The next task starts a zygote and a host again.
        task3, host3 = run(_whoami)
        assert host3 not in (host, task3) and ex._zygote is not None and ex._zygote.pid != zygote
    finally:
        ex.close()
    assert _descendants(os.getpid()) == set()


def test_fork_runtime_keeps_its_processes_while_the_function_is_used(tmp_path, monkeypatch):
    monkeypatch.setattr(executor_mod, "WARM_IDLE_S", 4.0)
    ex = Executor(spool=tmp_path / "spool")
    try:
        run = _runner(ex, tmp_path)
        _task, host = run(_whoami)
        before = wait_for(lambda: d if len(d := _descendants(os.getpid()) - {_task}) >= 3 else None,
                          10, "zygote, host and spare")
        import time
        time.sleep(2.0)  # two janitor rounds (one every WARM_IDLE_S / 4), within the setting
        assert {ex._zygote.pid, host} <= _descendants(os.getpid())
        assert run(_whoami)[1] == host
        assert len(before) == 3
    finally:
        ex.close()


def test_spawn_runtime_releases_the_function_spare_and_the_generic_spare_when_idle(tmp_path, monkeypatch):
    monkeypatch.setattr(spawn_mod, "WARM_IDLE_S", 2.0)
    ex = SpawnExecutor(spool=tmp_path / "spool")
    try:
        run = _runner(ex, tmp_path)
        task, parent = run(_whoami)
        assert parent == os.getpid()  # spawned by this process, which then reaped it
        # After a task: a spare loaded with its function and a generic one for the next.
        spares = _descendants(os.getpid())
        assert task not in spares and len(spares) == 2
        wait_for(lambda: not _descendants(os.getpid()), 30, "the idle spares to exit")
        assert not any(ex._spares.values())
        task2, _ = run(_whoami)  # a new process is started for the next task
        assert task2 not in spares and task2 != task
    finally:
        ex.close()
    assert _descendants(os.getpid()) == set()
