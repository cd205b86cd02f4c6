"""Every error gpumesh raises, under one base class.

    MeshError                      catch this to catch anything gpumesh raises
    ├── AuthError                  the coordinator refused the token (HTTP 401/403)
    │   └── LockedOut              it refuses this address for a while (HTTP 429)
    ├── RequestRejected            the coordinator refused a request as malformed (HTTP 4xx)
    ├── MeshUnavailable            the coordinator stopped answering after it accepted a job
    ├── WireError                  bytes that are not a gpumesh payload, or another wire version
    ├── PayloadTooLarge            a body over a documented size limit (names the limit)
    ├── VersionMismatch            the other end runs another gpumesh version (names both
    │                              and the command that installs the coordinator's)
    ├── Unsatisfiable              no alive worker (nor, with none alive, this machine) can
    │                              ever meet the call's hardware requirements
    ├── EngineCannotExpress        a Dask or Ray engine cannot express what the call asks (a
    │                              GPU model, gpu_memory=, a native-only feature; also a
    │                              ValueError)
    ├── TaskFailed                 the task did not return a value
    │   ├── RemoteError            the function raised an exception whose class could not travel
    │   │                          as itself (its type, message and traceback are kept)
    │   ├── TaskCrashed            the task's process died (signal, os._exit, segfault)
    │   ├── WorkerLost             every worker that tried the task went away
    │   └── Cancelled              the job was cancelled
    ├── TaskTimeout                the task ran past its timeout (also a TimeoutError)
    └── StartFailed                a coordinator or worker started from Python did not come
                                   up (also a RuntimeError; the message holds its log's end)

An exception raised by *your* function is re-raised at the caller as itself (same type
and message, ``args`` and attributes), rebuilt without its ``__init__`` where pickle
alone would fail (:mod:`gpumesh.portable`); gpumesh attaches the remote traceback as its
``__cause__`` (a :class:`RemoteTraceback`). Only when its class cannot travel do you get
a :class:`RemoteError`.

Which exception a failed task becomes at the caller, by the ``kind`` of its error
(:class:`gpumesh.protocol.FailureKind`), is :data:`gpumesh.protocol.FAILURE_EXCEPTIONS`;
an unknown kind (a newer worker's) is a :class:`TaskFailed`.
"""

from __future__ import annotations


class MeshError(Exception):
    """Base class of every error gpumesh raises itself."""


class AuthError(MeshError):
    """The coordinator refused the token. Never raised for a network failure."""


class LockedOut(AuthError):
    """The coordinator refuses every request from this address for ``retry_after``
    seconds, after too many refused tokens from it (any program's there, not necessarily
    this one's: a shared NAT or proxy address). A worker waits it out; a caller raises it."""

    def __init__(self, message: str, retry_after: float = 60.0):
        super().__init__(message)
        self.retry_after = retry_after


