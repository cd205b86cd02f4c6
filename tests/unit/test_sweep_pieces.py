"""The pure parts of issue 20's sweeps: retry_on in the coordinator core (real store,
fake clock), the decorator's validation of retries/retry_on, error texts that name the
item, the caller's source lines in a worker's traceback, code that keeps its file name on
the wire, and progress texts that count failures apart."""

from __future__ import annotations

import asyncio
import linecache
import pickle

import pytest

from gpumesh import GPUMesh, accelerate, wire
from gpumesh.client import calls, progress
from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.model import StaleLease
from gpumesh.coordinator.store import Store
from gpumesh.errors import MeshError, TaskCrashed, TaskTimeout, WorkerLost
from gpumesh.limits import MAX_ATTEMPTS, MAX_RETRIES
from gpumesh.protocol import ResultItem
from gpumesh import retries

from ..conftest import FakeClock


def lease(coord, wid, slots=1):
    return asyncio.run(coord.lease(wid, slots, 0.0))


def submit(coord, n=1, job_id="aaaa01", meta=None):
    return coord.submit(job_id, "fn", "function", "f" * 64, dict({"timeout": None}, **(meta or {})),
                        [b"a"] * n, [1.0] * n, False)[0]


def raised(type_name, mro):
    return {"kind": "raised", "type": type_name, "message": "it broke", "mro": mro}


OSERR = raised("FileNotFoundError", ["FileNotFoundError", "OSError", "Exception", "BaseException"])
VALERR = raised("ValueError", ["ValueError", "Exception", "BaseException"])
RETRY_META = {"retries": 2, "retry_on": ["OSError"]}


def test_retry_on_requeues_a_subclass_elsewhere_then_delivers(store):
    coord = Coordinator(store, clock=FakeClock())
    a = coord.register({"hostname": "box-a"}, None, 1)
    b = coord.register({"hostname": "box-b"}, None, 1)
    job = submit(coord, meta=RETRY_META)
    (g1,) = lease(coord, a.id)
    coord.post_result(g1.task_id, g1.lease_id, "error", dict(OSERR), b"E")
    assert list(store.results_after(job.id, -1, 10)) == []  # held back: it runs again
    assert lease(coord, a.id) == []  # not where it failed, while box-b can run it
    (g2,) = lease(coord, b.id)
    assert g2.task_id == g1.task_id and g2.attempt == 2
    coord.post_result(g2.task_id, g2.lease_id, "ok", None, b"R")
    (res,) = store.results_after(job.id, -1, 10)
    assert (res.state, res.result) == ("done", b"R")
    (row,) = store.task_rows(job.id)
    assert row["attempts"] == 2 and row["worker_id"] == b.id
    (h,) = row["history"]
    assert h["attempt"] == 1 and h["worker"] == a.id and h["hostname"] == "box-a"
    assert h["retried"] is True and h["error"] == {"type": "FileNotFoundError", "message": "it broke"}
    assert "raised FileNotFoundError" in h["ended"]
    with pytest.raises(StaleLease):  # the first attempt's lease can never deliver now
        coord.post_result(g1.task_id, g1.lease_id, "ok", None, b"late")


def test_retries_go_round_the_workers_not_back_to_the_last_one(store):
    """Failed on box-a, then on box-b: the third run goes to box-a again (the worker it
    failed on longest ago), not to box-b, which asks first; and so on, round."""
    coord = Coordinator(store, clock=FakeClock())
    a = coord.register({"hostname": "box-a"}, None, 1)
    b = coord.register({"hostname": "box-b"}, None, 1)
    submit(coord, meta={"retries": 4, "retry_on": ["OSError"]})
    ran = []
    for _ in range(5):
        (g,) = lease(coord, b.id) or lease(coord, a.id)  # box-b always asks first
        ran.append(coord.leases[g.task_id].worker_id)
        coord.post_result(g.task_id, g.lease_id, "error", dict(OSERR), b"E")
    assert ran == [b.id, a.id, b.id, a.id, b.id]


