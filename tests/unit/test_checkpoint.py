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
        while path.stat().st_size < 1000 * 4096 and time.monotonic() < deadline:
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
