"""The coordinator's HTTP API as an OpenAPI 3.1 description (served at ``GET /v1/openapi.json``).

The request bodies' schemas come from :mod:`.schemas`, the declarations the routes
validate with; the operations (paths, parameters, answers) are written here next to the
routes of :mod:`.routes`, and checked against them by ``tests/security/test_auth.py``
(every route described, nothing else) and the fuzz test (``tests/security/test_fuzz.py``),
which generates requests from this description and asserts that the live coordinator
never answers 5xx.

Bodies of type ``application/x-gpumesh-frames`` are the frames layout of
:mod:`gpumesh.wire`; the schema given for them is that of frame 0 (JSON metadata), and
the frames that follow are payloads (see each operation's description).
"""

from __future__ import annotations

import copy
from typing import Any

from .. import protocol
from .._version import __version__
from ..limits import LONG_POLL_MAX_S, MAX_BODY_BYTES, MAX_JSON_BODY_BYTES, OUTPUT_BODY_BYTES
from . import schemas
from .bodies import FRAMES
from .schemas import HEX_ID, SHA256


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    text = {400: "malformed request (the message names the field)",
            401: "token missing or refused", 403: "the token's role may not do this, or the job "
            "is another person's (not_yours)",
            404: "unknown worker, job, task or blob", 409: "conflict (no_workers, missing_blob, "
            "stale_lease, exists)", 410: "results released (collected, or let go)", 413: "body over the size limit",
            429: "locked out after too many refused tokens (see Retry-After)"}
    out = {}
    for c in (400, 401, 403, 429) + codes:
        out[str(c)] = {"description": text[c], **_json(_ref("Error"))}
    return out


def _path_param(name: str, pattern: str, what: str) -> dict:
    return {"name": name, "in": "path", "required": True, "description": what,
            "schema": {"type": "string", "pattern": pattern}}


def _query(name: str, schema: dict, what: str, required: bool = False) -> dict:
    return {"name": name, "in": "query", "required": required, "description": what, "schema": schema}


_WID = _path_param("wid", HEX_ID, "worker id")
_JID = _path_param("jid", HEX_ID, "job id")
_TID = _path_param("tid", HEX_ID, "task id")
_SHA = _path_param("h", SHA256, "sha256 of the blob (hex)")
_LEASE = _query("lease", {"type": "string", "pattern": HEX_ID}, "the lease id the task was granted under",
                required=True)
_FRAMES_ANSWER = {"description": "frames: JSON metadata, then payloads",
                  "content": {FRAMES: {"schema": {"type": "string", "format": "binary"}}}}

_SCHEMAS: dict[str, Any] = {
    **{body.name: body.json_schema() for body in schemas.BODIES},
    "Error": {"type": "object", "required": ["error", "message"],
              "properties": {"error": {"type": "string"}, "message": {"type": "string"}}},
    "Registered": {"type": "object", "properties": {"id": {"type": "string"},
                                                     "heartbeat_s": {"type": "number"},
                                                     "ttl_s": {"type": "number"},
                                                     "version": {"type": "string"}}},
    "OutputMeta": {"type": "object",
                   "description": "frame 0 of an output post; frames 1 and 2 are stdout and stderr bytes"},
    "Handoff": {"type": "object", "required": ["blob_dir", "handoff_dir", "nonce"], "properties": {
        "blob_dir": {"type": "string", "description": "absolute path of the store's payload files"},
        "handoff_dir": {"type": "string", "description": "absolute path where a sender on this "
                        "machine may write payload files (mode 0600) to name in refs"},
        "nonce": {"type": "string", "description": "the content of handoff_dir/.probe: a sender "
                  "that reads the same there shares this file system"}}},
    "Submitted": {"type": "object", "properties": {"job_id": {"type": "string"},
                                                    "n_tasks": {"type": "integer"},
                                                    "created": {"type": "boolean"}}},
}

