"""Script jobs from the caller's side: submit a script with JSON payloads, read results.

A script job runs ``python SCRIPT`` once per payload on the workers; the payload arrives
as JSON on the script's stdin and the result is the last stdout line that parses as JSON
(see :mod:`gpumesh.worker.scripts`). Results are JSON both ways: nothing is pickled, so
a coordinator in safe mode accepts these jobs. The job is sent and its results read
through the native backend's submit and long-poll (:mod:`gpumesh.client.native`): the
same idempotent resend with backoff, blob upload and reconnect as a function job.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .. import protocol, wire
from ..limits import INLINE_FUNCTION_BYTES, MAX_TASKS_PER_JOB
from . import native
from .calls import HINT_KEYS
from .paths import check_job_id, job_path

#: Seconds one results long-poll may wait.
POLL_S = 5.0


def load_payloads(path: str | os.PathLike) -> list:
    """Payloads from a JSON file: a JSON array (one task per element), or JSON Lines (one
    task per non-empty line, a file of one line included: a program that writes one line
    per payload must not be refused when it has a single one). A file whose only line is
    an array is the array form. Raises ``ValueError`` naming the file and what is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read the payloads file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the payloads file {path} is not UTF-8 text") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    try:
        data = json.loads(text)
    except ValueError as first:
        if not lines:
            raise ValueError(f"the payloads file {path} is not JSON: {first}") from None
        try:
            data = [json.loads(ln) for ln in lines]
        except ValueError:
            raise ValueError(f"the payloads file {path} is not JSON ({first}); it must hold a "
                             "JSON array with one payload per task, or one JSON value per "
                             "line") from None
    if not isinstance(data, list):
        if len(lines) == 1:  # JSON Lines of one line: one task
            return [data]
        kind = {"dict": "object", "str": "string", "NoneType": "null"}.get(
            type(data).__name__, type(data).__name__)
        raise ValueError(f"the payloads file {path} must hold a JSON array with one payload per "
                         f"task, or one JSON value per line, not a JSON {kind} over "
                         f"{len(lines)} lines (for a single task, put it in brackets: [ ... ], "
                         f"or on one line)")
    return data


