"""``POST /v1/tasks/results``: several results in one request, and a slot's queue of
grants in its answer (the ``result_batch`` feature a coordinator names at registration).

Small tasks finish faster than one request per result can carry them (in a process that
stays up, ``isolation="job"``, and in one forked per task alike): the request, the JSON
and the store's write per task cost the coordinator and the agent more CPU than the task
itself. A batch carries every
result that is ready when the worker's previous post returned, each still fenced by its
own lease (a stale one is refused alone, the others land), and its answer tops up the
queue of each slot that asked (``next``) with grants as a lease answer carries them.
"""

from __future__ import annotations

import asyncio
import sqlite3

from starlette.requests import Request
from starlette.responses import Response

from ... import protocol, tracing
from ...errors import WireError
from ..bodies import frames_streamed
from ..model import ResultNotStored, StaleLease
from ..schemas import bad, check_id
from .base import ctx, maps_locked, route
from .workers import lease_response

#: Most results one batch may carry (a worker sends what its slots finished meanwhile).
MAX_BATCH_RESULTS = 256
#: Most grants a slot's queue may ask for at once (the running task's successors).
MAX_QUEUED_GRANTS = protocol.MAX_QUEUED_GRANTS


def read_batch(meta: dict, n_frames: int) -> protocol.ResultBatch:
    """The validated batch of frame 0 (400 for any malformed field, a payload count
    that does not match the frames, or an ``ok`` result without a payload)."""
    try:
        batch = protocol.ResultBatch.from_dict(meta)
    except WireError as e:
        raise bad(str(e)) from None
    if not 1 <= len(batch.results) <= MAX_BATCH_RESULTS:
        raise bad(f"field 'results' must hold 1 to {MAX_BATCH_RESULTS} results")
    for r in batch.results:
        check_id(r.task_id, "task id")
        check_id(r.lease_id, "lease id")
        if r.status == "ok" and not r.has_payload:
            raise bad(f"result of task {r.task_id}: an ok result needs a payload frame")
    if len({r.task_id for r in batch.results}) != len(batch.results):
        raise bad("field 'results' names a task more than once")
    if sum(r.has_payload for r in batch.results) != n_frames:
        raise bad("the batch needs one payload frame per result with has_payload")
    for slot, n in (batch.next or {}).items():
        if not (0 <= slot < 1024 and 0 <= n <= MAX_QUEUED_GRANTS):
            raise bad(f"field 'next' must map slot ids (0-1023) to 0-{MAX_QUEUED_GRANTS} grants")
    if not set(batch.idle or ()) <= set(batch.next or ()):
        raise bad("field 'idle' may name only slots that field 'next' names")
    return batch


@route(protocol.TASKS_RESULTS, ["POST"], worker=True, hot=True, action="act as a worker")
async def results(request: Request) -> Response:
    tracing.mark("coordinator.result")
    coord = ctx(request).coord
    meta, parts = await frames_streamed(request, coord.store)
    batch = read_batch(meta, len(parts))
    payloads = iter(parts)
    refused, wid, grants = [], None, []
    idle = set(batch.idle or ())
    coord.woke_callers = False
    # The batch's results and its grants in one commit: the answer leaves after it, so
    # a result it acknowledges is stored, and a grant it carries is a stored lease.
    try:
        with coord.atomic():
            for r in batch.results:
                payload = next(payloads) if r.has_payload else None
                try:
                    wid = coord.post_result(r.task_id, r.lease_id, r.status, r.error, payload) or wid
                except StaleLease as e:
                    refused.append({"task_id": r.task_id, "error": protocol.ErrorCode.STALE_LEASE,
                                    "message": StaleLease(e.task_id, "the task was re-queued or "
                                                          "already has a result").message})
            if wid is not None:
                for slot, n in sorted((batch.next or {}).items()):
                    # Each grant is a lease, counted as running; only a job that keeps its
                    # process queues more behind the first (Coordinator.grant_queued).
                    grants += coord.grant_queued(wid, slot, n, idle=slot in idle)
    except (OSError, sqlite3.Error) as e:
        # The commit failed: memory is as stored again (every lease of the batch holds,
        # its grants' tasks are pending), so the worker's next post of it is accepted.
        raise ResultNotStored(batch.results[0].task_id, e, len(batch.results) - 1,
                              data_dir=coord.store.dir) from e
    tracing.mark("coordinator.result_stored")
    if coord.woke_callers:
        # A caller waits for one of these results: its answer leaves first, this
        # worker's right after it (it is delayed by one results page, not the other way).
        await asyncio.sleep(0)
    return lease_response(coord, grants, batch.handoff, maps_locked(request),
                          extra={"refused": refused})
