"""When the coordinator frees a job's payloads and deletes what is past retention, and
how much of it goes in one commit.

A commit of a million task rows holds the event loop (every request and heartbeat) for
seconds: 1.2 s for a 200,000-task job's purge and 0.3 s for its release on the build VM
(``benchmarks/purge_stall.py``). So a job of more than TASK_SLICE_ROWS tasks is released
a slice of task rows per commit, in the background of the request that released it,
and a purge deletes whole jobs, or a slice of one job's tasks, a batch per commit sized
to take about PURGE_SLICE_S; the loop runs between any two. The statements are the
store's (:mod:`.freeing`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..limits import PURGE_BATCH_MAX, TASK_SLICE_ROWS
from . import diskfull

if TYPE_CHECKING:
    from .core import Coordinator

log = logging.getLogger("gpumesh.coordinator")


def release(coord: Coordinator, job_ids: Iterable[str]) -> None:
    """The callers have every result of ``job_ids``: free their payloads (the rows stay
    for listings). A job still running is skipped (nothing to release yet), and so is
    one being released already. Small jobs go in one commit together; each job of more
    than TASK_SLICE_ROWS tasks is released by :func:`release_in_slices`, started here
    and not awaited (outside a running event loop: at once, in one commit). Raises
    ``sqlite3.Error``/``OSError`` when the one commit fails."""
    done = [j for j in dict.fromkeys(job_ids) if j not in coord.releasing
            and ((job := coord.jobs.get(j)) is None or job.n_final >= job.n_tasks)]
    big = {j: job.n_tasks for j in done
           if (job := coord.jobs.get(j)) is not None and job.n_tasks > TASK_SLICE_ROWS}
    if big:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            big = {}
        for job_id, n_tasks in big.items():
            coord.releasing.add(job_id)
            task = loop.create_task(release_in_slices(coord, job_id, n_tasks))
            coord.background.add(task)
            task.add_done_callback(coord.background.discard)
    small = [j for j in done if j not in big]
    if small:
        coord.store.release_jobs(small)
    for job_id in small:
        coord.forget_released(job_id)


async def release_in_slices(coord: Coordinator, job_id: str, n_tasks: int) -> None:
    """Release ``job_id`` (``n_tasks`` tasks) a slice of TASK_SLICE_ROWS task rows per
    commit, the loop served between two. A failure leaves it unreleased (logged): its
    retention's purge frees what is left."""
    try:
        for lo in range(0, n_tasks, TASK_SLICE_ROWS):
            coord.store.release_slice(job_id, lo, lo + TASK_SLICE_ROWS)
            await asyncio.sleep(0)
        coord.store.mark_released(job_id)
        coord.forget_released(job_id)
    except Exception as e:  # noqa: BLE001 - a background task: nobody else would see it
        if not diskfull.note(coord.store.full, e):
            log.warning("releasing job %s failed: %s", job_id, e)
    finally:
        coord.releasing.discard(job_id)


async def purge_in_slices(coord: Coordinator, cutoff: float, slice_s: float) -> int:
    """Delete the jobs that ended before ``cutoff`` (epoch seconds), then the function
    blobs no job uses, a batch per commit, yielding to the event loop between two. A
    batch is sized in task rows to take about ``slice_s`` seconds (halved after a slower
    one, doubled after a quick one): whole jobs (at most PURGE_BATCH_MAX), or the
    lowest-numbered tasks of one job of more tasks than that (its row goes with its
    last slice). Each batch stands alone (a job expired before ``cutoff`` stays
    expired), so what runs between them cannot undo one. Returns the number of jobs
    deleted."""
    store = coord.store
    n, rows, blobs = 0, TASK_SLICE_ROWS, 16

    def resize(took: float, size: int, most: int) -> int:
        if took > slice_s:
            return max(1, size // 2)
        return min(most, size * 2) if took < slice_s / 2 else size

    while expired := store.expired_jobs(cutoff, PURGE_BATCH_MAX):
        t0 = time.perf_counter()
        first, first_n = expired[0]
        gone: list[str] = []
        if first_n <= rows or store.purge_task_slice(first, rows) < rows:
            take: list[str] = []
            total = 0
            for job_id, n_tasks in expired:
                if take and total + n_tasks > rows:
                    break
                take.append(job_id)
                total += n_tasks
            gone = store.purge_job_ids(take)
        coord.forget_purged(gone)
        n += len(gone)
        rows = resize(time.perf_counter() - t0, rows, 64 * TASK_SLICE_ROWS)
        await asyncio.sleep(0)
    while True:
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        if store.purge_blobs(cutoff, blobs) < blobs:
            break
        blobs = resize(time.perf_counter() - t0, blobs, PURGE_BATCH_MAX)
    return n
