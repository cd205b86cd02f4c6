"""Every JSON request body of the coordinator, declared once: validation and OpenAPI.

Each :class:`Body` lists its :class:`Field`\\ s (name, JSON type, bounds, default, the
domain check that follows); :meth:`Body.read` validates a decoded body in that order
and returns the values, and :meth:`Body.json_schema` is the body's schema in the OpenAPI
document (:mod:`.openapi`). A route reads its body with one call, so "where is this route
validated" has one answer: here, plus the few checks that need the coordinator's state
(is the blob stored, is the job known), which stay in the route. Ids a person gives
(job and task ids: in a path, a query or a body) go through :func:`user_id`, which takes
them in either case (``routes/base.py``'s ``path_id``), ids only machines send through
:func:`check_id`, exact; numeric query parameters through
``routes/base.py``'s ``query_float`` (the few flags and ids a route reads from its query
are checked in that route), and a frames body's frames through :mod:`.bodies`.

Refusals are :class:`~.model.HTTPError` 400 ``bad_request`` naming the field
(``field 'slots' must be between 1 and 1024, got 0``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import availability, hardware, packages, payloadref, protocol, retries
from ..limits import MAX_RELEASE_JOBS  # the caller's RELEASE_BATCH_MAX stays within it
from ..limits import (LONG_POLL_MAX_S, MAX_HEARTBEAT_TASKS, MAX_META_JSON_BYTES, MAX_RETRIES,
                      MAX_RETRY_TYPES, MAX_STRING_CHARS, MAX_TASKS_PER_JOB)
from ..protocol import ErrorCode
from . import people
from .model import HTTPError

HEX_ID = "^[0-9a-f]{4,64}$"
#: An id a person may give (:func:`user_id`): in either case.
USER_ID = "^[0-9a-fA-F]{4,64}$"
SHA256 = "^[0-9a-f]{64}$"
_HEX = re.compile(r"[0-9a-f]{4,64}\Z")
_SHA = re.compile(r"[0-9a-f]{64}\Z")


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: ``Field.default`` for a field the body must carry.
REQUIRED: Any = _Marker("REQUIRED")
#: ``Field.default`` for a field left out of :meth:`Body.read`'s answer when absent.
OMIT: Any = _Marker("OMIT")
#: ``Field.kind`` for a number (an int or a float; never a bool).
NUMBER = (int, float)

_TYPE_NAMES = {str: "string", int: "integer", NUMBER: "number", bool: "boolean", list: "array",
               dict: "object"}


def bad(message: str) -> HTTPError:
    return HTTPError(400, ErrorCode.BAD_REQUEST, message)


# ---------------------------------------------------------------- value checks -----
def check_str(v: str, name: str) -> None:
    """A string field: at most MAX_STRING_CHARS characters, valid Unicode (no lone
    surrogates, which could never be stored or sent back)."""
    if len(v) > MAX_STRING_CHARS:
        raise bad(f"field {name!r} is longer than {MAX_STRING_CHARS} characters")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"field {name!r} is not valid Unicode text") from None


def check_meta(v: Any, name: str) -> None:
    """A nested JSON value kept by the coordinator (an error, a GPU list, caller info):
    plain JSON types, valid strings, finite numbers, at most MAX_META_JSON_BYTES."""
    try:
        size = len(json.dumps(v, allow_nan=False, ensure_ascii=False).encode("utf-8"))
    except (ValueError, UnicodeEncodeError, RecursionError, TypeError):
        raise bad(f"field {name!r} holds a value that is not plain JSON "
                  "(non-finite number or invalid text)") from None
    if size > MAX_META_JSON_BYTES:
        raise bad(f"field {name!r} is over {MAX_META_JSON_BYTES // 1024} KiB")


def check_id(value: Any, what: str) -> str:
    """``value`` if it is a hex id (a worker, job, task or lease id); 400 otherwise."""
    if not isinstance(value, str) or not _HEX.match(value):
        raise bad(f"{what} {str(value)[:80]!r} is not a valid id")
    return value


def is_id(value: Any) -> bool:
    return isinstance(value, str) and bool(_HEX.match(value))


def as_user_id(value: Any) -> str | None:
    """An id a person gives (a job or task id, as `gpumesh jobs` lists it or typed in
    capitals, as the CLI and the Python API accept it) in lower case, as ids are made
    and stored; None if it is not one. Ids only machines send (lease ids, a worker's
    own protocol fields) stay :func:`check_id`'s, exact: gpumesh makes them in lower
    case, so one in capitals is a fault to refuse, not a typing habit to forgive."""
    if isinstance(value, str) and value.isascii() and _HEX.match(value.lower()):
        return value.lower()
    return None


def user_id(value: Any, what: str) -> str:
    """:func:`as_user_id`'s id, or 400 naming ``what`` (with the value as given)."""
    got = as_user_id(value)
    return got if got is not None else check_id(value, what)