class RequestRejected(MeshError):
    """The coordinator answered 4xx to a request; ``status`` and the server's message are kept."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    @property
    def retry_later(self) -> bool:
        """503: the coordinator took nothing from this request (a result it could not
        store keeps its lease) and asks for the same request again later."""
        return self.status == 503


class MeshUnavailable(MeshError):
    """The coordinator could not be reached for longer than the client is willing to wait.

    Raised only once the coordinator has accepted work (before that, calls fall back to
    local execution instead).
    """


class WireError(MeshError):
    """Bytes that are not a gpumesh payload, or a payload of another wire version."""


class PayloadTooLarge(MeshError):
    """A request or result is over a size limit; the message names the limit in MiB."""


class VersionMismatch(MeshError):
    """This process and the coordinator run different gpumesh versions (or the
    coordinator is another program). The message names both versions and the
    ``pip install`` command that installs the coordinator's version from the
    coordinator. Never retried: the versions do not change while one waits.
    """


class Unsatisfiable(MeshError):
    """A call asks for hardware (``gpu=``, ``cores=``, ``memory=``, ``gpu_memory=``, a
    ``gpu_memory_mb`` hint) that no alive worker could ever provide; the message lists
    what the pool has. With no worker alive, raised when this machine cannot provide it
    either (otherwise the call runs here). Raised at call time, before anything runs.

    Not raised when suitable workers exist but are busy, or their GPUs lack free memory
    right now: the task then waits for one.
    """


class TaskFailed(MeshError):
    """A task did not produce a value. ``task_id`` and ``worker`` say where, when known;
    so do ``index`` (the task's ``.map`` item), ``hostname`` (the worker's) and
    ``attempt`` (1 for the first run), None when unknown."""

    index: int | None = None
    hostname: str | None = None
    attempt: int | None = None

    def __init__(self, message: str, task_id: str | None = None, worker: str | None = None):
        super().__init__(message)
        self.task_id = task_id
        self.worker = worker


class RemoteError(TaskFailed):
    """The function raised an exception that could not be sent back as itself: its class
    cannot be pickled, or cannot be loaded here (a module only the worker has). Other
    exceptions travel as themselves, rebuilt where pickle alone would fail
    (:mod:`gpumesh.portable`).

    ``remote_type`` is the exception's qualified type name, ``remote_message`` its text and
    ``remote_traceback`` the formatted traceback from the worker.
    """

    def __init__(self, remote_type: str, remote_message: str, remote_traceback: str = "",
                 task_id: str | None = None, worker: str | None = None):
        super().__init__(f"{remote_type}: {remote_message}", task_id, worker)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback


class TaskCrashed(TaskFailed):
    """The task's process died without returning (a signal, ``os._exit``, a segfault)."""


class WorkerLost(TaskFailed):
    """The task was re-queued after worker losses until its attempts ran out; or, at the
    caller, no worker was alive to run it for the call's ``timeout=`` (without one, for
    ``GPUMESH_NO_WORKER_TIMEOUT`` seconds, default 600) and the job was cancelled."""


class Cancelled(TaskFailed):
    """The job the task belongs to was cancelled."""


class TaskTimeout(MeshError, TimeoutError):
    """The task ran longer than its ``timeout`` (seconds) and its process tree was killed;
    or, at the caller, it could not start for that long because every worker that could
    run it was closed by its owner's rules (paused, outside its hours) and the job was
    cancelled. Where it ran, as :class:`TaskFailed` says it: ``index``, ``task_id``,
    ``worker``, ``hostname``, ``attempt`` (None when unknown)."""

    index: int | None = None
    task_id: str | None = None
    worker: str | None = None
    hostname: str | None = None
    attempt: int | None = None


class EngineCannotExpress(MeshError, ValueError):
    """A call asks for something (a GPU model, ``gpu_memory=``, a ``gpu_memory_mb`` hint,
    a native-only feature) that this engine's resource model cannot express. Raised at
    call time, before anything is submitted. Defined here, not beside the engines
    (``gpumesh.client.backends``), so that ``from gpumesh import EngineCannotExpress``
    costs no more than the other errors."""


class StartFailed(MeshError, RuntimeError):
    """``GPUMesh.start_coordinator`` or ``GPUMesh.add_worker`` started ``gpumesh serve``
    or ``join`` and it exited or did not come up in time (a port or data directory in use,
    say); the message gives the process's own last words and ends with the path of its
    log file, which is kept. Also a ``RuntimeError``, which these raised before it
    existed."""


class RemoteTraceback(Exception):
    """Carries the worker-side traceback text; set as ``__cause__`` of a re-raised exception.

    Also says where the task ran, as far as known (else None): ``index`` (its ``.map``
    item), ``task_id``, ``worker`` (id), ``hostname`` and ``attempt`` (1 for the first run).
    """

    index: int | None = None
    task_id: str | None = None
    worker: str | None = None
    hostname: str | None = None
    attempt: int | None = None

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'
