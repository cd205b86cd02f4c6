"""Start-up: rebuild the coordinator's in-memory view from the store after a (re)start.

The store is the truth for every acknowledged job and result; the coordinator's dicts and
run queue are a cache of it. :func:`recover` fills that cache once, from
``Coordinator.__init__``, before any worker or caller is answered.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .model import Job, Lease

if TYPE_CHECKING:  # core imports this module: no import of core at run time
    from .core import Coordinator

log = logging.getLogger("gpumesh.coordinator")


def recover(coord: Coordinator) -> None:
    """Rebuild ``coord``'s jobs, open tasks, leases and run queue from its store."""
    for row in coord.store.active_jobs():
        job = Job(row["id"], row["kind"], row["fn_hash"], row["meta"], row["n_tasks"],
                  state=row["state"], owner=row.get("owner"), submitted=coord.clock())
        try:
            job.prepare()
        except ValueError as e:  # written by another version: run it without them
            log.warning("job %s: ignoring unreadable requirements (%s)", job.id, e)
        counts = coord.store.task_counts(job.id)
        job.n_final = sum(n for s, n in counts.items() if s not in ("pending", "leased"))
        job.next_seq = coord.store.max_seq(job.id) + 1
        coord.jobs[job.id] = job
        coord.callers.hold(job)  # a function job's tasks wait for its caller (.callers)
    now = coord.clock()
    for t in coord.store.open_tasks():
        if t.job_id not in coord.jobs:
            continue
        coord.task_meta[t.id] = (t.idx, t.attempts)
        if t.preempted:
            coord.preempted_runs[t.id] = t.preempted
        if t.retried:
            coord.retried[t.id] = t.retried
            coord.jobs[t.job_id].avoid[t.id] = set(t.raised_on)
        if t.cost != 1.0:
            coord.task_cost[t.id] = t.cost
            coord.jobs[t.job_id].costs_vary = True
        if t.state == "leased" and t.lease_id and t.worker_id:
            # Keep the lease: a worker that comes back within the TTL may still
            # deliver this result. The sweeper requeues it otherwise.
            coord.leases[t.id] = Lease(t.id, t.job_id, t.lease_id, t.worker_id, now,
                                       delivered=now)
        else:
            coord.queue.add(t.job_id, [t.id], lane=coord.jobs[t.job_id].lane,
                            owner=coord.jobs[t.job_id].owner)
    if coord.jobs:
        log.info("recovered %d unreleased jobs from the store: %d tasks pending, %d leased "
                 "(kept for workers that come back)", len(coord.jobs), len(coord.queue), len(coord.leases))
    if coord.callers.held:
        log.info("%d of them are function jobs: their pending tasks wait for their callers "
                 "to come back (for up to %gs)", len(coord.callers.held), coord.callers.timeout)