def is_sha256(value: Any) -> bool:
    return isinstance(value, str) and bool(_SHA.match(value))


#: What a heartbeat's ``gpu_telemetry`` may hold per GPU, with the accepted range.
_TELEMETRY = {"utilization_pct": (0.0, 100.0), "temperature_c": (-50.0, 200.0)}


def check_telemetry(value: Any) -> dict[str, dict[str, float]]:
    """``{"<gpu index>": {"utilization_pct"?, "temperature_c"?}}``; ``ValueError`` otherwise."""
    if not isinstance(value, dict) or len(value) > 256:
        raise ValueError("field 'gpu_telemetry' must be an object of at most 256 GPUs")
    out = {}
    for k, d in value.items():
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 4) or not isinstance(d, dict) \
                or set(d) - set(_TELEMETRY):
            raise ValueError("field 'gpu_telemetry' maps a GPU index to "
                             "{utilization_pct, temperature_c}")
        for name, v in d.items():
            lo, hi = _TELEMETRY[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"gpu_telemetry.{k}.{name} must be a number from {lo:g} to {hi:g}")
        out[k] = {n: float(v) for n, v in d.items()}
    return out


# ---------------------------------------------------------------- fields -----------
#: ``check(value, data, got)``: the typed value, the whole decoded body and the values
#: read so far; returns the value to keep. Raises HTTPError, or ValueError (a 400 with
#: its text).
Check = Callable[[Any, dict, dict], Any]


@dataclass(frozen=True)
class Field:
    """One JSON body field.

    ``kind``: ``str``, ``int``, :data:`NUMBER`, ``bool``, ``list``, ``dict``, or None (any
    JSON value; ``check`` decides). ``default``: the value when absent or null,
    :data:`REQUIRED`, or :data:`OMIT` (absent: left out; null: refused). ``lo``/``hi``:
    bounds of a number. ``check``: what follows the type check (see :data:`Check`).
    ``null_checked``: a null value goes to ``check`` instead of meaning "absent".
    ``always``: ``check`` runs even when the field is absent (it gets None).
    ``type_error``: the message for a value of the wrong type (``{name}`` is filled in).
    ``schema``: JSON Schema keywords added to (or replacing) the generated ones.
    """

    name: str
    kind: type | tuple | None
    default: Any = REQUIRED
    lo: float | None = None
    hi: float | None = None
    doc: str = ""
    check: Check | None = None
    null_checked: bool = False
    always: bool = False
    type_error: str | None = None
    schema: dict | None = None

    def read(self, data: dict, got: dict) -> Any:
        """This field's value in ``data`` (validated), its default, or :data:`OMIT`."""
        name = self.name
        if name not in data or (data[name] is None and not self.null_checked):
            if name in data and self.default is OMIT:  # present but null
                raise bad(self.type_error.format(name=repr(name)) if self.type_error
                          else f"field {name!r} is required")
            if self.default is REQUIRED:
                raise bad(f"field {name!r} is required")
            if self.always and self.check is not None:
                return self._checked(None, data, got)
            return self.default
        v = data[name]
        if self.kind is not None and not (v is None and self.null_checked):
            self._check_type(v)
        return self._checked(v, data, got)

    def _checked(self, v: Any, data: dict, got: dict) -> Any:
        if self.check is None:
            return v
        try:
            return self.check(v, data, got)
        except ValueError as e:
            raise bad(str(e)) from None

    def _check_type(self, v: Any) -> None:
        name, kind = self.name, self.kind
        assert kind is not None  # (only called for a field with a type)
        if kind in (int, float) or kind == NUMBER:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(f"field {name!r} must be a number, got {type(v).__name__}")
            if kind is int and not isinstance(v, int):
                raise bad(f"field {name!r} must be an integer")
            lo, hi = self.lo, self.hi
            if v != v or (lo is not None and v < lo) or (hi is not None and v > hi):
                raise bad(f"field {name!r} must be between {lo} and {hi}, got {v}")
            return
        if not isinstance(v, kind):
            if self.type_error:
                raise bad(self.type_error.format(name=repr(name)))
            raise bad(f"field {name!r} must be {getattr(kind, '__name__', kind)}, "
                      f"got {type(v).__name__}")
        if kind is str and isinstance(v, str):  # (always a str then: see above)
            check_str(v, name)
        elif kind is dict:
            check_meta(v, name)

    def json_schema(self) -> dict:
        extra = self.schema or {}
        out: dict[str, Any] = {}
        # An enum says it all; a pattern bounds the length itself (and a generator that
        # meets both a pattern and a maxLength has to filter, which is slow to fuzz).
        if self.kind is not None and "enum" not in extra:
            out["type"] = _TYPE_NAMES[self.kind]
        if self.kind is str and not {"enum", "pattern"} & set(extra):
            out["maxLength"] = MAX_STRING_CHARS
        if self.lo is not None:
            out["minimum"] = self.lo
        if self.hi is not None:
            out["maximum"] = self.hi
        if self.doc:
            out["description"] = self.doc
        out.update(extra)
        return out


