"""The store's work per task and per call, made smaller (docs/performance.md, "Tenth
session"): no index on a task's state or finish time (each lease and result would write
them), so start-up's open tasks and the usage figures find the tasks through their jobs
(checked here against the rows themselves); a batch of releases in one commit; a stored
function blob looked up once."""

from __future__ import annotations

from gpumesh.coordinator.store import Store
from gpumesh.coordinator.usage import USAGE_CLOCK_SLACK_S, task_time


def _job(store: Store, job_id: str, n: int, owner: str | None = None) -> list[str]:
    tids = [f"{job_id}t{i}" for i in range(n)]
    store.create_job(job_id, "f", "function", None, {}, [(t, i, 1.0, b"a") for i, t in enumerate(tids)],
                     owner=owner)
    return tids


def _times(store: Store, tid: str, started: float, finished: float) -> None:
    store.db.execute("UPDATE tasks SET started=?, finished=? WHERE id=?", (started, finished, tid))


def test_a_data_directory_with_the_old_indexes_loses_them_and_keeps_its_tasks(tmp_path):
    store = Store(tmp_path)
    _job(store, "j1", 3)
    store.db.execute("CREATE INDEX tasks_open ON tasks (state) WHERE state IN ('pending', 'leased')")
    store.db.execute("CREATE INDEX tasks_finished ON tasks (finished) WHERE finished IS NOT NULL")
    store.close()
    store = Store(tmp_path)
    names = {r[0] for r in store.db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "tasks_open" not in names and "tasks_finished" not in names
    assert {"tasks_seq", "jobs_finished"} <= names
    assert [t.id for t in store.open_tasks()] == ["j1t0", "j1t1", "j1t2"]
    store.close()


def test_open_tasks_are_the_pending_and_leased_ones_of_unreleased_jobs_in_order(tmp_path):
    store = Store(tmp_path)
    a = _job(store, "ja", 4)
    b = _job(store, "jb", 2)
    c = _job(store, "jc", 2)
    store.lease([(a[1], "L1", "w1"), (b[0], "L2", "w2")])
    store.finish(a[0], "done", 0, None, b"r", "ja")
    store.finish(a[3], "failed", 1, {"kind": "raised"}, None, "ja")
    store.finish(c[0], "done", 0, None, b"r", "jc")
    store.finish(c[1], "done", 1, None, b"r", "jc", job_finished=True)
    store.release_job("jc")
    got = [(t.id, t.state, t.lease_id, t.worker_id) for t in store.open_tasks()]
    assert got == [(a[1], "leased", "L1", "w1"), (a[2], "pending", None, None),
                   (b[0], "leased", "L2", "w2"), (b[1], "pending", None, None)]
    # the same as a scan of every row gives (what the old index served)
    rows = store.db.execute("SELECT id FROM tasks WHERE state IN ('pending', 'leased')"
                            " ORDER BY rowid").fetchall()
    assert [r[0] for r in rows] == [g[0] for g in got]
    store.close()


def test_usage_counts_the_tasks_finished_in_the_window_whatever_their_job_state(tmp_path):
    store = Store(tmp_path)
    now = 1_000_000.0
    since = now - 100
    old = _job(store, "old", 2, owner="ann")        # finished before the window
    span = _job(store, "span", 2, owner="ann")      # one task before, one in the window
    live = _job(store, "live", 2, owner="bob")      # still running: one task finished
    step = _job(store, "step", 1, owner="bob")      # its job's time a little before its task's
    for t in old:
        _times(store, t, now - 500, now - 400)
    store.db.execute("UPDATE jobs SET state='finished', finished=? WHERE id='old'", (now - 400,))
    _times(store, span[0], now - 300, now - 200)
    _times(store, span[1], now - 50, now - 20)
    store.db.execute("UPDATE jobs SET state='finished', finished=? WHERE id='span'", (now - 20,))
    _times(store, live[0], now - 30, now - 10)
    _times(store, step[0], now - 40, now - 5)
    store.db.execute("UPDATE jobs SET state='finished', finished=? WHERE id='step'",
                     (since - USAGE_CLOCK_SLACK_S / 2,))
    store.db.execute("UPDATE tasks SET gpu=1 WHERE id=?", (live[0],))
    got = task_time(store, since)
    assert got == {"ann": {"gpu_s": 0.0, "cpu_s": 30.0, "tasks": 1},
                   "bob": {"gpu_s": 20.0, "cpu_s": 35.0, "tasks": 2}}
    # the same figures as a scan of every task finished in the window
    brute: dict = {}
    for owner, gpu, st, fin in store.db.execute(
            "SELECT j.owner, COALESCE(t.gpu, 0), t.started, t.finished FROM tasks t"
            " JOIN jobs j ON j.id = t.job_id WHERE t.finished >= ?", (since,)):
        d = brute.setdefault(owner, {"gpu_s": 0.0, "cpu_s": 0.0, "tasks": 0})
        d["gpu_s" if gpu else "cpu_s"] += fin - st
        d["tasks"] += 1
    assert got == brute
    store.close()


def test_usage_reads_jobs_first_not_every_task(tmp_path):
    """The plan of the query ``usage`` runs: jobs scanned, each one's tasks found by its
    key, never a scan of the tasks table."""
    store = Store(tmp_path)
    _job(store, "j1", 2, owner="ann")
    ran: list[str] = []
    store.db.set_trace_callback(ran.append)  # (the statement with its values bound)
    task_time(store, 0.0)
    store.db.set_trace_callback(None)
    [query] = [q for q in ran if "FROM jobs" in q]
    plan = [r[3] for r in store.db.execute("EXPLAIN QUERY PLAN " + query)]
    assert any(p.startswith("SEARCH t USING INDEX") for p in plan), plan
    assert not any(p.startswith("SCAN t") for p in plan), plan
    store.close()


def test_a_batch_of_releases_is_one_commit_and_frees_every_payload(tmp_path):
    from gpumesh.limits import INLINE_BLOB_BYTES
    store = Store(tmp_path)
    big = b"x" * (INLINE_BLOB_BYTES + 1)  # stored as files
    for j in ("r1", "r2", "r3"):
        tids = [f"{j}t0", f"{j}t1"]
        store.create_job(j, "f", "function", None, {}, [(tids[0], 0, 1.0, big), (tids[1], 1, 1.0, b"a")])
        store.finish(tids[0], "done", 0, None, big, j)
        store.finish(tids[1], "done", 1, None, b"r", j, job_finished=True)
    files = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file() and "r" in p.parent.name]
    assert len(files) == 6  # an argument and a result file per job
    ran: list[str] = []
    store.db.set_trace_callback(ran.append)
    store.release_jobs(["r1", "r3"])
    store.db.set_trace_callback(None)
    assert sum(q.strip().upper() == "COMMIT" for q in ran) == 1
    released = dict(store.db.execute("SELECT id, released FROM jobs"))
    assert released == {"r1": 1, "r2": 0, "r3": 1}
    left = store.db.execute("SELECT job_id FROM tasks WHERE result IS NOT NULL OR result_file IS NOT NULL"
                            " OR args IS NOT NULL OR args_file IS NOT NULL").fetchall()
    assert {r[0] for r in left} == {"r2"}
    assert store.reaper.flush(10)  # (the files go on the store's reaper thread)
    assert sorted(p.parent.name for p in files if p.exists()) == ["r2", "r2"]
    for sub in ("args", "results"):  # the emptied job directories are gone too
        assert sorted(p.name for p in (tmp_path / "blobs" / sub).iterdir()) == ["r2"]
    store.close()


def test_a_function_blob_is_looked_up_once_until_purge_deletes_it(tmp_path):
    store = Store(tmp_path)
    h = "ab" * 32
    assert store.has_blob(h) is False
    store.put_blob(h, [b"code"])
    ran: list[str] = []
    store.db.set_trace_callback(ran.append)
    assert store.has_blob(h) and store.has_blob(h) and store.blob_file(h) is not None
    store.db.set_trace_callback(None)
    assert sum("FROM blobs" in q for q in ran) <= 1
    store.db.execute("UPDATE blobs SET created=0")
    store.purge_before(1.0)  # no job uses it: deleted, and forgotten
    assert store.has_blob(h) is False and store.blob_file(h) is None
    store.close()
