"""The store's write-ahead log is checkpointed on a thread of its own, never inside a
commit (gpumesh.coordinator.checkpoint)."""

from __future__ import annotations

import sqlite3
import threading
import time

from gpumesh.coordinator.checkpoint import Checkpointer
from gpumesh.coordinator.store import Store


def _fill(db: sqlite3.Connection, rows: int) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS filler (id INTEGER PRIMARY KEY, b BLOB)")
    for _ in range(rows):
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO filler (b) VALUES (zeroblob(3000))")
        db.execute("COMMIT")


def test_commits_never_checkpoint(tmp_path):
    store = Store(tmp_path)
    try:
        assert store.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        assert store.checkpointer is not None
        assert any(t.name == "wal-checkpoint" for t in threading.enumerate())
    finally:
        store.close()
    assert not any(t.name == "wal-checkpoint" and t.is_alive() for t in threading.enumerate())


def test_the_thread_copies_the_log_into_the_database(tmp_path):
    path = tmp_path / "t.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    _fill(db, 1500)  # ~1,500 pages: past the 1,000 at which a commit would checkpoint
    # Until a checkpoint, the rows are only in the log: the database file stays small.
    assert path.stat().st_size < 100 * 4096
    assert (tmp_path / "t.db-wal").stat().st_size > 1000 * 4096
    ck = Checkpointer(path, interval=0.05)
    try:
        deadline = time.monotonic() + 20
        # (the count goes up just after the copy: wait for both)
        while ((path.stat().st_size < 1000 * 4096 or ck.checkpoints < 1)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert path.stat().st_size >= 1000 * 4096
        assert ck.checkpoints >= 1
    finally:
        ck.close()
        db.close()


def test_committed_rows_survive_a_reopen(tmp_path):
    store = Store(tmp_path)
    _fill(store.db, 1200)
    store.close()
    again = Store(tmp_path)
    try:
        assert again.db.execute("SELECT COUNT(*) FROM filler").fetchone()[0] == 1200
    finally:
        again.close()


def _wal_header(path) -> bytes:
    with open(f"{path}-wal", "rb") as f:
        return f.read(32)  # magic, version, page size, checkpoint sequence, salts, checksums


def test_after_a_quiet_spell_the_thread_starts_the_log_over_not_the_next_commit(tmp_path):
    # The commit that starts the log over fsyncs its new header (even with
    # synchronous=NORMAL): after a quiet spell the checkpoint thread makes that write,
    # so a request's commit finds the log started and only appends to it.
    path = tmp_path / "t.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    _fill(db, 20)
    before = _wal_header(path)
    ck = Checkpointer(path, interval=0.05)
    try:
        deadline = time.monotonic() + 20
        while _wal_header(path) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        started = _wal_header(path)
        assert started != before, "the thread started the log over (a new header, new salts)"
        ck.close()  # (no checkpoint of its own can come between now and the next assert)
        assert ck.restarts == 1 and ck.checkpoints >= 1
        _fill(db, 3)  # the next commits, after the quiet spell
        assert _wal_header(path) == started, "they appended to the log the thread started"
        assert db.execute("SELECT COUNT(*) FROM filler").fetchone()[0] == 23
        assert db.execute("PRAGMA user_version").fetchone()[0] == 0  # rewritten as it was
    finally:
        ck.close()
        db.close()