@dataclass(frozen=True)
class Body:
    """A JSON request body (or a frames body's frame 0): ``fields`` in the order they are
    checked. ``name`` is its schema's name in the OpenAPI document."""

    name: str
    fields: Sequence[Field]
    doc: str = ""

    def read(self, data: dict) -> dict[str, Any]:
        """The validated values by field name (absent :data:`OMIT` fields left out)."""
        got: dict[str, Any] = {}
        for f in self.fields:
            v = f.read(data, got)
            if v is not OMIT:
                got[f.name] = v
        return got

    def json_schema(self) -> dict:
        out: dict[str, Any] = {"type": "object",
                               "properties": {f.name: f.json_schema() for f in self.fields}}
        required = [f.name for f in self.fields if f.default is REQUIRED]
        if required:
            out["required"] = required
        if self.doc:
            out["description"] = self.doc
        return out


# ---------------------------------------------------------------- checks -----------
def _id_of(what: str) -> Check:
    return lambda v, data, got: check_id(v, what)


def _user_id_of(what: str) -> Check:
    return lambda v, data, got: user_id(v, what)


def _one_of(*allowed: str, message: str) -> Check:
    def check(v, data, got):
        if v not in allowed:
            raise bad(message)
        return v
    return check


def _gpus(v, data, got):
    if not isinstance(v, list) or len(v) > 256 or not all(isinstance(g, dict) for g in v):
        raise bad("field 'gpus' must be a list of objects (at most 256)")
    check_meta(v, "gpus")
    return v


def _running(v, data, got):
    if len(v) > MAX_HEARTBEAT_TASKS or not all(is_id(t) for t in v):
        raise bad(f"field 'running' must be a list of task ids (at most {MAX_HEARTBEAT_TASKS})")
    return v


def _reason(v, data, got):
    if len(v) > 200 or not v.isprintable():
        raise bad("field 'reason' must be a printable line of at most 200 characters")
    return v


def _script_name(v, data, got):
    if got["kind"] != "script":
        raise bad("field 'script' (the script's file name) is for script jobs")
    if protocol.script_name(v) != v:
        raise bad(f"field 'script' must be a plain file name of at most "
                  f"{protocol.SCRIPT_NAME_MAX} characters, without path separators or any of "
                  '<>:"|?*, got ' f"{v[:200]!r}")
    return v


def _isolation(v, data, got):
    if v not in ("task", "job"):
        raise bad("field 'isolation' must be 'task' or 'job'")
    if v == "job" and got["kind"] == "script":
        raise bad("script jobs always run one process per task: isolation='job' is for "
                  "function jobs")
    return v


