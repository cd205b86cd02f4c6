"""``.map(items, isolation=...)`` and ``.imap``: one batch's isolation, whatever the
decorator says, checked like ``@accelerate(m, isolation=...)``; on a real mesh."""

from __future__ import annotations

import pytest

from gpumesh import accelerate


def where(i):
    import os
    import sys
    sys.gpumesh_seen = getattr(sys, "gpumesh_seen", 0) + 1  # state the process keeps
    return os.getpid(), sys.gpumesh_seen


def test_map_takes_isolation_for_its_own_tasks(make_mesh):
    m = make_mesh(workers=1, slots=2)
    mesh = m.client(output=False)
    f = accelerate(mesh)(where)                  # the decorator's default: "task"

    kept = f.map(range(12), isolation="job")
    pids = {pid for pid, _ in kept}
    assert 1 <= len(pids) <= 2, "one process per slot for the job"
    assert sum(n for _pid, n in kept) > 12, "the map's tasks ran in the processes they kept"
    streamed = sorted(f.imap(range(6), isolation="job"))
    assert [i for i, _ in streamed] == list(range(6))
    assert len({pid for _, (pid, _n) in streamed}) <= 2
    assert not pids & {pid for _, (pid, _n) in streamed}, "a process was reused for another job"
    # the decorator's own option is unchanged by it, and can be overridden the other way
    assert len({pid for pid, _ in f.map(range(4))}) == 4
    g = accelerate(mesh, isolation="job")(where)
    fresh = g.map(range(4), isolation="task")
    assert len({pid for pid, _ in fresh}) == 4 and all(n == 1 for _pid, n in fresh)
    unordered = g.map(range(4), ordered=False, isolation="job")
    assert sorted(i for i, _ in unordered) == [0, 1, 2, 3]


def test_map_refuses_another_isolation(make_mesh):
    m = make_mesh(workers=0)
    f = accelerate(m.client())(where)
    for bad in ("process", "", 1, "JOB"):
        for method, kw in ((f.map, {}), (f.imap, {}), (f.map, {"ordered": False})):
            with pytest.raises(ValueError, match=f"isolation must be 'task' or 'job', got {bad!r}"):
                method([1], isolation=bad, **kw)
