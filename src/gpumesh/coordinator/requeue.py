"""How a lease ends other than by a stored result: its task re-queued (its worker was
lost, handed it back, or asked to retry), re-run on another worker (its process crashed,
a ``retry_on`` exception, a module missing there, a ``requires=`` it could not build), or
failed as lost after ``MAX_ATTEMPTS`` losses.

Each is all or nothing, also inside a commit that fails later (:mod:`.journal`): the
store is written first, and each change to memory registers its undoing.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import TaskCrashed
from ..limits import MAX_ATTEMPTS
from ..protocol import FailureKind
from ..retries import type_name
from . import diskfull, placing, views
from .model import Job, Lease

if TYPE_CHECKING:
    from .core import Coordinator

log = logging.getLogger("gpumesh.coordinator")

#: How ``retry_on`` names TaskCrashed (types travel by name).
CRASHED_NAME = type_name(TaskCrashed)

#: Modules remembered as missing on some worker (for ``gpumesh doctor``), newest kept.
MAX_LACKING_MODULES = 100


def requeue(coord: Coordinator, task_ids: list[str], reason: str, error: dict[str, Any] | None = None,
             preempted: bool = False) -> None:
    """Put leased tasks back in line (or fail them as lost after ``MAX_ATTEMPTS``
    losses); each attempt that ended so is added to its task's history, with
    ``error`` when it raised a ``retry_on`` exception. A ``preempted`` attempt (its
    worker handed it back) keeps its number, so logs and history tell the runs apart,
    but is not a loss: like a ``retry_on`` re-run it does not count towards the limit."""
    back, lost, history = [], [], {}
    for tid in task_ids:
        lease = coord.leases.get(tid)
        if lease is None or tid in history:
            continue
        w = coord.workers.get(lease.worker_id)
        idx, attempts = coord.task_meta[tid]
        entry = {"attempt": attempts, "worker": lease.worker_id, "ended": reason}
        if w is not None and w.hostname:
            entry["hostname"] = w.hostname
        if error is not None:
            entry["retried"] = True  # a raised retry_on exception, not a loss
            entry["error"] = {k: error[k] for k in ("type", "message") if isinstance(error.get(k), str)}
        if preempted:
            entry["preempted"] = True
        history[tid] = entry
        runs = coord.preempted_runs.get(tid, 0) + (1 if preempted else 0)
        losses = attempts - coord.retried.get(tid, 0) - runs
        if losses >= MAX_ATTEMPTS:  # losses only
            lost.append((lease, attempts))
        else:
            back.append(lease)
    if not history:
        return
    with coord.atomic():  # one commit; memory as the store has it, whatever fails
        # The store first (one write): when it fails, nothing here changed.
        coord.store.requeue([lease.task_id for lease in back], history)
        for lease in back:
            lease_ended(coord, lease, preempted)
        for lease in reversed(back):
            job = coord.jobs.get(lease.job_id)
            coord.queue.push_front(lease.job_id, lease.task_id, lane=job.lane if job else None,
                                  owner=job.owner if job else None)

        def unqueue() -> None:
            for lease in back:
                coord.queue.remove(lease.job_id, lease.task_id)
        coord._on_rollback(unqueue)
        for lease, attempts in lost:
            coord._finalize(lease.job_id, lease.task_id, "failed", {
                "kind": "lost", "type": "WorkerLost",
                "message": f"task lost its worker {attempts} times (last: {reason})"}, None)
            lease_ended(coord, lease, False)  # (final: no attempt of it is counted again)
        if back:
            coord._once_stored(coord._wake_idle)


def requeue_soon(coord: Coordinator, task_ids: list[str], reason: str) -> None:
    """:func:`requeue`, for what must not fail with it (a heartbeat, a worker found gone,
    a lease answer that broke off, the sweep): when the store cannot write it (a full
    disk), nothing changed, the leases hold, and each sweep tries again
    (:func:`requeue_stalled`) until one can."""
    try:
        requeue(coord, task_ids, reason)
    except (OSError, sqlite3.Error) as e:
        if not diskfull.note(coord.store.full, e):
            log.error("%d task(s) could not be re-queued now (%s: %s); the sweep tries again",
                      len(task_ids), type(e).__name__, e)
        for tid in task_ids:
            lease = coord.leases.get(tid)
            if lease is not None:
                coord.unrequeued.setdefault(tid, (lease.lease_id, reason))


def requeue_stalled(coord: Coordinator) -> None:
    """Re-queue again what :func:`requeue_soon` could not (each lease only while it is
    the one that was to end)."""
    if not coord.unrequeued:
        return
    todo, coord.unrequeued = coord.unrequeued, {}
    by_reason: dict[str, list[str]] = {}
    for tid, (lease_id, reason) in todo.items():
        lease = coord.leases.get(tid)
        if lease is not None and lease.lease_id == lease_id:
            by_reason.setdefault(reason, []).append(tid)
    for reason, tids in by_reason.items():
        requeue_soon(coord, tids, reason)


def lease_ended(coord: Coordinator, lease: Lease, preempted: bool) -> None:
    """``lease`` no longer holds (its task was re-queued or failed as lost); a
    ``preempted`` attempt is counted as such. Undone if the commit fails."""
    tid = lease.task_id
    del coord.leases[tid]
    w = coord.workers.get(lease.worker_id)
    if w:
        w.leases.discard(tid)
    runs = coord.preempted_runs.get(tid)
    if preempted:
        coord.preempted_runs[tid] = (runs or 0) + 1

    def undo() -> None:
        relet(coord, lease)
        if runs is None:
            coord.preempted_runs.pop(tid, None)
        else:
            coord.preempted_runs[tid] = runs
    coord._on_rollback(undo)


def relet(coord: Coordinator, lease: Lease) -> None:
    """``lease`` holds again (what ended it was not stored)."""
    coord.leases[lease.task_id] = lease
    w = coord.workers.get(lease.worker_id)
    if w is not None:
        w.leases.add(lease.task_id)


def missing_module(coord: Coordinator, lease: Lease, error: dict[str, Any]) -> dict[str, Any] | None:
    """The task failed on ``lease``'s worker with ModuleNotFoundError: the worker lacks
    the module, or (the error names a ``package``) has another version of its package,
    without it. Either way it is kept off the job (:func:`keep_off`); the task's final
    error, when no other worker could run it, names the module and each worker's case."""
    module = error["module"][:200]
    gap = _version_gap(error)
    job = coord.jobs.get(lease.job_id)
    if job is not None:
        job.lacking.setdefault(module, {})[lease.worker_id] = gap
    coord.lacking.setdefault(module, {})[lease.worker_id] = gap
    while len(coord.lacking) > MAX_LACKING_MODULES:  # the oldest module first
        del coord.lacking[next(iter(coord.lacking))]
    # A version gap is still kept off the job and tried elsewhere, like a missing module:
    # in a mixed pool another worker may well have the caller's version (which is what a
    # pickle of numpy 2 needs), and this worker will not grow it by trying again.
    why = (f"has {gap[0]} {gap[1]}, which has no module {module!r}" if gap
           else f"has no module {module!r}")
    return keep_off(coord, lease, error, why, lambda job: dict(
        error, kind=FailureKind.MISSING_MODULE,
        message=views.missing_module_message(coord, job, module)))


