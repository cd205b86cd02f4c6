"""Placement against the live pool: what one grant round knows, and which task a slot takes.

:mod:`.placement` is the pure policy (cost ranking, stragglers, no state of its own);
this module applies it to the coordinator's workers, jobs and queues: the per-round
context :class:`Placing`, which of a worker's slots a grant serves (:func:`free_slots`),
the choice of a task within a job's queue (:func:`choose`), and the order in which
long-polling workers are served (:func:`best_score`).
``Coordinator._grant`` drives it; nothing here changes the coordinator's state.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .. import availability, hardware
from . import placement, views
from .model import Job, Worker

if TYPE_CHECKING:  # core imports this module: no import of core at run time
    from .core import Coordinator


def runs(req: hardware.Requirements | None, slot: hardware.Slot) -> bool:
    """Whether ``slot`` meets ``req`` (a run queue lane; None: a job not known here)."""
    return not req or hardware.refusal(req, slot) is None


class RamBudget:
    """What the ``memory=`` of the tasks running on one worker leaves of its RAM (bytes),
    for one grant round: a task that asks ``memory=`` runs there only while it fits
    beside those (Ray counts memory as a resource the same way), not merely when the
    machine's total would hold it alone. ``free`` is None when the worker did not say
    how much RAM it has (nothing is held back then)."""

    def __init__(self, coord: Coordinator, w: Worker):
        ram = w.info.get("ram_mb")
        self.free: float | None = None
        if isinstance(ram, (int, float)) and ram > 0:
            running = views.running_leases(coord.leases[t] for t in w.leases if t in coord.leases)
            self.free = float(ram) * hardware.MiB - sum(_memory(coord.jobs.get(lease.job_id))
                                                        for lease in running)

    def fits(self, req: hardware.Requirements | None) -> bool:
        return self.free is None or not req or req.memory is None or req.memory <= self.free

    def take(self, job: Job | None) -> None:
        """A task of ``job`` was granted here in this round."""
        if self.free is not None:
            self.free -= _memory(job)


def _memory(job: Job | None) -> float:
    return float(job.require.memory or 0) if job is not None and job.require else 0.0


class Placing:
    """What one grant round needs to know about the whole pool, computed once, lazily:
    which jobs need a GPU, the stragglers per function, the best slot per job."""

    def __init__(self, coord: Coordinator):
        self.coord = coord
        self._gpu_jobs: bool | None = None
        self._slots: list[hardware.Slot] | None = None
        self._stragglers: dict[str, set[placement.SlotKey]] = {}
        self._best: dict[str, float] = {}

    def gpu_jobs_pending(self) -> bool:
        """Whether a job that needs a GPU has pending tasks (one look per lane)."""
        if self._gpu_jobs is None:
            self._gpu_jobs = any(req is not None and req.needs_gpu for req in self.coord.queue.lanes())
        return self._gpu_jobs

    def _all_slots(self) -> list[hardware.Slot]:
        if self._slots is None:
            self._slots = [s for w in self.coord.alive_workers() for s in w.slot_views()]
        return self._slots

    def stragglers(self, fn: str) -> set[placement.SlotKey]:
        if fn not in self._stragglers:
            self._stragglers[fn] = self.coord.stats.stragglers(fn, self.coord.clock())
        return self._stragglers[fn]

    def relative(self, job: Job, slot: hardware.Slot) -> float:
        """``slot``'s strength over the best alive slot that could run ``job``."""
        fn = job.fn_hash or ""
        st = self.stragglers(fn)
        if job.id not in self._best:
            fit = [s for s in self._all_slots() if not job.lane or hardware.refusal(job.lane, s) is None]
            self._best[job.id] = max((placement.strength(s, st) for s in fit), default=0.0)
        return placement.relative(placement.strength(slot, st), self._best[job.id])


def free_slots(coord: Coordinator, w: Worker, slots: int, free: list[int] | None) -> list[int]:
    """The ids of ``w``'s slots a grant for ``slots`` tasks serves, in order: those in
    ``free`` (None: any) that its owner's rules leave open."""
    ids = [s["id"] for s in w.slot_list] or list(range(w.slots))
    closed = availability.closed_slots(w.info, w.slot_list)  # the owner's rules
    if closed:
        ids = [i for i in ids if i not in closed]
        free = None if free is None else [i for i in free if i not in closed]
    if free is not None:
        known = set(ids)
        return [i for i in dict.fromkeys(free) if i in known]
    # A request that names no slots (a worker from before slots, or a test) asks for
    # ``slots`` tasks, as it always could: idle slots first, then busy ones again.
    busy = {lease.slot for tid in w.leases if (lease := coord.leases.get(tid)) is not None}
    order = [i for i in ids if i not in busy] + [i for i in ids if i in busy]
    return [order[k % len(order)] for k in range(max(0, slots))] if order else []


def reopened(coord: Coordinator, w: Worker, closed: set[int]) -> list[int]:
    """``w``'s slots that its owner's rules closed (``closed``, before a heartbeat) and
    leave open now (resumed, a GPU that stopped yielding or cooled down), without a lease
    on them: idle, so they may take a task at once."""
    opened = closed - availability.closed_slots(w.info, w.slot_list)
    held = {lease.slot for tid in w.leases if (lease := coord.leases.get(tid)) is not None}
    return sorted(opened - held)


def choose(coord: Coordinator, job_id: str, q: deque[str], slot: hardware.Slot,
           ctx: Placing) -> int | None:
    """Position in job ``job_id``'s queue ``q`` of the task ``slot`` should run, or
    None if it can run none of the first ``placement.HEAD_WINDOW``. The job's
    requirements were checked already, for its whole lane (see ``Coordinator._grant``)."""
    job = coord.jobs.get(job_id)
    if job is None:
        return 0
    if job.unable and job.excludes(slot.worker):
        return None  # it cannot run this job's tasks (a module it lacks, a failed build)
    if not job.vram_mb and not job.costs_vary and not job.avoid:
        return 0  # the common case: FIFO
    candidates = []
    for pos in range(min(len(q), placement.HEAD_WINDOW)):
        tid = q[pos]
        if job.avoid and slot.worker in job.avoid.get(tid, ()) and elsewhere(coord, job, tid):
            continue  # its function raised here: another worker tries it
        hint = job.vram_mb.get(coord.task_meta[tid][0]) if job.vram_mb else None
        if hint and hardware.vram_refusal(slot, hint) is not None:
            continue
        candidates.append((pos, coord.task_cost.get(tid, 1.0)))
    if not candidates:
        return None
    if not job.costs_vary:
        return candidates[0][0]
    return placement.pick(candidates, ctx.relative(job, slot))


def elsewhere(coord: Coordinator, job: Job, task_id: str) -> bool:
    """Whether an alive worker the task has not failed on could run it now: in a slot its
    owner's rules leave open (a paused or out-of-hours worker may stay closed for hours,
    while one the task already ran on is free)."""
    tried = job.avoid.get(task_id, ())
    for w in coord.workers.values():
        if not w.alive or w.id in tried:
            continue
        closed = availability.closed_slots(w.info, w.slot_list)
        if any(s.id not in closed and runs(job.require, s) for s in w.slot_views()):
            return True
    return False


def best_score(w: Worker | None) -> float:
    """``w``'s best benchmark score (0.0 when gone or not measured): long-polling workers
    are served strongest first."""
    if w is None:
        return 0.0
    scores = w.info.get("scores") or {}
    return max([float(v) for v in scores.values()] + [float(w.info.get("score") or 0)])