def _sha(v, data, got):
    if not is_sha256(v):
        raise bad("field 'fn' must be a sha256 hex digest")
    return v


def _nonblank(v, data, got):
    if not v.strip():
        raise bad("field 'hostname' must not be empty")
    return v


def _costs(v, data, got):
    n = got["n_tasks"]
    if v is None:
        return [1.0] * n
    if len(v) != n or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                              and 0 <= c < 1e9 for c in v):
        raise bad("field 'costs' must hold one number >= 0 per task")
    return [float(c) for c in v]


def _job_ids(v, data, got):
    ids = [as_user_id(j) for j in v]
    if not 1 <= len(v) <= MAX_RELEASE_JOBS or None in ids:
        raise bad(f"field 'jobs' must be a list of 1 to {MAX_RELEASE_JOBS} job ids")
    return ids


def _domain(fn: Callable[[Any], Any]) -> Check:
    """A check of :mod:`gpumesh.hardware` and friends (ValueError naming the field)."""
    return lambda v, data, got: fn(v)


# ---------------------------------------------------------------- the bodies -------
_STRINGS = ("hostname", "user", "device", "device_name", "platform", "python", "version", "cpu")
_SCORES_DOC = "benchmark score per device (cpu, cuda:N, mps)"
_PACKAGES = Field("packages", None, None, check=_domain(packages.check),
                  schema={"type": "object", "maxProperties": 5000, "description": "installed Python "
                          "distributions: normalised name -> version (gpumesh.packages)",
                          "additionalProperties": {"type": "string", "maxLength": 100}})
#: The owner's rules as a worker reports them (gpumesh.availability), each replaced whole.
_OWNER_FIELDS = (
    Field("owner", None, OMIT, null_checked=True, check=_domain(availability.check_owner),
          schema={"type": ["object", "null"], "description": "the whole worker takes no new task: "
                  "{state: paused|outside_hours, label, until?}; null: it does"}),
    Field("gpu_states", None, OMIT, null_checked=True, check=_domain(availability.check_gpu_states),
          schema={"type": "object", "description": "GPU index -> {state: yielding|hot|power, "
                  "label}: the GPUs that take no new task"}),
)
HANDOFF_FILES = Field(
    "handoff_files", dict, None,
    schema={"deprecated": True, "description": "the key before refs (read where refs is "
            "absent, until the next release): frame number -> name of a file the sender "
            "wrote into handoff_dir; that frame is empty (see GET /v1/handoff)",
            "additionalProperties": {"type": "string", "pattern": "^[0-9a-f]{24}\\.part$"}})

#: The one key for a body's payload references (gpumesh.payloadref); HANDOFF_FILES is
#: the key before it, read for one release more (drop it in the next).
REFS = Field(
    payloadref.REFS, dict, None, check=_domain(payloadref.check_refs),
    schema={"description": "frame number (0 = the first frame after this one) -> payload "
            "reference {kind: handoff, name, size}: that frame is empty, its bytes are the "
            "file the sender wrote into handoff_dir (see GET /v1/handoff)",
            "additionalProperties": {"type": "object", "required": ["kind", "name"],
                                     "properties": {
                                         "kind": {"enum": ["handoff"]},
                                         "name": {"type": "string",
                                                  "pattern": "^[0-9a-f]{24}\\.part$"},
                                         "size": {"type": "integer", "minimum": 0}}}})

