"""The caller's routes: submit a job with its arguments, list and read jobs, long-poll
their results and output, read their logs, and release, cancel or retry them.

Routes that read results or output, cancel, retry or release admit only the job's owner
(or an admin): :func:`.base.owned`.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ... import payloadref, protocol, tracing
from ...limits import LONG_POLL_MAX_S, RESULT_PAGE_BYTES, RESULT_PAGE_COUNT
from ...protocol import ErrorCode
from .. import people, views
from ..auth import is_loopback
from ..bodies import Part, frames_response, frames_streamed, json_body, sha256, take_handoffs
from ..core import Coordinator
from ..model import HTTPError, JobReleased, UnknownJob
from ..schemas import ALIVE_JOBS, JOB_SUBMIT, RELEASE_JOBS, bad
from ..store import Incoming
from .base import (ctx, maps_locked, not_yours, owned, path_id, query_choice, query_float,
                   query_id, route, until_disconnect, who_of)


@route(protocol.JOBS, ["POST"], action="submit jobs", hot=True)
async def submit(request: Request) -> Response:
    tracing.mark("coordinator.submit")
    c = ctx(request)
    coord = c.coord
    meta, frames = await frames_streamed(request, coord.store)
    v = JOB_SUBMIT.read(meta)
    job_id, kind, fn, n = v["job_id"], v["kind"], v["fn"], v["n_tasks"]
    if c.safe_mode and kind == "function":
        raise HTTPError(403, ErrorCode.SAFE_MODE,
                        "this coordinator runs in safe mode (serve --safe-mode): it refuses "
                        "function jobs, whose pickled code and arguments run on the workers; "
                        "submit a script job instead")
    if len(frames) != n + (1 if v["fn_inline"] else 0):
        raise bad(f"n_tasks is {n} but the body carries {len(frames)} payload frames")
    new = not (job_id in coord.jobs or coord.store.job_exists(job_id))
    if new:
        # (a resent submit of a stored job: its files were claimed the first time)
        frames = take_handoffs(request, v["handoff_files"], frames, coord.store, v["refs"])
    args = frames
    if v["fn_inline"]:
        blob, args = frames[0], frames[1:]
        if sha256(blob) != fn:
            raise bad("inline function blob does not match 'fn'")
        coord.store.put_blob(fn, blob if isinstance(blob, Incoming) else [blob])
    elif not coord.store.has_blob(fn):
        raise HTTPError(409, ErrorCode.MISSING_BLOB, f"upload blob {fn} first (PUT /v1/blobs/{fn})")
    caller = dict(v["caller"] or {})
    # Said by the coordinator, never the caller: a caller on this machine whose process
    # is gone is given up sooner (callers.gone_here).
    caller["loopback"] = is_loopback(request.client.host if request.client else None)
    job_meta = {"timeout": v["timeout"], "name": v["name"], "caller": caller}
    require, vram, retry = v["require"], v["gpu_memory_mb"], v["retry_on"]
    if require:
        job_meta["require"] = require.to_meta()
    if vram:
        job_meta["gpu_memory_mb"] = {str(i): x for i, x in vram.items()}
    if v["result_format"] != "pickle":
        job_meta["result_format"] = v["result_format"]
    if v["isolation"] != "task":
        job_meta["isolation"] = v["isolation"]
    if v["script"] is not None:  # (a script job's file name: its tasks run it so named)
        job_meta["script"] = v["script"]
    if retry is not None:
        job_meta["retries"], job_meta["retry_on"] = retry
    # (no await since the look-up above: it still holds)
    job, created = coord.submit(job_id, v["name"], kind, fn, job_meta, list(args), v["costs"],
                                v["require_worker"], owner=who_of(request).name, known_new=new)
    tracing.mark("coordinator.stored")
    coord.callers.heard(coord, (job.id,))  # (a function job: its caller is watched from now)
    info = {"job_id": job.id, "n_tasks": job.n_tasks, "created": created}
    if not v["wait"] or job.id not in coord.jobs:
        return JSONResponse(info)
    # Submit-and-wait: a short call's result comes back in the submit's own answer,
    # saving the caller a round trip (the answer is a results page, cursor -1).
    out_after = -1 if v["output"] else None
    # A job that only paused (or out-of-hours) workers could run will not start soon:
    # the answer says so at once, and the caller decides how long to wait.
    wait = 0 if views.closed_for(coord, job.id) else v["wait"]
    waited = await until_disconnect(request, coord.wait_results(job.id, -1, wait, out_after))
    if waited is None:
        return Response(status_code=204)
    tracing.mark("coordinator.answer")
    return results_page(coord, waited, -1, out_after, info, v["handoff"], maps_locked(request))


#: What ``GET /v1/jobs?state=`` may pick.
JOB_STATES = ("active", "finished", "cancelled")


@route(protocol.JOBS, ["GET"], action="list jobs", roles=people.READ)
async def list_jobs(request: Request) -> Response:
    coord = ctx(request).coord
    limit = int(query_float(request, "limit", 20, 1, 1000))
    return JSONResponse([job_view(coord, jid, with_tasks=False)
                         for jid in listed_job_ids(request, coord, limit)])


def listed_job_ids(request: Request, coord: Coordinator, limit: int) -> list[str]:
    """The ``limit`` newest jobs' ids that a listing's query picks: ``before=JOB_ID``
    (the next page: jobs older than that one, the last of the page before), ``owner=NAME``
    (``admin``: also the jobs from before people), ``state=active|finished|cancelled``.
    400 for a malformed parameter or a ``before`` job this coordinator does not hold."""
    q = request.query_params
    before = None
    jid = query_id(request, "before", "query parameter 'before': job id")
    if jid is not None:
        found = coord.store.job_created(jid)
        if found is None:
            raise bad(f"query parameter 'before': no job {jid} here (it may have been purged)")
        before = (found, jid)
    owner = q.get("owner")
    if owner is not None and not people.NAME_RE.match(owner):
        raise bad(f"query parameter 'owner' must be a person's name (1 to 64 letters, digits "
                  f"and . _ @ -), not {owner[:80]!r}")
    state = query_choice(request, "state", JOB_STATES, None)
    return coord.store.recent_job_ids(limit, before=before, owner=owner, state=state,
                                      unowned=owner == people.MAIN_PERSON)


@route(protocol.JOB, ["GET"], action="read job status", roles=people.READ)
async def job_status(request: Request) -> Response:
    jid = path_id(request, "jid", "job id")
    view = job_view(ctx(request).coord, jid, with_tasks=True)
    if view is None:
        raise UnknownJob(jid)
    if not who_of(request).may_touch(view["owner"]):
        # Someone else's job: its shape and states, not its error texts (they may
        # quote the arguments), nor those of its tasks' earlier attempts.
        view["tasks"] = [people.task_outline(t) for t in view["tasks"]]
    return JSONResponse(view)


@route(protocol.JOB_RESULTS, ["GET"], action="read results", roles=people.READ, hot=True)
async def results(request: Request) -> Response:
    coord = ctx(request).coord
    jid = path_id(request, "jid", "job id")
    after = int(query_float(request, "after", -1, -1, 1e15))
    wait = query_float(request, "wait", 0, 0, LONG_POLL_MAX_S)
    raw_after = request.query_params.get("out_after")
    out_after = None if raw_after is None else int(query_float(request, "out_after", -1, -1, 1e15))
    owned(request, jid, "read the results of")
    if jid not in coord.jobs:
        row = coord.store.job_row(jid)
        if row is None:
            raise UnknownJob(jid)
        if row["state"] == "cancelled":  # e.g. its caller went unheard for too long (.callers)
            raise JobReleased(jid, f"job {jid} was cancelled and released; `gpumesh status "
                                   f"{jid}` says why")
        raise JobReleased(jid, f"job {jid}'s results were released: collected by its caller, "
                               f"or let go (its caller gave up, or went unheard for the "
                               f"coordinator's GPUMESH_CALLER_TIMEOUT)")
    if request.query_params.get("caller") == "1":  # the waiting call, not a status read
        coord.callers.heard(coord, (jid,))
    # closed=1: a caller that does not yet know its job waits on owner-closed workers only
    # (a submit that did not wait, an .imap) hears it at once, not after a long poll; it
    # then polls without it (else each poll would answer at once while they stay closed).
    if wait and request.query_params.get("closed") == "1" and views.closed_for(coord, jid):
        wait = 0
    job = await until_disconnect(request, coord.wait_results(jid, after, wait, out_after))
    if job is None:
        return Response(status_code=204)
    return results_page(coord, job, after, out_after, {}, request.query_params.get("handoff") == "1",
                        maps_locked(request))


def results_page(coord: Coordinator, job, after: int, out_after: int | None, extra: dict,
                 by_path: bool = False, locked: bool = False) -> Response:
    """Frames: JSON (results, counts, output chunks) + result payloads + output bytes.
    ``by_path`` (the caller shares this machine): a result the store keeps as a file is
    named by ``refs: {"result": {"kind": "store", "path", "size"}}`` (the path relative
    to the blob directory; see :mod:`gpumesh.payloadref`) instead of sent. ``locked``:
    the caller maps such files under locks, so they may go to the handoff pool once
    released (:meth:`~gpumesh.coordinator.store.Store.note_readers`)."""
    items: list[dict[str, Any]] = []
    parts: list[Part] = []
    budget = RESULT_PAGE_BYTES
    for t in coord.store.results_after(job.id, after, RESULT_PAGE_COUNT):
        size = 0 if by_path and t.result_file is not None else t.result_size
        if parts and size > budget:
            break
        budget -= size
        items.append({"index": t.idx, "task_id": t.id, "state": t.state, "seq": t.seq,
                      "worker": t.worker_id, "error": t.error,
                      "has_payload": t.result is not None or t.result_file is not None})
        if t.result is not None:
            parts.append(Part(t.result))
        elif t.result_file is not None and by_path:
            items[-1]["has_payload"] = False
            ref: dict[str, Any] = {"kind": "store", "path": t.result_file}
            if t.result_size is not None:
                ref["size"] = t.result_size
            items[-1][payloadref.REFS] = {"result": ref}
            # The key before refs, for a caller from before it: drop it in the next release.
            items[-1]["file"] = t.result_file
            coord.store.note_readers(job.id, "result", locked)
        elif t.result_file is not None:
            parts.append(Part(path=coord.store.file_path(t.result_file), size=t.result_size))
            coord.store.note_readers(job.id, "result", False)
    able = coord.able_workers(job)
    meta = dict(extra, results=items, n_tasks=job.n_tasks, n_final=job.n_final,
                state=job.state, workers_alive=len(coord.alive_workers()), workers_able=able)
    # Paused or out-of-hours workers are alive but lend nothing: a caller whose pending
    # tasks only they could run hears why it waits (protocol.ResultPage.workers_closed).
    closed = views.closed_counts(coord, job.id) if able else None
    if closed:
        meta["workers_closed"] = closed
    if out_after is not None:  # the caller also wants what tasks printed
        chunks, skipped = coord.output.since(job.id, out_after)
        meta["output"] = [{"seq": c.seq, "task_id": c.task_id, "index": c.index,
                           "stream": c.stream, "worker": c.worker} for c in chunks]
        meta["output_skipped"] = skipped
        parts += [Part(c.data) for c in chunks]
    return frames_response(meta, parts)


@route(protocol.JOB_LOGS, ["GET"], action="read logs", roles=people.READ)
async def job_logs(request: Request) -> Response:
    """Each task's kept stdout and stderr (text, invalid UTF-8 replaced)."""
    coord = ctx(request).coord
    jid = path_id(request, "jid", "job id")
    task = query_id(request, "task", "task id")
    owned(request, jid, "read the output of")
    rows = coord.store.task_rows(jid)
    if not rows and not coord.store.job_exists(jid):
        raise UnknownJob(jid)
    out = []
    for t in rows:
        if task is not None and t["id"] != task:
            continue
        attempts = views.attempt_logs(coord, jid, t)
        out.append({"id": t["id"], "index": t["index"], "state": t["state"],
                    "stdout": "".join(a["stdout"] for a in attempts),
                    "stderr": "".join(a["stderr"] for a in attempts),
                    "attempts": attempts})
    if task is not None and not out:
        raise HTTPError(404, ErrorCode.UNKNOWN_TASK, f"job {jid} has no task {task}")
    return JSONResponse({"job_id": jid, "tasks": out})


