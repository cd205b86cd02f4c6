"""Fault tests: meshes with short liveness timings, and helpers to find processes."""

from __future__ import annotations

import os
import signal

import pytest

from ..conftest import Mesh, wait_until  # noqa: F401 - the fault tests import it from here

#: Short TTL so silent-worker tests finish quickly (the default is 10 s).
TEST_TTL_S = 3


@pytest.fixture
def fault_mesh(tmp_path):
    """Factory: a mesh whose processes run with ``GPUMESH_WORKER_TTL=3`` (+ extra env)."""
    made: list[Mesh] = []

    def make(workers: int = 0, slots: int = 1, **env: str) -> Mesh:
        m = Mesh(tmp_path / f"mesh{len(made)}")
        m.env.update({"GPUMESH_WORKER_TTL": str(TEST_TTL_S), **env})
        made.append(m)
        m.start()
        for _ in range(workers):
            m.add_worker(slots=slots)
        return m

    yield make
    for m in made:
        for p in m.procs:  # a test may have stopped (SIGSTOP) a process: wake it to stop it
            try:
                os.killpg(p.p.pid, signal.SIGCONT)
            except OSError:
                pass
        m.stop()


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