REGISTRATION = Body("Registration", (
    Field("id", str, None, check=_id_of("worker id"),
          schema={"pattern": HEX_ID, "description": "come back under the id the worker had"}),
    Field("slots", int, 1, lo=1, hi=1024),
    *(Field(k, NUMBER, OMIT, lo=0, hi=1e12) for k in ("cores", "ram_mb", "score")),
    *(Field(k, str, OMIT, type_error="field {name} must be a string")
      for k in _STRINGS if k != "hostname"),
    Field("gpus", None, OMIT, null_checked=True, check=_gpus,
          schema={"type": "array", "maxItems": 256, "items": {"type": "object"}}),
    # the slots it offers (one per GPU, then CPU slots) and its device scores
    Field("slot_list", None, None, always=True,
          check=lambda v, data, got: hardware.check_slot_list(v, got["slots"], got.get("gpus")),
          schema={"type": "array", "maxItems": 1024, "description": "one slot per GPU, then CPU "
                  "slots: {id, kind: cuda|mps|cpu, gpu: index} (see docs/hardware.md)",
                  "items": {"type": "object"}}),
    Field("scores", None, None, check=_domain(hardware.check_scores),
          schema={"type": "object", "description": _SCORES_DOC}),
    _PACKAGES,  # its Python distributions (gpumesh.packages)
    Field("allow_installs", bool, None, doc="builds task environments for requires= "
          "(gpumesh join --allow-installs)"),
    *_OWNER_FIELDS,
    # (last, so a bad field above is named first; a worker is listed by its hostname: a
    # body without one is no worker's join)
    Field("hostname", str, REQUIRED, check=_nonblank, type_error="field {name} must be a string",
          schema={"minLength": 1}),
))

HEARTBEAT = Body("Heartbeat", (
    Field("running", list, None, check=_running,
          schema={"maxItems": MAX_HEARTBEAT_TASKS, "items": {"type": "string", "pattern": HEX_ID}}),
    Field("receiving", bool, False, doc="a lease answer is arriving: its tasks are not in "
          "running yet, and must not be taken for forgotten"),
    Field("score", NUMBER, OMIT, lo=0, hi=1e12),
    # device scores once measured; free GPU memory as last seen
    Field("scores", None, None, check=_domain(hardware.check_scores),
          schema={"type": "object", "description": _SCORES_DOC}),
    Field("gpu_free_mb", None, None, check=_domain(hardware.check_gpu_free),
          schema={"type": "object", "description": "free GPU memory in MiB per GPU index"}),
    Field("gpu_telemetry", None, None, check=_domain(check_telemetry),
          schema={"type": "object", "description": "per GPU index: utilization_pct (0-100) and "
                  "temperature_c, shown on the dashboard and /metrics"}),
    _PACKAGES,  # something was installed or removed
    *_OWNER_FIELDS,
))

LEASE_REQUEST = Body("LeaseRequest", (
    Field("slots", int, 1, lo=1, hi=1024),
    Field("wait", NUMBER, 0, lo=0, hi=LONG_POLL_MAX_S),
    Field("free", None, None, check=_domain(hardware.check_free_slots),
          schema={"type": "array", "maxItems": 1024, "description": "the free slots' ids",
                  "items": {"type": "integer", "minimum": 0, "maximum": 1023}}),
    Field("handoff", bool, False, doc="the worker shares this machine (see GET /v1/handoff): "
          "arguments kept as files come as refs.args, not bytes"),
))

HAND_BACK = Body("HandBack", (
    Field("reason", str, "handed back by its worker", check=_reason,
          doc="why the worker gives the task back, e.g. 'paused: owner'", schema={"maxLength": 200}),
))

RESULT_META = Body("ResultMeta", (
    Field("status", str, check=_one_of("ok", "error", "retry",
                                       message="field 'status' must be ok, error or retry"),
          schema={"enum": ["ok", "error", "retry"]}),
    Field("error", dict, None, doc="kind, type, message, traceback, ..."),
    HANDOFF_FILES,
    REFS,
), doc="frame 0 of a result; frame 1 (required for ok) is the payload")

