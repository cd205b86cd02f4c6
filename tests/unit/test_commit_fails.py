"""A COMMIT that fails (a full disk, an I/O error) leaves the coordinator's memory as the
store has it: nothing of the transaction is acknowledged, no caller is woken with what
it did not store, every lease it ended holds again (so the worker's re-post is
accepted), and the tasks it granted are pending again, not leased to anyone.

The fault is put at the narrowest boundary: the store's SQLite connection, whose next
``COMMIT`` raises ``sqlite3.OperationalError`` as SQLite does then, either having rolled
the transaction back itself (``SQLITE_FULL``, ``SQLITE_IOERR``) or leaving it open
(``SQLITE_BUSY``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3

import pytest

from gpumesh import protocol
from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store
from gpumesh.protocol import BatchedResult, JobSubmit

from . import test_result_batch
from .test_result_batch import WORKER, _answer, _auth, _body, _lease, _post, _results, _setup, _worker_id

coordinator = test_result_batch.coordinator  # (the fixture: an in-process coordinator)

JOB = "00aa11bb22cc"


class FailingCommit:
    """Stands in for ``Store.db``: the next ``fails`` COMMITs raise; all else is the real
    connection's."""

    def __init__(self, db: sqlite3.Connection, rolls_back: bool, fails: int = 1):
        self._db, self.rolls_back, self.fails = db, rolls_back, fails

    def execute(self, sql: str, *args):
        if sql == "COMMIT" and self.fails:
            self.fails -= 1
            if self.rolls_back:
                self._db.execute("ROLLBACK")
            raise sqlite3.OperationalError("database or disk is full")
        return self._db.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._db, name)


def fail_next_commit(store: Store, rolls_back: bool, fails: int = 1) -> FailingCommit:
    store.db = FailingCommit(store.db, rolls_back, fails)  # type: ignore[assignment]
    return store.db


def rows(store: Store) -> dict[int, tuple[str, int, str | None]]:
    """index -> (state, attempts, lease id) as the store has them."""
    return {r[0]: (r[1], r[2], r[3]) for r in store.db.execute(
        "SELECT idx, state, attempts, lease_id FROM tasks WHERE job_id=?", (JOB,))}


def result_files(store: Store) -> list:
    return [p for p in (store.blob_dir / "results").rglob("*") if p.is_file()]


def memory(coord: Coordinator) -> tuple:
    """What the coordinator holds in memory about the job's tasks and their leases."""
    job = coord.jobs[JOB]
    leases = {tid: lease.lease_id for tid, lease in coord.leases.items()}
    held = {wid: set(w.leases) for wid, w in coord.workers.items()}
    return (leases, held, dict(coord.task_meta), len(coord.queue), coord.queue.pending(JOB),
            job.n_final, job.next_seq, job.state)


def watch_wakes(coord: Coordinator) -> list[int]:
    """Calls of the job's notify (what wakes a caller waiting for its results)."""
    job, woken = coord.jobs[JOB], []
    real = job.notify
    job.notify = lambda: (woken.append(job.next_seq), real())  # type: ignore[method-assign]
    return woken


@pytest.mark.parametrize("rolls_back", [True, False], ids=["sqlite-rolled-back", "left-open"])
def test_a_batch_whose_commit_fails_changes_nothing_and_its_re_post_lands(coordinator, rolls_back):
    c, coord = coordinator
    _setup(c, 6, slots=2)
    wid = _worker_id(c)
    g = _lease(c, wid, [0, 1])
    assert len(g) == 2
    before, stored = memory(coord), rows(coord.store)
    woken = watch_wakes(coord)
    batch = [BatchedResult(g[0].task_id, g[0].lease_id, "ok", has_payload=True),
             BatchedResult(g[1].task_id, g[1].lease_id, "error", has_payload=True,
                           error={"kind": "raised", "type": "ValueError", "message": "no"})]
    big = b"R" * (1 << 20)  # kept as a file by the store: the file must go with its row
    fail_next_commit(coord.store, rolls_back)

    r = _post(c, batch, [big, b"E1"], next={0: 3, 1: 2}, idle=[1])
    assert r.status_code == 503, r.text
    assert r.json()["error"] == "internal"
    msg = r.json()["message"]
    assert g[0].task_id in msg and "1 more could not be stored" in msg
    assert "the coordinator's disk is full" in msg and str(coord.store.dir) in msg
    assert memory(coord) == before, "every lease holds, the grants' tasks are pending"
    assert rows(coord.store) == stored
    assert woken == [], "no caller was woken with a result that was not stored"
    assert result_files(coord.store) == []
    assert not coord.store.db.in_transaction

    # the worker's re-post of the same batch (after its backoff) is accepted whole
    r = _post(c, batch, [big, b"E1"], next={0: 3, 1: 2}, idle=[1])
    assert r.status_code == 200, r.text
    head, _ = _answer(r)
    assert head["refused"] == []
    grants = protocol.TaskGrant.list_from_dict(head)
    assert sorted(t.index for t in grants) == [2, 3, 4, 5], "the tasks stayed first in line"
    assert all(t.attempt == 1 for t in grants), "their failed grants were not counted"
    assert woken == [2, 2], "callers are woken once both results are stored"
    got = _results(c)
    assert got[g[0].index] == ("done", big) and got[g[1].index][0] == "failed"
    after = rows(coord.store)
    assert {i: after[i][:2] for i in (g[0].index, g[1].index)} == \
        {g[0].index: ("done", 1), g[1].index: ("failed", 1)}, "each task ran to completion once"
    assert {after[t.index][2] for t in grants} == {t.lease_id for t in grants}
    assert {t.task_id for t in grants} == set(coord.leases)