def test_a_retry_does_not_wait_for_a_worker_its_owner_closed(store):
    # box-b is paused by its owner (it may stay so for hours): the retry runs again where
    # it failed, now, rather than wait for the one worker it has not tried.
    coord = Coordinator(store, clock=FakeClock())
    a = coord.register({"hostname": "box-a"}, None, 1)
    coord.register({"hostname": "box-b", "owner": {"state": "paused", "label": "paused"}}, None, 1)
    job = submit(coord, meta=RETRY_META)
    (g1,) = lease(coord, a.id)
    coord.post_result(g1.task_id, g1.lease_id, "error", dict(OSERR), b"E")
    (g2,) = lease(coord, a.id)
    assert g2.task_id == g1.task_id and g2.attempt == 2
    coord.post_result(g2.task_id, g2.lease_id, "ok", None, b"R")
    (res,) = store.results_after(job.id, -1, 10)
    assert (res.state, res.result) == ("done", b"R")


def test_retry_on_runs_on_the_same_worker_when_it_is_the_only_one(store):
    coord = Coordinator(store, clock=FakeClock())
    a = coord.register({}, None, 1)
    job = submit(coord, meta=RETRY_META)
    for attempt in (1, 2, 3):
        (g,) = lease(coord, a.id)
        assert g.attempt == attempt
        coord.post_result(g.task_id, g.lease_id, "error", dict(OSERR), b"E")
    (res,) = store.results_after(job.id, -1, 10)  # retries=2: the third failure is the answer
    assert res.state == "failed" and res.error["attempt"] == 3
    assert len(store.task_rows(job.id)[0]["history"]) == 2


def test_other_types_and_jobs_without_retry_on_are_answered_at_once(store):
    coord = Coordinator(store, clock=FakeClock())
    a = coord.register({}, None, 2)
    j1 = submit(coord, meta=RETRY_META, job_id="aaaa01")
    j2 = submit(coord, job_id="bbbb02")
    for g in lease(coord, a.id, slots=2):
        coord.post_result(g.task_id, g.lease_id, "error", dict(VALERR if g.job_id == j1.id else OSERR), b"E")
    for job in (j1, j2):
        (res,) = store.results_after(job.id, -1, 10)
        assert res.state == "failed" and res.error["attempt"] == 1


def test_raised_retries_do_not_count_as_losses(store):
    clock = FakeClock()
    coord = Coordinator(store, clock=clock)
    a = coord.register({}, None, 1)
    job = submit(coord, meta={"retries": MAX_ATTEMPTS, "retry_on": ["OSError"]})
    for _ in range(MAX_ATTEMPTS):
        (g,) = lease(coord, a.id)
        coord.post_result(g.task_id, g.lease_id, "error", dict(OSERR), b"E")
    (g,) = lease(coord, a.id)
    coord.deregister(a.id)  # one loss after many raised retries: re-queued, not "lost"
    assert store.task_rows(job.id)[0]["state"] == "pending"
    assert "retried" not in store.task_rows(job.id)[0]["history"][-1]


def test_a_lost_or_handed_back_attempt_is_kept_in_the_history(store):
    coord = Coordinator(store, clock=FakeClock())
    a = coord.register({"hostname": "box-a"}, None, 1)
    job = submit(coord)
    (g1,) = lease(coord, a.id)
    coord.post_result(g1.task_id, g1.lease_id, "retry", {"message": "the owner needs the GPU"}, None)
    (g2,) = lease(coord, a.id)
    coord.deregister(a.id, reason="its connection dropped")
    (row,) = store.task_rows(job.id)
    assert [(h["attempt"], h["worker"], h["hostname"], h["ended"]) for h in row["history"]] == [
        (1, a.id, "box-a", "the owner needs the GPU"), (2, a.id, "box-a", "its connection dropped")]
    assert not any(h.get("retried") for h in row["history"])


