"""Fault tests: meshes with short liveness timings (waiting and /proc helpers: ../conftest.py)."""

from __future__ import annotations

import os
import signal

import pytest

from ..conftest import Mesh

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