def test_a_single_result_whose_commit_fails_keeps_its_lease_and_grants_nothing(coordinator):
    c, coord = coordinator
    _setup(c, 3, isolation=None)
    wid = _worker_id(c)
    (g,) = _lease(c, wid, [0])
    before, stored = memory(coord), rows(coord.store)
    woken = watch_wakes(coord)
    body = _body([json.dumps(protocol.ResultPost("ok").as_dict()).encode(), b"v0"])
    url = protocol.task_result(g.task_id) + f"?lease={g.lease_id}&next=1&slot=0"
    fail_next_commit(coord.store, rolls_back=True)

    r = c.post(url, content=body, headers=_auth(WORKER))
    assert r.status_code == 503, r.text
    assert r.json()["error"] == "internal" and g.task_id in r.json()["message"]
    assert memory(coord) == before and rows(coord.store) == stored and woken == []

    r = c.post(url, content=body, headers=_auth(WORKER))
    assert r.status_code == 200, r.text
    (nxt,) = protocol.TaskGrant.list_from_dict(_answer(r)[0])
    assert (nxt.index, nxt.attempt) == (1, 1)
    assert _results(c) == {0: ("done", b"v0")}
    assert woken == [1]


def test_a_retry_and_a_retried_exception_in_a_failed_commit_are_undone(tmp_path):
    store = Store(tmp_path / "data")
    coord = Coordinator(store)
    try:
        w = coord.register({"hostname": "h"}, None, 3)
        coord.submit(JOB, "x", "function", "f" * 64, {"retries": 1, "retry_on": ["OSError"]},
                     [b"a0", b"a1", b"a2", b"a3"], [1.0] * 4, False)
        g = coord._grant(w, 3)
        assert len(g) == 3
        before, stored = memory(coord), rows(store)
        history = dict(store.db.execute("SELECT idx, history FROM tasks"))
        fail_next_commit(store, rolls_back=False)
        with pytest.raises(sqlite3.OperationalError):
            with coord.atomic():
                coord.post_result(g[0].task_id, g[0].lease_id, "retry", {"message": "busy"}, None)
                coord.post_result(g[1].task_id, g[1].lease_id, "error",
                                  {"kind": "raised", "type": "OSError", "message": "flaky"}, None)
                coord.post_result(g[2].task_id, g[2].lease_id, "ok", None, b"v2")
                assert coord.grant_queued(w.id, 0, 1) != [], "memory moved with the writes"
        assert memory(coord) == before
        assert coord.retried == {} and coord.jobs[JOB].avoid == {}
        assert rows(store) == stored
        assert dict(store.db.execute("SELECT idx, history FROM tasks")) == history
        # the re-posts land, and the retried exception still has its one retry left
        assert coord.post_result(g[1].task_id, g[1].lease_id, "error",
                                 {"kind": "raised", "type": "OSError", "message": "flaky"}, None) == w.id
        assert coord.retried == {g[1].task_id: 1}
        assert g[1].task_id in coord.jobs[JOB].avoid
    finally:
        store.close()