JOB_SUBMIT = Body("JobSubmit", (
    Field("job_id", str, check=_user_id_of("job id"), schema={"pattern": USER_ID},
          doc="chosen by the caller (stored in lower case); a resend with the same id is "
              "idempotent"),
    Field("kind", str, "function", schema={"enum": ["function", "script"]},
          check=_one_of("function", "script", message="field 'kind' must be 'function' or 'script'")),
    Field("result_format", str, "pickle", schema={"enum": ["pickle", "json"]},
          doc="json: the task returns its value as JSON (strict results)",
          check=_one_of("pickle", "json", message="field 'result_format' must be 'pickle' or 'json'")),
    Field("isolation", str, "task", check=_isolation, schema={"enum": ["task", "job"]},
          doc="task (default): a fresh process per task; job: each worker slot keeps one "
              "process for the job's tasks (function jobs only)"),
    Field("name", str, "", check=lambda v, data, got: v[:200]),
    Field("script", str, None, check=_script_name, schema={"maxLength": protocol.SCRIPT_NAME_MAX},
          doc="a script job's file name as submitted (task.py): its tasks run the script "
              "under that name, so tracebacks name it"),
    Field("fn", str, check=_sha, schema={"pattern": SHA256}),
    Field("fn_inline", bool, False),
    Field("n_tasks", int, lo=0, hi=MAX_TASKS_PER_JOB),
    Field("timeout", NUMBER, None, lo=0.001, hi=365 * 86400, schema={"type": ["number", "null"]}),
    Field("costs", list, None, always=True, check=_costs,
          schema={"items": {"type": "number", "minimum": 0, "exclusiveMaximum": 1e9}}),
    # hardware the tasks need, and their GPU memory hints (MiB)
    Field("require", dict, None, always=True,
          check=lambda v, data, got: hardware.Requirements.from_meta(v),
          doc="hardware every task needs: gpu (kind or model), cores, memory and gpu_memory "
              "(bytes); see docs/hardware.md; python ('3.11': code shipped by value only runs on "
              "workers of that Python); requires (PEP 508 strings: workers that have them or "
              "allow installs)"),
    Field("gpu_memory_mb", None, None, always=True, null_checked=True,
          check=lambda v, data, got: hardware.check_vram_hints(v, got["n_tasks"]),
          schema={"type": "array", "description": "per task: free GPU memory it needs (MiB) or "
                  "null", "items": {"type": ["number", "null"], "minimum": 0}}),
    # re-runs of items whose function raised one of these types (gpumesh.retries)
    Field("retries", None, None, schema={"type": "integer", "minimum": 1, "maximum": MAX_RETRIES,
                                         "description": "with retry_on: re-runs of a task whose "
                                                        "function raised"}),
    Field("retry_on", None, None, always=True, null_checked=True,
          check=lambda v, data, got: retries.check_meta(data.get("retries"), v),
          schema={"type": "array", "maxItems": MAX_RETRY_TYPES,
                  "items": {"type": "string", "maxLength": MAX_STRING_CHARS},
                  "description": "exception type names (module.Qualname, builtins bare) whose "
                                 "raising re-runs the task"}),
    Field("require_worker", bool, False),
    Field("caller", dict, None),  # the route makes a fresh {} of null
    Field("wait", NUMBER, 0, lo=0, hi=LONG_POLL_MAX_S),
    Field("output", bool, False),
    Field("handoff", bool, False, doc="with wait: name result files by path (as results?handoff=1)"),
    HANDOFF_FILES,
    REFS,
), doc="frame 0 of a submit; then the function blob when fn_inline, then one argument payload "
       "per task")

def _job_list(name: str) -> Body:
    """A body ``{"jobs": [1 to MAX_RELEASE_JOBS job ids]}``."""
    return Body(name, (
        Field("jobs", list, check=_job_ids,
              schema={"minItems": 1, "maxItems": MAX_RELEASE_JOBS,
                      "items": {"type": "string", "pattern": USER_ID}}),
    ))


RELEASE_JOBS = _job_list("ReleaseJobs")
ALIVE_JOBS = _job_list("AliveJobs")  # POST /v1/jobs/alive: a caller's keepalive

_PERSON = "^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$"
NEW_TOKEN = Body("NewToken", (
    Field("name", str, schema={"pattern": _PERSON}),
    Field("role", str, people.ROLE_SUBMIT, schema={"enum": ["admin", "submit", "view", "worker"]}),
    Field("max_running", int, None, lo=1, hi=people.MAX_RUNNING_CAP,
          schema={"type": ["integer", "null"]}),
))

#: Every body, for the OpenAPI document's components.
BODIES = (REGISTRATION, HEARTBEAT, LEASE_REQUEST, HAND_BACK, RESULT_META, JOB_SUBMIT,
          RELEASE_JOBS, ALIVE_JOBS, NEW_TOKEN)
