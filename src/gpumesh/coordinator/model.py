"""What the coordinator keeps and what it refuses: its data classes and its errors.

The data classes (:class:`Worker`, :class:`Lease`, :class:`Job`, :class:`Grant`) are the
coordinator's in-memory state (:mod:`.core` owns and mutates them; the store keeps their
durable part). The errors are what :class:`~.core.Coordinator` raises; each carries the
HTTP ``status`` and error ``code`` that the routes answer with, so a route never maps
them itself: the app's one exception handler (:func:`.app.create_app`) turns any
:class:`CoordinatorError` into ``{"error": code, "message": text}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import hardware
from ..protocol import ErrorCode
from . import diskfull, placement


class CoordinatorError(Exception):
    """A refusal the HTTP layer answers as ``status`` + ``{"error": code, "message": ...}``.

    ``message`` is the text sent; subclasses derive it from their arguments (an id)."""

    status = 500
    code: str = ErrorCode.INTERNAL

    @property
    def message(self) -> str:
        return str(self)


class HTTPError(CoordinatorError):
    """A refusal decided at the boundary (validation, ownership, limits)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self._message = status, code, message

    @property
    def message(self) -> str:
        return self._message


class NoWorkers(CoordinatorError):
    """Submit asked for a live worker and there is none."""

    status, code = 409, ErrorCode.NO_WORKERS

    @property
    def message(self) -> str:
        return "no worker is alive in the mesh"


class UnknownWorker(CoordinatorError):
    """A worker id the coordinator does not know (e.g. it restarted): register again."""

    status, code = 404, ErrorCode.UNKNOWN_WORKER

    @property
    def message(self) -> str:
        return "worker is not registered (register again)"


class UnknownJob(CoordinatorError):
    """A job id the coordinator does not know (never submitted, or purged)."""

    status, code = 404, ErrorCode.UNKNOWN_JOB

    @property
    def message(self) -> str:
        return f"no such job {self}"


class Unsatisfiable(CoordinatorError):
    """No alive worker could ever run the job (its requirements or GPU memory hints);
    the message lists what the pool has. Nothing is stored."""

    status, code = 409, ErrorCode.UNSATISFIABLE


class JobReleased(CoordinatorError):
    """The job's arguments and results were already released (or purged).

    ``JobReleased(job_id)`` is what a retry meets; ``JobReleased(job_id, text)`` answers
    ``text`` instead (a results read after the caller collected them)."""

    status, code = 410, ErrorCode.RELEASED

    def __init__(self, job_id: str, text: str | None = None):
        super().__init__(job_id)
        self.job_id, self.text = job_id, text

    @property
    def message(self) -> str:
        if self.text is not None:
            return self.text
        return (f"job {self.job_id} cannot be retried: its results belong to the caller that "
                "submitted it (a function call or .map) or were already collected; call or "
                "submit it again")


class NotStored(CoordinatorError):
    """The store could not write what a request asked for (its disk is full, an I/O
    error): nothing of the request was kept or changed, and the same request may be sent
    again later (503: a worker does so after a backoff). ``data_dir``: the store's
    directory, which a full disk's message names."""

    status, code = 503, ErrorCode.INTERNAL

    def __init__(self, cause: BaseException, data_dir: Path | None = None):
        super().__init__(str(cause))
        self.cause, self.data_dir = cause, data_dir

    @property
    def why(self) -> str:
        if self.data_dir is not None and diskfull.is_full(self.cause):
            return diskfull.what_full(self.data_dir)
        return f"the store could not write ({type(self.cause).__name__}: {str(self.cause)[:200]})"

    @property
    def message(self) -> str:
        return f"{self.why}: nothing of this request was stored or changed; send it again later"


class ResultNotStored(NotStored):
    """A result the store could not write: nothing of it was accepted, the task stays
    leased, and the same post may be sent again."""

    def __init__(self, task_id: str, cause: BaseException, more: int = 0,
                 data_dir: Path | None = None):
        super().__init__(cause, data_dir)
        self.task_id, self.more = task_id, more

    @property
    def message(self) -> str:
        if self.more:  # a batch's commit
            return (f"the results of task {self.task_id} and {self.more} more could not be "
                    f"stored: {self.why}; the tasks are still leased: post the results again")
        return (f"the result of task {self.task_id} could not be stored: {self.why}; the task is "
                "still leased: post the result again")


class StaleLease(CoordinatorError):
    """A result posted under a lease that is no longer the task's current one.

    ``why``: what the answer adds in parentheses (a result post says what happened)."""

    status, code = 409, ErrorCode.STALE_LEASE

    def __init__(self, task_id: str, why: str | None = None):
        super().__init__(task_id)
        self.task_id, self.why = task_id, why

    @property
    def message(self) -> str:
        text = "this lease is no longer current"
        return f"{text} ({self.why})" if self.why else text


