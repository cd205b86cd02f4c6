"""The coordinator's brain: jobs, leases and workers, between the HTTP routes and the store.

The life of a task::

    submit ──► pending ──lease──► leased ──result──► done | failed
                  ▲                  │
                  └──── requeue ─────┘  worker lost (TTL, deregister, dropped session)
                                        or reconciled away by a heartbeat

* **submit** writes the job and all its tasks in one transaction, then wakes idle
  workers that are long-polling for work: a task is handed out the moment it exists.
* **lease** grants up to ``slots`` tasks with a fresh lease id each (the fencing token).
  A lease stays valid while its worker is alive; heartbeats keep the worker alive.
* **result** is accepted only under the task's current lease id; a result under an
  expired or superseded lease is refused (``StaleLease``) and never replaces the first
  accepted one. Each final result gets the next ``seq`` of its job, and callers read
  results by ``seq`` cursor, so each caller sees each result exactly once.
* **requeue** puts a task back at the front of its job's queue; after ``MAX_ATTEMPTS``
  losses it fails with kind ``lost``. A task whose process crashed (died without a
  result) runs again, up to ``MAX_ATTEMPTS`` attempts in all; one whose *code* raised
  is retried only when its job names the exception's type in ``retry_on``
  (``@accelerate(retries=N, retry_on=...)``), at most ``retries`` times; both on another
  worker when one can run it (:func:`.requeue.retry_failed`). Each attempt that ended
  without a result is kept in the task's history.

Everything here runs on the event loop thread; there is no locking.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import sqlite3
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

from .. import availability, hardware
from ..protocol import FailureKind
from ..limits import (HEARTBEAT_INTERVAL_S, MAX_ATTEMPTS,  # noqa: F401 (MAX_ATTEMPTS: core's own)
                      PURGE_SLICE_S, WORKER_TTL_S)
from . import callers, diskfull, jobops, placement, placing, recovery, requeue, retention, views
from .model import (CoordinatorError, Grant, Job, JobReleased, Lease, NoWorkers,  # noqa: F401
                    ResultNotStored, StaleLease, UnknownJob, UnknownWorker, Unsatisfiable, Worker)
from .journal import Journalled
from .output import OutputHub
from .scheduler import RunQueue
from .store import Store

log = logging.getLogger("gpumesh.coordinator")

#: How long a results long-poll of a big job lingers after the first new result, to
#: answer with a batch rather than one result per round trip.
RESULT_BATCH_S = 0.005
#: Dead workers stay listed (``alive: false``) this long before they are forgotten.
FORGET_DEAD_AFTER_S = 300.0


def new_id(nbytes: int = 6) -> str:
    return secrets.token_hex(nbytes)


def _settle(fut: asyncio.Future[Any], value: Any) -> None:
    """A long-poll's timer: ``fut`` gets ``value`` unless something answered it first."""
    if not fut.done():
        fut.set_result(value)


