"""The pool's routes: register, heartbeat, the pulse session, leave, and the lease
long-poll (whose answer, a frames body of tasks and their arguments, is also what a
result post answers with: :func:`lease_response`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ... import availability, payloadref, protocol, tracing, versions
from ..._version import __version__
from ...protocol import ErrorCode
from ...limits import HEARTBEAT_INTERVAL_S, SESSION_PING_S, WORKER_TTL_S
from .. import people
from ..bodies import Part, frames_response, json_body
from ..core import Coordinator
from ..model import HTTPError, Job
from ..schemas import HEARTBEAT, LEASE_REQUEST, REGISTRATION
from .base import base_url, ctx, maps_locked, path_id, route, until_disconnect

#: What this coordinator offers beyond one result per request (see protocol.FEATURE_*).
FEATURES: tuple[str, ...] = (protocol.FEATURE_RESULT_BATCH,)
#: Registration fields kept as the worker reports them (validated by REGISTRATION).
_INFO = ("hostname", "user", "device", "device_name", "platform", "python", "version", "cpu",
         "gpus", "cores", "ram_mb", "score", "slot_list", "owner", "gpu_states")
#: Fields kept only when given (null: keep what there is).
_IF_GIVEN = ("scores", "packages", "allow_installs", "gpu_free_mb", "gpu_telemetry")


def _info(v: dict, keys: tuple[str, ...]) -> dict:
    info = {k: v[k] for k in keys if k in v}
    info.update({k: v[k] for k in _IF_GIVEN if v.get(k) is not None})
    return info


@route(protocol.WORKERS, ["GET"], action="list the workers", roles=people.READ)
async def list_workers(request: Request) -> Response:
    coord = ctx(request).coord
    return JSONResponse([coord.worker_view(w) for w in coord.workers.values()])


@route(protocol.WORKERS, ["POST"], worker=True, action="join as a worker")
async def register(request: Request) -> Response:
    v = REGISTRATION.read(await json_body(request))
    if v.get("version", __version__) != __version__:  # (what its User-Agent did not say)
        raise HTTPError(409, ErrorCode.VERSION_MISMATCH, versions.refusal(
            "worker", str(v["version"])[:40], __version__, base_url(request)))
    info = _info(v, _INFO)
    info.setdefault("score", 0.0)
    w = ctx(request).coord.register(info, v["id"], v["slots"])
    return JSONResponse({"id": w.id, "heartbeat_s": HEARTBEAT_INTERVAL_S, "ttl_s": WORKER_TTL_S,
                         "version": __version__, "features": list(FEATURES)})


@route(protocol.WORKER_HEARTBEAT, ["POST"], worker=True, action="act as a worker")
async def heartbeat(request: Request) -> Response:
    wid = path_id(request, "wid", "worker id")
    v = HEARTBEAT.read(await json_body(request))
    info = _info(v, ("score", "owner", "gpu_states"))
    coord = ctx(request).coord
    w = coord.workers.get(wid)
    before = availability.closed_slots(w.info, w.slot_list) if w is not None else set()
    answer = coord.heartbeat(wid, v["running"], info, receiving=bool(v["receiving"]))
    if w is not None and availability.closed_slots(w.info, w.slot_list) - before:
        _wake_waiting_callers(coord)
    return JSONResponse(answer)


def _wake_waiting_callers(coord: Coordinator) -> None:
    """A worker's owner just closed some of its slots (a pause, the end of its hours, a
    busy GPU): callers long-polling jobs with pending tasks get their page now, which
    says when they wait for closed workers only, not at the end of their long-poll."""
    for job in coord.jobs.values():
        if job.waiters and coord.queue.pending(job.id):
            job.notify()


@route(protocol.WORKER_SESSION, ["GET"], worker=True, action="act as a worker")
async def session(request: Request) -> Response:
    """The worker's pulse: an open response that only ends when either side goes.
    A worker process that dies closes its sockets at once, so its tasks are re-queued
    in milliseconds instead of after the heartbeat TTL."""
    coord = ctx(request).coord
    wid = path_id(request, "wid", "worker id")
    sid = coord.session_opened(wid)

    worker = coord.workers[wid]
    wake = worker.wake = asyncio.Event()

    async def pulse() -> AsyncIterator[bytes]:
        try:
            yield b"open\n"
            while not coord.closing:
                try:
                    await asyncio.wait_for(wake.wait(), SESSION_PING_S)
                except asyncio.TimeoutError:
                    yield b"ping\n"
                    continue
                wake.clear()
                lines, worker.outbox = worker.outbox, []
                if lines:
                    yield ("\n".join(lines) + "\n").encode()
        finally:
            coord.session_closed(wid, sid)
    return StreamingResponse(pulse(), media_type="text/plain")


@route(protocol.WORKER, ["DELETE"], worker=True, action="act as a worker")
async def deregister(request: Request) -> Response:
    wid = path_id(request, "wid", "worker id")
    return JSONResponse({"requeued": ctx(request).coord.deregister(wid)})


@route(protocol.WORKER_LEASE, ["POST"], worker=True, hot=True, action="act as a worker")
async def lease(request: Request) -> Response:
    coord = ctx(request).coord
    wid = path_id(request, "wid", "worker id")
    v = LEASE_REQUEST.read(await json_body(request))
    grants = await until_disconnect(request, coord.lease(wid, v["slots"], v["wait"], v["free"]))
    return lease_response(coord, grants or [], v["handoff"], maps_locked(request))


def lease_response(coord: Coordinator, grants, by_path: bool = False, locked: bool = False,
                   extra: dict | None = None) -> Response:
    """Frames: JSON ``{"tasks": [...]}`` (plus ``extra``'s keys) then each task's argument payload.
    ``by_path`` (the worker shares this machine): arguments the store keeps as files
    travel as ``refs: {"args": {"kind": "store", "path"}}`` (the path relative to the blob
    directory; see :mod:`gpumesh.payloadref`) and an empty frame. ``locked``: the worker
    (its agent and task processes) maps such files under locks, so they may go to the
    handoff pool once their job is released (see
    :meth:`~gpumesh.coordinator.store.Store.note_readers`); files sent as bytes never do."""
    if grants:
        tracing.mark("coordinator.grant")
    tasks, parts, files = [], [], {}
    args = coord.store.tasks_args([g.task_id for g in grants]) if grants else {}
    fields: dict[str, tuple[dict, dict]] = {}  # job id -> its keys (before, after "slot")
    for g in grants:
        inline, fname = args[g.task_id]
        if fname is None:
            parts.append(Part(inline))
        elif by_path:  # same machine: the worker maps the file itself
            files[g.task_id] = fname
            parts.append(Part(b""))
            coord.store.note_readers(g.job_id, "args", locked)
        else:
            path = coord.store.file_path(fname)
            parts.append(Part(path=path, size=path.stat().st_size))
            coord.store.note_readers(g.job_id, "args", False)  # (streamed from it after this)
        if g.job_id not in fields:  # a queue's grants are mostly of one job: once each
            fields[g.job_id] = _job_fields(coord.jobs[g.job_id])
        before, after = fields[g.job_id]
        tasks.append({"task_id": g.task_id, "job_id": g.job_id, "index": g.index,
                      "lease_id": g.lease_id, "attempt": g.attempt, **before, "slot": g.slot,
                      **after})
        if g.task_id in files:
            tasks[-1][payloadref.REFS] = {"args": {"kind": "store", "path": files[g.task_id]}}
            # The key before refs, for a worker from before it: drop it in the next release.
            tasks[-1]["args_file"] = files[g.task_id]
    head = {"tasks": tasks, **(extra or {})}
    if not grants:
        return frames_response(head, parts)
    leases = [(g.task_id, g.lease_id) for g in grants]
    # A lease counts as delivered only once its whole answer has left; one whose answer
    # broke off goes back to the queue at once (see Coordinator.lease_delivered).
    return frames_response(head, parts,
                           on_sent=lambda ok: coord.lease_delivered(leases, ok))


def _job_fields(job: Job) -> tuple[dict, dict]:
    """The keys a grant of ``job`` carries that are the same for all its tasks, as two
    dicts: those before the grant's ``slot`` and those after it (the wire's key order)."""
    head = {"kind": job.kind, "fn": job.fn_hash, "timeout": job.meta.get("timeout"),
            "name": job.meta.get("name", "")}
    tail = {"result_format": job.meta.get("result_format", "pickle"),
            "isolation": job.meta.get("isolation", "task")}
    if job.require.requires:  # built into a task environment if the worker lacks them
        tail["requires"] = list(job.require.requires)
    if job.meta.get("script"):  # a script job's file name, as submitted
        tail["script"] = job.meta["script"]
    return head, tail
