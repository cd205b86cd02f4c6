"""The HTTP contract between coordinator, worker, caller and script client, in one place.

Routes (templates as the coordinator registers them; a function of the same name builds
the concrete path, e.g. ``job_results(jid)`` -> ``/v1/jobs/<jid>/results``)::

    GET    /v1/health                    HEALTH            liveness + the coordinator's version (no token)
    GET    /v1/openapi.json              OPENAPI           this API as OpenAPI 3.1 (no token)
    GET    /v1/dist/{name}               DIST_FILE         the coordinator's own wheel (no token)
    GET    /v1/workers                   WORKERS           the workers (read role)
    POST   /v1/workers                   WORKERS           register a worker (worker token)
    DELETE /v1/workers/{wid}             WORKER            a worker leaves
    POST   /v1/workers/{wid}/heartbeat   WORKER_HEARTBEAT  alive, running tasks, slot changes
    GET    /v1/workers/{wid}/session     WORKER_SESSION    NDJSON stream: wake-ups and cancels
    POST   /v1/workers/{wid}/lease       WORKER_LEASE      long-poll for tasks -> TaskGrant per task
    POST   /v1/tasks/{tid}/result        TASK_RESULT       a ResultPost (frames) under a lease
    POST   /v1/tasks/results             TASKS_RESULTS     a ResultBatch: several results, each under its lease
    POST   /v1/tasks/{tid}/release       TASK_RELEASE      hand a running task back (preempted)
    POST   /v1/tasks/{tid}/output        TASK_OUTPUT       a task's stdout/stderr bytes
    GET    /v1/handoff                   HANDOFF           the same-machine file hand-off directory
    HEAD   /v1/blobs/{h}                 BLOB              is a function blob stored
    GET    /v1/blobs/{h}                 BLOB              fetch a function blob
    PUT    /v1/blobs/{h}                 BLOB              upload a function blob
    POST   /v1/jobs                      JOBS              submit a job (JobSubmit + argument frames)
    GET    /v1/jobs                      JOBS              recent jobs
    GET    /v1/jobs/{jid}                JOB               a job and its tasks
    GET    /v1/jobs/{jid}/results        JOB_RESULTS       long-poll a ResultPage after a seq
    GET    /v1/jobs/{jid}/logs           JOB_LOGS          a task's stored output
    POST   /v1/jobs/release              JOBS_RELEASE      forget collected jobs (a batch)
    POST   /v1/jobs/alive                JOBS_ALIVE        a caller's keepalive of the jobs it waits on
    POST   /v1/jobs/{jid}/release        JOB_RELEASE       forget one collected job
    POST   /v1/jobs/{jid}/cancel         JOB_CANCEL        cancel a job
    POST   /v1/jobs/{jid}/retry          JOB_RETRY         re-run a job's failed tasks
    GET    /v1/tokens                    TOKENS            people's tokens (admin)
    POST   /v1/tokens                    TOKENS            add a person's token (admin)
    DELETE /v1/tokens/{name}             TOKEN             revoke a person's token (admin)
    GET    /metrics                      METRICS           Prometheus metrics
    GET    /ui, /ui/..., /ui/api/...     UI_*              the dashboard (see coordinator/ui.py)

Messages (frame 0 of a frames body, see :mod:`gpumesh.wire`, or a JSON body); the
worker, caller and script client build and read each through its class here, the
coordinator checks what it receives against coordinator/schemas.py::

    JobSubmit     caller, script client -> POST /v1/jobs: the job (function hash, n_tasks, ...)
    LeaseRequest  worker -> POST .../lease: how many tasks, which slots are free, long-poll
    TaskGrant     coordinator -> worker: one task of a lease answer {"tasks": [...]}
    ResultPost    worker -> POST .../result: status ok | error | retry, the error dict
    ResultBatch   worker -> POST /v1/tasks/results: several ResultPosts, next grants per slot
    ResultPage    coordinator -> caller, script client, status: results after a seq
                  (ResultItem each), counts, output, workers closed by their owners

Payload references: a frame whose bytes lie in a file on the coordinator's machine is
sent empty and named under one key of the message, ``refs`` (see
:mod:`gpumesh.payloadref`): frame number or field -> wire form::

    JobSubmit, ResultPost  {"refs": {"<frame>": {"kind": "handoff", "name": "<hex>.part", "size": N}}}
    TaskGrant              {"refs": {"args": {"kind": "store", "path": "args/...", "size"?: N}}}
    ResultItem             {"refs": {"result": {"kind": "store", "path": "results/...", "size": N}}}

``path`` is relative to the store's blob directory, ``name`` a file of its handoff
directory; a reference that is not one of these is a 400 naming the field (``refs.1:
...``). The keys before ``refs`` (``handoff_files``, ``args_file``, ``file``) are still
written and read for one release, for peers from before it; drop them in the next.

Error codes: every refusal is ``{"error": code, "message": text}``::

    400 bad_request         a field, query parameter or body is malformed (415 at /ui/login)
    401 unauthorized        no token, or a wrong one                       -> AuthError
    429 locked_out          too many wrong tokens from this address        -> LockedOut
    403 forbidden           this token's role may not do this              -> AuthError
    403 not_yours           the job belongs to another person
    403 safe_mode           serve --safe-mode takes script jobs only
    403 csrf                dashboard change without its CSRF token, or cross-origin
    401 signed_out          dashboard request without a session            -> AuthError
    404 not_found           no such route (or wheel, or dashboard file)
    404 unknown_worker      the worker is not registered: it registers again
    404 unknown_job         no such job
    404 unknown_task        the job has no such task
    404 unknown_blob        no such function blob
    404 unknown_token       nobody of that name has a token
    405 method_not_allowed  the route does not take this method
    409 stale_lease         the lease is no longer current: the result is dropped
    409 handoff_missing     a hand-off file the body names is not there: sent again as bytes
    409 missing_blob        upload the function blob first: the caller uploads, resends
    409 no_workers          no worker is alive: the caller runs the call here
    409 unsatisfiable       no alive worker can meet them -> Unsatisfiable (GPUMesh's, from RequestRejected)
    409 version_mismatch    the client runs another gpumesh version        -> VersionMismatch
    409 exists              that person already has a token
    410 released            the job was released (results collected, or given up on)
    413 too_large           the body is over the coordinator's limit       -> PayloadTooLarge
    500 internal            a bug; the coordinator logs it and keeps serving
    503 internal            the store could not write (a full disk: names its data dir): nothing kept; send again
    503 dist_unavailable    the coordinator cannot build its wheel
    (any other 4xx code)                                                   -> RequestRejected

Failure kinds: a failed task's error is ``{"kind", "type", "message", ...}`` (also
``traceback``, ``stderr_tail``, ``code``, ``module``, ``package``, ``package_version``,
``worker``, ``hostname``, ``attempt`` where known); what the caller raises is :data:`FAILURE_EXCEPTIONS`::

    raised              the function raised          -> its own exception (else RemoteError)
    unpickle            function or arguments do not load on the worker       -> RemoteError
    exit                the function called sys.exit()                        -> RemoteError
    result_unpicklable  the return value cannot be pickled                    -> RemoteError
    result_not_json     strict mesh: the value is not JSON                    -> RemoteError
    timeout             ran past timeout=; its process tree was killed        -> TaskTimeout
    crashed             its process died (signal, os._exit, segfault)         -> TaskCrashed
    cancelled           the job was cancelled                                 -> Cancelled
    script              a script exited non-zero or printed no JSON line      -> TaskFailed
    requires            no able worker can provide the job's requires=        -> TaskFailed
    missing_module      (coordinator) no able worker has the module   -> ModuleNotFoundError
    lost                (coordinator) it lost its worker too often            -> WorkerLost
    host_died           retry: the function's host died or could not start (re-queued)
    fetch               retry: the function blob or arguments could not be fetched
    handoff             retry: a same-machine hand-off file was gone
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import quote

from . import payloadref
from .errors import (Cancelled, RemoteError, TaskCrashed, TaskFailed, TaskTimeout, WireError,
                     WorkerLost)

# ----------------------------------------------------------------- routes --------

HEALTH = "/v1/health"
OPENAPI = "/v1/openapi.json"
#: Prefix the coordinator's wheel is served under.
DIST = "/v1/dist"
DIST_FILE = DIST + "/{name}"
WORKERS = "/v1/workers"
WORKER = WORKERS + "/{wid}"
WORKER_HEARTBEAT = WORKER + "/heartbeat"
WORKER_SESSION = WORKER + "/session"
WORKER_LEASE = WORKER + "/lease"
TASKS = "/v1/tasks"
TASK_RESULT = TASKS + "/{tid}/result"
TASK_RELEASE = TASKS + "/{tid}/release"
TASK_OUTPUT = TASKS + "/{tid}/output"
TASKS_RESULTS = TASKS + "/results"
HANDOFF = "/v1/handoff"
BLOB = "/v1/blobs/{h}"
JOBS = "/v1/jobs"
JOBS_RELEASE = JOBS + "/release"
JOBS_ALIVE = JOBS + "/alive"
JOB = JOBS + "/{jid}"
JOB_RESULTS = JOB + "/results"
JOB_LOGS = JOB + "/logs"
JOB_RELEASE = JOB + "/release"
JOB_CANCEL = JOB + "/cancel"
JOB_RETRY = JOB + "/retry"
TOKENS = "/v1/tokens"
TOKEN = TOKENS + "/{name}"
METRICS = "/metrics"
UI = "/ui"
UI_SLASH = UI + "/"
UI_STATIC = UI + "/static/{name}"
UI_LOGIN = UI + "/login"
UI_LOGOUT = UI + "/logout"
UI_STATE = UI + "/api/state"
UI_JOB = UI + "/api/jobs/{jid}"
UI_JOB_OUTPUT = UI_JOB + "/output"
UI_JOB_CANCEL = UI_JOB + "/cancel"
UI_JOB_RETRY = UI_JOB + "/retry"

#: Every path template the coordinator serves (what it registers, as it registers it).
TEMPLATES = frozenset({
    HEALTH, OPENAPI, DIST_FILE, WORKERS, WORKER, WORKER_HEARTBEAT, WORKER_SESSION, WORKER_LEASE,
    TASK_RESULT, TASKS_RESULTS, TASK_RELEASE, TASK_OUTPUT, HANDOFF, BLOB, JOBS, JOBS_RELEASE,
    JOBS_ALIVE, JOB, JOB_RESULTS, JOB_LOGS, JOB_RELEASE, JOB_CANCEL, JOB_RETRY, TOKENS, TOKEN,
    METRICS, UI, UI_SLASH, UI_STATIC, UI_LOGIN, UI_LOGOUT, UI_STATE, UI_JOB, UI_JOB_OUTPUT,
    UI_JOB_CANCEL, UI_JOB_RETRY})

#: Paths only a worker's token uses (another version's request there is a worker's).
WORKER_PREFIXES = (WORKERS, TASKS)


def fill(template: str, **params: str) -> str:
    """``template`` with each ``{name}`` replaced by ``params[name]``, percent-encoded as
    one path segment (so an id can never add a segment or a query). Raises ``KeyError``
    for a missing parameter."""
    return template.format(**{k: quote(str(v), safe="") for k, v in params.items()})


# The concrete paths: one function per template with a parameter, named as the constant
# in lower case (each parameter is one percent-encoded segment, see fill).

def worker(wid: str) -> str:
    return fill(WORKER, wid=wid)


def worker_heartbeat(wid: str) -> str:
    return fill(WORKER_HEARTBEAT, wid=wid)


def worker_session(wid: str) -> str:
    return fill(WORKER_SESSION, wid=wid)


def worker_lease(wid: str) -> str:
    return fill(WORKER_LEASE, wid=wid)


def task_result(tid: str) -> str:
    return fill(TASK_RESULT, tid=tid)


def task_release(tid: str) -> str:
    return fill(TASK_RELEASE, tid=tid)


def task_output(tid: str) -> str:
    return fill(TASK_OUTPUT, tid=tid)


def blob(h: str) -> str:
    return fill(BLOB, h=h)


def job(jid: str) -> str:
    return fill(JOB, jid=jid)


def job_results(jid: str) -> str:
    return fill(JOB_RESULTS, jid=jid)


def job_logs(jid: str) -> str:
    return fill(JOB_LOGS, jid=jid)


def job_release(jid: str) -> str:
    return fill(JOB_RELEASE, jid=jid)


def job_cancel(jid: str) -> str:
    return fill(JOB_CANCEL, jid=jid)


def job_retry(jid: str) -> str:
    return fill(JOB_RETRY, jid=jid)


def token(name: str) -> str:
    return fill(TOKEN, name=name)


def dist_file(name: str) -> str:
    return fill(DIST_FILE, name=name)


#: What a coordinator offers beyond the one-at-a-time protocol, named in its registration
#: answer's ``features`` (a worker uses only those named; an older coordinator names none).
#: ``result_batch``: POST TASKS_RESULTS takes several results at once and answers with
#: up to ``n`` grants per slot (a slot's queue, see :class:`ResultBatch`).
FEATURE_RESULT_BATCH = "result_batch"
#: Most grants one result batch may ask for per slot (its ``next``): a coordinator
#: refuses more (400), and a worker asks for no more, however deep its slot's queue.
MAX_QUEUED_GRANTS = 16


# ------------------------------------------------------------------ codes --------

class _StrEnum(str, Enum):
    """A str-valued enum that is its value in ``str()``, f-strings and JSON on every
    Python 3.10+ (3.11 changed ``format()`` of mixed-in enums to the member's name)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ErrorCode(_StrEnum):
    """The ``error`` of every refusal the coordinator answers (the module docstring gives
    each one's HTTP status, meaning and what the caller makes of it)."""

    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    LOCKED_OUT = "locked_out"
    FORBIDDEN = "forbidden"
    NOT_YOURS = "not_yours"
    SAFE_MODE = "safe_mode"
    CSRF = "csrf"
    SIGNED_OUT = "signed_out"
    NOT_FOUND = "not_found"
    UNKNOWN_WORKER = "unknown_worker"
    UNKNOWN_JOB = "unknown_job"
    UNKNOWN_TASK = "unknown_task"
    UNKNOWN_BLOB = "unknown_blob"
    UNKNOWN_TOKEN = "unknown_token"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    STALE_LEASE = "stale_lease"
    HANDOFF_MISSING = "handoff_missing"
    MISSING_BLOB = "missing_blob"
    NO_WORKERS = "no_workers"
    UNSATISFIABLE = "unsatisfiable"
    VERSION_MISMATCH = "version_mismatch"
    EXISTS = "exists"
    RELEASED = "released"
    TOO_LARGE = "too_large"
    INTERNAL = "internal"
    DIST_UNAVAILABLE = "dist_unavailable"


class FailureKind(_StrEnum):
    """The ``kind`` of a task's error dict (the module docstring says what each means).

    A worker posts most with ``status: error``, which ends the task (the caller raises
    what :data:`FAILURE_EXCEPTIONS` names); ``host_died``, ``fetch`` and ``handoff`` with
    ``status: retry``, which re-queues it without blaming the function (only the
    coordinator's log and the task's history see those)."""

    RAISED = "raised"
    UNPICKLE = "unpickle"
    EXIT = "exit"
    RESULT_UNPICKLABLE = "result_unpicklable"
    RESULT_NOT_JSON = "result_not_json"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    CANCELLED = "cancelled"
    SCRIPT = "script"
    REQUIRES = "requires"
    MISSING_MODULE = "missing_module"
    LOST = "lost"
    HOST_DIED = "host_died"
    FETCH = "fetch"
    HANDOFF = "handoff"


def timeout_message(seconds: float | None) -> str:
    """The words of a ``timeout`` failure, ``seconds`` the task's limit: one wording on
    every runtime and in the local fallback."""
    return "the task ran longer than its timeout" + ("" if seconds is None else f" of {seconds:g}s")


# --------------------------------------------------------- failure -> caller -----

#: The exception the caller raises for a failed task, by its error's ``kind``. ``raised``
#: is the function's own exception whenever it unpickles at the caller; this entry is
#: for when it does not. Kinds a worker posts only with ``status: retry`` (the task is
#: re-queued, never failed by them) map to :class:`~gpumesh.errors.TaskFailed` should
#: one ever arrive; so does a kind this version does not know (a newer worker's).
FAILURE_EXCEPTIONS: dict[FailureKind, type[BaseException]] = {
    FailureKind.RAISED: RemoteError,
    FailureKind.UNPICKLE: RemoteError,
    FailureKind.EXIT: RemoteError,
    FailureKind.RESULT_UNPICKLABLE: RemoteError,
    FailureKind.RESULT_NOT_JSON: RemoteError,
    FailureKind.TIMEOUT: TaskTimeout,
    FailureKind.CRASHED: TaskCrashed,
    FailureKind.CANCELLED: Cancelled,
    FailureKind.LOST: WorkerLost,
    FailureKind.MISSING_MODULE: ModuleNotFoundError,
    FailureKind.SCRIPT: TaskFailed,
    FailureKind.REQUIRES: TaskFailed,
    FailureKind.HOST_DIED: TaskFailed,
    FailureKind.FETCH: TaskFailed,
    FailureKind.HANDOFF: TaskFailed,
}


def failure_exception(kind: str | None, text: str, *, remote_type: str = "Exception",
                      remote_message: str | None = None, traceback: str = "",
                      task_id: str | None = None, worker: str | None = None,
                      module: str | None = None) -> BaseException:
    """The exception (not raised) that stands for a task whose error has ``kind``, with
    message ``text``: of the class :data:`FAILURE_EXCEPTIONS` names (``TaskFailed`` for an
    unknown kind). ``remote_type``/``remote_message``/``traceback`` fill a
    :class:`~gpumesh.errors.RemoteError` (``remote_message`` defaults to ``text``);
    ``module`` names a ``ModuleNotFoundError``'s module."""
    try:
        cls = FAILURE_EXCEPTIONS[FailureKind(kind)]
    except ValueError:
        cls = TaskFailed
    if cls is RemoteError:
        err = RemoteError(remote_type, text, traceback, task_id, worker)
        err.remote_message = text if remote_message is None else remote_message
        return err
    if cls is ModuleNotFoundError:
        return ModuleNotFoundError(text, name=module)
    if cls is TaskTimeout:
        return TaskTimeout(text)
    return cls(text, task_id, worker)


# --------------------------------------------------------------- messages --------
#
# Each message converts to and from exactly the JSON object that travels (frame 0 of a
# frames body, see gpumesh.wire). ``from_dict`` checks what it reads and raises
# WireError naming the field; keys it does not know are ignored (a newer peer's), and
# keys a peer may leave out take the defaults an older peer implied. ``as_dict`` leaves
# out the optional keys that are unset, as the peers did before these classes existed.

_MISSING: Any = object()


def _get(d: Mapping[str, Any], msg: str, name: str, kinds: type | tuple[type, ...],
         default: Any = _MISSING) -> Any:
    """``d[name]`` checked to be of ``kinds`` (None allowed when ``default`` is None)."""
    if name not in d or (d[name] is None and default is None):
        if default is _MISSING:
            raise WireError(f"{msg}: field {name!r} is required")
        return default
    v = d[name]
    ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in _as_tuple(kinds))
    if not ok:
        want = " or ".join(k.__name__ for k in _as_tuple(kinds))
        raise WireError(f"{msg}: field {name!r} must be {want}, got {type(v).__name__}")
    return v


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _object(d: Any, msg: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise WireError(f"{msg} must be a JSON object, got {type(d).__name__}")
    return d


def _some(out: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """``out`` with each of ``optional`` that is not None."""
    out.update((k, v) for k, v in optional.items() if v is not None)
    return out


_NUMBER = (int, float)

SCRIPT_NAME_MAX = 120  # the longest script file name a script job carries (JobSubmit.script)


def script_name(path: str) -> str | None:
    """The name a script job's tasks run the script as (tracebacks name it): the last part
    of ``path``, ``<>:"|?*`` as ``_``, cut to ``SCRIPT_NAME_MAX``; None for ``""``, ``.``,
    ``..``. Coordinators and workers take only a name that is its own ``script_name``."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join("_" if c in '<>:"|?*' or not c.isprintable() else c for c in name)
    name = name[:SCRIPT_NAME_MAX].strip()
    return None if name in ("", ".", "..") else name


def _refs(d: Mapping[str, Any], msg: str, keys: tuple[str, ...] | None = None) -> dict[str, Any] | None:
    """The message's ``refs`` (see :mod:`gpumesh.payloadref`), each wire form checked:
    ``keys`` the fields it may name (None: frame numbers). Raises :class:`WireError`
    naming the field."""
    refs: dict[str, Any] | None = _get(d, msg, payloadref.REFS, dict, None)
    if refs is not None:
        try:
            payloadref.check_refs(refs, payloadref.REFS, keys)
        except payloadref.BadRef as e:
            raise WireError(f"{msg}: field {e}") from None
    return refs


@dataclass(frozen=True, slots=True)
class JobSubmit:
    """Frame 0 of ``POST /v1/jobs``; then the function blob (when ``fn_inline``), then
    one argument payload per task. The coordinator's own checks (ranges, sizes) are its
    ``JOB_SUBMIT`` schema in coordinator/schemas.py, which takes a field left out as its
    null; this is the shape."""

    job_id: str
    fn: str                                   # sha256 hex of the function (or script) blob
    n_tasks: int
    kind: str = "function"                    # "function" or "script"
    fn_inline: bool = False                   # the blob travels as the first frame
    timeout: float | None = None              # seconds per task; always sent (null: none)
    name: str = ""
    costs: list[float] | None = None          # one per task (scheduling weight)
    result_format: str | None = None          # "json" (strict results); unset: pickle
    isolation: str | None = None              # "job"; unset: "task"
    require: dict[str, Any] | None = None     # hardware.Requirements.to_meta()
    gpu_memory_mb: list[Any] | None = None    # per-task GPU memory hints (MiB)
    retries: int | None = None                # gpumesh.retries.to_meta()
    retry_on: list[str] | None = None
    require_worker: bool | None = None        # refuse (no_workers) when none is alive
    wait: float | None = None                 # long-poll the first results page (s)
    output: bool | None = None                # that page also carries what tasks printed
    caller: dict[str, Any] | None = None      # {"host", "pid"} of the caller
    handoff: bool | None = None               # the caller maps same-machine files
    refs: dict[str, Any] | None = None        # {"<frame>": {"kind": "handoff", "name", "size"}}
    handoff_files: dict[str, str] | None = None  # refs' key before it; drop in the next release
    script: str | None = None                 # a script job's file name (see script_name)

    def as_dict(self) -> dict[str, Any]:
        return _some({"job_id": self.job_id, "kind": self.kind, "fn": self.fn,
                      "fn_inline": self.fn_inline, "n_tasks": self.n_tasks,
                      "timeout": self.timeout, "name": self.name},
                     costs=self.costs, result_format=self.result_format,
                     isolation=self.isolation, require=self.require,
                     gpu_memory_mb=self.gpu_memory_mb, retries=self.retries,
                     retry_on=self.retry_on, require_worker=self.require_worker,
                     wait=self.wait, output=self.output, caller=self.caller,
                     handoff=self.handoff, refs=self.refs, handoff_files=self.handoff_files,
                     script=self.script)

    @classmethod
    def from_dict(cls, d: Any) -> JobSubmit:
        m = "job submit"
        d = _object(d, m)
        return cls(job_id=_get(d, m, "job_id", str), fn=_get(d, m, "fn", str),
                   n_tasks=_get(d, m, "n_tasks", int), kind=_get(d, m, "kind", str, "function"),
                   fn_inline=_get(d, m, "fn_inline", bool, False),
                   timeout=_get(d, m, "timeout", _NUMBER, None), name=_get(d, m, "name", str, ""),
                   costs=_get(d, m, "costs", list, None),
                   result_format=_get(d, m, "result_format", str, None),
                   isolation=_get(d, m, "isolation", str, None),
                   require=_get(d, m, "require", dict, None),
                   gpu_memory_mb=_get(d, m, "gpu_memory_mb", list, None),
                   retries=_get(d, m, "retries", int, None),
                   retry_on=_get(d, m, "retry_on", list, None),
                   require_worker=_get(d, m, "require_worker", bool, None),
                   wait=_get(d, m, "wait", _NUMBER, None), output=_get(d, m, "output", bool, None),
                   caller=_get(d, m, "caller", dict, None),
                   handoff=_get(d, m, "handoff", bool, None), refs=_refs(d, m),
                   handoff_files=_get(d, m, "handoff_files", dict, None),
                   script=_get(d, m, "script", str, None))


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """The JSON body of ``POST /v1/workers/{wid}/lease``."""

    slots: int = 1                            # how many tasks the worker takes
    free: list[int] | None = None             # ids of its free slots (grants name one)
    wait: float = 0                           # long-poll up to this many seconds
    handoff: bool = False                     # the worker shares the coordinator's disk

    def as_dict(self) -> dict[str, Any]:
        return _some({"slots": self.slots}, free=self.free) | {"wait": self.wait,
                                                               "handoff": self.handoff}

    @classmethod
    def from_dict(cls, d: Any) -> LeaseRequest:
        m = "lease request"
        d = _object(d, m)
        return cls(slots=_get(d, m, "slots", int, 1), free=_get(d, m, "free", list, None),
                   wait=_get(d, m, "wait", _NUMBER, 0), handoff=_get(d, m, "handoff", bool, False))


@dataclass(frozen=True, slots=True)
class TaskGrant:
    """One task a lease hands a worker: an entry of ``{"tasks": [...]}`` (frame 0 of the
    answer to ``POST /v1/workers/{wid}/lease`` and to a result post with ``next=1``);
    its arguments are the next frame (empty when ``refs["args"]`` names the store's file:
    ``{"kind": "store", "path"}``, relative to the store's blob directory)."""

    task_id: str
    lease_id: str                             # posts and releases name it (stale otherwise)
    fn: str                                   # sha256 hex of the function (or script) blob
    job_id: str | None = None
    index: int = 0                            # the task's .map item
    attempt: int = 1                          # 1 for the first run
    kind: str = "function"                    # "function" or "script"
    timeout: float | None = None              # seconds; None: no limit
    name: str = ""                            # the job's name
    slot: int | None = None                   # the worker's slot it was granted for
    result_format: str = "pickle"             # "pickle" or "json"
    isolation: str = "task"                   # "task" or "job"
    requires: tuple[str, ...] | None = None   # packages the task environment must have
    refs: dict[str, Any] | None = None        # same machine: {"args": store reference}
    args_file: str | None = None              # refs' key before it; drop in the next release
    script: str | None = None                 # a script's file name (see script_name)

    def as_dict(self) -> dict[str, Any]:
        return _some({"task_id": self.task_id, "job_id": self.job_id, "index": self.index,
                      "lease_id": self.lease_id, "attempt": self.attempt, "kind": self.kind,
                      "fn": self.fn, "timeout": self.timeout, "name": self.name,
                      "slot": self.slot, "result_format": self.result_format,
                      "isolation": self.isolation},
                     requires=None if self.requires is None else list(self.requires),
                     refs=self.refs, args_file=self.args_file, script=self.script)

    @classmethod
    def from_dict(cls, d: Any) -> TaskGrant:
        m = "task grant"
        d = _object(d, m)
        requires = _get(d, m, "requires", list, None)
        if requires is not None and not all(isinstance(r, str) for r in requires):
            raise WireError(f"{m}: field 'requires' must be a list of strings")
        return cls(task_id=_get(d, m, "task_id", str), lease_id=_get(d, m, "lease_id", str),
                   fn=_get(d, m, "fn", str), job_id=_get(d, m, "job_id", str, None),
                   index=_get(d, m, "index", int, 0), attempt=_get(d, m, "attempt", int, 1),
                   kind=_get(d, m, "kind", str, "function"),
                   timeout=_get(d, m, "timeout", _NUMBER, None), name=_get(d, m, "name", str, ""),
                   slot=_get(d, m, "slot", int, None),
                   result_format=_get(d, m, "result_format", str, "pickle"),
                   isolation=_get(d, m, "isolation", str, "task"),
                   requires=None if requires is None else tuple(requires),
                   refs=_refs(d, m, ("args",)), args_file=_get(d, m, "args_file", str, None),
                   script=_get(d, m, "script", str, None))

    def args_ref(self, blob_dir: str | Path) -> payloadref.PayloadRef | None:
        """The store file of the task's arguments, when the grant names one (same
        machine), its path under ``blob_dir``; None when they are the next frame. Raises
        :class:`~gpumesh.payloadref.BadRef` for a path that leaves the directory."""
        if self.refs and "args" in self.refs:
            return payloadref.from_wire(self.refs["args"], blob_dir, "refs.args")
        if self.args_file:  # a coordinator from before refs
            return payloadref.store_file(blob_dir, self.args_file)
        return None

    @classmethod
    def list_from_dict(cls, d: Any) -> list[TaskGrant]:
        """The grants of a lease answer's frame 0, ``{"tasks": [...]}``."""
        tasks = _get(_object(d, "lease answer"), "lease answer", "tasks", list)
        return [cls.from_dict(t) for t in tasks]


#: What a worker may post as a result's ``status``.
RESULT_STATUSES = ("ok", "error", "retry")


@dataclass(frozen=True, slots=True)
class ResultPost:
    """Frame 0 of ``POST /v1/tasks/{tid}/result?lease=...`` (query: ``next=1`` asks for
    the slot's next grant, ``slot``, ``handoff=1``); then the payload frame: the value
    (``ok``), the pickled exception or nothing (``error``), nothing (``retry``), or an
    empty frame when ``refs["0"]`` names the handoff file that holds it."""

    status: str                               # "ok", "error" or "retry" (RESULT_STATUSES)
    error: dict[str, Any] | None = None       # {"kind": FailureKind, "type", "message", ...}
    handoff_files: dict[str, str] | None = None  # refs' key before it; drop in the next release
    refs: dict[str, Any] | None = None        # {"0": {"kind": "handoff", "name", "size"}}

    def as_dict(self) -> dict[str, Any]:
        return _some({"status": self.status}, error=self.error, handoff_files=self.handoff_files,
                     refs=self.refs)

    @classmethod
    def from_dict(cls, d: Any) -> ResultPost:
        m = "result post"
        d = _object(d, m)
        status = _get(d, m, "status", str)
        if status not in RESULT_STATUSES:
            raise WireError(f"{m}: field 'status' must be ok, error or retry")
        return cls(status=status, error=_get(d, m, "error", dict, None),
                   handoff_files=_get(d, m, "handoff_files", dict, None), refs=_refs(d, m))


@dataclass(frozen=True, slots=True)
class ResultItem:
    """One final task in a :class:`ResultPage`."""

    index: int
    task_id: str
    state: str                                # "done" or "failed"
    seq: int                                  # the job's result cursor (after=)
    worker: str | None = None
    error: dict[str, Any] | None = None       # a failed task's error (see FailureKind)
    has_payload: bool = False                 # the page carries its payload frame, in order
    refs: dict[str, Any] | None = None        # same machine: {"result": store reference}
    file: str | None = None                   # refs' key before it; drop in the next release

    def as_dict(self) -> dict[str, Any]:
        return _some({"index": self.index, "task_id": self.task_id, "state": self.state,
                      "seq": self.seq, "worker": self.worker, "error": self.error,
                      "has_payload": self.has_payload}, refs=self.refs, file=self.file)

    @classmethod
    def from_dict(cls, d: Any) -> ResultItem:
        m = "result"
        d = _object(d, m)
        return cls(index=_get(d, m, "index", int), task_id=_get(d, m, "task_id", str),
                   state=_get(d, m, "state", str), seq=_get(d, m, "seq", int),
                   worker=_get(d, m, "worker", str, None), error=_get(d, m, "error", dict, None),
                   has_payload=_get(d, m, "has_payload", bool, False),
                   refs=_refs(d, m, ("result",)), file=_get(d, m, "file", str, None))


@dataclass(frozen=True, slots=True)
class ResultPage:
    """Frame 0 of ``GET /v1/jobs/{jid}/results?after=seq`` (and of a submit that
    waited): the results after ``seq``, then their payload frames, then the output
    chunks' bytes (when ``out_after`` was asked). A submit's page also carries
    ``job_id`` and ``created``."""

    results: tuple[ResultItem, ...]
    n_tasks: int
    n_final: int                              # tasks with a final state so far
    state: str                                # the job's state
    workers_alive: int
    workers_able: int                         # alive workers that could run every task
    output: list[dict[str, Any]] | None = None  # [{"seq", "task_id", "index", "stream", "worker"}]
    output_skipped: int | None = None         # chunks dropped from the bounded buffer
    job_id: str | None = None
    created: bool | None = None
    #: Pending tasks that only closed workers could run: how many of those workers are
    #: closed in each state (``{"paused": 1}``; states of :mod:`gpumesh.availability`).
    #: None (absent) when the job does not wait so, or from a coordinator before it.
    workers_closed: dict[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = _some({}, job_id=self.job_id, created=self.created)
        out.update(results=[r.as_dict() for r in self.results], n_tasks=self.n_tasks,
                   n_final=self.n_final, state=self.state, workers_alive=self.workers_alive,
                   workers_able=self.workers_able)
        return _some(out, output=self.output, output_skipped=self.output_skipped,
                     workers_closed=self.workers_closed)

    @classmethod
    def from_dict(cls, d: Any) -> ResultPage:
        m = "results page"
        d = _object(d, m)
        results = _get(d, m, "results", list)
        return cls(results=tuple(ResultItem.from_dict(r) for r in results),
                   n_tasks=_get(d, m, "n_tasks", int), n_final=_get(d, m, "n_final", int),
                   state=_get(d, m, "state", str, ""),
                   workers_alive=_get(d, m, "workers_alive", int, 0),
                   workers_able=_get(d, m, "workers_able", int, 0),
                   output=_get(d, m, "output", list, None),
                   output_skipped=_get(d, m, "output_skipped", int, None),
                   job_id=_get(d, m, "job_id", str, None), created=_get(d, m, "created", bool, None),
                   workers_closed=_counts(d, m, "workers_closed"))


def _counts(d: Mapping[str, Any], msg: str, name: str) -> dict[str, int] | None:
    """``d[name]`` checked to be ``{str: int >= 0}`` (None when absent)."""
    counts: dict[str, int] | None = _get(d, msg, name, dict, None)
    for k, v in (counts or {}).items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise WireError(f"{msg}: field {name}.{str(k)[:40]} must be a count, got {v!r:.40}")
    return counts



@dataclass(frozen=True, slots=True)
class BatchedResult:
    """One result of a :class:`ResultBatch`: a :class:`ResultPost` for ``task_id`` under
    ``lease_id``; its payload is the batch's next frame when ``has_payload``."""

    task_id: str
    lease_id: str
    status: str                               # "ok", "error" or "retry" (RESULT_STATUSES)
    error: dict[str, Any] | None = None
    has_payload: bool = False

    def as_dict(self) -> dict[str, Any]:
        return _some({"task_id": self.task_id, "lease_id": self.lease_id, "status": self.status,
                      "has_payload": self.has_payload}, error=self.error)

    @classmethod
    def from_dict(cls, d: Any) -> BatchedResult:
        m = "batched result"
        d = _object(d, m)
        status = _get(d, m, "status", str)
        if status not in RESULT_STATUSES:
            raise WireError(f"{m}: field 'status' must be ok, error or retry")
        return cls(task_id=_get(d, m, "task_id", str), lease_id=_get(d, m, "lease_id", str),
                   status=status, error=_get(d, m, "error", dict, None),
                   has_payload=_get(d, m, "has_payload", bool, False))


@dataclass(frozen=True, slots=True)
class ResultBatch:
    """Frame 0 of ``POST /v1/tasks/results`` (a coordinator with ``result_batch``); then
    the payload frame of each result that has one, in order. Each result is fenced by
    its own lease: a stale one is refused alone (the answer's ``refused``), the others
    land. ``next``: ``{slot id: n}``, up to ``n`` grants to queue for that slot (answered
    like a lease, ``{"tasks": [...], "refused": [{"task_id", "error", "message"}]}`` then
    the grants' argument frames). ``idle``: the slots of ``next`` that run nothing now
    (as a result post's ``next=1``: one that gets no grant may be served by the worker's
    open lease poll). ``handoff``: as :class:`LeaseRequest`'s."""

    results: tuple[BatchedResult, ...]
    next: dict[int, int] | None = None
    idle: list[int] | None = None
    handoff: bool = False

    def as_dict(self) -> dict[str, Any]:
        return _some({"results": [r.as_dict() for r in self.results], "handoff": self.handoff},
                     next=None if self.next is None else {str(k): v for k, v in self.next.items()},
                     idle=self.idle)

    @classmethod
    def from_dict(cls, d: Any) -> ResultBatch:
        m = "result batch"
        d = _object(d, m)
        nxt = _get(d, m, "next", dict, None)
        if nxt is not None:
            try:
                nxt = {int(k): v for k, v in nxt.items()}
            except ValueError:
                raise WireError(f"{m}: field 'next' must map slot ids to counts") from None
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in nxt.values()):
                raise WireError(f"{m}: field 'next' must map slot ids to counts")
        idle = _get(d, m, "idle", list, None)
        if idle is not None and not all(isinstance(i, int) and not isinstance(i, bool)
                                        for i in idle):
            raise WireError(f"{m}: field 'idle' must be a list of slot ids")
        return cls(results=tuple(BatchedResult.from_dict(r) for r in _get(d, m, "results", list)),
                   next=nxt, idle=idle, handoff=_get(d, m, "handoff", bool, False))