@route(protocol.JOBS_RELEASE, ["POST"], action="release jobs")
async def release_many(request: Request) -> Response:
    """Release several collected jobs in one request (the caller batches them)."""
    coord = ctx(request).coord
    jobs = RELEASE_JOBS.read(await json_body(request))["jobs"]
    who = who_of(request)
    owners = coord.store.job_owners(list(dict.fromkeys(jobs)))
    for jid, owner in owners.items():
        if not who.may_touch(owner):
            raise not_yours(jid, owner, who, "release")
    # Unknown ids are skipped (retention got there first): ``owners`` holds the others.
    coord.release(*owners)
    return JSONResponse({"released": len(owners)})


@route(protocol.JOBS_ALIVE, ["POST"], action="keep jobs alive")
async def keep_alive(request: Request) -> Response:
    """The caller still waits on these jobs (its keepalive, :mod:`..callers`). Ids of
    jobs that are gone, or that are not function jobs, are skipped: ``alive`` counts the
    others."""
    coord = ctx(request).coord
    jobs = list(dict.fromkeys(ALIVE_JOBS.read(await json_body(request))["jobs"]))
    who = who_of(request)
    for jid, owner in coord.store.job_owners(jobs).items():
        if not who.may_touch(owner):
            raise not_yours(jid, owner, who, "keep alive")
    return JSONResponse({"alive": coord.callers.heard(coord, jobs)})


