"""One job as ``GPUMesh.status`` shows it: state, counts, and each task with its result.

The coordinator's ``GET /v1/jobs/{id}`` gives the job and its tasks (state, attempts,
worker, error, cost); the results themselves come from the results endpoint
(``GET /v1/jobs/{id}/results``, read page by page from the start without waiting). A
result is decoded as the call that made the job would decode it:

* a script job (and any job a strict caller submitted) answers in JSON: the value the
  script printed;
* a function job answers with a pickle: the value the function returned, unpickled here
  (never when this mesh is ``strict``).

Results are kept by the coordinator's store, so they are there after a coordinator
restart too. Once a job is *released* - its caller collected the results (a function
call or ``.map`` does that as soon as it has them), or gave up on them after a failure,
Ctrl+C or cancel - the payloads are deleted: the view says ``released: True`` and no
task carries a result.
"""

from __future__ import annotations

import json
from typing import Any

from .. import wire
from ..errors import RequestRejected
from ..protocol import ResultPage
from .paths import check_job_id, job_path

#: The text the terminal shows for a finished task whose result was released.
RELEASED_NOTE = "(released: its caller collected the results, or let them go)"
#: Longest result text one terminal line shows; ``--json`` prints results whole.
RESULT_TEXT_MAX = 4000


def job_status(mesh, job_id: str) -> dict:
    """The job view of :meth:`GPUMesh.status <gpumesh.client.mesh.GPUMesh.status>`.

    Every task that is ``done`` and whose result is still kept gets ``result`` (the
    decoded value); one whose result cannot be decoded here gets ``result_error`` (why)
    instead. Raises :class:`~gpumesh.errors.RequestRejected` (404) for an unknown job.
    """
    job_id = check_job_id(job_id)  # (in either case: as the coordinator spells it)
    view = mesh.http.request("GET", job_path(job_id), timeout=10).json()
    view.setdefault("released", False)
    if view["released"] or not view.get("counts", {}).get("done"):
        return view
    try:
        found = _read_results(mesh, job_id)
    except RequestRejected as e:
        if e.status == 403:  # someone else's job: its states, not its results
            view["results_hidden"] = True
            return view
        if e.status != 410:
            raise
        view["released"] = True  # released between the two requests
        return view
    as_json = json_results(view)
    for t in view.get("tasks", []):
        got = found.get(t["id"])
        if t["state"] != "done" or got is None:
            continue
        decode_into(t, got, as_json, mesh.strict)
    return view


def json_results(view: dict) -> bool:
    """Whether the job of ``view`` (the coordinator's ``GET /v1/jobs/{id}``) answers in
    JSON (a script job, or a function job of a strict caller) rather than with pickles."""
    return view.get("result_format") == "json" or view.get("kind") == "script"


def decode_into(task: dict, payload: memoryview | bytes | None, as_json: bool, strict: bool) -> None:
    """Set ``task["result"]`` to the decoded ``payload`` (:func:`json_results` says how
    it is encoded; ``strict``: never unpickle), or ``task["result_error"]`` to why it
    could not be decoded here."""
    try:
        task["result"] = _decode(payload, as_json, strict)
    except Exception as e:  # noqa: BLE001 - a view shows what it can; the rest is named
        task["result_error"] = f"{type(e).__name__}: {e}"


def _read_results(mesh, job_id: str) -> dict[str, memoryview | None]:
    """Every final result of the job: ``{task_id: payload bytes (None: no payload)}``."""
    out: dict[str, memoryview | None] = {}
    after, seen = -1, 0
    while True:
        body = mesh.http.stream_into("GET", job_path(job_id, "results"),
                                     params={"after": after, "wait": 0}, timeout=60)
        if not body:
            return out
        frames = wire.unpack_frames(body)
        page = ResultPage.from_dict(json.loads(bytes(frames[0])))
        if not page.results:
            return out
        k = 1
        for item in page.results:
            payload = None
            if item.has_payload:
                payload, k = frames[k], k + 1  # a view into the page: no copy
            if item.state == "done":
                out[item.task_id] = payload
            after = max(after, item.seq)
        seen += len(page.results)
        if seen >= page.n_final:
            return out


def _decode(payload: memoryview | bytes | None, json_results: bool, strict: bool) -> Any:
    if json_results:
        from ..strict import decode
        return decode(payload if payload is not None else b"")
    if strict:
        raise ValueError("a pickled result is not unpickled by a strict mesh (strict=True)")
    return wire.loads(payload if payload is not None else b"")


def jsonable(view: dict) -> dict:
    """``view`` with every result JSON can hold as it is; any other result (an array, a
    set, an object) becomes its ``repr()`` text with ``result_repr: True`` beside it."""
    out = dict(view)
    tasks = []
    for t in view.get("tasks", []):
        if "result" in t:
            try:
                json.dumps(t["result"], allow_nan=False)
            except (TypeError, ValueError):
                t = dict(t, result=repr(t["result"]), result_repr=True)
        tasks.append(t)
    if "tasks" in view:
        out["tasks"] = tasks
    return out


def result_text(task: dict, released: bool) -> str | None:
    """The ``result:`` part of a task's line in the terminal, or None for none."""
    if "result" in task:
        value = task["result"]
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            text = repr(value)
        if len(text) > RESULT_TEXT_MAX:
            text = f"{text[:RESULT_TEXT_MAX]}... ({len(text)} characters in all; --json shows it whole)"
        return text
    if "result_error" in task:
        return f"(cannot be shown here: {task['result_error']})"
    if released and task.get("state") == "done":
        return RELEASED_NOTE
    return None