def _version_gap(error: dict[str, Any]) -> tuple[str, str] | None:
    """``(package, version)`` of a worker's error whose module is a submodule of a package
    it has, in another version (gpumesh.worker.loadfail); None when it lacks the module."""
    package, version = error.get("package"), error.get("package_version")
    if isinstance(package, str) and package and isinstance(version, str):
        return package[:200], version[:100]
    return None


def cannot_provide(coord: Coordinator, lease: Lease, error: dict[str, Any]) -> dict[str, Any] | None:
    """The task failed on ``lease``'s worker because the worker could not provide the
    job's ``requires=`` (its environment did not build there: a Python too old for a
    version asked for, say). Kept off the job like a worker without a module
    (:func:`keep_off`); the final error names each worker that could not, and why."""
    message = error.get("message")
    reason = message[:2000] if isinstance(message, str) else "it failed"
    return keep_off(coord, lease, error, f"could not provide requires=: {reason}",
                    lambda job: dict(error, message=views.unable_message(coord, job)))


def keep_off(coord: Coordinator, lease: Lease, error: dict[str, Any], why: str,
             final: Callable[[Job], dict[str, Any]]) -> dict[str, Any] | None:
    """The task cannot run on ``lease``'s worker for a reason every task of its job
    shares (``why``, in words that follow the worker's name: a module it lacks, a
    requires= it could not build): none of the job's tasks goes to that worker again
    (until it reports new packages). If another alive worker could run it, re-queue it
    there (not a loss: the attempt goes into its history) and return None; otherwise
    return ``final(job)``, the task's final error."""
    job = coord.jobs.get(lease.job_id)
    if job is None:
        return error
    job.unable[lease.worker_id] = why
    others = [w for w in coord.alive_workers() if not job.excludes(w.id)
              and any(placing.runs(job.lane, s) for s in w.slot_views())]
    if not others:
        return final(job)
    log.info("task %s: worker %s %s; trying it on another worker",
             lease.task_id, lease.worker_id, why[:300])
    rerun(coord, lease, f"this worker {why}", error)
    if views.closed_for(coord, job.id):
        # Only workers their owners closed (paused, outside hours) may run it now: the
        # waiting caller hears so at once (its results page says why), not after its
        # long poll.
        job.notify()
    return None


