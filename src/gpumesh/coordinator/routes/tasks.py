"""What a worker sends about a task it holds: the result, what it printed, or the task
itself handed back. Each is fenced by ``?lease=``: a post under a lease that is no longer
current is refused (409 ``stale_lease``) and changes nothing."""

from __future__ import annotations

import asyncio
import re
import sqlite3

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ... import protocol, tracing
from ...limits import OUTPUT_BODY_BYTES
from ..bodies import frames, frames_streamed, json_body, read_body, take_handoffs
from ..model import ResultNotStored, StaleLease
from ..schemas import HAND_BACK, RESULT_META, bad
from .base import ctx, lease_of, maps_locked, path_id, route
from .workers import lease_response


@route(protocol.TASK_RESULT, ["POST"], worker=True, hot=True, action="act as a worker")
async def result(request: Request) -> Response:
    tracing.mark("coordinator.result")
    coord = ctx(request).coord
    tid = path_id(request, "tid", "task id")
    lease_id = lease_of(request)
    meta, parts = await frames_streamed(request, coord.store)
    v = RESULT_META.read(meta)
    if v["status"] == "ok" and not parts:
        raise bad("an ok result needs a payload frame")
    parts = take_handoffs(request, v["handoff_files"], parts, coord.store, v["refs"])
    payload = parts[0] if parts else None
    # ?next=1: the worker's slot is free again; hand it the next task in the same
    # round trip instead of making it come back with a lease request.
    want_next = request.query_params.get("next") == "1"
    slot = request.query_params.get("slot") if want_next else None
    if slot is not None and not (re.fullmatch(r"[0-9]{1,4}", slot) and int(slot) < 1024):
        raise bad("query parameter 'slot' must be a slot id")  # (before anything is stored)
    grants = []
    coord.woke_callers = False
    try:
        with coord.atomic():  # the result and the next grant in one commit
            try:
                wid = coord.post_result(tid, lease_id, v["status"], v["error"], payload)
            except StaleLease:
                raise StaleLease(tid, "the task was re-queued or already has a result") from None
            if want_next and wid is not None:
                grants = coord.grant_now(wid, 1, None if slot is None else int(slot))
    except (OSError, sqlite3.Error) as e:
        # The commit failed: memory is as stored again (the lease holds, no grant was made).
        raise ResultNotStored(tid, e, data_dir=coord.store.dir) from e
    tracing.mark("coordinator.result_stored")
    if coord.woke_callers:
        await asyncio.sleep(0)  # the waiting caller's answer first (see routes/batch.py)
    return lease_response(coord, grants, request.query_params.get("handoff") == "1",
                          maps_locked(request))


@route(protocol.TASK_RELEASE, ["POST"], worker=True, action="act as a worker")
async def hand_back(request: Request) -> Response:
    """The worker hands a running task back (its owner's rules): re-queued as
    preempted, the attempt not counted; fenced by the lease like a result."""
    tid = path_id(request, "tid", "task id")
    lease_id = lease_of(request)
    v = HAND_BACK.read(await json_body(request))
    ctx(request).coord.hand_back(tid, lease_id, v["reason"])
    return JSONResponse({"requeued": True})


@route(protocol.TASK_OUTPUT, ["POST"], worker=True, action="act as a worker")
async def task_output(request: Request) -> Response:
    tid = path_id(request, "tid", "task id")
    lease_id = lease_of(request)
    _meta, parts = frames(await read_body(request, OUTPUT_BODY_BYTES))
    if len(parts) != 2:
        raise bad("output needs two frames: stdout, stderr")
    ctx(request).coord.post_output(tid, lease_id, bytes(parts[0]), bytes(parts[1]))
    return JSONResponse({"accepted": True})