def test_retry_on_counts_survive_a_restart(tmp_path):
    s1 = Store(tmp_path / "d")
    c1 = Coordinator(s1, clock=FakeClock())
    a = c1.register({}, None, 1)
    submit(c1, meta={"retries": 1, "retry_on": ["OSError"]})
    (g,) = lease(c1, a.id)
    c1.post_result(g.task_id, g.lease_id, "error", dict(OSERR), b"E")
    s1.close()
    s2 = Store(tmp_path / "d")
    try:
        c2 = Coordinator(s2, clock=FakeClock())
        c2.callers.heard(c2, ["aaaa01"])  # its caller polls again (coordinator.callers)
        assert c2.retried == {g.task_id: 1}
        assert c2.jobs["aaaa01"].avoid == {g.task_id: {a.id}}
        w = c2.register({}, a.id, 1)
        (g2,) = lease(c2, w.id)
        c2.post_result(g2.task_id, g2.lease_id, "error", dict(OSERR), b"E")
        (res,) = s2.results_after("aaaa01", -1, 10)  # its one retry was used before the restart
        assert res.state == "failed"
    finally:
        s2.close()


# ---------------------------------------------------------------- the decorator ----

def test_decorator_validates_retries_and_retry_on():
    m = GPUMesh("http://127.0.0.1:9", token="x")
    ok = accelerate(m, retries=2, retry_on=(OSError, TimeoutError))(lambda: 1)
    assert ok.retry == (2, (OSError, TimeoutError))
    assert accelerate(m, retries=1, retry_on=OSError)(lambda: 1).retry == (1, (OSError,))
    assert accelerate(m)(lambda: 1).retry is None
    for kwargs, error in [({"retries": 2}, ValueError), ({"retry_on": (OSError,)}, ValueError),
                          ({"retries": -1, "retry_on": OSError}, ValueError),
                          ({"retries": MAX_RETRIES + 1, "retry_on": OSError}, ValueError),
                          ({"retries": "2", "retry_on": OSError}, TypeError),
                          ({"retries": True, "retry_on": OSError}, TypeError),
                          ({"retries": 1, "retry_on": "OSError"}, TypeError),
                          ({"retries": 1, "retry_on": (OSError, 3)}, TypeError),
                          ({"retries": 1, "retry_on": (KeyboardInterrupt,)}, TypeError),
                          ({"retries": 1, "retry_on": ()}, ValueError),
                          # gpumesh's own errors never match (the function never raises them)
                          ({"retries": 1, "retry_on": (TaskTimeout,)}, ValueError),
                          ({"retries": 1, "retry_on": (OSError, WorkerLost)}, ValueError),
                          ({"retries": 1, "retry_on": (MeshError,)}, ValueError)]:
        with pytest.raises(error):
            accelerate(m, **kwargs)(lambda: 1)
    with pytest.raises(ValueError, match=r"retry_on=\(TaskTimeout,\) would never match"):
        accelerate(m, retries=1, retry_on=TaskTimeout)(lambda: 1)
    assert accelerate(m, retries=1, retry_on=TaskCrashed)(lambda: 1).retry == (1, (TaskCrashed,))


def test_retry_meta_names_types_and_the_coordinator_checks_them():
    class Flaky(Exception):
        pass

    meta = retries.to_meta(2, (OSError, Flaky))
    assert meta == {"retries": 2, "retry_on": ["OSError", f"{__name__}.test_retry_meta_names_types_"
                                                          f"and_the_coordinator_checks_them.<locals>.Flaky"]}
    assert retries.check_meta(None, None) is None
    assert retries.check_meta(2, ["OSError", "OSError"]) == (2, ["OSError"])
    for bad in [(0, ["OSError"]), (True, ["OSError"]), (2, []), (2, "OSError"), (2, [3]),
                (2, ["not a name!"]), (MAX_RETRIES + 1, ["OSError"]), (2, None), (None, ["OSError"])]:
        with pytest.raises(ValueError):
            retries.check_meta(*bad)


def test_a_decorated_function_with_retries_still_pickles(monkeypatch):
    # The copy is rebuilt without its mesh and calls the default one: point that at a
    # closed port too, so a coordinator on this machine's default port cannot answer.
    from gpumesh.client import remote
    monkeypatch.setenv("GPUMESH_URL", "http://127.0.0.1:9")
    monkeypatch.setattr(remote.mesh, "_mesh", None)  # connected by an earlier test: anew
    m = GPUMesh("http://127.0.0.1:9", token="x")
    f = accelerate(m, retries=1, retry_on=OSError)(abs)
    g = pickle.loads(pickle.dumps(f))
    assert g.retry == (1, (OSError,)) and g(-3) == 3


