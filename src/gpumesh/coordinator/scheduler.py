"""Which pending task goes to which worker: pure data structures, no I/O, no clock.

The run queue holds pending task ids per job. Within a job tasks leave in index order
(FIFO); between jobs the queue takes turns task by task (round-robin), so two users'
jobs interleave instead of the second waiting for the whole first one. A task that is
re-queued after its worker was lost goes to the *front* of its job's queue: it has
waited longest.

Which of the tasks a job offers a given slot takes (hard filters, cost, stragglers) is
decided by :mod:`gpumesh.coordinator.placement`, through :meth:`RunQueue.take_one`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable


class RunQueue:
    """Pending tasks, grouped by job. All operations are O(1) per task moved."""

    def __init__(self) -> None:
        self._jobs: OrderedDict[str, deque[str]] = OrderedDict()
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def add(self, job_id: str, task_ids: Iterable[str]) -> None:
        """Append tasks at the back of ``job_id``'s queue."""
        q = self._jobs.setdefault(job_id, deque())
        before = len(q)
        q.extend(task_ids)
        self._n += len(q) - before

    def push_front(self, job_id: str, task_id: str) -> None:
        """Put a re-queued task first in line within its job."""
        self._jobs.setdefault(job_id, deque()).appendleft(task_id)
        self._n += 1

    def drop_job(self, job_id: str) -> list[str]:
        """Remove and return every pending task of ``job_id``."""
        q = self._jobs.pop(job_id, None)
        if not q:
            return []
        self._n -= len(q)
        return list(q)

    def pending(self, job_id: str) -> int:
        q = self._jobs.get(job_id)
        return len(q) if q else 0

    def job_ids(self) -> list[str]:
        """Jobs with pending tasks, in the order they will next be served."""
        return list(self._jobs)

    def take_one(self, choose: Callable[[str, deque[str]], int | None]) -> tuple[str, str] | None:
        """Remove one task for one free slot and return ``(job_id, task_id)``, or None.

        Jobs are offered in turn (round-robin, as :meth:`take`); ``choose(job_id, queue)``
        returns the position in that job's queue of the task to run (0 keeps FIFO), or
        None when the slot can run none of them: the job then keeps its place in line.
        The served job moves to the back of the line.
        """
        for job_id, q in self._jobs.items():  # changed only right before returning
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
                self._jobs.move_to_end(job_id)
            else:
                del self._jobs[job_id]
            return job_id, task_id
        return None

    def take(self, n: int, eligible: Callable[[str], bool] = lambda job_id: True) -> list[tuple[str, str]]:
        """Remove up to ``n`` tasks, one job at a time in turn; returns ``(job_id, task_id)``.

        ``eligible(job_id)`` lets the caller skip jobs this worker cannot run (hardware
        requirements); skipped jobs keep their place in line.
        """
        out: list[tuple[str, str]] = []
        if n <= 0 or not self._n:
            return out
        skipped: set[str] = set()
        while len(out) < n and self._jobs:
            job_id = next((j for j in self._jobs if j not in skipped), None)
            if job_id is None:
                break
            if not eligible(job_id):
                skipped.add(job_id)
                continue
            q = self._jobs[job_id]
            out.append((job_id, q.popleft()))
            self._n -= 1
            if q:
                self._jobs.move_to_end(job_id)  # next turn goes to another job
            else:
                del self._jobs[job_id]
        return out
