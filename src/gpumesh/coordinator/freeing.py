"""The store's end of a job's life: its payloads freed when its caller has every result
(*release*), then its rows and files deleted once it is past retention (*purge*).

A mixin of :class:`.store.Store` (it uses the store's connection, transactions, reaper
and the readers :meth:`.store.Store.note_readers` recorded). Each method is a few
statements in one or two commits; the coordinator decides how much goes in one
(:mod:`.retention`): a job of many tasks is freed and deleted a slice of task rows per
commit, through the ``(job_id, idx)`` key, so that no commit holds the event loop for
long.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from ..limits import PURGE_BATCH_MAX
from .reaper import Reaper
from .tables import ARGS_PER_QUERY


class Freeing:
    """Release and purge statements of :class:`.store.Store`."""

    # What this mixin uses of the store: its attributes, and (for the type checker only:
    # they exist on Store, not here) two of its methods.
    db: sqlite3.Connection
    blob_dir: Path
    reaper: Reaper
    _pool_ok: dict[tuple[str, str], bool]
    _blobs: set[str]

    if TYPE_CHECKING:
        def _tx(self) -> contextlib.AbstractContextManager[None]: ...

        def _remove_file(self, rel: str | None) -> None: ...

    def release_job(self, job_id: str) -> None:
        """The caller has every result: drop argument and result payloads, keep the rows."""
        self.release_jobs([job_id])

    def release_jobs(self, job_ids: list[str]) -> None:
        """:meth:`release_job` of several jobs in one commit (a caller releases the jobs
        of its finished calls in batches: one commit each cost as much as the rest).
        A job of many tasks is released a slice at a time instead (:meth:`release_slice`,
        then :meth:`mark_released`): one commit of a million rows holds the event loop
        for seconds."""
        files: list[tuple[str, str | None, str | None]] = []
        for i in range(0, len(job_ids), ARGS_PER_QUERY):
            ids = job_ids[i:i + ARGS_PER_QUERY]
            files += self.db.execute(
                f"SELECT job_id, args_file, result_file FROM tasks WHERE job_id IN ({','.join('?' * len(ids))})"
                " AND (args_file IS NOT NULL OR result_file IS NOT NULL)", ids).fetchall()
        with self._tx():
            self.db.executemany("UPDATE tasks SET args=NULL, args_file=NULL, result=NULL,"
                                " result_file=NULL WHERE job_id=?", [(j,) for j in job_ids])
            self.db.executemany("UPDATE jobs SET released=1 WHERE id=?", [(j,) for j in job_ids])
        self._drop_payload_files(files, job_ids, whole=True)

    def release_slice(self, job_id: str, lo: int, hi: int) -> None:
        """Drop the payloads of ``job_id``'s tasks with ``lo <= idx < hi`` in one commit
        (through the ``(job_id, idx)`` key: each slice costs its own rows only). The job
        stays unreleased until :meth:`mark_released`; a crash in between leaves it so, and
        its retention's purge deletes what is left."""
        files = self.db.execute(
            "SELECT job_id, args_file, result_file FROM tasks WHERE job_id=? AND idx>=? AND idx<?"
            " AND (args_file IS NOT NULL OR result_file IS NOT NULL)", (job_id, lo, hi)).fetchall()
        with self._tx():
            self.db.execute("UPDATE tasks SET args=NULL, args_file=NULL, result=NULL, result_file=NULL"
                            " WHERE job_id=? AND idx>=? AND idx<?", (job_id, lo, hi))
        self._drop_payload_files(files, [job_id], whole=False)

    def mark_released(self, job_id: str) -> None:
        """The last step of a release in slices: every slice done, the job is released."""
        with self._tx():
            self.db.execute("UPDATE jobs SET released=1 WHERE id=?", (job_id,))
        self._drop_payload_files([], [job_id], whole=True)

    def _drop_payload_files(self, files: list[tuple[str, str | None, str | None]],
                            job_ids: list[str], whole: bool) -> None:
        """Hand the payload files ``files`` (rows of ``(job_id, args_file, result_file)``
        no row names any more) to the reaper; ``whole``: the jobs' release is complete,
        so their folders go too and what their readers said is forgotten."""
        # Unlinking them (their pages freed there and then, tens of ms for a big one) is
        # the reaper's, not the event loop's. A file may go to the pool instead
        # (gpumesh.handoff): those of a job whose readers (callers for results, workers
        # for arguments) said they map under locks.
        said = self._pool_ok.pop if whole else self._pool_ok.get
        ok = {(j, w): said((j, w), False) for j in job_ids for w in ("args", "result")}
        named = [(j, w, self.blob_dir / f) for j, a, r in files
                 for w, f in (("args", a), ("result", r)) if f]
        self.reaper.remove(
            files=[p for j, w, p in named if not ok[j, w]],
            pool=[p for j, w, p in named if ok[j, w]],
            dirs=[self.blob_dir / sub / j for j in job_ids for sub in ("args", "results")] if whole else [])

    def purge_before(self, cutoff: float) -> list[str]:
        """Delete jobs that ended before ``cutoff`` (epoch seconds) with their tasks and
        payloads, then function blobs no remaining job uses. Returns the deleted job ids.
        All at once: :meth:`purge_jobs` and :meth:`purge_blobs` do it a batch at a time."""
        ids: list[str] = []
        while gone := self.purge_jobs(cutoff, PURGE_BATCH_MAX):
            ids += gone
        while self.purge_blobs(cutoff, PURGE_BATCH_MAX):
            pass
        return ids

    def purge_jobs(self, cutoff: float, limit: int) -> list[str]:
        """Delete at most ``limit`` jobs that ended before ``cutoff`` with their tasks and
        payloads (:meth:`purge_job_ids`). Returns the deleted job ids: fewer than
        ``limit`` when no more are expired."""
        return self.purge_job_ids([j for j, _ in self.expired_jobs(cutoff, limit)])

    def expired_jobs(self, cutoff: float, limit: int) -> list[tuple[str, int]]:
        """At most ``limit`` jobs that ended before ``cutoff``: ``(id, n_tasks)`` each."""
        return [(r[0], r[1]) for r in self.db.execute(
            "SELECT id, n_tasks FROM jobs WHERE finished IS NOT NULL AND finished < ? LIMIT ?",
            (cutoff, max(1, limit)))]

    def purge_job_ids(self, ids: list[str]) -> list[str]:
        """Delete the jobs ``ids`` with their tasks and payloads, in one transaction
        (their payloads are released first, in one of its own: a crash between the two
        leaves released jobs, which the next purge deletes). Returns ``ids``."""
        if not ids:
            return ids
        self.release_jobs(ids)
        with self._tx():
            self.db.executemany("DELETE FROM tasks WHERE job_id=?", [(j,) for j in ids])
            self.db.executemany("DELETE FROM jobs WHERE id=?", [(j,) for j in ids])
        self.reaper.remove(trees=[self.blob_dir / sub / job_id for job_id in ids
                                  for sub in ("results", "args")])
        return ids

    def purge_task_slice(self, job_id: str, limit: int) -> int:
        """Delete the ``limit`` lowest-numbered tasks of expired job ``job_id`` and their
        payload files, in one transaction: a job of many tasks is purged a slice at a
        time, its row last (:meth:`purge_job_ids`, once this returns fewer than
        ``limit``). Returns how many tasks were deleted."""
        rows = self.db.execute("SELECT idx, args_file, result_file FROM tasks WHERE job_id=?"
                               " ORDER BY idx LIMIT ?", (job_id, max(1, limit))).fetchall()
        if not rows:
            return 0
        with self._tx():
            self.db.execute("DELETE FROM tasks WHERE job_id=? AND idx<=?", (job_id, rows[-1][0]))
        self.reaper.remove(files=[self.blob_dir / f for _, a, r in rows for f in (a, r) if f])
        return len(rows)

    def purge_blobs(self, cutoff: float, limit: int) -> int:
        """Delete at most ``limit`` function blobs stored before ``cutoff`` that no job
        uses (rows in one transaction, then their files). Returns how many."""
        unused = [r[0] for r in self.db.execute(
            "SELECT hash FROM blobs WHERE created < ? AND hash NOT IN"
            " (SELECT fn_hash FROM jobs WHERE fn_hash IS NOT NULL) LIMIT ?", (cutoff, max(1, limit)))]
        if not unused:
            return 0
        with self._tx():
            self.db.executemany("DELETE FROM blobs WHERE hash=?", [(h,) for h in unused])
        for h in unused:
            # (here, not by the reaper: a submit of the same function right after must
            # not see its new file deleted behind it)
            self._blobs.discard(h)
            self._remove_file(f"fn/{h[:2]}/{h}")
        return len(unused)
