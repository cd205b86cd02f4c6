"""What a person does to a whole job: cancel what has not finished, re-run what failed.

Each is all or nothing: the store is written first, in one commit, and memory follows
it, each change registering its undoing (:mod:`.journal`). A cancel whose commit fails
(a full disk) changes nothing: its tasks stay pending or leased, their workers are told
nothing, and no caller is woken; the request is answered 503 and may be sent again.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import TYPE_CHECKING, Any

from . import diskfull, requeue
from .model import JobReleased, UnknownJob

if TYPE_CHECKING:
    from .core import Coordinator

log = logging.getLogger("gpumesh.coordinator")


def cancel(coord: Coordinator, job_id: str, reason: str) -> int:
    """Cancel every task of ``job_id`` that is not final yet (``reason``: each one's error
    message). Returns how many. Raises ``sqlite3.Error``/``OSError`` when the store cannot
    write it, with nothing changed."""
    job = coord.job(job_id)
    pending = coord.queue.tasks(job_id)
    leased = [tid for tid, lease in coord.leases.items() if lease.job_id == job_id]
    error = {"kind": "cancelled", "type": "Cancelled", "message": reason}
    rows: list[tuple[str, str, int, dict[str, Any] | None]] = [
        (tid, "cancelled", job.next_seq + i, dict(error)) for i, tid in enumerate(pending + leased)]
    ends = job.state == "active"
    with coord.atomic():
        # The store first: when it cannot write, nothing below has happened.
        coord.store.finish_many(rows)
        if ends:
            coord.store.set_job_state(job_id, "cancelled")
        counts = job.next_seq, job.n_final, job.state, dict(job.avoid)
        coord.queue.drop_job(job_id)
        # Newest lease first: a slot's queued grants were leased after the task it runs,
        # so the worker drops them before it kills that task; else the killed task's
        # slot could start its next queued grant before that grant's cancel line came.
        ended = [coord.leases.pop(tid) for tid in reversed(leased)]
        for lease in ended:
            w = coord.workers.get(lease.worker_id)
            if w:
                w.leases.discard(lease.task_id)
        kept: list[tuple[dict[str, Any], str, Any]] = [
            (d, tid, d.pop(tid)) for tid, *_ in rows
            for d in (coord.task_meta, coord.task_cost, coord.retried, coord.preempted_runs)
            if tid in d]
        job.next_seq += len(rows)
        job.n_final += len(rows)
        job.avoid.clear()
        if ends:
            job.state = "cancelled"

        def undo() -> None:
            job.next_seq, job.n_final, job.state = counts[:3]
            job.avoid.update(counts[3])
            for d, tid, v in kept:
                d[tid] = v
            for lease in reversed(ended):
                requeue.relet(coord, lease)
            if pending:
                coord.queue.add(job_id, pending, lane=job.lane, owner=job.owner)
        coord._on_rollback(undo)

        def tell() -> None:  # the workers and the callers, once it is stored
            for lease in ended:
                w = coord.workers.get(lease.worker_id)
                if w:
                    w.push(f"cancel {lease.task_id}")  # now, not at the next heartbeat
            job.notify()
        coord._once_stored(tell)
    return len(rows)


def retry(coord: Coordinator, job_id: str) -> int:
    """Re-queue every failed task of ``job_id`` (their old results and errors are
    dropped; the failed attempt stays in the history as a re-run, not a loss). Returns
    how many. Raises ``UnknownJob`` for an unknown job and ``JobReleased`` when its
    arguments were already released (nothing to re-run)."""
    job = coord.jobs.get(job_id)
    if job is None:
        if coord.store.job_exists(job_id):
            raise JobReleased(job_id)
        raise UnknownJob(job_id)
    if job.kind == "function":
        # Its caller collects (or, after a failure, has given up on) its results: a
        # re-run would compute values nobody receives. Call the function again instead.
        raise JobReleased(job_id)
    failed = coord.store.failed_tasks(job_id)
    if not failed:
        return 0
    ids = [tid for tid, _ in failed]
    hosts = {w.id: w.hostname for w in coord.workers.values() if w.hostname}
    costs = {t["id"]: t["cost"] for t in coord.store.task_rows(job_id)} if job.costs_vary else {}
    # The store first (its own commit): when it cannot write, nothing here changed.
    attempts = coord.store.retry_tasks(job_id, ids, hosts)
    job.n_final -= len(ids)
    job.state = "active"
    for tid, idx in failed:
        coord.task_meta[tid] = (idx, attempts.get(tid, 0))
        coord.retried[tid] = coord.retried.get(tid, 0) + 1  # a re-run: not a loss
        if costs.get(tid, 1.0) != 1.0:
            coord.task_cost[tid] = costs[tid]
    coord.queue.add(job_id, ids, lane=job.lane, owner=job.owner)
    try:
        coord._wake_idle()
    except (OSError, sqlite3.Error) as e:
        # The retry is stored; the tasks wait, pending, for the workers' next lease.
        if not diskfull.note(coord.store.full, e):
            log.error("job %s: its retried tasks could not be granted now (%s: %s)",
                      job_id, type(e).__name__, e)
    return len(ids)
