"""Which warm function hosts the fork runtime closes to keep at most MAX_WARM_FUNCTIONS
(gpumesh.worker.host.to_close, Executor._evict): the least recently used idle ones,
never one a task was handed, even before it has loaded its function. The rule alone,
then a real Executor (zygote, hosts and task processes)."""

from __future__ import annotations

import os
import sys
import threading
from types import SimpleNamespace

import pytest

from gpumesh import wire
from gpumesh.limits import MAX_WARM_FUNCTIONS
from gpumesh.protocol import TaskGrant
from gpumesh.worker import procs
from gpumesh.worker.executor import Executor
from gpumesh.worker.host import to_close

from ..conftest import function_blob, wait_for

fork_only = pytest.mark.skipif(sys.platform != "linux" or bool(procs.fork_missing()),
                               reason="the fork runtime")


def _names(hosts) -> list[int]:
    return [h.name for h in hosts]


def test_the_least_recently_used_idle_hosts_beyond_the_limit_close_never_one_in_use():
    now = 1000.0
    hosts = [SimpleNamespace(name=i, dead=False, last_used=now) for i in range(6)]  # LRU first
    assert _names(to_close(hosts, lambda h: False, 4, 60, now)) == [0, 1]
    # The oldest in use: the next idle ones go in their place.
    assert _names(to_close(hosts, lambda h: h.name in (0, 1), 4, 60, now)) == [2, 3]
    # Only the newest idle: it goes, the count back to the limit...
    assert _names(to_close(hosts, lambda h: h.name != 5, 4, 60, now)) == [5]
    # ...but all in use (the newest too, as a host just started for a task is): none
    # goes, and the count stays over the limit until some are idle again.
    assert to_close(hosts, lambda h: True, 4, 60, now) == []
    # Within the limit: the dead and those idle too long go; one in use never does.
    hosts[1].dead = True
    hosts[2].last_used = now - 61
    hosts[3].dead = True
    assert _names(to_close(hosts, lambda h: h.name == 3, 10, 60, now)) == [1, 2]


@pytest.fixture
def ex(tmp_path):
    e = Executor(spool=tmp_path / "spool")
    yield e
    e.close()


def _returns(k):
    def f(x):
        return k, x
    return f


class _LoadsWhen:
    """Unpickles (as None) only once ``path`` exists: a function that refers to one keeps
    its host loading until then (at most 60 s)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return exec, (f"import os, time\nend = time.monotonic() + 60\n"
                      f"while not os.path.exists({self.path!r}) and time.monotonic() < end:\n"
                      f"    time.sleep(0.01)\n",)


def _slow_to_load(path):
    loads = _LoadsWhen(path)

    def slow(x):
        return x if loads is None else None  # (it loaded: None, exec's value)
    return slow


def _call(ex, tmp_path, fn, x, job, slot=0):
    h, path = function_blob(tmp_path, fn)
    body = b"".join(bytes(c) for c in wire.dumps(((x,), {})).chunks)
    ex.new_output()
    grant = TaskGrant(os.urandom(8).hex(), "-", h, timeout=60, isolation="job", job_id=job)
    return ex.run(grant, path, body, slot=slot)


def _value(out):
    assert out.status == "ok", out.error
    return wire.loads(out.payload)


@fork_only
def test_one_call_jobs_of_more_functions_than_stay_warm_all_run(ex, tmp_path):
    # Each call a new job of a new function on one slot (as a notebook that redefines its
    # function makes): the slot lets the last job's kept process go only as the next
    # task starts, so the last few hosts counted as in use and the host just started
    # for the call was closed under it (the task failed as "the function's host process
    # died", three times over, then WorkerLost).
    fns = [_returns(k) for k in range(2 * MAX_WARM_FUNCTIONS)]
    for rnd in range(2):
        for k, fn in enumerate(fns):
            assert _value(_call(ex, tmp_path, fn, rnd, job=f"j{rnd}-{k}")) == (k, rnd)
            assert len(ex._hosts) <= MAX_WARM_FUNCTIONS


@fork_only
def test_a_host_still_loading_for_a_task_is_not_closed_to_make_room(ex, tmp_path):
    go = tmp_path / "go"
    got = {}
    slow = threading.Thread(target=lambda: got.update(
        out=_call(ex, tmp_path, _slow_to_load(str(go)), 7, job="slow", slot=0)))
    slow.start()
    try:
        wait_for(lambda: ex._hosts, 30, "the slow function's host to start")
        # Another slot runs more new functions than stay warm meanwhile: the loading
        # host (its task not yet among its tasks) was the least recently used, and closed.
        for k in range(MAX_WARM_FUNCTIONS + 1):
            assert _value(_call(ex, tmp_path, _returns(k), 1, job=f"j{k}", slot=1)) == (k, 1)
    finally:
        go.touch()
        slow.join(60)
    assert _value(got["out"]) == 7
    assert len(ex._hosts) <= MAX_WARM_FUNCTIONS + 1  # (until the janitor's next look)


@fork_only
def test_a_host_the_worker_closed_is_not_reported_as_dead(tmp_path):
    ex = Executor(spool=tmp_path / "spool")
    go = tmp_path / "go"
    got = {}
    slow = threading.Thread(target=lambda: got.update(
        out=_call(ex, tmp_path, _slow_to_load(str(go)), 7, job="slow")))
    slow.start()
    try:
        wait_for(lambda: ex._hosts, 30, "the slow function's host to start")
        ex.close()  # (the worker stops while the host loads)
        slow.join(30)
    finally:
        go.touch()
        ex.close()
    out = got["out"]
    assert out.status == "retry" and out.error["kind"] == "host_died"
    assert out.error["message"] == "this worker closed the function's host (it is stopping)"
