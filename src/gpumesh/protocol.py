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
    POST   /v1/jobs/{jid}/release        JOB_RELEASE       forget one collected job
    POST   /v1/jobs/{jid}/cancel         JOB_CANCEL        cancel a job
    POST   /v1/jobs/{jid}/retry          JOB_RETRY         re-run a job's failed tasks
    GET    /v1/tokens                    TOKENS            people's tokens (admin)
    POST   /v1/tokens                    TOKENS            add a person's token (admin)
    DELETE /v1/tokens/{name}             TOKEN             revoke a person's token (admin)
    GET    /metrics                      METRICS           Prometheus metrics
    GET    /ui, /ui/..., /ui/api/...     UI_*              the dashboard (see coordinator/ui.py)

Every refusal is ``{"error": <ErrorCode>, "message": text}`` with a 4xx/5xx status
(see :class:`ErrorCode` for each code and its status). A task that fails carries
``{"kind": <FailureKind>, "type": ..., "message": ..., ...}`` (see :class:`FailureKind`),
and :data:`gpumesh.errors.FAILURE_EXCEPTIONS` says which exception the caller raises.
"""

from __future__ import annotations

from enum import Enum
from urllib.parse import quote

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
HANDOFF = "/v1/handoff"
BLOB = "/v1/blobs/{h}"
JOBS = "/v1/jobs"
JOBS_RELEASE = JOBS + "/release"
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
    HEALTH, OPENAPI, DIST_FILE, WORKERS, WORKER, WORKER_HEARTBEAT, WORKER_SESSION,
    WORKER_LEASE, TASK_RESULT, TASK_RELEASE, TASK_OUTPUT, HANDOFF, BLOB, JOBS, JOBS_RELEASE,
    JOB, JOB_RESULTS, JOB_LOGS, JOB_RELEASE, JOB_CANCEL, JOB_RETRY, TOKENS, TOKEN, METRICS,
    UI, UI_SLASH, UI_STATIC, UI_LOGIN, UI_LOGOUT, UI_STATE, UI_JOB, UI_JOB_OUTPUT,
    UI_JOB_CANCEL, UI_JOB_RETRY,
})

#: Paths only a worker's token uses (a request of another gpumesh version there is a
#: worker's, for the version refusal's wording).
WORKER_PREFIXES = (WORKERS, TASKS)


def fill(template: str, **params: str) -> str:
    """``template`` with each ``{name}`` replaced by ``params[name]``, percent-encoded as
    one path segment (so an id can never add a segment or a query). Raises ``KeyError``
    for a missing parameter."""
    return template.format(**{k: quote(str(v), safe="") for k, v in params.items()})


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


# ------------------------------------------------------------------ codes --------

class _StrEnum(str, Enum):
    """A str-valued enum that is its value in ``str()``, f-strings and JSON on every
    Python 3.10+ (3.11 changed ``format()`` of mixed-in enums to the member's name)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ErrorCode(_StrEnum):
    """The ``error`` of every refusal the coordinator answers, with its HTTP status."""

    BAD_REQUEST = "bad_request"            # 400 (415 at /ui/login): a field, query or body is malformed
    UNAUTHORIZED = "unauthorized"          # 401: no token, or a wrong one
    LOCKED_OUT = "locked_out"              # 429: too many wrong tokens from this address (Retry-After)
    FORBIDDEN = "forbidden"                # 403: this token's role may not do this
    NOT_YOURS = "not_yours"                # 403: the job belongs to another person
    SAFE_MODE = "safe_mode"                # 403: this coordinator takes only script jobs
    CSRF = "csrf"                          # 403: dashboard change without its CSRF token / cross-origin
    SIGNED_OUT = "signed_out"              # 401: dashboard request without a session
    NOT_FOUND = "not_found"                # 404: no such route (or dist/static file)
    UNKNOWN_WORKER = "unknown_worker"      # 404: the worker is not registered (register again)
    UNKNOWN_JOB = "unknown_job"            # 404: no such job
    UNKNOWN_TASK = "unknown_task"          # 404: the job has no such task
    UNKNOWN_BLOB = "unknown_blob"          # 404: no such function blob
    UNKNOWN_TOKEN = "unknown_token"        # 404: nobody of that name has a token
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405
    STALE_LEASE = "stale_lease"            # 409: the lease is no longer current (result dropped)
    HANDOFF_MISSING = "handoff_missing"    # 409: a hand-off file named in the body is not there
    MISSING_BLOB = "missing_blob"          # 409: upload the job's function blob first
    NO_WORKERS = "no_workers"              # 409: no worker is alive (the caller may run it here)
    UNSATISFIABLE = "unsatisfiable"        # 409: no alive worker can meet the requirements
    VERSION_MISMATCH = "version_mismatch"  # 409: the client runs another gpumesh version
    EXISTS = "exists"                      # 409: that person already has a token
    RELEASED = "released"                  # 410: the job's results were already collected
    TOO_LARGE = "too_large"                # 413: the body is over the coordinator's limit
    INTERNAL = "internal"                  # 500: a bug; see the coordinator's log
    DIST_UNAVAILABLE = "dist_unavailable"  # 503: the coordinator cannot build its wheel


class FailureKind(_StrEnum):
    """The ``kind`` of a task's error dict: who decided the task failed, and why.

    ``status`` says what the worker posts: ``error`` ends the task (the caller raises the
    exception in :data:`gpumesh.errors.FAILURE_EXCEPTIONS`), ``retry`` re-queues it
    without blaming the function (only the coordinator's log and the task's history see
    the kind)."""

    RAISED = "raised"                          # error: the function raised (pickled exception follows)
    UNPICKLE = "unpickle"                      # error: the function or its arguments did not unpickle
    EXIT = "exit"                              # error: the function called sys.exit()
    RESULT_UNPICKLABLE = "result_unpicklable"  # error: the return value could not be pickled
    RESULT_NOT_JSON = "result_not_json"        # error: result_format="json" and the value is not JSON
    TIMEOUT = "timeout"                        # error: ran past timeout=; its process tree was killed
    CRASHED = "crashed"                        # error: the task's process died (signal, os._exit)
    CANCELLED = "cancelled"                    # error: the job was cancelled (worker kill or coordinator)
    SCRIPT = "script"                          # error: a script exited non-zero or printed no JSON line
    REQUIRES = "requires"                      # error: the worker cannot install the job's requires=
    MISSING_MODULE = "missing_module"          # error (coordinator): no worker that could run it has the module
    LOST = "lost"                              # error (coordinator): the task lost its worker too often
    HOST_DIED = "host_died"                    # retry: the worker's function host died or could not start
    FETCH = "fetch"                            # retry: the worker could not fetch the function/script blob
    HANDOFF = "handoff"                        # retry: a same-machine hand-off file was gone