@dataclass
class Worker:
    id: str
    info: dict[str, Any]
    slots: int
    last_seen: float
    alive: bool = True
    leases: set[str] = field(default_factory=set)
    session: int = 0  # id of the worker's current pulse connection (0: none open)
    outbox: list[str] = field(default_factory=list)  # lines to push down the pulse
    wake: asyncio.Event | None = None
    slot_list: list[dict[str, Any]] = field(default_factory=list)  # [{"id", "kind", "gpu"?}]
    views: list[hardware.Slot] | None = None  # slot_views() cache; None when info changed
    #: Per slot, when its last result came (coordinator clock): a grant queued behind the
    #: slot's running task starts only then (gpumesh.coordinator.views.ran_in_slot).
    slot_free_at: dict[int, float] = field(default_factory=dict)

    @property
    def hostname(self) -> str | None:
        """The host name the worker reported (at most 200 characters), None if none."""
        name = self.info.get("hostname")
        return str(name)[:200] if name else None

    def slot_views(self) -> list[hardware.Slot]:
        """The worker's slots, strongest first (cached until its description changes)."""
        if self.views is None:
            if not self.slot_list:
                self.slot_list = hardware.check_slot_list(None, self.slots, None)
            self.views = placement.order_slots(hardware.slots_of(self.id, self.info, self.slot_list))
        return self.views

    def push(self, line: str) -> None:
        """Queue a line for the worker's pulse connection (e.g. ``cancel <task id>``)."""
        self.outbox.append(line)
        if self.wake is not None:
            self.wake.set()


@dataclass
class Lease:
    task_id: str
    job_id: str
    lease_id: str
    worker_id: str
    granted: float
    slot: int | None = None  # the worker's slot running it (None: unknown after a restart)
    #: When the worker's copy of the lease (its lease answer) finished sending; None while
    #: it is still on its way - a slow link must not make the task look forgotten.
    delivered: float | None = None


@dataclass
class Job:
    id: str
    kind: str
    fn_hash: str | None
    meta: dict[str, Any]
    n_tasks: int
    n_final: int = 0
    next_seq: int = 0
    state: str = "active"
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    require: hardware.Requirements = field(default_factory=hardware.Requirements)
    vram_mb: dict[int, float] = field(default_factory=dict)  # task index -> gpu_memory_mb hint
    costs_vary: bool = False  # tasks have different costs: choose by cost, not FIFO alone
    #: The run queue lane: ``require``, plus "a GPU" when every task hints GPU memory
    #: (such a job needs a GPU as surely as one that says ``gpu=``: CPU slots never look
    #: at it, and GPU slots serve it first).
    lane: hardware.Requirements = field(default_factory=hardware.Requirements)
    owner: str | None = None  # the person who submitted it (None: from before people)
    submitted: float = 0.0  # coordinator clock when it was submitted (or recovered)
    #: module -> {worker: None, or ``(package, version)``} for the workers whose run of
    #: this job failed with ModuleNotFoundError for it: None when the worker lacks it,
    #: the package and the worker's version of it when that version has no such submodule
    #: (a version gap; see coordinator.requeue.missing_module).
    lacking: dict[str, dict[str, tuple[str, str] | None]] = field(default_factory=dict)
    #: worker id -> why it cannot run this job's tasks (a module it lacks, another
    #: version of a package, a requires= it could not build), in words that follow its
    #: name; none of the job's tasks is granted to it again (see coordinator.requeue.keep_off).
    unable: dict[str, str] = field(default_factory=dict)

    def excludes(self, worker_id: str) -> bool:
        return worker_id in self.unable
    #: open task id -> workers whose run of it raised a retry_on exception (run it elsewhere)
    avoid: dict[str, set[str]] = field(default_factory=dict)

    def prepare(self) -> None:
        """Requirements and hints from ``meta`` (validated at submit)."""
        self.require = hardware.Requirements.from_meta(self.meta.get("require"))
        self.vram_mb = {int(k): float(v) for k, v in (self.meta.get("gpu_memory_mb") or {}).items()}
        self.lane = self.require
        if self.n_tasks and len(self.vram_mb) == self.n_tasks and self.require.gpu is None:
            self.lane = dataclasses.replace(self.require, gpu="gpu")

    def notify(self) -> None:
        for f in self.waiters:
            if not f.done():
                f.set_result(None)
        self.waiters.clear()


@dataclass
class Grant:
    """One leased task as handed to a worker."""

    task_id: str
    job_id: str
    index: int
    lease_id: str
    attempt: int
    slot: int | None = None
