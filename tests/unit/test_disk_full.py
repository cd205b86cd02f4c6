"""A store write that fails for lack of space changes nothing, is answered 503 naming
the data directory, and is logged once per spell; what must not fail with it (a
heartbeat, a worker found gone, a caller's expiry) keeps going and tries again later.

The fault is the one of test_commit_fails.py: a real Store whose next COMMITs raise
``sqlite3.OperationalError("database or disk is full")`` as SQLite does."""

from __future__ import annotations

import errno
import logging
import sqlite3

import pytest

from gpumesh import protocol
from gpumesh.coordinator import diskfull
from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.model import NotStored
from gpumesh.coordinator.store import Store

from . import test_result_batch
from .test_commit_fails import JOB, fail_next_commit, memory, rows, watch_wakes
from .test_result_batch import WORKER, _auth, _lease, _setup, _worker_id

coordinator = test_result_batch.coordinator  # (the fixture: an in-process coordinator)

FULL = "database or disk is full"


@pytest.fixture
def coord(tmp_path):
    store = Store(tmp_path / "data")
    yield Coordinator(store)
    store.close()


def _job(coord: Coordinator, n: int = 5, slots: int = 2):
    w = coord.register({"hostname": "h"}, None, slots)
    coord.submit(JOB, "x", "function", "f" * 64, {}, [f"a{i}".encode() for i in range(n)], [1.0] * n, False)
    return w, coord._grant(w, slots)


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("exc, full", [
    (sqlite3.OperationalError(FULL), True),
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (sqlite3.OperationalError("disk I/O error"), False),
    (sqlite3.OperationalError("database is locked"), False),
    (OSError(errno.EACCES, "Permission denied"), False),
    (ValueError("database or disk is full"), False),
])
def test_a_full_disk_is_told_apart_from_other_failures(exc, full):
    assert diskfull.is_full(exc) is full


def test_a_real_sqlite_full_error_is_a_full_disk(tmp_path):
    db = sqlite3.connect(tmp_path / "x.db")
    db.execute("CREATE TABLE t (x)")
    db.execute("PRAGMA max_page_count=2")  # the file may not grow: SQLITE_FULL
    with pytest.raises(sqlite3.Error) as e:
        db.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    assert diskfull.is_full(e.value)
    db.close()


@pytest.mark.parametrize("rolls_back", [True, False], ids=["sqlite-rolled-back", "left-open"])
def test_a_cancel_whose_commit_fails_changes_nothing_and_tells_no_worker(coord, rolls_back):
    w, g = _job(coord)
    before, stored = memory(coord), rows(coord.store)
    woken = watch_wakes(coord)
    fail_next_commit(coord.store, rolls_back)
    with pytest.raises(sqlite3.OperationalError):
        coord.cancel(JOB)
    assert memory(coord) == before, "the leases hold, the tasks are in line, the counts as stored"
    assert rows(coord.store) == stored
    assert list(w.outbox) == [], "no worker was told to cancel"
    assert woken == [] and coord.jobs[JOB].state == "active"
    assert coord.store.job_row(JOB)["state"] == "active"

    # sent again once there is room: all of it
    assert coord.cancel(JOB) == 5
    assert sorted(w.outbox) == sorted(f"cancel {x.task_id}" for x in g)
    assert {s for s, *_ in rows(coord.store).values()} == {"cancelled"}
    assert coord.jobs[JOB].state == "cancelled" and coord.store.job_row(JOB)["state"] == "cancelled"
    assert coord.leases == {} and len(coord.queue) == 0 and len(woken) == 1


def test_a_cancel_inside_a_commit_that_fails_later_is_undone(coord):
    w, g = _job(coord)
    before, stored = memory(coord), rows(coord.store)
    fail_next_commit(coord.store, rolls_back=True)
    with pytest.raises(sqlite3.OperationalError):
        with coord.atomic():
            assert coord.cancel(JOB) == 5
            assert coord.leases == {}, "memory moved with the writes"
    assert memory(coord) == before and rows(coord.store) == stored and list(w.outbox) == []
    assert coord.cancel(JOB) == 5


def test_a_cancel_answers_503_naming_the_data_directory_and_is_logged_once_per_spell(coordinator, caplog):
    c, coord = coordinator
    _setup(c, 4, slots=2)
    _lease(c, _worker_id(c), [0, 1])
    before = memory(coord)
    caplog.set_level(logging.INFO, "gpumesh.coordinator")
    fail_next_commit(coord.store, rolls_back=True, fails=3)
    for _ in range(3):
        r = c.post(protocol.job_cancel(JOB), headers=_auth())
        assert r.status_code == 503, r.text
        msg = r.json()["message"]
        assert msg.startswith("the coordinator's disk is full") and str(coord.store.dir) in msg
        assert "nothing of this request was stored" in msg
    assert memory(coord) == before
    errors = _errors(caplog)
    assert len(errors) == 1 and str(coord.store.dir) in errors[0], errors
    assert not any("Traceback" in (r.exc_text or "") for r in caplog.records)

    r = c.post(protocol.job_cancel(JOB), headers=_auth())
    assert r.status_code == 200 and r.json()["cancelled"] == 4
    assert any("has room again" in r.getMessage() for r in caplog.records)
    assert coord.store.full.since is None


