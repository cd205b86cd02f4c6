"""``isolation=``: a fresh process per task (the default), or one per slot for a job."""

from __future__ import annotations

import pytest

from gpumesh import TaskCrashed, TaskTimeout, accelerate


def test_isolation_is_checked_at_decoration(make_mesh):
    m = make_mesh(workers=0)
    for bad in ("process", "", 1, "JOB"):
        with pytest.raises(ValueError, match="isolation must be 'task' or 'job'"):
            accelerate(m.client(), isolation=bad)(abs)
    with pytest.raises(ValueError, match="isolation"):
        m.client().distribute(abs, [1], isolation="worker")


def test_each_task_process_and_each_jobs_process_draws_its_own_random_numbers(make_mesh):
    # Forked from one host, task processes start from its RNG states: each must be
    # reseeded (random's own at-fork hook is registered before the host's fork records
    # hooks), or a random search draws the same sample in every task.
    m = make_mesh(workers=1, slots=2)
    mesh = m.client(output=False)

    def draw(_i):
        import os
        import random

        import numpy
        return os.getpid(), random.random(), random.sample(range(1000), 3), numpy.random.random()

    for isolation in ("task", "job"):
        got = accelerate(mesh, isolation=isolation)(draw).map(range(8))
        first_draw = {}
        for pid, *values in got:
            first_draw.setdefault(pid, values)  # (a job's process draws on: its first draw)
        per_process = list(first_draw.values())
        assert len(per_process) >= (8 if isolation == "task" else 1)
        for k in range(3):
            assert len({repr(v[k]) for v in per_process}) == len(per_process), (isolation, got)
        assert len({repr(v[1:]) for v in got}) == 8, (isolation, got)


def test_a_jobs_tasks_share_a_process_per_slot_and_never_across_jobs(make_mesh):
    m = make_mesh(workers=1, slots=2)
    mesh = m.client(output=False)

    @accelerate(mesh, isolation="job")
    def where(i):
        import os
        import sys
        sys.gpumesh_seen = getattr(sys, "gpumesh_seen", 0) + 1  # state the process keeps
        return os.getpid(), sys.gpumesh_seen

    first = where.map(range(20))
    pids = {pid for pid, _ in first}
    assert 1 <= len(pids) <= 2, "one process per slot for the job"
    assert sum(n for _pid, n in first) > 20, "tasks of one job ran in the same process"
    second = where.map(range(6))
    assert not pids & {pid for pid, _ in second}, "a process was reused for another job"
    single = where(0)
    assert single[0] not in pids | {pid for pid, _ in second} and single[1] == 1
    via_distribute = mesh.distribute(where, [{"i": k} for k in range(6)])
    assert len({pid for pid, _ in via_distribute}) <= 2

    @accelerate(mesh)
    def default(i):
        import os
        return os.getpid()

    assert len(set(default.map(range(6)))) == 6, "the default is a fresh process per task"


@pytest.mark.parametrize("fail", ["crash", "timeout"])
def test_a_crash_or_timeout_in_job_isolation_loses_no_other_result(make_mesh, fail):
    m = make_mesh(workers=1, slots=2)
    mesh = m.client(output=False)

    @accelerate(mesh, isolation="job", timeout=4)
    def task(i):
        import os
        import time
        if i == 0:  # holds one slot while the other slot runs every other task
            time.sleep(2)
            if FAIL == "crash":
                os._exit(9)
            time.sleep(60)
        return i * i

    FAIL = fail  # noqa: N806 - captured by the closure above
    with pytest.raises(TaskCrashed if fail == "crash" else TaskTimeout) as err:
        task.map(range(12))
    if fail == "crash":
        assert "code 9" in str(err.value)
    job = mesh.jobs()[0]
    assert job["n_tasks"] == 12
    states = {t["index"]: t["state"] for t in mesh.status(job["id"])["tasks"]}
    assert states[0] == "failed"
    assert all(states[i] == "done" for i in range(1, 12)), states
    # and the caller gets every other value, with the failure in its place
    got = task.map(range(12), return_exceptions=True)
    assert isinstance(got[0], TaskCrashed if fail == "crash" else TaskTimeout), got[0]
    assert got[1:] == [i * i for i in range(1, 12)]
    # the job's other slot kept its process; the failed task's slot gets a new one
    assert task.map(range(1, 5)) == [1, 4, 9, 16]


def _say(i):
    import os
    print(f"task {i} says")
    return os.getpid(), os.getppid()


def test_a_jobs_kept_process_logs_each_tasks_own_output_and_is_forked_from_the_function_host(make_mesh):
    m = make_mesh(workers=1, slots=1)
    mesh = m.client(output=False)
    got = accelerate(mesh, isolation="job")(_say).map(range(8))
    assert len({pid for pid, _ in got}) == 1, "one slot: one process for the job"
    job = mesh.jobs()[0]
    logs = {t["index"]: t["stdout"] for t in mesh.logs(job["id"])}
    assert logs == {i: f"task {i} says\n" for i in range(8)}
    # The job's process has the parent a default task's process has: on the fork runtime
    # the function's host (a forked child of it, not a fresh interpreter), on the spawn
    # runtime the agent.
    _pid, host = accelerate(mesh)(_say)(0)
    assert {ppid for _, ppid in got} == {host}


def test_more_job_isolated_functions_than_a_worker_keeps_warm_all_run(make_mesh):
    # One-call jobs of more functions than MAX_WARM_FUNCTIONS, in turn, on one slot (a
    # notebook redefining its function makes the same: a new function per call): each
    # call's host was closed to make room for it while the last few jobs' processes
    # still counted as in use, and the call failed as WorkerLost after three tries.
    from gpumesh.limits import MAX_WARM_FUNCTIONS
    m = make_mesh(workers=1)
    mesh = m.client(output=False)

    def make(k):
        @accelerate(mesh, isolation="job")
        def f(x):
            return k, x
        return f

    fns = [make(k) for k in range(2 * MAX_WARM_FUNCTIONS)]
    for rnd in range(3):
        assert [f(rnd) for f in fns] == [(k, rnd) for k in range(len(fns))]