class Coordinator(Journalled):
    """All mutable coordinator state. ``clock`` is injectable for tests (seconds)."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.clock = clock
        self.started = clock()
        self.workers: dict[str, Worker] = {}
        self.jobs: dict[str, Job] = {}
        self.leases: dict[str, Lease] = {}
        self.queue: RunQueue[hardware.Requirements] = RunQueue()
        self.task_meta: dict[str, tuple[int, int]] = {}  # open task id -> (index, attempts)
        self.idle: OrderedDict[str, tuple[asyncio.Future[list[Grant]], int, list[int] | None]] = OrderedDict()
        self.task_cost: dict[str, float] = {}  # open task id -> cost, for jobs whose costs vary
        self.retried: dict[str, int] = {}  # open task id -> re-runs after a retry_on exception
        self.preempted_runs: dict[str, int] = {}  # open task id -> attempts handed back
        self.unrequeued: dict[str, tuple[str, str]] = {}  # task id -> (lease id, why): see requeue_soon
        self.stats = placement.SlotStats()
        #: module -> {worker: None, or (package, the worker's version)} a recent job found
        #: without it: the worker lacks it, or its version of the package has no such
        #: submodule (``gpumesh doctor`` shows both, in those words)
        self.lacking: dict[str, dict[str, tuple[str, str] | None]] = {}
        self._sessions = 0
        self.closing = False  # set by begin_shutdown()
        self.output = OutputHub(store.dir / "logs")
        #: Cap on running tasks per person (``token add NAME --max-running N``); set by
        #: whoever manages the people (see coordinator.people), read at every grant.
        self.max_running: dict[str, int] = {}
        #: Observers for the metrics leaf (coordinator.metrics), None when unused:
        #: ``on_grants(grants, now)`` after tasks are leased, ``on_result(lease, state,
        #: now)`` after a worker's result is accepted. They must not raise.
        self.on_grants = None
        self.on_result = None
        #: Set when a result woke a waiting caller (a route clears it before its writes):
        #: the worker's answer may then let the caller's go first (routes/batch.py).
        self.woke_callers = False
        self.callers = callers.Callers(clock)  # when open function jobs' callers were heard
        #: Jobs of many tasks being released a slice at a time (.retention), and the
        #: asyncio tasks doing it (held here: the loop keeps only weak references).
        self.releasing: set[str] = set()
        self.background: set[asyncio.Task[None]] = set()
        recovery.recover(self)  # rebuild the in-memory view from the store

    # ------------------------------------------------------------ workers --------
    def register(self, info: dict[str, Any], worker_id: str | None, slots: int) -> Worker:
        """Add a worker (or bring one back under the id it had). Leases it held survive."""
        wid = worker_id or new_id()
        w = self.workers.get(wid)
        if w is None:
            w = Worker(wid, info, slots, self.clock())
            w.leases = {tid for tid, lease in self.leases.items() if lease.worker_id == wid}
            self.workers[wid] = w
        w.info, w.slots, w.last_seen, w.alive = info, slots, self.clock(), True
        w.slot_list = info.get("slot_list") or hardware.check_slot_list(None, slots, None)
        w.views = None
        scores = info.get("scores") or {}
        score = f"{max(scores.values()):.3f}" if scores else "pending"
        log.info("worker joined: %s (%s %s, %d slot(s), score=%s, id %s)", info.get("hostname", "?"),
                 info.get("device", "CPU"), info.get("device_name", "?"), slots, score, wid)
        return w

    def _worker(self, wid: str) -> Worker:
        w = self.workers.get(wid)
        if w is None or not w.alive:
            raise UnknownWorker(wid)
        return w

    def heartbeat(self, wid: str, running: list[str] | None, info: dict[str, Any] | None,
                  receiving: bool = False) -> dict[str, Any]:
        """Mark ``wid`` alive. ``running`` lists the task ids the worker is executing:
        leases it holds but does not know about (a lost lease response) are requeued,
        unless the worker is ``receiving`` a lease answer still: behind a slow link the
        last bytes of a big answer leave this socket seconds before the worker has read
        them, and the tasks in it are not "running" until then.
        Returns ``{"cancel": [task ids the worker should kill]}``."""
        w = self._worker(wid)
        w.last_seen = self.clock()
        if info:
            closed = availability.closed_slots(w.info, w.slot_list)
            free = info.pop("gpu_free_mb", None)
            tele = info.pop("gpu_telemetry", None)  # shown (dashboard, metrics), not scheduled on
            for g in (w.info.get("gpus") or ()) if tele else ():
                got = tele.get(str(g.get("index")))
                if got:
                    g.update(got)
            if info.get("scores") and not w.info.get("scores"):
                log.info("worker scored: %s (%s, id %s)", w.info.get("hostname", "?"),
                         ", ".join(f"{k} score={v:.3f}" for k, v in info["scores"].items()), wid)
            w.info.update(info)
            news = "packages" in info  # something was installed: give its jobs another try
            if news:
                for job in self.jobs.values():
                    job.unable.pop(wid, None)
                    for ws in job.lacking.values():
                        ws.pop(wid, None)
                for ws in self.lacking.values():
                    ws.pop(wid, None)
            for g in (w.info.get("gpus") or ()) if free else ():  # a waiting task may fit now
                new = free.get(g.get("index"))
                if new is not None and new != g.get("memory_free_mb"):
                    g["memory_free_mb"], news = new, True
            w.views = None  # after every change above: placement reads them all
            # Slots the owner's rules opened again join the worker's open poll (it named
            # only the open ones), as an idle slot does after its result.
            opened = placing.reopened(self, w, closed)
            for slot in opened if self.idle else ():
                self._poll_serves(wid, slot)
            if self.idle and (news or opened):
                self._wake_idle()  # place again now, as a new job does
        cancel: list[str] = []
        if running is not None:
            held = set(running)
            now = self.clock()
            forgotten = [tid for tid in w.leases
                         if tid not in held and (sent := self.leases[tid].delivered) is not None
                         and now - sent > 2 * HEARTBEAT_INTERVAL_S] if not receiving else []
            requeue.requeue_soon(self, forgotten, reason="the worker no longer reported it")
            cancel = [tid for tid in held if tid not in w.leases]
        return {"cancel": cancel}

    def deregister(self, wid: str, reason: str = "worker left") -> int:
        """A worker is gone: requeue its leases now. Returns how many were requeued."""
        w = self.workers.get(wid)
        if w is None:
            return 0
        w.alive = False
        waiter = self.idle.pop(wid, None)
        if waiter and not waiter[0].done():
            waiter[0].set_result([])
        n = len(w.leases)
        requeue.requeue_soon(self, list(w.leases), reason=reason)
        log.info("worker %s gone (%s); %d task(s) re-queued", wid, reason, n)
        # A caller waiting on a job that no alive worker can run any more (the pool is
        # empty, or the only GPU box went while CPU workers stay) hears of it now: its
        # no-worker wait is bounded from this moment, not from the end of its long-poll.
        for job in self.jobs.values():
            if job.waiters and self.able_workers(job) == 0:
                job.notify()
        return n

    def session_opened(self, wid: str) -> int:
        """The worker opened its pulse connection; returns the session's id."""
        w = self._worker(wid)
        self._sessions += 1
        w.session = self._sessions
        w.last_seen = self.clock()
        return w.session

    def session_closed(self, wid: str, session: int) -> None:
        """The pulse connection dropped. If it was the worker's current one and the worker
        did not leave cleanly, the process (or its network) is gone: requeue now rather
        than after the heartbeat TTL."""
        if self.closing:  # our own shutdown ends every pulse: the workers are fine
            return
        w = self.workers.get(wid)
        if w is not None and w.alive and w.session == session:
            self.deregister(wid, reason="its connection dropped")

    def begin_shutdown(self) -> None:
        """The coordinator is stopping: answer every long-poll now (empty), end the pulses
        without declaring anyone dead, and make new long-polls return at once. Leases and
        queues stay as they are in the store; a restarted coordinator picks them up."""
        self.closing = True
        for fut, *_ in list(self.idle.values()):
            if not fut.done():
                fut.set_result([])
        self.idle.clear()
        for job in self.jobs.values():
            job.notify()
        for w in self.workers.values():
            if w.wake is not None:
                w.wake.set()

    def alive_workers(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive]

    def able_workers(self, job: Job) -> int:
        """How many alive workers could ever run every task of ``job`` (its requirements
        and largest ``gpu_memory_mb`` hint): callers stop waiting when none can."""
        alive = self.alive_workers()
        hint = max(job.vram_mb.values(), default=None)
        if not (job.require or hint):
            return len(alive)
        return sum(1 for w in alive if hardware.satisfiable(job.require, w.slot_views(), hint))

    def sweep(self) -> None:
        """Declare silent workers dead, requeue orphaned leases, forget long-dead workers."""
        now = self.clock()
        for w in list(self.workers.values()):
            if w.alive and now - w.last_seen > WORKER_TTL_S:
                self.deregister(w.id, reason=f"no heartbeat for {WORKER_TTL_S:.0f}s")
            elif not w.alive and now - w.last_seen > FORGET_DEAD_AFTER_S:
                del self.workers[w.id]
                self.stats.forget_worker(w.id)
        if now - self.started > WORKER_TTL_S:
            orphans = [tid for tid, lease in self.leases.items() if lease.worker_id not in self.workers]
            requeue.requeue_soon(self, orphans, reason="its worker did not come back after a restart")
        requeue.requeue_stalled(self)
        self.callers.expire(self)

    # ------------------------------------------------------------ leasing --------
    async def lease(self, wid: str, slots: int, wait: float, free: list[int] | None = None) -> list[Grant]:
        """Grant up to ``slots`` tasks to ``wid``, waiting up to ``wait`` s for some.
        ``free`` names the worker's free slots (None: any it holds no lease on)."""
        w = self._worker(wid)
        w.last_seen = self.clock()
        grants = self._grant(w, slots, free)
        if grants or wait <= 0 or self.closing:
            return grants
        old = self.idle.pop(wid, None)
        if old and not old[0].done():
            old[0].set_result([])
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Grant]] = loop.create_future()
        self.idle[wid] = (fut, slots, free)
        # Awaited as it is (not through wait_for, whose callbacks cost two more turns of
        # the event loop between a grant and this answer): the timer settles it empty.
        timer = loop.call_later(wait, _settle, fut, [])
        try:
            return await fut
        except asyncio.CancelledError:
            # The long-poll was abandoned (its connection dropped). Tasks granted in the
            # same instant would be stranded on a worker that never saw them.
            if fut.done() and not fut.cancelled() and fut.result():
                requeue.requeue_soon(self, [g.task_id for g in fut.result()],
                                     reason="the lease response was not delivered")
            raise
        finally:
            timer.cancel()
            cur = self.idle.get(wid)
            if cur and cur[0] is fut:
                del self.idle[wid]

    def _grant(self, w: Worker, slots: int, free: list[int] | None = None,
               queue: bool = False) -> list[Grant]:
        """Give each of ``w``'s free slots (strongest first) a task it can run, chosen by
        :mod:`.placement` from what the run queue offers (round-robin between people, then
        between each person's jobs; a person at their ``max_running`` cap is passed over).
        ``queue`` (``free`` names one slot): up to ``slots`` tasks for that one slot, one
        after the other, while each granted job may queue another (:meth:`queues`)."""
        if not len(self.queue):
            return []
        slot_ids = placing.free_slots(self, w, slots, free)
        if not slot_ids:
            return []
        views = w.slot_views()  # strongest first
        if len(slot_ids) == 1:
            serve = [v for v in views if v.id == slot_ids[0]] * (max(1, slots) if queue else 1)
        else:
            want = Counter(slot_ids)  # a legacy request may name a slot more than once
            serve = [v for v in views for _ in range(want.get(v.id, 0))]
        ctx, ram = placing.Placing(self), placing.RamBudget(self, w)
        owner_ok = None
        if self.max_running:
            running = self.running_by_owner()

            def owner_ok(owner: Any) -> bool:  # a job's owner: a person's name, or None
                cap = self.max_running.get(owner)
                return cap is None or running[owner] < cap
        taken = []
        for slot in serve:
            if not len(self.queue):
                break
            got = None
            # The run queue's lanes are the jobs' requirements: the slot is offered only
            # jobs whose requirements it meets, without looking at the others one by one.
            if slot.kind != "cpu" and ctx.gpu_jobs_pending():
                # A GPU slot serves jobs that need a GPU before those that merely may use one.
                got = self.queue.take_one(
                    lambda j, q: self._choose(j, q, slot, ctx),
                    lane_ok=lambda req: (req is not None and req.needs_gpu and placing.runs(req, slot)
                                         and ram.fits(req)), owner_ok=owner_ok)
            if got is None:
                got = self.queue.take_one(lambda j, q: self._choose(j, q, slot, ctx), owner_ok=owner_ok,
                                          lane_ok=lambda req: placing.runs(req, slot) and ram.fits(req))
            if got is None:
                if queue:
                    break  # (the same slot again would get nothing either)
                continue
            taken.append((got[0], got[1], slot.id, slot.kind != "cpu"))
            ram.take(job := self.jobs.get(got[0]))
            if owner_ok is not None:
                running[job.owner if job else None] += 1
            if queue and not self.queues(got[0]):
                break
        if not taken:
            return []
        now = self.clock()
        grants, rows, on_gpu = [], [], set()
        for job_id, tid, slot_id, gpu in taken:
            idx, attempts = self.task_meta[tid]
            lease_id = new_id(8)
            grants.append(Grant(tid, job_id, idx, lease_id, attempts + 1, slot_id))
            rows.append((tid, lease_id, w.id))
            if gpu:
                on_gpu.add(tid)
        try:
            self.store.lease(rows, on_gpu)
        except BaseException:
            self._ungrant(w, grants)  # the tasks go back in line, as the store has them
            raise
        for g in grants:
            self.task_meta[g.task_id] = (g.index, g.attempt)
            self.leases[g.task_id] = Lease(g.task_id, g.job_id, g.lease_id, w.id, now, g.slot)
            w.leases.add(g.task_id)
        self._on_rollback(lambda: self._ungrant(w, grants, leased=True))
        if self.on_grants is not None:
            on_grants = self.on_grants
            self._once_stored(lambda: on_grants(grants, now))
        return grants

    def _ungrant(self, w: Worker, grants: list[Grant], leased: bool = False) -> None:
        """Undo :meth:`_grant` (its store write failed or was rolled back): each task
        pending again, first in its job's line as it was; ``leased``: memory had leased
        them."""
        for g in reversed(grants):
            if leased:
                self.leases.pop(g.task_id, None)
                w.leases.discard(g.task_id)
                self.task_meta[g.task_id] = (g.index, g.attempt - 1)
            job = self.jobs.get(g.job_id)
            self.queue.push_front(g.job_id, g.task_id, lane=job.lane if job else None,
                                  owner=job.owner if job else None)

    def grant_queued(self, wid: str, slot: int, n: int, idle: bool = False) -> list[Grant]:
        """Up to ``n`` tasks for slot ``slot`` of worker ``wid``, in one placement pass and
        one store write (``[]`` for a worker that is gone or when nothing is pending).

        The grants are what the slot runs next, in this order: behind its running task
        (its queue), or first of all when the slot is ``idle``. Each is an ordinary lease
        (counted as running, re-queued when the worker is lost). A grant follows another
        only while the job granted last queues (:meth:`queues`): a task of another kind
        may end the queue, but nothing waits behind it. An idle slot that gets nothing
        joins the worker's open lease poll, as with :meth:`grant_now`; a busy one does
        not (that poll would start a second task in it)."""
        w = self.workers.get(wid)
        if w is None or not w.alive or n < 1:
            return []
        grants = self._grant(w, n, [slot], queue=True)
        if not grants and idle:
            self._poll_serves(wid, slot)
        return grants

    def queues(self, job_id: str) -> bool:
        """Whether a slot may hold more grants behind a task of ``job_id``: not for a
        person with a ``max_running`` cap (a queued grant counts as running, and would
        keep their tasks off other, idle slots). The worker asks for a queue only behind
        short tasks (``worker/poster.py``), in either isolation."""
        job = self.jobs.get(job_id)
        return job is not None and job.owner not in self.max_running

    def running_by_owner(self) -> Counter[str | None]:
        """Running tasks per person, not the grants queued behind them (O(leases))."""
        out: Counter[str | None] = Counter()
        for lease in views.running_leases(self.leases.values()):
            job = self.jobs.get(lease.job_id)
            out[job.owner if job else None] += 1
        return out

    def _choose(self, job_id: str, q: deque[str], slot: hardware.Slot, ctx: placing.Placing) -> int | None:
        """Position in job ``job_id``'s queue ``q`` of the task ``slot`` should run, or
        None (see :func:`.placing.choose`)."""
        if job_id in self.callers.held:  # recovered, and its caller is not back yet
            return None
        return placing.choose(self, job_id, q, slot, ctx)

    def _wake_idle(self) -> None:
        """Hand newly pending tasks to workers that are long-polling: the strongest first
        (longest-waiting first among equals). A worker none of whose free slots can run
        what is pending keeps waiting."""
        if not self.idle or not len(self.queue):
            return
        waiting = list(self.idle.items())
        if len(waiting) > 1:
            waiting.sort(key=lambda kv: -placing.best_score(self.workers.get(kv[0])))
        for wid, (fut, slots, free) in waiting:
            if not len(self.queue):
                break
            w = self.workers.get(wid)
            if fut.done() or w is None or not w.alive:
                self.idle.pop(wid, None)
                continue
            grants = self._grant(w, slots, free)
            if grants:
                waiter = self.idle.pop(wid)
                if self._undo is not None:  # (the grants are undone first: last first)
                    def restore(wid: str = wid, waiter: Any = waiter) -> None:
                        self.idle.setdefault(wid, waiter)
                    self._undo.append(restore)
                # The worker's answer waits for the commit (one that fails undoes the grants).
                self._once_stored(functools.partial(self._answer_poll, fut, grants))

    def _answer_poll(self, fut: asyncio.Future[list[Grant]], grants: list[Grant]) -> None:
        if fut.done():  # (its worker left meanwhile: nobody takes these)
            requeue.requeue_soon(self, [g.task_id for g in grants], reason="the lease response was not delivered")
        else:
            fut.set_result(grants)

    def _requeue(self, task_ids: list[str], reason: str, preempted: bool = False) -> None:
        """Put leased tasks back in line, or fail them as lost (see :func:`.requeue.requeue`)."""
        requeue.requeue(self, task_ids, reason, preempted=preempted)

    # ------------------------------------------------------------ jobs -----------
    def submit(self, job_id: str, name: str, kind: str, fn_hash: str | None, meta: dict[str, Any],
               args: list[Any], costs: list[float], require_worker: bool,
               owner: str | None = None, known_new: bool = False) -> tuple[Job, bool]:
        """Create a job with one task per ``args`` payload, owned by the person ``owner``.
        Idempotent on ``job_id``: returns ``(job, created)``. Raises ``NoWorkers`` when
        ``require_worker`` and none is alive (nothing is stored then). ``known_new``: the
        caller has just found that no job ``job_id`` exists, with no ``await`` since
        (one look-up in the store per submit, not two)."""
        if not known_new and (job_id in self.jobs or self.store.job_exists(job_id)):
            job = self.jobs.get(job_id)
            if job is None:
                row = self.store.job_row(job_id)
                assert row is not None  # (job_exists said so)
                job = Job(job_id, row["kind"], row["fn_hash"], row["meta"], row["n_tasks"],
                          n_final=row["n_tasks"], state=row["state"], owner=row.get("owner"))
            return job, False
        alive = self.alive_workers()
        if require_worker and not alive:
            raise NoWorkers()
        job = Job(job_id, kind, fn_hash, meta, len(args), owner=owner, submitted=self.clock())
        job.prepare()
        hint = max(job.vram_mb.values(), default=None)
        if alive and (job.require or hint):
            slots = [s for w in alive for s in w.slot_views()]
            if not hardware.satisfiable(job.require, slots, hint):
                raise Unsatisfiable(self.unsatisfiable_message(job.require, hint))
        task_ids = [new_id() for _ in args]
        # The job and the grants to workers that wait for work in one commit: the job is
        # acknowledged, and a grant leaves, only once both are stored.
        with self.atomic():
            self.store.create_job(job_id, name, kind, fn_hash, meta,
                                  [(tid, i, costs[i], a) for i, (tid, a) in enumerate(zip(task_ids, args))],
                                  owner=owner)
            if not args:
                job.state = "finished"
                self.store.set_job_state(job_id, "finished")
            self.jobs[job_id] = job
            job.costs_vary = len(set(costs)) > 1
            for i, tid in enumerate(task_ids):
                self.task_meta[tid] = (i, 0)
                if job.costs_vary and costs[i] != 1.0:
                    self.task_cost[tid] = costs[i]
            self.queue.add(job_id, task_ids, lane=job.lane, owner=job.owner)
            self._on_rollback(lambda: self._unsubmit(job_id, task_ids))
            self._wake_idle()
        return job, True

    def _unsubmit(self, job_id: str, task_ids: list[str]) -> None:
        """Forget a job whose submit was not stored (its commit failed)."""
        self.queue.drop_job(job_id)
        self.jobs.pop(job_id, None)
        for tid in task_ids:
            self.task_meta.pop(tid, None)
            self.task_cost.pop(tid, None)

    def unsatisfiable_message(self, req: hardware.Requirements, hint: float | None) -> str:
        """The text of the ``Unsatisfiable`` refusal (see :func:`.views.unsatisfiable_message`)."""
        return views.unsatisfiable_message(self, req, hint)

    def worker_view(self, w: Worker) -> dict[str, Any]:
        """A worker as ``GET /v1/workers`` lists it."""
        return views.worker_view(self, w)

    def job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJob(job_id)
        return job

    def post_result(self, task_id: str, lease_id: str, status: str, error: dict[str, Any] | None,
                    payload: Any) -> str | None:
        """Accept a worker's result under ``lease_id``; raises ``StaleLease`` otherwise.
        Returns the id of the worker that held the lease (None if it is gone).
        ``status``: ``ok`` (payload is the value), ``error`` (the function raised;
        payload is the pickled exception or None), ``retry`` (the worker could not run
        it; requeue without blaming the task)."""
        lease = self.leases.get(task_id)
        if lease is None or lease.lease_id != lease_id:
            raise StaleLease(task_id)
        w, now = self.workers.get(lease.worker_id), self.clock()
        cost, ran = self.task_cost.get(task_id, 1.0), views.ran_in_slot(w, lease, now)
        if w:
            w.last_seen = now
            if lease.slot is not None:  # (its next queued grant starts now)
                w.slot_free_at[lease.slot] = now
        state = "done" if status == "ok" else "failed"
        try:
            # The store first: when it cannot write the result (or the re-queue), nothing
            # here changed (the lease holds, so the worker's next post of it is accepted).
            if status == "retry":
                self._requeue([task_id], reason=(error or {}).get("message", "worker asked to retry"))
                return lease.worker_id if w and w.alive else None
            if status == "error" and isinstance(error, dict) and isinstance(error.get("module"), str):
                error = requeue.missing_module(self, lease, error)
                if error is None:  # tried again on a worker that may have it
                    return lease.worker_id if w and w.alive else None
            elif status == "error" and isinstance(error, dict) and error.get("kind") == FailureKind.REQUIRES:
                error = requeue.cannot_provide(self, lease, error)
                if error is None:  # tried again on a worker that may build it (or has it)
                    return lease.worker_id if w and w.alive else None
            if status == "error" and requeue.retry_failed(self, lease, error):
                return lease.worker_id if w and w.alive else None
            self._finalize(lease.job_id, task_id, state, error, payload, lease.worker_id, ran)
        except (OSError, sqlite3.Error) as e:
            if not diskfull.note(self.store.full, e):
                log.error("task %s: its result could not be stored (%s: %s); the task stays leased",
                          task_id, type(e).__name__, e)
            raise ResultNotStored(task_id, e, data_dir=self.store.dir) from e
        del self.leases[task_id]
        if w:
            w.leases.discard(task_id)
        self._on_rollback(lambda: requeue.relet(self, lease))
        if status == "ok" and lease.slot is not None:
            job = self.jobs.get(lease.job_id)
            key = (lease.worker_id, lease.slot), (job.fn_hash if job else None) or ""
            self._once_stored(lambda: self.stats.record(*key, ran, cost, now))
        if self.on_result is not None:
            on_result = self.on_result
            self._once_stored(lambda: on_result(lease, state, now))
        if self.max_running and self.idle:
            self._once_stored(self._wake_idle)  # a person at their cap may have a task to start now
        return lease.worker_id if w and w.alive else None

    def hand_back(self, task_id: str, lease_id: str, reason: str) -> None:
        """The worker gives a running task back (its owner paused it, wants the GPU, the
        hours ended): fenced by ``lease_id`` like a result (``StaleLease`` otherwise).
        The task is *preempted*, not failed: it goes back to the front of its queue, the
        attempt does not count towards the loss limit, and what the killed copy printed is
        marked as such."""
        lease = self.leases.get(task_id)
        if lease is None or lease.lease_id != lease_id:
            raise StaleLease(task_id)
        w = self.workers.get(lease.worker_id)
        host = (w.info.get("hostname") if w else None) or lease.worker_id
        idx, attempts = self.task_meta[task_id]
        # The store first: when it cannot write, the lease holds and nothing is noted.
        self._requeue([task_id], reason=f"preempted: {reason}", preempted=True)
        log.info("task %s handed back by worker %s (%s); re-queued as preempted",
                 task_id, lease.worker_id, reason)
        try:
            self.output.append(lease.job_id, task_id, idx, host, "stderr",
                               f"[gpumesh: attempt {attempts} on {host} ended here, preempted "
                               f"({reason}); the task runs again]\n".encode(), attempts)
        except OSError as e:  # (a note in its log: the hand-back stands without it)
            if not diskfull.note(self.store.full, e):
                log.warning("task %s: its log's note of the hand-back not written: %s", task_id, e)

    def waiting_reason(self, job_id: str) -> str | None:
        """Why the job's pending tasks wait although workers that could run them are
        alive (see :func:`.views.waiting_reason`). None otherwise."""
        return views.waiting_reason(self, job_id)

    def lease_delivered(self, leases: list[tuple[str, str]], ok: bool) -> None:
        """The answer carrying these ``(task_id, lease_id)`` grants finished sending (``ok``)
        or broke off: then the worker never got them, so they are re-queued now."""
        now = self.clock()
        lost = []
        for tid, lease_id in leases:
            lease = self.leases.get(tid)
            if lease is None or lease.lease_id != lease_id:
                continue
            if ok:
                lease.delivered = now
            else:
                lost.append(tid)
        if lost:
            requeue.requeue_soon(self, lost, reason="the lease answer did not reach the worker")

    def grant_now(self, wid: str, slots: int, slot: int | None = None) -> list[Grant]:
        """Grant up to ``slots`` tasks to ``wid`` without waiting (``[]`` if none);
        ``slot``: the one slot that just became free."""
        w = self.workers.get(wid)
        if w is None or not w.alive:
            return []
        grants = self._grant(w, slots, None if slot is None else [slot])
        if not grants and slot is not None:
            self._poll_serves(wid, slot)
        return grants

    def _poll_serves(self, wid: str, slot: int) -> None:
        """Slot ``slot`` of ``wid`` is idle and got nothing. If the worker has a lease
        long-poll open (naming its other free slots), let that poll serve this slot too;
        otherwise a task only this slot may run would wait for the poll to time out."""
        waiter = self.idle.get(wid)
        if waiter is not None and not waiter[0].done() and waiter[2] is not None \
                and slot not in waiter[2]:
            self.idle[wid] = (waiter[0], waiter[1] + 1, waiter[2] + [slot])

    def _finalize(self, job_id: str, task_id: str, state: str, error: dict[str, Any] | None,
                  payload: Any, worker_id: str | None = None, ran_s: float | None = None) -> None:
        job = self.jobs[job_id]
        if error is not None and worker_id:
            error.setdefault("worker", worker_id)
            w = self.workers.get(worker_id)
            if w is not None and w.hostname:
                error["hostname"] = w.hostname
        if error is not None and task_id in self.task_meta:
            error["attempt"] = self.task_meta[task_id][1]  # ours, whatever the worker said
        last = job.n_final + 1 >= job.n_tasks and job.state == "active"
        # Stored before anything in memory changes: a write that raises leaves both as they were.
        self.store.finish(task_id, state, job.next_seq, error, payload, job_id, last, ran_s)
        counts = job.next_seq, job.n_final, job.state
        job.next_seq += 1
        job.n_final += 1
        kept: list[tuple[dict[str, Any], Any]] = [(d, d.pop(task_id)) for d in (self.task_meta, self.task_cost, self.retried,
                                               self.preempted_runs, job.avoid) if task_id in d]
        if last:
            job.state = "finished"

        def undo() -> None:
            job.next_seq, job.n_final, job.state = counts
            for d, v in kept:
                d[task_id] = v
        self._on_rollback(undo)
        self._once_stored(lambda: self._notify(job))  # no caller is woken with a result not stored

    def _notify(self, job: Job) -> None:
        """Wake the callers waiting for ``job``'s results (:attr:`woke_callers` says so)."""
        if job.waiters:
            self.woke_callers = True
        job.notify()

    def cancel(self, job_id: str, reason: str = "the job was cancelled") -> int:
        """Cancel every task of a job that is not final yet (``reason``: each one's error
        message). Returns how many. All or nothing (see :func:`.jobops.cancel`)."""
        return jobops.cancel(self, job_id, reason)

    def retry(self, job_id: str) -> int:
        """Re-queue every failed task of ``job_id`` (see :func:`.jobops.retry`)."""
        return jobops.retry(self, job_id)

    async def wait_results(self, job_id: str, after: int, wait: float, out_after: int | None = None) -> Job:
        """Return once ``job_id`` has a result with ``seq > after`` (or, when ``out_after``
        is given, output with a higher seq than it), or ``wait`` s passed."""
        job = self.job(job_id)
        if job.next_seq - 1 > after or wait <= 0 or self.closing:
            return job
        if out_after is not None and self.output.last_seq(job_id) > out_after:
            return job
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        job.waiters.append(fut)
        timer = loop.call_later(wait, _settle, fut, False)  # (notify settles it None)
        try:
            woken = await fut
        finally:
            timer.cancel()
        if woken is False:  # the wait ran out
            if fut in job.waiters:
                job.waiters.remove(fut)
            return job
        if job.n_tasks - job.n_final > 1:
            # More results are on their way: gather a few per answer instead of one
            # round trip per result (a single call is never delayed by this).
            await asyncio.sleep(RESULT_BATCH_S)
        return job

    def purge(self, cutoff: float) -> int:
        """Forget jobs that ended before ``cutoff`` (epoch seconds) all at once; see
        Store.purge_before. The coordinator's loop uses :meth:`purge_in_slices`."""
        gone = self.store.purge_before(cutoff)
        self.forget_purged(gone)
        return len(gone)

    async def purge_in_slices(self, cutoff: float, slice_s: float = PURGE_SLICE_S) -> int:
        """:meth:`purge`, a transaction at a time, the event loop served between two
        (:func:`.retention.purge_in_slices`). Returns the number of jobs deleted."""
        return await retention.purge_in_slices(self, cutoff, slice_s)

    def forget_purged(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self.jobs.pop(job_id, None)
            self.output.forget(job_id, files=True)

    def post_output(self, task_id: str, lease_id: str, stdout: bytes, stderr: bytes) -> None:
        """Output a running task printed; fenced by its lease like a result."""
        lease = self.leases.get(task_id)
        if lease is None or lease.lease_id != lease_id:
            raise StaleLease(task_id)
        w = self.workers.get(lease.worker_id)
        host = (w.info.get("hostname") if w else None) or lease.worker_id
        idx, attempt = self.task_meta.get(task_id, (-1, 1))
        for stream, data in (("stdout", stdout), ("stderr", stderr)):
            self.output.append(lease.job_id, task_id, idx, host, stream, data, attempt)
        job = self.jobs.get(lease.job_id)
        if job is not None and (stdout or stderr):
            job.notify()

    def release(self, *job_ids: str) -> None:
        """The callers have every result: free the payloads (metadata stays for listings);
        see :func:`.retention.release`. A job still running is skipped."""
        retention.release(self, job_ids)

    def forget_released(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)
        self.output.forget(job_id)