def test_a_lease_whose_grant_cannot_be_stored_answers_503_and_leases_nothing(coordinator):
    """Not only the result posts: any route whose write fails for lack of space."""
    c, coord = coordinator
    _setup(c, 3)
    wid = _worker_id(c)
    fail_next_commit(coord.store, rolls_back=True, fails=1)
    r = c.post(protocol.worker_lease(wid), json={"slots": 1}, headers=_auth(WORKER))
    assert r.status_code == 503 and "disk is full" in r.json()["message"], r.text
    assert coord.leases == {} and coord.queue.pending(JOB) == 3
    g = _lease(c, wid, [0])
    assert len(g) == 1


def test_a_heartbeat_whose_re_queue_cannot_be_stored_still_answers_and_the_sweep_retries(coord):
    w, g = _job(coord, slots=1)
    coord.leases[g[0].task_id].delivered = -100.0  # sent long ago; the worker no longer has it
    fail_next_commit(coord.store, rolls_back=True)
    assert coord.heartbeat(w.id, [], None) == {"cancel": []}
    assert g[0].task_id in coord.leases, "nothing changed"
    assert coord.unrequeued == {g[0].task_id: (g[0].lease_id, "the worker no longer reported it")}
    coord.sweep()
    assert g[0].task_id not in coord.leases and coord.queue.pending(JOB) == 5
    assert coord.unrequeued == {}


def test_a_worker_gone_while_the_disk_is_full_has_its_tasks_re_queued_by_a_later_sweep(coord):
    w, g = _job(coord)
    fail_next_commit(coord.store, rolls_back=False, fails=2)
    assert coord.deregister(w.id) == 2
    assert not w.alive and set(coord.leases) == {x.task_id for x in g}
    coord.sweep()  # the disk is still full: nothing changes, and it is tried again
    assert set(coord.leases) == {x.task_id for x in g} and len(coord.unrequeued) == 2
    coord.sweep()
    assert coord.leases == {} and coord.queue.pending(JOB) == 5 and coord.unrequeued == {}
    assert {s for s, *_ in rows(coord.store).values()} == {"pending"}


def test_a_stalled_re_queue_skips_a_lease_that_ended_meanwhile(coord):
    w, g = _job(coord, slots=1)
    coord.unrequeued[g[0].task_id] = ("another-lease", "old news")
    coord.sweep()
    assert g[0].task_id in coord.leases and coord.unrequeued == {}


def test_a_hand_back_whose_re_queue_cannot_be_stored_keeps_its_lease_and_notes_nothing(coord):
    w, g = _job(coord, slots=1)
    before, stored = memory(coord), rows(coord.store)
    fail_next_commit(coord.store, rolls_back=True)
    with pytest.raises(sqlite3.OperationalError):
        coord.hand_back(g[0].task_id, g[0].lease_id, "paused: owner")
    assert memory(coord) == before and rows(coord.store) == stored
    assert not (coord.store.dir / "logs" / JOB).exists(), "no note of a hand-back that did not happen"
    coord.hand_back(g[0].task_id, g[0].lease_id, "paused: owner")
    assert g[0].task_id not in coord.leases
    assert "preempted" in (coord.store.dir / "logs" / JOB / f"{g[0].task_id}.err").read_text()


def test_a_hand_back_stands_when_its_log_note_cannot_be_written(coord, monkeypatch):
    w, g = _job(coord, slots=1)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(coord.output, "append", full)
    coord.hand_back(g[0].task_id, g[0].lease_id, "paused: owner")
    assert g[0].task_id not in coord.leases and coord.queue.pending(JOB) == 5
    assert coord.store.full.since is not None


def test_an_expired_caller_whose_cancel_cannot_be_stored_is_tried_again(coord):
    now = [1000.0]
    coord.callers._clock = lambda: now[0]
    w, g = _job(coord)
    coord.callers.heard(coord, [JOB])
    now[0] += coord.callers.timeout + 100
    fail_next_commit(coord.store, rolls_back=True)
    assert coord.callers.expire(coord) == []
    assert coord.jobs[JOB].state == "active" and JOB in coord.callers.last
    now[0] += 100
    assert coord.callers.expire(coord) == [JOB]
    assert JOB not in coord.jobs and coord.store.job_row(JOB)["state"] == "cancelled"


def test_not_stored_says_what_failed_when_it_is_not_a_full_disk(tmp_path):
    e = NotStored(sqlite3.OperationalError("disk I/O error"), tmp_path)
    assert e.status == 503 and "disk I/O error" in e.message and "full" not in e.message