# ---------------------------------------------------------------- error texts ------

def test_failure_names_the_item_the_worker_and_the_attempt():
    item = ResultItem(index=7, task_id="t9", state="failed", seq=3,
                      error={"kind": "crashed", "message": "the task process exited with code 9",
                             "worker": "0afecb2dfd44", "hostname": "laptop-a", "attempt": 2})
    exc = calls.failure(item, None, call=((), {"lr": 0.5, "data": "x" * 500}), n=20, name="train",
                        hint=calls.keep_going())
    text = str(exc)
    assert ".map item 7 of 20, train(lr=0.5, data='xxx" in text
    assert "on worker laptop-a (0afecb2dfd44), attempt 2, task t9" in text
    assert "return_exceptions=True" in text and len(text) < 600  # the long argument is shortened
    assert (exc.index, exc.hostname, exc.attempt, exc.worker) == (7, "laptop-a", 2, "0afecb2dfd44")


def test_worker_traceback_gets_the_callers_source_lines():
    cell = "<ipython-input-7-0123456789ab>"
    linecache.cache[cell] = (40, None, ["def f(x):\n", "    return 1 / x\n"], cell)
    tb = ("Traceback (most recent call last):\n"
          f'  File "{cell}", line 2, in f\n'
          '  File "/nowhere/at/all.py", line 3, in g\n'
          '  File "/site/lib.py", line 9, in h\n'
          "    known = line\n"
          "ZeroDivisionError: division by zero\n")
    out = calls.with_source(tb)
    assert out.splitlines() == [
        "Traceback (most recent call last):", f'  File "{cell}", line 2, in f', "    return 1 / x",
        '  File "/nowhere/at/all.py", line 3, in g', '  File "/site/lib.py", line 9, in h',
        "    known = line", "ZeroDivisionError: division by zero"]


def test_code_shipped_by_value_keeps_its_file_name():
    ns = {"__name__": "__main__"}
    exec(compile("def f(x):\n    return x + 1\n", "/home/u/sweep.py", "exec"), ns)
    g = wire.loads(bytearray(wire.dumps(ns["f"], code=True).to_bytes()))
    assert g.__code__.co_filename == "/home/u/sweep.py" and g(1) == 2
    assert g.__code__.co_name == "f" and g.__code__.co_firstlineno == 1


# ---------------------------------------------------------------- progress ---------

def test_progress_counts_failed_and_cancelled_apart():
    assert progress.bar_text(6, 6, 10.2) == "#################### 100%  6/6 done  (10s)"
    assert progress.bar_text(4, 4, 3, failed=1).endswith("100%  4/4 final: 3 done, 1 failed  (3s)")
    assert progress.outcome_text(5, 8, failed=1, cancelled=2) == "5/8 final: 2 done, 1 failed, 2 cancelled"
    bar = progress.Progress(4, enabled=False)
    bar.update(4, failed=1)
    assert (bar.done, bar.failed, bar.cancelled) == (4, 1, 0)


def test_notebook_bar_counts_failed_and_cancelled_apart():
    bar = progress.NotebookBar(started=0.0)
    task = bar.add_task("fit", total=4)
    bar.update(task, completed=4, failed=1, rate="1/s", outcome="ignored")
    assert "4/4 final: 3 done, 1 failed" in bar.text() and "4/4 done" not in bar.text()


def test_a_cancelled_jobs_cancel_lines_go_newest_lease_first(store):
    """A slot's queued grants are leased after the task it runs: their cancel lines come
    first, so the worker has dropped them before it kills that task (whose slot would
    otherwise start its next queued grant at once, a cancelled task run to completion)."""
    coord = Coordinator(store, clock=FakeClock())
    a = coord.register({}, None, 1)
    submit(coord, n=5)
    first = [g.task_id for g in lease(coord, a.id, slots=3)]
    more = [g.task_id for g in lease(coord, a.id, slots=2)]
    a.outbox.clear()
    assert coord.cancel("aaaa01") == 5
    assert list(a.outbox) == [f"cancel {t}" for t in reversed(first + more)]
