"""A function job whose caller is gone is cancelled and released (coordinator/callers.py),
and a recovered one waits for its caller; the caller's keepalive (client/keepalive.py)."""

from __future__ import annotations

import asyncio

from gpumesh.client import keepalive
from gpumesh.coordinator.callers import CHECK_EVERY_S
from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store
from gpumesh.limits import KEEPALIVE_MAX_S

N = 3


def lease(coord, wid, slots=1):
    return asyncio.run(coord.lease(wid, slots, 0.0))


def submit(coord, job_id, kind="function", n=N):
    job, _ = coord.submit(job_id, "fn", kind, "f" * 64, {"timeout": None},
                          [f"a{i}".encode() for i in range(n)], [1.0] * n, False)
    coord.callers.heard(coord, [job_id])  # as the submit route does
    return job


def states(store, job_id):
    return sorted(r["state"] for r in store.task_rows(job_id))


def test_a_job_whose_caller_goes_quiet_is_cancelled_and_released(coord, store, clock):
    timeout = coord.callers.timeout
    w = coord.register({}, None, 1)
    submit(coord, "aaaa01")
    (g,) = lease(coord, w.id)
    clock.advance(timeout - 1)
    w.last_seen = clock()  # (the worker stays alive: its heartbeats)
    coord.sweep()
    assert coord.jobs["aaaa01"].state == "active"  # not yet
    clock.advance(2)
    w.last_seen = clock()
    coord.sweep()
    assert "aaaa01" not in coord.jobs  # released: nobody will collect it
    assert states(store, "aaaa01") == ["cancelled"] * N
    row = next(r for r in store.task_rows("aaaa01") if r["id"] == g.task_id)
    assert "its caller was not heard from for" in row["error"]["message"]
    assert store.job_row("aaaa01")["state"] == "cancelled"
    assert f"cancel {g.task_id}" in w.outbox  # the running task is stopped on its worker


def test_a_poll_or_keepalive_keeps_the_job(coord, store, clock):
    timeout = coord.callers.timeout
    submit(coord, "aaaa02")
    for _ in range(3):
        clock.advance(timeout - 1)
        assert coord.callers.heard(coord, ["aaaa02", "ffff99"]) == 1  # (an unknown id is skipped)
        coord.sweep()
    assert coord.jobs["aaaa02"].state == "active"
    assert states(store, "aaaa02") == ["pending"] * N


def test_a_finished_job_nobody_collects_is_released(coord, store, clock):
    w = coord.register({}, None, 1)
    submit(coord, "aaaa03", n=1)
    (g,) = lease(coord, w.id)
    coord.post_result(g.task_id, g.lease_id, "ok", None, b"r")
    assert coord.jobs["aaaa03"].state == "finished"
    clock.advance(coord.callers.timeout + CHECK_EVERY_S + 1)
    coord.sweep()
    assert "aaaa03" not in coord.jobs
    assert states(store, "aaaa03") == ["done"]  # its result stays done, only released
    assert store.job_row("aaaa03")["state"] == "finished"


def test_script_jobs_have_no_caller_to_wait_for(coord, store, clock):
    submit(coord, "aaaa04", kind="script")
    clock.advance(coord.callers.timeout * 10)
    coord.sweep()
    assert coord.jobs["aaaa04"].state == "active"
    assert coord.callers.last == {}


def test_a_recovered_job_waits_for_its_caller(tmp_path, clock):
    data = tmp_path / "data"
    s1 = Store(data)
    c1 = Coordinator(s1, clock=clock)
    submit(c1, "bbbb01")
    submit(c1, "bbbb02", kind="script")
    s1.close()  # the coordinator dies; its callers may have given up meanwhile

    s2 = Store(data)
    try:
        c2 = Coordinator(s2, clock=clock)
        assert c2.callers.held == {"bbbb01"}
        w = c2.register({}, None, 1)
        got = lease(c2, w.id, 4)
        assert {g.job_id for g in got} == {"bbbb02"}  # the script job runs; bbbb01 waits
        assert c2.queue.pending("bbbb01") == N
        assert c2.waiting_reason("bbbb01").startswith("waiting for its caller")  # (status says so)
        assert c2.waiting_reason("bbbb02") is None
        c2.callers.heard(c2, ["bbbb01"])  # its caller polls again
        assert c2.callers.held == set()
        w2 = c2.register({}, None, 4)
        assert {g.job_id for g in lease(c2, w2.id, 4)} == {"bbbb01"}
    finally:
        s2.close()


def test_a_recovered_job_whose_caller_never_comes_back_never_runs(tmp_path, clock):
    data = tmp_path / "data"
    s1 = Store(data)
    submit(Coordinator(s1, clock=clock), "cccc01")
    s1.close()
    s2 = Store(data)
    try:
        c2 = Coordinator(s2, clock=clock)
        w = c2.register({}, None, 1)
        assert lease(c2, w.id) == []
        clock.advance(c2.callers.timeout + CHECK_EVERY_S + 1)
        w.last_seen = clock()  # (the worker stays alive)
        c2.sweep()
        assert "cccc01" not in c2.jobs
        assert states(s2, "cccc01") == ["cancelled"] * N
        assert lease(c2, w.id) == []
    finally:
        s2.close()


def test_the_keepalive_pace_follows_the_coordinator():
    assert keepalive.interval(None) == KEEPALIVE_MAX_S  # an older coordinator: the slow pace
    assert keepalive.interval(360) == KEEPALIVE_MAX_S
    assert keepalive.interval(8) == 2.0
    assert keepalive.interval(0.1) == keepalive.KEEPALIVE_MIN_S


def _exited_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_caller_on_this_machine_whose_process_is_gone_is_given_up_sooner(coord, store, clock):
    import os
    import socket

    from gpumesh.coordinator.callers import LOCAL_GONE_S, gone_here
    here, dead = socket.gethostname(), _exited_pid()
    assert gone_here({"host": here, "pid": dead, "loopback": True}) is True
    assert gone_here({"host": here, "pid": os.getpid(), "loopback": True}) is False  # alive
    assert gone_here({"host": here, "pid": dead}) is False  # not over loopback: not known here
    assert gone_here({"host": "elsewhere", "pid": dead, "loopback": True}) is False
    assert gone_here({"host": here, "pid": "12", "loopback": True}) is False
    assert gone_here({}) is False
    w = coord.register({}, None, 1)
    job = submit(coord, "bbbb01")
    job.meta["caller"] = {"host": here, "pid": dead, "loopback": True}
    alive = submit(coord, "bbbb02")
    alive.meta["caller"] = {"host": here, "pid": os.getpid(), "loopback": True}
    clock.advance(LOCAL_GONE_S - 1)
    w.last_seen = clock()
    coord.sweep()
    assert coord.jobs["bbbb01"].state == "active"  # a poll may still come: not yet
    clock.advance(2)
    w.last_seen = clock()
    coord.sweep()
    assert "bbbb01" not in coord.jobs and states(store, "bbbb01") == ["cancelled"] * N
    message = store.task_rows("bbbb01")[0]["error"]["message"]
    assert f"its process (pid {dead} on this machine) has exited" in message
    # The live caller's job waits for the whole GPUMESH_CALLER_TIMEOUT as before.
    assert coord.jobs["bbbb02"].state == "active"