def encode_payloads(payloads: Iterable[Any]) -> list[bytes]:
    """Each payload as UTF-8 JSON; ``ValueError`` naming the first that is not JSON."""
    if isinstance(payloads, (str, bytes, dict)):
        raise ValueError("payloads must be a list with one JSON value per task")
    out = []
    for i, p in enumerate(payloads):
        try:
            out.append(json.dumps(p, ensure_ascii=False, allow_nan=False).encode("utf-8"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"payload #{i} cannot be written as JSON: {e}") from None
    if not out:
        raise ValueError("no payloads: a script job needs at least one (one task per payload)")
    if len(out) > MAX_TASKS_PER_JOB:
        raise ValueError(f"{len(out)} payloads is more than {MAX_TASKS_PER_JOB} tasks per job")
    return out


def read_script(script: str | os.PathLike | bytes) -> tuple[bytes, str]:
    """``(source bytes, default job name)``: ``script`` is a path, or the source as bytes."""
    if isinstance(script, (bytes, bytearray)):
        return bytes(script), "script"
    path = Path(script)
    try:
        source = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the script {script}: {e.strerror or e}") from None
    return source, str(script)


def file_name(script: str | os.PathLike | bytes) -> str | None:
    """The file name the tasks run ``script`` under (its own, e.g. ``task.py``, so that
    tracebacks name it; see :func:`gpumesh.protocol.script_name`); None for source bytes
    (the worker calls it ``script.py``)."""
    if isinstance(script, (bytes, bytearray)):
        return None
    return protocol.script_name(os.fspath(script))


def payload_hints(payloads: list) -> list[dict]:
    """The scheduling hints of each payload: ``{"cost": float, "gpu_memory_mb": float}``
    (keys present only when given), read from the keys ``cost`` and ``gpu_memory_mb`` of
    a payload that is a JSON object, as for a ``.map`` item. The payload itself is not
    changed: the script still receives those keys. Raises ``ValueError`` naming the
    payload whose hint is not a number >= 0."""
    out = []
    for i, p in enumerate(payloads):
        hint: dict = {}
        if isinstance(p, dict):
            for key in HINT_KEYS:
                if key not in p or p[key] is None:
                    continue
                v = p[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e9:
                    raise ValueError(f"payload #{i}: {key!r} is a scheduling hint and must be a "
                                     f"number >= 0, got {v!r}")
                hint[key] = float(v)
        out.append(hint)
    return out


def submit(mesh, script, payloads: Iterable[Any], *, name: str | None = None,
           timeout: float | None = None, costs: list[float] | None = None) -> str:
    """Submit a script job on ``mesh`` (a :class:`~gpumesh.client.mesh.GPUMesh`); returns
    its job id. The job waits in the queue when no worker is connected yet.

    A payload's ``cost`` and ``gpu_memory_mb`` keys are scheduling hints, as in ``.map``
    items (:func:`payload_hints`); ``costs`` overrides the costs. Raises
    :class:`~gpumesh.errors.Unsatisfiable` when a ``gpu_memory_mb`` hint is more than
    any alive worker's GPU has (the message lists the pool)."""
    source, default_name = read_script(script)
    payloads = list(payloads) if not isinstance(payloads, (str, bytes, dict)) else payloads
    args = encode_payloads(payloads)
    hints = payload_hints(payloads)  # type: ignore[arg-type]  # (a list: encode_payloads said so)
    if costs is not None and len(costs) != len(args):
        raise ValueError(f"{len(costs)} costs for {len(args)} payloads")
    if costs is None:
        costs = [h.get("cost", 1.0) for h in hints]
    h = hashlib.sha256(source).hexdigest()
    blob = wire.Payload([source])
    backend = mesh._backend()
    if not isinstance(backend, native.NativeBackend):
        mesh.http  # noqa: B018 - an engine has no coordinator API: this raises, saying so
    inline = len(source) <= INLINE_FUNCTION_BYTES
    if not inline and h not in mesh._known_blobs:
        backend.upload_blob(h, blob)
    job_id = secrets.token_hex(6)
    # Queued even with no worker connected yet (no require_worker): never a local run.
    submit = protocol.JobSubmit(
        job_id=job_id, kind="script", fn=h, fn_inline=inline, n_tasks=len(args),
        timeout=timeout, name=(name or default_name)[:200], result_format="json", costs=costs,
        script=file_name(script),
        gpu_memory_mb=([h.get("gpu_memory_mb") for h in hints]
                       if any(h.get("gpu_memory_mb") for h in hints) else None))
    backend.send_job(submit, blob, args, fallback=False)
    return job_id


def wait(mesh, job_id: str, on_progress: Callable[[int, int, dict], None] | None = None,
         timeout: float | None = None, as_json: bool | None = None) -> dict[str, dict]:
    """Wait until every task of ``job_id`` is final; returns ``{task_id: {"index",
    "state", "worker", "error", "result"}}``. ``result`` is decoded as
    :meth:`GPUMesh.status <gpumesh.client.mesh.GPUMesh.status>` decodes it: the JSON value
    a script printed, or the value a function returned (unpickled; never when the mesh is
    ``strict``); None for a task not done, and for one whose result cannot be decoded
    here, which has ``result_error`` (why) instead. ``as_json``: whether the job answers
    in JSON (None: ask the coordinator, once, at the first result to decode).
    ``on_progress(n_final, n_tasks, counts)`` is called after every page (``counts``: the
    final tasks so far per state, ``{"done": 3, "failed": 1}``). Reading the results does
    not release them (``gpumesh status``, ``retry`` still work); a function job whose
    caller already collected them raises :class:`~gpumesh.errors.RequestRejected` (410)."""
    from .jobview import decode_into, json_results
    out: dict[str, dict] = {}
    after = -1
    deadline = None if timeout is None else time.monotonic() + timeout
    job_id = check_job_id(job_id)  # ValueError for what is not a job id, before any request
    path = job_path(job_id)
    reconnect: dict = {}
    while True:
        try:
            body = native.poll_results(mesh, job_id, {"after": after, "wait": POLL_S}, POLL_S,
                                       reconnect)
        except native.Retrying:
            body = None
        if body:
            page, frames = native.read_page(body, f"the coordinator at {mesh.url} (job {job_id})")
            k = 1
            for item in page.results:
                payload = None
                if item.has_payload:
                    payload, k = frames[k], k + 1
                after = max(after, item.seq)
                row = {"index": item.index, "state": item.state, "worker": item.worker,
                       "error": item.error, "result": None}
                if item.state == "done" and payload is not None:
                    if as_json is None:  # (a function job answers with pickles, unless strict)
                        as_json = json_results(mesh.http.request("GET", path, timeout=30).json())
                    decode_into(row, payload, as_json, mesh.strict)
                out[item.task_id] = row
            if on_progress is not None:
                counts: dict[str, int] = {}
                for got in out.values():
                    counts[got["state"]] = counts.get(got["state"], 0) + 1
                on_progress(page.n_final, page.n_tasks, counts)
            if page.n_final >= page.n_tasks:
                return out
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} did not finish within {timeout:g}s")