def test_a_lease_whose_commit_fails_leaves_its_tasks_in_line(tmp_path):
    store = Store(tmp_path / "data")
    coord = Coordinator(store)
    try:
        w = coord.register({"hostname": "h"}, None, 2)
        coord.submit(JOB, "x", "function", "f" * 64, {}, [b"a0", b"a1", b"a2"], [1.0] * 3, False)
        before, stored = memory(coord), rows(store)
        fail_next_commit(store, rolls_back=True)
        with pytest.raises(sqlite3.OperationalError):
            coord._grant(w, 2)
        assert memory(coord) == before and rows(store) == stored
        assert not store.db.in_transaction
        g = coord._grant(w, 2)
        assert [(x.index, x.attempt) for x in g] == [(0, 1), (1, 1)]
        assert rows(store)[0] == ("leased", 1, g[0].lease_id)
    finally:
        store.close()


def test_a_failed_commit_leaves_the_connection_out_of_its_transaction(tmp_path):
    """SQLite may leave a transaction open when its COMMIT fails: the store rolls it back,
    or every later write would nest, uncommitted, inside it."""
    store = Store(tmp_path / "data")
    try:
        store.create_job(JOB, "x", "function", "f" * 64, {}, [("t0", 0, 1.0, b"a")])
        fail_next_commit(store, rolls_back=False)
        with pytest.raises(sqlite3.OperationalError):
            store.lease([("t0", "l0", "w")])
        assert not store.db.in_transaction
        store.lease([("t0", "l1", "w")])
        other = sqlite3.connect(store.dir / "gpumesh.db")
        assert other.execute("SELECT state, lease_id FROM tasks").fetchall() == [("leased", "l1")]
        other.close()
    finally:
        store.close()


def test_a_submit_whose_commit_fails_is_not_acknowledged_and_may_be_sent_again(coordinator):
    c, coord = coordinator
    c.post(protocol.WORKERS, json={"slots": 1, "hostname": "box"}, headers=_auth(WORKER))
    blob = b"not really a function"
    submit = JobSubmit(job_id=JOB, fn=hashlib.sha256(blob).hexdigest(), n_tasks=2, fn_inline=True)
    body = _body([json.dumps(submit.as_dict()).encode(), blob, b"a0", b"A" * (1 << 20)])
    fail_next_commit(coord.store, rolls_back=True)
    r = c.post(protocol.JOBS, content=body, headers=_auth())
    assert r.status_code == 503, r.text  # a full disk: retry later, nothing kept
    assert r.json()["message"].startswith("the coordinator's disk is full") and str(coord.store.dir) in r.text
    assert JOB not in coord.jobs and not coord.store.job_exists(JOB) and len(coord.queue) == 0
    assert [f for f in (coord.store.blob_dir / "args").rglob("*") if f.is_file()] == []
    r = c.post(protocol.JOBS, content=body, headers=_auth())
    assert r.status_code == 200 and r.json()["created"] is True
    assert coord.queue.pending(JOB) == 2


def test_a_submit_whose_commit_fails_answers_no_waiting_worker(tmp_path):
    """The job and the grant to a worker that long-polls for work are one commit: when it
    fails, the poll is not answered, nothing is leased or queued, and the job is unknown."""
    store = Store(tmp_path / "data")
    coord = Coordinator(store)
    try:
        w = coord.register({"hostname": "h"}, None, 1)

        async def scenario():
            poll = asyncio.ensure_future(coord.lease(w.id, 1, 5.0))
            await asyncio.sleep(0.01)
            fail_next_commit(store, rolls_back=True)
            with pytest.raises(sqlite3.OperationalError):
                coord.submit(JOB, "x", "function", "f" * 64, {}, [b"a0", b"A" * (1 << 20)],
                             [1.0, 1.0], False)
            await asyncio.sleep(0.01)
            assert not poll.done(), "the worker's poll still waits"
            assert (coord.jobs, coord.leases, coord.task_meta, len(coord.queue)) == ({}, {}, {}, 0)
            assert not store.job_exists(JOB)
            assert [f for f in (store.blob_dir / "args").rglob("*") if f.is_file()] == []
            job, created = coord.submit(JOB, "x", "function", "f" * 64, {}, [b"a0", b"a1"],
                                        [1.0, 1.0], False)
            return created, await asyncio.wait_for(poll, 1.0)

        created, grants = asyncio.run(scenario())
        assert created and [(g.index, g.attempt) for g in grants] == [(0, 1)]
        assert rows(store)[0] == ("leased", 1, grants[0].lease_id)
    finally:
        store.close()