@route(protocol.JOB_RELEASE, ["POST"], action="release jobs")
async def release(request: Request) -> Response:
    jid = path_id(request, "jid", "job id")
    owned(request, jid, "release")
    ctx(request).coord.release(jid)
    return JSONResponse({"released": True})


@route(protocol.JOB_CANCEL, ["POST"], action="cancel jobs")
async def cancel(request: Request) -> Response:
    coord = ctx(request).coord
    jid = path_id(request, "jid", "job id")
    owned(request, jid, "cancel")
    if jid not in coord.jobs:  # finished a while ago: only the store still has it
        row = coord.store.job_row(jid)
        if row is None:
            raise UnknownJob(jid)
        return JSONResponse({"cancelled": 0, "state": row["state"]})
    n = coord.cancel(jid)
    return JSONResponse({"cancelled": n, "state": coord.jobs[jid].state})


@route(protocol.JOB_RETRY, ["POST"], action="retry jobs")
async def retry(request: Request) -> Response:
    jid = path_id(request, "jid", "job id")
    owned(request, jid, "retry")
    return JSONResponse({"retried": ctx(request).coord.retry(jid)})


# ---------------------------------------------------------------- views ------------
def job_view(coord: Coordinator, job_id: str, with_tasks: bool) -> dict | None:
    """A job as ``GET /v1/jobs/{id}`` answers it (None for an unknown job)."""
    row = coord.store.job_row(job_id)
    if row is None:
        return None
    counts = coord.store.task_counts(job_id)
    view = {"id": row["id"], "name": row["name"], "kind": row["kind"], "state": row["state"],
            "n_tasks": row["n_tasks"], "counts": counts, "created": row["created"],
            # released: the results were collected (or let go) and their payloads deleted
            "released": bool(row["released"]),
            "owner": row.get("owner") or people.MAIN_PERSON,
            "result_format": (row["meta"] or {}).get("result_format", "pickle")}
    if with_tasks:
        view["tasks"] = coord.store.task_rows(job_id)
    preempted = coord.store.preempted_count(job_id)
    if preempted:
        view["preempted"] = preempted
    waiting = coord.waiting_reason(job_id)
    if waiting:
        view["waiting"] = waiting
    return view