def retry_failed(coord: Coordinator, lease: Lease, error: dict[str, Any] | None) -> bool:
    """If the task's failure is worth another attempt and re-runs are left, re-queue it,
    to run on another worker when one can (see :func:`.placing.choose`). Returns whether
    it did. Two failures are:

    * a crash: the task process died without a result (a signal, ``os._exit``, native
      code that aborted, the OOM killer). A failure of the machine or process rather than
      an answer of the code (Ray, too, retries these by default; Dask retries nothing):
      run again until ``MAX_ATTEMPTS`` attempts in all, or more if the job's ``retry_on``
      names :class:`~gpumesh.errors.TaskCrashed` with more ``retries``;
    * an exception the job's ``retry_on`` names (the type or one of its bases, by name),
      up to its ``retries``. Any other exception the function raised is its answer.
    """
    job = coord.jobs.get(lease.job_id)
    if job is None or not isinstance(error, dict):
        return False
    names = job.meta.get("retry_on") or []
    retries = int(job.meta.get("retries") or 0)
    done = coord.retried.get(lease.task_id, 0)
    if error.get("kind") == FailureKind.CRASHED:
        limit = max(MAX_ATTEMPTS - 1, retries if CRASHED_NAME in names else 0)
        if done >= limit:
            if done and isinstance(error.get("message"), str):  # (its final error says so)
                error["message"] += (f"; attempt {done + 1} of {limit + 1}: `gpumesh status "
                                     f"{lease.job_id}` lists how each attempt ended")
            return False
        # (the error's own message is in the history beside this: not repeated here)
        rerun(coord, lease, f"crashed; run again (attempt {done + 2} of at most {limit + 1})",
              error, avoid=job)
        return True
    if not names or error.get("kind") != "raised":
        return False
    mro = error.get("mro")
    if not isinstance(mro, list):
        mro = [error.get("type")]
    if not any(isinstance(t, str) and t in names for t in mro):
        return False
    if done >= retries:
        return False
    name = error.get("type") if isinstance(error.get("type"), str) else "an exception"
    rerun(coord, lease, f"raised {name}, which the job retries (retry {done + 1} of "
                       f"{retries})", error, avoid=job)
    return True


def rerun(coord: Coordinator, lease: Lease, reason: str, error: dict[str, Any], avoid: Job | None = None) -> None:
    """Re-queue ``lease``'s task for a re-run that is not a loss (counted in
    ``retried``); ``avoid``: its job, which then keeps the task off this worker: off
    every worker it failed on while another could run it now, and once it has failed on
    all of those, off the last one only (the runs go round: A, B, A, B, not A, B, B).
    All of it, or (a store write that fails) none of it, also when a commit fails later."""
    tid, wid = lease.task_id, lease.worker_id
    done = coord.retried.get(tid)
    kept_off = avoid.avoid if avoid is not None else None  # task id -> workers to avoid
    before = None if kept_off is None or tid not in kept_off else set(kept_off[tid])
    coord.retried[tid] = (done or 0) + 1
    if avoid is not None:
        avoid.avoid.setdefault(tid, set()).add(wid)
        if not placing.elsewhere(coord, avoid, tid):
            avoid.avoid[tid] = {wid}

    def undo() -> None:
        if done is None:
            coord.retried.pop(tid, None)
        else:
            coord.retried[tid] = done
        if kept_off is None:
            return
        if before is None:
            kept_off.pop(tid, None)
        else:
            kept_off[tid] = before
    try:
        requeue(coord, [tid], reason=reason, error=error)
    except BaseException:
        undo()
        raise
    coord._on_rollback(undo)
