"""Write-ahead-log checkpoints on a thread of their own, never inside a request.

In WAL mode SQLite copies the log back into the database file (a *checkpoint*) by
default inside whichever commit takes the log past 1,000 pages: that commit then waits
for the copy and its fsyncs. The coordinator commits on its event loop, so every request
in flight waited with it: measured on the 2-core VM, one commit in ~500 took 4-5 ms
instead of 0.02 ms (more on a busy disk). :class:`Store` turns the automatic checkpoint
off on its connection and runs a :class:`Checkpointer`, which every ``CHECKPOINT_S`` runs
a ``PASSIVE`` checkpoint on a connection of its own. A passive checkpoint never blocks a
writer or a reader (SQLite, "Checkpoint a database", sqlite3_wal_checkpoint_v2), and
Python's sqlite3 releases the GIL while SQLite works, so the event loop keeps running.

Durability is unchanged: a commit is in the log (and, with ``synchronous=FULL``, on disk)
before it returns, whoever checkpoints it later. The log is bounded: the coordinator holds
no long read transaction, so each checkpoint copies all of it and the next writer starts
the log over; ``journal_size_limit`` truncates a log a burst grew.

**Starting the log over is this thread's work too.** The first commit after a checkpoint
that copied the whole log writes a new log header and fsyncs it (SQLite does so even
with ``synchronous=NORMAL``: an out-of-order write after a restart could corrupt the
database). After a quiet spell that fsync fell on the first request's commit, on the
event loop: milliseconds on the first call after a pause (docs/performance.md, "Ninth
session"). So once the database has been quiet for a whole interval after a checkpoint
that copied everything, the thread makes that first write itself: it rewrites the
database's ``user_version`` with the value it has (a one-page transaction that changes
nothing). The next request's commit then appends
to a log already started. It does this once per quiet spell; a request that comes while
the header is being synced waits for SQLite's write lock (``busy_timeout``), which only
a request in that millisecond or so after a second of quiet can meet.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

from ..limits import CHECKPOINT_S

log = logging.getLogger("gpumesh.coordinator")

#: A log a burst of writes grew is cut back to this size once it starts over (bytes).
JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024


class Checkpointer:
    """Runs ``PRAGMA wal_checkpoint(PASSIVE)`` on the database at ``path`` every
    ``interval`` seconds, on a daemon thread with its own connection, until :meth:`close`.
    Raises ``sqlite3.Error`` if the database cannot be opened (the caller then keeps
    SQLite's automatic checkpoint)."""

    def __init__(self, path: Path | str, interval: float = CHECKPOINT_S) -> None:
        self.interval = interval
        self.checkpoints = 0  # passive checkpoints that ran (for tests and diagnostics)
        self.restarts = 0  # logs this thread started over after a quiet spell (see above)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA busy_timeout=5000")
        # It may be this connection that starts the log over, and so truncates it.
        self._db.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wal-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failing = False
        seen = None  # the database's data_version at the last checkpoint
        copied = False  # that checkpoint copied the whole log: its next writer restarts it
        restarted = False  # this thread has started the log over since that checkpoint
        while not self._stop.wait(self.interval):
            try:
                # data_version changes when another connection commits (not this one).
                version = self._db.execute("PRAGMA data_version").fetchone()[0]
                if version != seen or not copied:
                    busy, log_frames, done = self._db.execute(
                        "PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    seen, copied, restarted = version, busy == 0 and done == log_frames, False
                    self.checkpoints += 1
                elif not restarted:  # quiet for an interval, the whole log copied
                    value = self._db.execute("PRAGMA user_version").fetchone()[0]
                    self._db.execute(f"PRAGMA user_version={int(value)}")
                    restarted = True
                    self.restarts += 1
                failing = False
            except sqlite3.Error as e:  # (a full disk...) the next round tries again
                if not failing:
                    log.warning("could not checkpoint the database's write-ahead log: %s", e)
                failing = True

    def close(self) -> None:
        """Stop the thread (waiting for a checkpoint in progress) and close its connection."""
        self._stop.set()
        self._thread.join(30)
        try:
            self._db.close()
        except sqlite3.Error:
            pass