_DOC: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "gpumesh coordinator", "version": __version__,
        "description": (
            "Every operation but /v1/health, /v1/openapi.json and /v1/dist/{name} needs "
            "`Authorization: Bearer <token>`. The main token may do everything; a worker token "
            "(serve --worker-token) only the operations tagged 'worker'. Body limits: "
            f"{MAX_BODY_BYTES // 2**20} MiB for payload bodies (GPUMESH_MAX_BODY_MB), "
            f"{MAX_JSON_BODY_BYTES // 1024} KiB for JSON bodies (GPUMESH_MAX_JSON_KB), "
            f"{OUTPUT_BODY_BYTES // 2**20} MiB for an output post."),
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": _SCHEMAS,
    },
    "security": [{"bearer": []}],
    "paths": {
        protocol.HEALTH: {"get": {
            "operationId": "health", "security": [], "summary": "liveness (no auth)",
            "responses": {"200": {"description": "up", **_json({"type": "object"})}}}},
        protocol.OPENAPI: {"get": {
            "operationId": "openapi", "security": [], "summary": "this description (no auth)",
            "responses": {"200": {"description": "OpenAPI 3.1", **_json({"type": "object"})}}}},
        protocol.DIST_FILE: {"get": {
            "operationId": "wheel", "security": [],
            "summary": "the wheel of the gpumesh this coordinator runs (no auth)",
            "description": "pip install http://HOST:PORT/v1/dist/gpumesh-<version>-py3-none-any.whl "
                           "installs it on another machine; any other name is a 404",
            "parameters": [_path_param("name", "^[^/]{1,200}$", "gpumesh-<version>-py3-none-any.whl")],
            "responses": {"200": {"description": "the wheel",
                                  "content": {"application/zip": {"schema": {"type": "string",
                                                                             "format": "binary"}}}},
                          "404": {"description": "not this coordinator's wheel", **_json(_ref("Error"))},
                          "503": {"description": "the wheel cannot be made here",
                                  **_json(_ref("Error"))}}}},
        protocol.WORKERS: {
            "get": {"operationId": "listWorkers", "summary": "the pool",
                    "responses": {"200": {"description": "workers", **_json({"type": "array"})}, **_errors()}},
            "post": {"operationId": "register", "tags": ["worker"], "summary": "register a worker",
                     "requestBody": {"required": False, **_json(_ref("Registration"))},
                     "responses": {"200": {"description": "registered", **_json(_ref("Registered"))},
                                   **_errors(413)}},
        },
        protocol.WORKER_HEARTBEAT: {"post": {
            "operationId": "heartbeat", "tags": ["worker"], "parameters": [_WID],
            "requestBody": {"required": False, **_json(_ref("Heartbeat"))},
            "responses": {"200": {"description": "task ids to cancel", **_json({"type": "object"})},
                          **_errors(404, 413)}}},
        protocol.WORKER_SESSION: {"get": {
            "operationId": "session", "tags": ["worker"], "parameters": [_WID],
            "summary": "the worker's pulse: a response held open while the worker lives",
            "x-long-lived": True,
            "responses": {"200": {"description": "lines: open, ping, cancel <task id>",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                          **_errors(404)}}},
        protocol.WORKER: {"delete": {
            "operationId": "deregister", "tags": ["worker"], "parameters": [_WID],
            "responses": {"200": {"description": "leases re-queued", **_json({"type": "object"})},
                          **_errors()}}},
        protocol.WORKER_LEASE: {"post": {
            "operationId": "lease", "tags": ["worker"], "parameters": [_WID],
            "summary": "long-poll for up to `slots` tasks",
            "requestBody": {"required": False, **_json(_ref("LeaseRequest"))},
            "responses": {"200": _FRAMES_ANSWER, **_errors(404, 413)}}},
        protocol.TASK_RESULT: {"post": {
            "operationId": "postResult", "tags": ["worker"],
            "parameters": [_TID, _LEASE, _query("next", {"enum": ["0", "1"]},
                                                "1: answer with this slot's next task"),
                           _query("handoff", {"enum": ["0", "1"]},
                                  "1: that next task's arguments may come as refs.args"),
                           _query("slot", {"type": "string", "pattern": "^[0-9]{1,4}$"},
                                  "the slot the task ran in")],
            "requestBody": {"required": True, "content": {FRAMES: {"schema": _ref("ResultMeta")}}},
            "responses": {"200": _FRAMES_ANSWER, **_errors(409, 413)}}},
        protocol.TASKS_RESULTS: {"post": {
            "operationId": "postResults", "tags": ["worker"],
            "summary": "several results, each fenced by its own lease (a stale one is refused "
                       "alone, in the answer's `refused`); `next` queues grants per slot",
            "requestBody": {"required": True, "content": {FRAMES: {"schema": {
                "type": "object", "required": ["results"],
                "properties": {"results": {"type": "array", "minItems": 1, "maxItems": 256,
                                           "items": {"type": "object"}},
                               "next": {"type": "object", "additionalProperties": {
                                   "type": "integer", "minimum": 0, "maximum": 16}},
                               "handoff": {"type": "boolean"}}}}}},
            "responses": {"200": _FRAMES_ANSWER, **_errors(413)}}},
        protocol.TASK_RELEASE: {"post": {
            "operationId": "handBack", "tags": ["worker"], "parameters": [_TID, _LEASE],
            "summary": "hand a running task back (its owner's rules): re-queued as preempted, "
                       "the attempt not counted",
            "requestBody": {"required": False, **_json(_ref("HandBack"))},
            "responses": {"200": {"description": "re-queued", **_json({"type": "object"})},
                          **_errors(409, 413)}}},
        protocol.TASK_OUTPUT: {"post": {
            "operationId": "postOutput", "tags": ["worker"], "parameters": [_TID, _LEASE],
            "requestBody": {"required": True, "content": {FRAMES: {"schema": _ref("OutputMeta")}}},
            "responses": {"200": {"description": "accepted", **_json({"type": "object"})},
                          **_errors(409, 413)}}},
        protocol.HANDOFF: {"get": {
            "operationId": "handoff", "tags": ["worker"],
            "summary": "where a caller or worker on this machine may hand payloads off as files",
            "responses": {"200": {"description": "the directories", **_json(_ref("Handoff"))},
                          **_errors()}}},
        protocol.BLOB: {
            "get": {"operationId": "getBlob", "tags": ["worker"], "parameters": [_SHA],
                    "responses": {"200": {"description": "the blob", "content": {
                        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                                  **_errors(404)}},
            "head": {"operationId": "hasBlob", "tags": ["worker"], "parameters": [_SHA],
                     "responses": {"200": {"description": "present"}, "404": {"description": "absent"},
                                   "400": {"description": "malformed name"},
                                   "401": {"description": "token refused"}}},
            "put": {"operationId": "putBlob", "parameters": [_SHA],
                    "requestBody": {"required": True, "content": {
                        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                    "responses": {"200": {"description": "stored", **_json({"type": "object"})},
                                  **_errors(413)}},
        },
        protocol.JOBS: {
            "post": {"operationId": "submit", "summary": "submit a job with all its arguments",
                     "requestBody": {"required": True, "content": {FRAMES: {"schema": _ref("JobSubmit")}}},
                     "responses": {"200": {"description": "accepted (JSON) or, with wait, a results "
                                                          "page (frames)",
                                           "content": {"application/json": {"schema": _ref("Submitted")},
                                                       FRAMES: {"schema": {"type": "string",
                                                                           "format": "binary"}}}},
                                   "204": {"description": "the caller went away while waiting"},
                                   **_errors(409, 413)}},
            "get": {"operationId": "listJobs",
                    "parameters": [_query("limit", {"type": "integer", "minimum": 1, "maximum": 1000},
                                          "most jobs to list"),
                                   _query("before", {"type": "string", "pattern": HEX_ID},
                                          "a job id: list the jobs older than it (the next page "
                                          "after a page whose last job it is)"),
                                   _query("owner", {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$"},
                                          "only this person's jobs (admin: also those from before people)"),
                                   _query("state", {"enum": ["active", "finished", "cancelled"]},
                                          "only jobs in this state")],
                    "responses": {"200": {"description": "jobs, newest first; a page shorter than "
                                                         "limit is the last", **_json({"type": "array"})},
                                  **_errors()}},
        },
        protocol.JOB: {"get": {
            "operationId": "jobStatus", "parameters": [_JID],
            "responses": {"200": {"description": "the job: state, counts, released, result_format and its tasks",
                                  **_json({"type": "object"})}, **_errors(404)}}},
        protocol.JOB_RESULTS: {"get": {
            "operationId": "results",
            "parameters": [_JID,
                           _query("after", {"type": "integer", "minimum": -1, "maximum": 10**15},
                                  "results with seq > after"),
                           _query("wait", {"type": "number", "minimum": 0, "maximum": LONG_POLL_MAX_S},
                                  "seconds to long-poll"),
                           _query("out_after", {"type": "integer", "minimum": -1, "maximum": 10**15},
                                  "also task output with seq > out_after"),
                           _query("handoff", {"enum": ["0", "1"]},
                                  "1: results kept as files are named by path (file), not sent"),
                           _query("closed", {"enum": ["0", "1"]},
                                  "1: answer at once (no long poll) if only workers closed by "
                                  "their owners could run the job's pending tasks"),
                           _query("caller", {"enum": ["0", "1"]},
                                  "1: this is the call waiting on the job (it is heard: "
                                  "GPUMESH_CALLER_TIMEOUT); not for a status read")],
            "responses": {"200": _FRAMES_ANSWER, "204": {"description": "the caller went away"},
                          **_errors(404, 410)}}},
        protocol.JOB_LOGS: {"get": {
            "operationId": "jobLogs",
            "parameters": [_JID, _query("task", {"type": "string", "pattern": HEX_ID}, "one task only")],
            "responses": {"200": {"description": "stdout and stderr per task, and per attempt (attempts: attempt, worker, hostname, ended, stdout, stderr)", **_json({"type": "object"})},
                          **_errors(404)}}},
        protocol.JOBS_RELEASE: {"post": {
            "operationId": "releaseMany",
            "requestBody": {"required": True, **_json(_ref(schemas.RELEASE_JOBS.name))},
            "responses": {"200": {"description": "how many known jobs were released",
                                  **_json({"type": "object"})}, **_errors(400)}}},
        protocol.JOBS_ALIVE: {"post": {
            "operationId": "keepAlive",
            "requestBody": {"required": True, **_json(_ref(schemas.ALIVE_JOBS.name))},
            "responses": {"200": {"description": "how many of them are open function jobs "
                                                 "(their caller is now heard; see GPUMESH_CALLER_TIMEOUT)",
                                  **_json({"type": "object"})}, **_errors(400)}}},
        protocol.JOB_RELEASE: {"post": {
            "operationId": "release", "parameters": [_JID],
            "responses": {"200": {"description": "released", **_json({"type": "object"})}, **_errors(404)}}},
        protocol.JOB_CANCEL: {"post": {
            "operationId": "cancel", "parameters": [_JID],
            "responses": {"200": {"description": "how many tasks were cancelled (0 for a job that had ended) and the job's state afterwards", **_json({"type": "object"})},
                          **_errors(404)}}},
        protocol.JOB_RETRY: {"post": {
            "operationId": "retry", "parameters": [_JID],
            "responses": {"200": {"description": "how many failed tasks were re-queued",
                                  **_json({"type": "object"})},
                          **_errors(404, 410)}}},
        protocol.TOKENS: {
            "get": {"operationId": "listTokens", "tags": ["people"],
                    "summary": "the people's tokens: name, role, max_running, created (admin)",
                    "responses": {"200": {"description": "never a token or its hash",
                                          **_json({"type": "array"})}, **_errors()}},
            "post": {"operationId": "addToken", "tags": ["people"],
                     "summary": "give a person their own token (admin); answered once",
                     "requestBody": {"required": True, **_json(_ref(schemas.NEW_TOKEN.name))},
                     "responses": {"200": {"description": "the new token (shown once)",
                                           **_json({"type": "object"})}, **_errors(409)}},
        },
        protocol.METRICS: {"get": {
            "operationId": "metrics", "tags": ["monitoring"],
            "summary": "Prometheus text format (see docs/monitoring.md); the API token or "
                       "serve --metrics-token",
            "responses": {"200": {"description": "metrics", "content": {
                "text/plain": {"schema": {"type": "string"}}}}, **_errors()}}},
        protocol.TOKEN: {"delete": {
            "operationId": "revokeToken", "tags": ["people"],
            "parameters": [_path_param("name", "^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$", "the person")],
            "summary": "revoke a person's token at once (admin)",
            "responses": {"200": {"description": "revoked", **_json({"type": "object"})},
                          **_errors(404)}}},
    },
}


def spec() -> dict:
    """A fresh copy of the OpenAPI description (a dict ready for JSON)."""
    return copy.deepcopy(_DOC)
