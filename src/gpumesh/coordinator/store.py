"""The coordinator's durable state: every SQL statement gpumesh runs lives here.

SQLite in WAL mode, ``synchronous=NORMAL``: a transaction is durable once ``commit``
returns as far as a *process* crash is concerned (SIGKILL of the coordinator loses
nothing it acknowledged); the WAL is fsynced at checkpoints, so a power cut may lose the
last transactions before one. ``GPUMESH_SYNC=FULL`` fsyncs on every commit instead.
Checkpoints run on a thread of their own (:mod:`.checkpoint`), never inside a commit.

Payloads (function blobs, task arguments, results) up to ``INLINE_BLOB_BYTES`` live in
rows; larger ones are files under ``<data_dir>/blobs`` written to a temporary name and
renamed before the row that points at them is committed, so a row never points at a
half-written file (with ``GPUMESH_SYNC=FULL`` they are fsynced before the rename too).
A big payload arriving in a request body is written to such a file as it streams in
(:meth:`Store.incoming`, under ``<data_dir>/blobs/incoming``) and *adopted* - renamed into
place - when its row is stored; one never adopted is deleted with its request, and any
left by a crash are deleted on start. A sender on this machine may instead write a big
payload into ``<data_dir>/blobs/handoff`` itself and name the file (:meth:`Store.take_handoff`,
see :mod:`gpumesh.handoff`); it is adopted the same way. Function blobs are
content-addressed (sha256).

All methods are synchronous and fast (no method scans all tasks); the coordinator calls
them from its event loop. Released payload files are deleted by a thread of their own
(:mod:`.reaper`), after their rows stop naming them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
import stat
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any, cast
from dataclasses import dataclass
from pathlib import Path

from .. import handoff
from .. import limits
from ..limits import INLINE_BLOB_BYTES
from ..wire import Chunk
from .checkpoint import JOURNAL_SIZE_LIMIT, Checkpointer
from .diskfull import Spell
from .reaper import Reaper
from .freeing import Freeing
from .tables import ARGS_PER_QUERY, INDEXES, MIGRATIONS, SCHEMA, UNRELEASED_JOBS

log = logging.getLogger("gpumesh.coordinator")

class Incoming:
    """A payload being written to a temporary file as its bytes arrive (see
    :meth:`Store.incoming`). ``write`` the bytes, ``finish`` it, then hand it to the store in
    place of the bytes (``create_job``, ``finish``, ``put_blob``), which renames it into
    place. ``discard`` deletes it unless the store adopted it; it is safe to call twice."""

    __slots__ = ("path", "size", "_fh", "_full_sync")

    def __init__(self, path: Path, full_sync: bool):
        self.path: Path | None = path
        self.size = 0
        self._full_sync = full_sync
        self._fh: IO[bytes] | None = open(path, "xb")

    @classmethod
    def claimed(cls, path: Path, size: int, full_sync: bool) -> Incoming:
        """A file a sender wrote whole into the handoff directory (see
        :meth:`Store.take_handoff`): already finished, adopted like any other."""
        inc = cls.__new__(cls)
        inc.path, inc.size, inc._fh, inc._full_sync = path, size, None, full_sync
        return inc

    def write(self, data: Chunk) -> None:
        assert self._fh is not None, "write after finish"
        self.size += self._fh.write(data)

    def finish(self) -> None:
        """All bytes are written: flush them (and fsync under ``GPUMESH_SYNC=FULL``)."""
        fh, self._fh = self._fh, None
        if fh is None:
            return
        try:
            fh.flush()
            if self._full_sync:  # same promise as Store._write_file
                os.fsync(fh.fileno())
        finally:
            fh.close()

    def sha256(self) -> str:
        import hashlib
        h = hashlib.sha256()
        assert self.path is not None, "sha256 of an adopted payload"
        with open(self.path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()

    def _adopted(self) -> Path:
        if self._fh is not None or self.path is None:
            raise ValueError("an incoming payload must be finished (and not adopted yet)")
        path, self.path = self.path, None
        return path

    def discard(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self.path is not None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self.path = None


@dataclass
class OpenTask:
    """A task that is pending or leased, as loaded at start-up."""

    id: str
    job_id: str
    idx: int
    state: str
    attempts: int
    cost: float
    lease_id: str | None
    worker_id: str | None
    retried: int = 0  # re-runs after a crash or retry_on exception (coordinator.requeue.retry_failed)
    raised_on: tuple[str, ...] = ()  # the workers where those attempts raised
    preempted: int = 0  # attempts its workers handed back (not losses)


@dataclass
class FinalTask:
    """A task whose result (value or failure) is final."""

    id: str
    idx: int
    state: str
    seq: int
    worker_id: str | None
    error: dict[str, Any] | None
    result: bytes | None
    result_file: str | None
    result_size: int



class Store(Freeing):
    """SQLite + files under ``data_dir``. Raises ``OSError``/``sqlite3.Error`` if unusable."""

    def __init__(self, data_dir: Path):
        self.dir = Path(data_dir)
        self.blob_dir = self.dir / "blobs"
        #: Whether its writes fail for lack of space now (see :mod:`.diskfull`).
        self.full = Spell(self.dir)
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.incoming_dir = self.blob_dir / "incoming"
        # What a crash left mid-upload: no row can point there (adopted files are renamed
        # out of this directory before their row commits).
        shutil.rmtree(self.incoming_dir, ignore_errors=True)
        self.incoming_dir.mkdir(exist_ok=True)
        # Same-machine senders write payloads here (gpumesh.handoff); what is left from
        # before a restart was never claimed. The probe file proves to a would-be sender
        # that it sees this very directory.
        self.handoff_dir = self.blob_dir / "handoff"
        shutil.rmtree(self.handoff_dir, ignore_errors=True)
        self.handoff_dir.mkdir(mode=0o700)
        self.handoff_nonce = os.urandom(16).hex()
        (self.handoff_dir / handoff.PROBE).write_text(self.handoff_nonce, encoding="ascii")
        #: Inside :meth:`transaction`: the payload files written for its rows (removed
        #: when its commit fails); None outside one.
        self._written: list[str] | None = None
        #: Deletes released payload files off the event loop, or gives them to
        #: the handoff pool (see .reaper and gpumesh.handoff).
        self.reaper = Reaper(self.handoff_dir, handoff.pool_bytes())
        #: ``(job id, "args" or "result")``: whether that job's argument or result files
        #: went, so far, only by path to readers that map under locks: True (released,
        #: they may be pooled); False or absent, never pooled (see :meth:`note_readers`).
        self._pool_ok: dict[tuple[str, str], bool] = {}
        #: Function blobs known to be stored (see :meth:`has_blob`).
        self._blobs: set[str] = set()
        self.db = sqlite3.connect(self.dir / "gpumesh.db", isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        sync = limits.setting("GPUMESH_SYNC")  # NORMAL or FULL; SettingError otherwise
        self.full_sync = sync == "FULL"
        self.db.execute(f"PRAGMA synchronous={sync}")
        self.db.execute("PRAGMA busy_timeout=5000")
        self.db.executescript(SCHEMA)
        for table, column, kind in MIGRATIONS:
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self.db.executescript(INDEXES)
        # Checkpoints run on a thread of their own, not inside a commit on the event loop
        # (see .checkpoint); SQLite's automatic one stays on if that thread cannot start.
        self.checkpointer: Checkpointer | None = None
        try:
            self.checkpointer = Checkpointer(self.dir / "gpumesh.db")
        except sqlite3.Error as e:
            log.warning("checkpoints stay inside commits: %s", e)
        else:
            self.db.execute("PRAGMA wal_autocheckpoint=0")
            self.db.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")

    def close(self) -> None:
        self.reaper.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        """One explicit transaction (the connection is in autocommit mode otherwise);
        inside :meth:`transaction`, a savepoint: its writes all land, or none does."""
        if self.db.in_transaction:
            self.db.execute("SAVEPOINT tx")
            try:
                yield
            except BaseException:
                self.db.execute("ROLLBACK TO tx")
                self.db.execute("RELEASE tx")
                raise
            self.db.execute("RELEASE tx")
            return
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self._commit()

    def _commit(self) -> None:
        """COMMIT; when it fails (a full disk, an I/O error, a busy database), roll back
        what SQLite left open, so the connection is usable and the next write is not
        nested, uncommitted, inside the failed transaction. Raises ``sqlite3.Error``."""
        try:
            self.db.execute("COMMIT")
        except sqlite3.Error:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise
        if self.full.since is not None:
            self.full.cleared()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Every write made inside in one commit, instead of one each (a commit costs as
        much as a few small writes). It commits when the block raises too: the
        coordinator's memory already holds each write that ran, so the store keeps them,
        as it would have with one commit each. Nested, the outermost one commits. A
        commit that fails is rolled back (the connection stays usable) and raises
        ``sqlite3.Error``; the payload files its rows would have pointed at are removed."""
        if self.db.in_transaction:
            yield
            return
        self.db.execute("BEGIN IMMEDIATE")
        self._written = []
        try:
            yield
        finally:
            written, self._written = self._written, None
            try:
                self._commit()
            except sqlite3.Error:
                for rel in written:  # payload files of rows that are gone
                    self._remove_file(rel)
                raise

    # ---------------------------------------------------------- files ------------
    def _write_file(self, rel: str, chunks: Iterable[Chunk]) -> int:
        path = self.blob_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        n = 0
        with open(tmp, "wb") as fh:
            for c in chunks:
                n += fh.write(c)
            fh.flush()
            if self.full_sync:  # same promise as the database: see the module docstring
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        return n

    def file_path(self, rel: str) -> Path:
        return self.blob_dir / rel

    def incoming(self) -> Incoming:
        """A new temporary file for a payload that is still arriving (see :class:`Incoming`)."""
        return Incoming(self.incoming_dir / f"{os.urandom(12).hex()}.tmp", self.full_sync)

    def _adopt(self, rel: str, data: Incoming) -> int:
        """Rename a finished incoming file to ``rel``. Returns its size."""
        path = self.blob_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(data._adopted(), path)
        return data.size

    def _store_payload(self, rel: str, data: Chunk | Incoming) -> tuple[bytes | None, str | None]:
        """Inline small payloads, write big ones to a file (or adopt the file they were
        streamed into). Returns (inline, file)."""
        if isinstance(data, Incoming):
            self._adopt(rel, data)
            return None, rel
        if memoryview(data).nbytes <= INLINE_BLOB_BYTES:
            return bytes(data), None
        self._write_file(rel, [data])
        return None, rel

    def take_handoff(self, name: str) -> Incoming:
        """Claim the payload a same-machine sender wrote to ``handoff/<name>`` (see
        :mod:`gpumesh.handoff`); the store adopts it like a streamed upload. Raises
        ``ValueError`` for a name that is not a handoff file name, ``FileNotFoundError``
        if no such regular file of ours is there (already claimed, swept, or never
        written)."""
        if not isinstance(name, str) or not handoff.NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a handoff file name")
        if not hasattr(os, "getuid"):  # senders never hand off to such a coordinator
            raise FileNotFoundError(f"handoff file {name}: not supported on this system")
        path = self.handoff_dir / name
        st = os.lstat(path)  # FileNotFoundError: not there
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise FileNotFoundError(f"handoff file {name} is not a regular file of ours")
        if self.full_sync:  # the sender wrote without fsync: same promise as Incoming
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return Incoming.claimed(path, st.st_size, self.full_sync)

    def sweep_handoff(self, older_than: float) -> int:
        """Delete handoff files last written before ``older_than`` (epoch seconds): their
        senders died before sending. Returns how many."""
        n = 0
        with os.scandir(self.handoff_dir) as it:
            for e in it:
                try:
                    if handoff.NAME.fullmatch(e.name) and e.stat(follow_symlinks=False).st_mtime < older_than:
                        os.unlink(e.path)
                        n += 1
                except FileNotFoundError:
                    pass
        return n

    def _remove_file(self, rel: str | None) -> None:
        if rel:
            try:
                (self.blob_dir / rel).unlink()
            except FileNotFoundError:
                pass

    # ---------------------------------------------------------- function blobs ---
    def has_blob(self, h: str) -> bool:
        """Whether blob ``h`` is stored. A submit asks for its function's every time: a
        blob found committed is remembered (until :meth:`purge_before` deletes it), so
        the repeat calls of one function skip the query."""
        if h in self._blobs:
            return True
        found = self.db.execute("SELECT 1 FROM blobs WHERE hash=?", (h,)).fetchone() is not None
        if found and not self.db.in_transaction:  # (a row not committed yet may still go)
            self._blobs.add(h)
        return found

    def put_blob(self, h: str, chunks: Iterable[Chunk] | Incoming) -> None:
        """Store a content-addressed blob (its bytes, or the finished incoming file holding
        them). The caller has verified that sha256 == ``h``."""
        if self.has_blob(h):
            return
        if isinstance(chunks, Incoming):
            size = self._adopt(f"fn/{h[:2]}/{h}", chunks)
        else:
            size = self._write_file(f"fn/{h[:2]}/{h}", chunks)
        self.db.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?, ?)", (h, size, time.time()))

    def blob_file(self, h: str) -> Path | None:
        if not self.has_blob(h):
            return None
        return self.blob_dir / "fn" / h[:2] / h

    # ---------------------------------------------------------- jobs -------------
    def create_job(self, job_id: str, name: str, kind: str, fn_hash: str | None, meta: dict[str, Any],
                   tasks: list[tuple[str, int, float, Chunk | Incoming]],
                   owner: str | None = None) -> None:
        """Insert a job and its tasks ``(task_id, index, cost, args_payload)`` atomically;
        a payload may be a finished :class:`Incoming` file (adopted). ``owner``: the
        person who submitted it."""
        rows = []
        written = []
        try:
            for tid, idx, cost, args in tasks:
                inline, fname = self._store_payload(f"args/{job_id}/{tid}", args)
                if fname:
                    written.append(fname)
                rows.append((tid, job_id, idx, cost, inline, fname))
            with self._tx():
                self.db.execute(
                    "INSERT INTO jobs (id, name, kind, fn_hash, meta, n_tasks, created, state, owner)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, 'active', ?)",
                    (job_id, name, kind, fn_hash, json.dumps(meta), len(tasks), time.time(), owner))
                self.db.executemany(
                    "INSERT INTO tasks (id, job_id, idx, state, cost, args, args_file)"
                    " VALUES (?, ?, ?, 'pending', ?, ?, ?)", rows)
        except BaseException:
            for f in written:
                self._remove_file(f)
            raise
        if self._written is not None:
            self._written.extend(written)

    def job_exists(self, job_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM jobs WHERE id=?", (job_id,)).fetchone() is not None

    def recent_job_ids(self, limit: int, before: tuple[float, str] | None = None,
                       owner: str | None = None, state: str | None = None,
                       unowned: bool = False) -> list[str]:
        """The ids of the ``limit`` newest jobs, newest first (created, then id): only
        those older than ``before`` (a job's ``(created, id)``: the next page after it),
        ``owner``'s (with ``unowned``, also those with no owner: from before people) and
        in ``state``."""
        where, args = ["1"], []
        if before is not None:
            where.append("(created < ? OR (created = ? AND id < ?))")
            args += [before[0], before[0], before[1]]
        if owner is not None:
            where.append("(owner = ? OR owner IS NULL)" if unowned else "owner = ?")
            args.append(owner)
        if state is not None:
            where.append("state = ?")
            args.append(state)
        return [r[0] for r in self.db.execute(f"SELECT id FROM jobs WHERE {' AND '.join(where)}"
                                              " ORDER BY created DESC, id DESC LIMIT ?", (*args, limit))]

    def job_created(self, job_id: str) -> float | None:
        row = self.db.execute("SELECT created FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None else row[0]

    def job_row(self, job_id: str) -> dict[str, Any] | None:
        row = self.db.execute(
            "SELECT id, name, kind, fn_hash, meta, n_tasks, created, state, released, owner"
            " FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is None:
            return None
        keys = ("id", "name", "kind", "fn_hash", "meta", "n_tasks", "created", "state", "released",
                "owner")
        out = dict(zip(keys, row))
        out["meta"] = json.loads(out["meta"])
        return out

    def preempted_count(self, job_id: str) -> int:
        """How many of the job's attempts were handed back by their workers' owners
        (history entries marked ``preempted``): durable, so a job's status says so after
        its results were collected and after a restart."""
        rows = self.db.execute("SELECT history FROM tasks WHERE job_id=? AND history LIKE"
                               " '%preempted%'", (job_id,)).fetchall()
        return sum(1 for (text,) in rows for e in _history(text) if e.get("preempted"))

    def task_counts(self, job_id: str) -> dict[str, int]:
        rows = self.db.execute("SELECT state, COUNT(*) FROM tasks WHERE job_id=? GROUP BY state",
                               (job_id,)).fetchall()
        return {state: n for state, n in rows}

    def set_job_state(self, job_id: str, state: str) -> None:
        self.db.execute("UPDATE jobs SET state=?, finished=? WHERE id=?",
                        (state, None if state == "active" else time.time(), job_id))

    def active_jobs(self) -> list[dict[str, Any]]:
        ids = [r[0] for r in self.db.execute(UNRELEASED_JOBS + " ORDER BY created")]
        # (each id was just read from jobs, so each has a row)
        return cast("list[dict[str, Any]]", [self.job_row(i) for i in ids])

    def open_tasks(self) -> list[OpenTask]:
        """Pending and leased tasks of the active and unreleased jobs (those start-up
        loads), in job-creation then index order. Reads every task of those jobs through
        the ``(job_id, idx)`` key, as start-up's per-job counts do: no index on ``state``
        is kept, since every lease and result would write it."""
        rows = self.db.execute(
            "SELECT id, job_id, idx, state, attempts, cost, lease_id, worker_id, history FROM tasks"
            f" WHERE job_id IN ({UNRELEASED_JOBS}) AND state IN ('pending', 'leased')"
            " ORDER BY rowid").fetchall()
        out = []
        for r in rows:
            history = _history(r[8])
            raised = [e for e in history if e.get("retried")]
            tid, job_id, idx, state, attempts, cost, lease_id, worker_id = r[:8]
            out.append(OpenTask(tid, job_id, idx, state, attempts, cost, lease_id, worker_id,
                                retried=len(raised),
                                raised_on=tuple(str(e.get("worker")) for e in raised),
                                preempted=sum(1 for e in history if e.get("preempted"))))
        return out

    def max_seq(self, job_id: str) -> int:
        row = self.db.execute("SELECT MAX(seq) FROM tasks WHERE job_id=?", (job_id,)).fetchone()
        return -1 if row[0] is None else row[0]

    def note_readers(self, job_id: str, which: str, locked: bool) -> None:
        """An answer named this job's ``which`` files (``"args"``: a lease, to a worker;
        ``"result"``: a results page, to a caller) by path (``locked``: to a reader that
        maps them under locks) or sent them (``locked`` False: the coordinator reads them
        itself, maybe still when the job is released). Only files of a kind that every
        such answer sent to a locking reader go to the handoff pool when the job is
        released; a job's files that no answer named are deleted."""
        key = (job_id, which)
        self._pool_ok[key] = self._pool_ok.get(key, True) and locked

    # ---------------------------------------------------------- tasks ------------
    def task_args(self, task_id: str) -> tuple[bytes | None, str | None]:
        row = self.db.execute("SELECT args, args_file FROM tasks WHERE id=?", (task_id,)).fetchone()
        return (row[0], row[1]) if row else (None, None)

    def tasks_args(self, task_ids: list[str]) -> dict[str, tuple[bytes | None, str | None]]:
        """:meth:`task_args` of several tasks in one query per ``ARGS_PER_QUERY``:
        ``{task_id: (inline, file name)}``, ``(None, None)`` for an unknown task."""
        out: dict[str, tuple[bytes | None, str | None]] = dict.fromkeys(task_ids, (None, None))
        for i in range(0, len(task_ids), ARGS_PER_QUERY):
            ids = task_ids[i:i + ARGS_PER_QUERY]
            marks = ",".join("?" * len(ids))
            for tid, inline, fname in self.db.execute(
                    f"SELECT id, args, args_file FROM tasks WHERE id IN ({marks})", ids):
                out[tid] = (inline, fname)
        return out

    def lease(self, grants: list[tuple[str, str, str]], on_gpu: frozenset[str] | set[str] = frozenset()) -> None:
        """Mark tasks leased: ``(task_id, lease_id, worker_id)``; ``on_gpu``: the task ids
        granted to a GPU slot (for per-person GPU time, :meth:`usage`)."""
        now = time.time()
        with self._tx():
            self.db.executemany(
                "UPDATE tasks SET state='leased', lease_id=?, worker_id=?, attempts=attempts+1,"
                " started=?, gpu=? WHERE id=?",
                [(lid, wid, now, 1 if tid in on_gpu else 0, tid) for tid, lid, wid in grants])

    def add_history(self, entries: dict[str, dict[str, Any]]) -> None:
        """Append an ended attempt to each task's history: ``{task_id: entry}`` (JSON)."""
        with self._tx():
            self.db.executemany(
                "UPDATE tasks SET history = COALESCE(history, '') || ? WHERE id=?",
                [(json.dumps(e) + "\n", tid) for tid, e in entries.items()])

    def requeue(self, task_ids: list[str], history: dict[str, dict[str, Any]] | None = None) -> None:
        """Leased tasks pending again; ``history``: ended attempts to append (as
        :meth:`add_history`), in the same write: both land, or neither does."""
        with self._tx():
            if history:
                self.add_history(history)
            self.db.executemany(
                "UPDATE tasks SET state='pending', lease_id=NULL, worker_id=NULL"
                " WHERE id=? AND state='leased'",
                [(t,) for t in task_ids])

    def finish(self, task_id: str, state: str, seq: int, error: dict[str, Any] | None,
               result: Chunk | Incoming | None, job_id: str, job_finished: bool = False,
               ran_s: float | None = None) -> None:
        """Record a final result (value or failure). ``state`` is 'done', 'failed' or
        'cancelled'. ``result`` may be a finished :class:`Incoming` file (adopted).
        ``job_finished``: it is the job's last one; the job's state becomes 'finished' in
        the same write. ``ran_s``: the seconds it ran, not counting a wait in its slot
        behind another task (a queued grant): ``started`` becomes ``finished - ran_s``,
        and :meth:`usage` counts only those seconds. All or nothing: when it raises (``OSError`` writing the payload,
        ``sqlite3.Error``) no row changed and no payload file of it is left."""
        inline, fname = (None, None)
        if result is not None:
            inline, fname = self._store_payload(f"results/{job_id}/{task_id}", result)
        try:
            now = time.time()
            with self._tx() if job_finished else contextlib.nullcontext():
                self.db.execute(
                    "UPDATE tasks SET state=?, seq=?, error=?, result=?, result_file=?, finished=?,"
                    " started=COALESCE(?, started), lease_id=NULL WHERE id=?",
                    (state, seq, json.dumps(error) if error else None, inline, fname, now,
                     None if ran_s is None else now - ran_s, task_id))
                if job_finished:
                    self.set_job_state(job_id, "finished")
        except BaseException:
            self._remove_file(fname)  # no row points at it
            raise
        if fname and self._written is not None:
            self._written.append(fname)

    def finish_many(self, rows: list[tuple[str, str, int, dict[str, Any] | None]]) -> None:
        """Final failures without payloads: ``(task_id, state, seq, error)``, one transaction."""
        now = time.time()
        with self._tx():
            self.db.executemany(
                "UPDATE tasks SET state=?, seq=?, error=?, finished=?, lease_id=NULL WHERE id=?",
                [(st, seq, json.dumps(err) if err else None, now, tid) for tid, st, seq, err in rows])

    def failed_tasks(self, job_id: str) -> list[tuple[str, int]]:
        """``(task_id, index)`` of the failed tasks of ``job_id``, in index order."""
        return [(r[0], r[1]) for r in self.db.execute(
            "SELECT id, idx FROM tasks WHERE job_id=? AND state='failed' ORDER BY idx", (job_id,))]

    def retry_tasks(self, job_id: str, task_ids: list[str],
                    hostnames: dict[str, str] | None = None) -> dict[str, int]:
        """Make failed tasks pending again (no result), and the job active. The failed
        attempt stays in each task's history (marked ``retried``: a re-run, not a loss) and
        the next run gets the next attempt number, so ``logs`` shows the runs apart.
        ``hostnames``: ``{worker id: host name}`` of the workers known now, recorded with
        each attempt as other ended attempts are. Returns ``{task_id: attempts so far}``."""
        marks = ",".join("?" * len(task_ids))
        rows = self.db.execute(
            f"SELECT id, attempts, worker_id, error, result_file FROM tasks"
            f" WHERE id IN ({marks}) AND state='failed'", task_ids).fetchall() if task_ids else []
        history = {}
        for tid, attempts, wid, err, _ in rows:
            entry = {"attempt": attempts, "worker": wid, "ended": "failed; re-run by gpumesh retry",
                     "retried": True}
            host = (hostnames or {}).get(wid)
            if host:
                entry["hostname"] = host
            error = json.loads(err) if err else None
            if isinstance(error, dict):
                entry["error"] = {k: error[k] for k in ("type", "message") if isinstance(error.get(k), str)}
            history[tid] = entry
        with self._tx():
            self.db.executemany(
                "UPDATE tasks SET state='pending', lease_id=NULL, worker_id=NULL,"
                " result=NULL, result_file=NULL, error=NULL, seq=NULL, finished=NULL,"
                " history = COALESCE(history, '') || ?"
                " WHERE id=? AND state='failed'",
                [(json.dumps(e) + "\n", t) for t, e in history.items()])
            self.db.execute("UPDATE jobs SET state='active', finished=NULL WHERE id=?", (job_id,))
        for *_, r in rows:
            self._remove_file(r)
        return {tid: attempts for tid, attempts, *_ in rows}

    def results_after(self, job_id: str, after: int, limit: int) -> Iterator[FinalTask]:
        """Final tasks of ``job_id`` with ``seq > after``, in seq order (uses tasks_seq)."""
        cur = self.db.execute(
            "SELECT id, idx, state, seq, worker_id, error, result, result_file,"
            " COALESCE(LENGTH(result), 0) FROM tasks"
            " WHERE job_id=? AND seq>? ORDER BY seq LIMIT ?", (job_id, after, limit))
        for tid, idx, state, seq, wid, err, res, rfile, rlen in cur.fetchall():
            size = rlen
            if rfile:
                try:
                    size = (self.blob_dir / rfile).stat().st_size
                except OSError:
                    size = 0
            yield FinalTask(tid, idx, state, seq, wid, json.loads(err) if err else None,
                            res, rfile, size)

    def task_rows(self, job_id: str, ids: list[str] | None = None) -> list[dict[str, Any]]:
        """The job's tasks (``ids``: only those), in index order."""
        if ids is None:
            return self._task_dicts("job_id=? ORDER BY idx", (job_id,))
        out = []
        for k in range(0, len(ids), ARGS_PER_QUERY):
            part = ids[k:k + ARGS_PER_QUERY]
            out += self._task_dicts(f"job_id=? AND id IN ({','.join('?' * len(part))})", (job_id, *part))
        return sorted(out, key=lambda d: d["index"])

    def task_page(self, job_id: str, after: int, limit: int, state: str | None = None) -> list[dict[str, Any]]:
        """Up to ``limit`` of the job's tasks with an index above ``after`` (in ``state``
        only, if given), in index order, as :meth:`task_rows` with ``started`` and
        ``finished``: a page of a big job through its ``(job_id, idx)`` key."""
        return self._task_dicts("job_id=? AND idx>?" + (" AND state=?" if state else "") +
                                " ORDER BY idx LIMIT ?",
                                (job_id, after, *((state,) if state else ()), limit), times=True)

    def _task_dicts(self, where: str, params: tuple[Any, ...], times: bool = False) -> list[dict[str, Any]]:
        keys = ("id", "index", "state", "attempts", "worker_id", "error", "cost", "history",
                *(("started", "finished") if times else ()))
        out = []
        for r in self.db.execute(f"SELECT id, idx, state, attempts, worker_id, error, cost, history"
                                 f"{', started, finished' if times else ''} FROM tasks WHERE {where}",
                                 params).fetchall():
            d = dict(zip(keys, r))
            d["error"] = json.loads(d["error"]) if d["error"] else None
            d["history"] = _history(d["history"])  # earlier attempts, oldest first
            out.append(d)
        return out

    # ---------------------------------------------------------- people -----------
    def tokens(self) -> list[dict[str, Any]]:
        """Every added token: ``{"name", "role", "digest", "max_running", "created"}``."""
        keys = ("name", "role", "digest", "max_running", "created")
        return [dict(zip(keys, r)) for r in self.db.execute(
            "SELECT name, role, digest, max_running, created FROM tokens ORDER BY name")]

    def add_token(self, name: str, role: str, digest: str, max_running: int | None,
                  created: float) -> None:
        """Insert one token row (``sqlite3.IntegrityError`` if the name or digest is taken)."""
        self.db.execute("INSERT INTO tokens (name, role, digest, max_running, created)"
                        " VALUES (?, ?, ?, ?, ?)", (name, role, digest, max_running, created))

    def revoke_token(self, name: str) -> None:
        self.db.execute("DELETE FROM tokens WHERE name=?", (name,))

    def recent_jobs(self, limit: int) -> list[dict[str, Any]]:
        """The ``limit`` most recent jobs as :meth:`job_row` gives them, newest first."""
        return [row for i in self.recent_job_ids(limit) if (row := self.job_row(i)) is not None]

    def task_state_counts(self) -> dict[str, int]:
        """How many tasks the store holds in each state (one pass over the tasks kept)."""
        return dict(self.db.execute("SELECT state, COUNT(*) FROM tasks GROUP BY state"))

    def job_owners(self, job_ids: list[str]) -> dict[str, str | None]:
        """``{job_id: owner}`` for the given jobs that exist."""
        if not job_ids:
            return {}
        return dict(self.db.execute(
            f"SELECT id, owner FROM jobs WHERE id IN ({','.join('?' * len(job_ids))})", job_ids))


def _history(text: str | None) -> list[dict[str, Any]]:
    """A task's history column: one JSON object per line (lines that do not parse are
    skipped: a history is information, never a reason to fail a listing)."""
    out = []
    for line in (text or "").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out
