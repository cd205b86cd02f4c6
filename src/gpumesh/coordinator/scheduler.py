"""Which pending task goes to which worker: pure data structures, no I/O, no clock.

The run queue holds pending task ids per job. Within a job tasks leave in index order
(FIFO). Jobs belong to *people* (their owner; None for all when nobody is named), and
free slots go round-robin between people first, then between each person's jobs, task by
task: one person's forty jobs get no more of the pool than another person's single job,
and a one-task job starts at the next free slot whatever else is queued (a person who
has not been served since they last had nothing pending goes before everyone who has). A task that is
re-queued after its worker was lost goes to the *front* of its job's queue: it has
waited longest. A person may be skipped for a round (``owner_ok``: their cap on running
tasks is reached); they keep their place in line.

Which of the tasks a job offers a given slot takes (hard filters, cost, stragglers) is
decided by :mod:`gpumesh.coordinator.placement`, through :meth:`RunQueue.take_one`.

Nothing here is proportional to the number of pending tasks: a job's tasks are a deque;
people wait in an ordered dict in turn order; each person's jobs wait in *lanes* - one per
distinct requirement (the caller's key, e.g. the job's hardware requirements) - each an
ordered dict of jobs in turn order. A free slot walks the people in turn, asks only the
lanes it can serve and walks their jobs merged by turn, so a lease costs O(people x
lanes) plus the jobs it looks at and passes over, however deep the queue is.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from operator import itemgetter
from typing import Generic, TypeVar

#: What a job's lane is (the coordinator's: its hardware requirements). A job added
#: without one is in the ``None`` lane.
L = TypeVar("L", bound=Hashable)


class RunQueue(Generic[L]):
    """Pending tasks, grouped by job, jobs by lane and lanes by person. All operations are
    O(1) per task moved; :meth:`take_one` is O(people x lanes) plus the jobs it passes over."""

    def __init__(self) -> None:
        self._jobs: dict[str, deque[str]] = {}  # only jobs with pending tasks
        self._lane_of: dict[str, L | None] = {}
        self._owner_of: dict[str, Hashable] = {}
        # person -> lane -> {job id: turn}, each lane's jobs in turn order
        self._people: dict[Hashable, dict[L | None, OrderedDict[str, int]]] = {}
        # The people's turn order: those not served since they last had something pending
        # (in arrival order), then the others, served longest ago first. A newcomer is
        # thus next, not behind everyone who has been served already.
        self._fresh: OrderedDict[Hashable, None] = OrderedDict()
        self._line: OrderedDict[Hashable, None] = OrderedDict()
        self._lane_jobs: Counter[L | None] = Counter()  # lane -> jobs waiting in it (any person)
        self._turns = 0
        self._n = 0

    def __len__(self) -> int:
        return self._n

    # -- jobs entering and leaving the line ---------------------------------------------
    def _enter(self, job_id: str, q: deque[str], lane: L | None, owner: Hashable) -> None:
        """A job with no pending tasks gets some: it joins the back of its person's line
        (and a person with nothing pending joins the back of the people's)."""
        self._jobs[job_id] = q
        self._lane_of[job_id] = lane
        self._owner_of[job_id] = owner
        self._turns += 1
        lanes = self._people.get(owner)
        if lanes is None:
            lanes = self._people[owner] = {}
            self._fresh[owner] = None
        lanes.setdefault(lane, OrderedDict())[job_id] = self._turns
        self._lane_jobs[lane] += 1

    def _leave(self, job_id: str) -> None:
        del self._jobs[job_id]
        lane = self._lane_of.pop(job_id)
        owner = self._owner_of.pop(job_id)
        lanes = self._people[owner]
        jobs = lanes[lane]
        del jobs[job_id]
        if not jobs:
            del lanes[lane]
            if not lanes:
                del self._people[owner]
                self._fresh.pop(owner, None)
                self._line.pop(owner, None)
        self._lane_jobs[lane] -= 1
        if not self._lane_jobs[lane]:
            del self._lane_jobs[lane]

    def _to_back(self, job_id: str) -> None:
        jobs = self._people[self._owner_of[job_id]][self._lane_of[job_id]]
        self._turns += 1
        jobs[job_id] = self._turns
        jobs.move_to_end(job_id)

    # -- adding -------------------------------------------------------------------------
    def add(self, job_id: str, task_ids: Iterable[str], lane: L | None = None,
            owner: Hashable = None) -> None:
        """Append tasks at the back of ``job_id``'s queue. ``lane``: the job's lane (what
        :meth:`take_one`'s ``lane_ok`` is asked about); ``owner``: the person it belongs
        to (what ``owner_ok`` is asked about). A job with pending tasks keeps the lane and
        owner it has."""
        q = self._jobs.get(job_id)
        if q is None:
            q = deque(task_ids)
            if q:  # a job with nothing pending never stands in line
                self._enter(job_id, q, lane, owner)
                self._n += len(q)
            return
        before = len(q)
        q.extend(task_ids)
        self._n += len(q) - before

    def push_front(self, job_id: str, task_id: str, lane: L | None = None,
                   owner: Hashable = None) -> None:
        """Put a re-queued task first in line within its job."""
        q = self._jobs.get(job_id)
        if q is None:
            self._enter(job_id, deque([task_id]), lane, owner)
        else:
            q.appendleft(task_id)
        self._n += 1

    def remove(self, job_id: str, task_id: str) -> bool:
        """Take one pending task out of line (found from the front: where a re-queued
        task stands). Returns whether it was there."""
        q = self._jobs.get(job_id)
        if q is None or task_id not in q:
            return False
        q.remove(task_id)
        self._n -= 1
        if not q:
            self._leave(job_id)
        return True

    def drop_job(self, job_id: str) -> list[str]:
        """Remove and return every pending task of ``job_id``."""
        q = self._jobs.get(job_id)
        if q is None:
            return []
        self._leave(job_id)
        self._n -= len(q)
        return list(q)

    # -- looking ------------------------------------------------------------------------
    def tasks(self, job_id: str) -> list[str]:
        """The pending tasks of ``job_id``, in line order (nothing is removed)."""
        return list(self._jobs.get(job_id) or ())

    def pending(self, job_id: str) -> int:
        q = self._jobs.get(job_id)
        return len(q) if q else 0

    def lanes(self) -> list[L | None]:
        """The lanes that have pending tasks."""
        return list(self._lane_jobs)

    def owners(self) -> list[Hashable]:
        """The people with pending tasks, in the order they will next be served."""
        return [*self._fresh, *self._line]

    def pending_by_owner(self) -> dict[Hashable, int]:
        """Pending tasks per person (O(jobs pending))."""
        out: Counter[Hashable] = Counter()
        for job_id, q in self._jobs.items():
            out[self._owner_of[job_id]] += len(q)
        return dict(out)

    def _in_turn(self, lanes: list[OrderedDict[str, int]]) -> Iterator[str]:
        """Job ids of ``lanes`` in turn order (each lane is already in turn order)."""
        if len(lanes) == 1:
            return iter(lanes[0])
        return (j for j, _ in heapq.merge(*(jobs.items() for jobs in lanes), key=itemgetter(1)))

    def job_ids(self) -> list[str]:
        """Jobs with pending tasks, in the order they would be served if each person's
        turn came round once per job."""
        return [j for owner in self.owners() for j in self._in_turn(list(self._people[owner].values()))]

    # -- taking -------------------------------------------------------------------------
    def take_one(self, choose: Callable[[str, deque[str]], int | None],
                 lane_ok: Callable[[L | None], bool] | None = None,
                 owner_ok: Callable[[Hashable], bool] | None = None) -> tuple[str, str] | None:
        """Remove one task for one free slot and return ``(job_id, task_id)``, or None.

        People are offered the slot in turn (for whom ``owner_ok(owner)`` is true; all
        when it is None), and each person's jobs in lanes for which ``lane_ok(lane)`` is
        true (all when it is None), in turn; ``choose(job_id, queue)`` returns the
        position in that job's queue of the task to run (0 keeps FIFO), or None when the
        slot can run none of them: the job then keeps its place in line. The served job
        moves to the back of its person's line, and the person to the back of the
        people's.
        """
        verdict: dict[L | None, bool] = {}

        def ok(lane: L | None) -> bool:
            if lane_ok is None:
                return True
            if lane not in verdict:
                verdict[lane] = lane_ok(lane)
            return verdict[lane]

        for owner in itertools.chain(self._fresh, self._line):  # changed only right before returning
            if owner_ok is not None and not owner_ok(owner):
                continue
            person_lanes = self._people[owner]
            lanes = [jobs for lane, jobs in person_lanes.items() if ok(lane)]
            if not lanes:
                continue
            for job_id in self._in_turn(lanes):
                q = self._jobs[job_id]
                pos = choose(job_id, q)
                if pos is None:
                    continue
                if pos == 0:
                    task_id = q.popleft()
                else:
                    task_id = q[pos]
                    del q[pos]
                self._n -= 1
                if q:
                    self._to_back(job_id)
                else:
                    self._leave(job_id)
                if owner in self._people:
                    self._fresh.pop(owner, None)
                    self._line[owner] = None
                    self._line.move_to_end(owner)
                return job_id, task_id
        return None

    def take(self, n: int, eligible: Callable[[str], bool] = lambda job_id: True) -> list[tuple[str, str]]:
        """Remove up to ``n`` tasks, one job at a time in turn; returns ``(job_id, task_id)``.

        ``eligible(job_id)`` lets the caller skip jobs this worker cannot run (hardware
        requirements); skipped jobs keep their place in line.
        """
        out: list[tuple[str, str]] = []
        verdict: dict[str, bool] = {}

        def first(job_id: str, q: deque[str]) -> int | None:
            if job_id not in verdict:
                verdict[job_id] = eligible(job_id)
            return 0 if verdict[job_id] else None

        while len(out) < n and self._n:
            got = self.take_one(first)
            if got is None:
                break
            out.append(got)
        return out
