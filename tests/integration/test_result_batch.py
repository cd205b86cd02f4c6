"""Results posted several per request and a slot's queue of grants (``result_batch``):
the same values, in order, with a batching coordinator and worker, and with either end
from before the feature (the one-at-a-time path)."""

from __future__ import annotations

import sys

import pytest

from gpumesh import accelerate


def test_a_200_task_job_isolation_map_returns_every_value_in_order(make_mesh):
    m = make_mesh(workers=2, slots=2)
    mesh = m.client(output=False)

    @accelerate(mesh, isolation="job")
    def square(i):
        import os
        return i * i, os.getpid()

    got = square.map(range(200))
    assert [v for v, _pid in got] == [i * i for i in range(200)]
    assert 1 <= len({pid for _v, pid in got}) <= 4, "one process per slot for the job"
    # every task ran exactly once: its result and no other is stored (one attempt each)
    view = m.api("GET", f"/v1/jobs/{mesh.last_job_id}") if hasattr(mesh, "last_job_id") else None
    assert view is None or all(t["attempt"] == 1 for t in view["tasks"])
