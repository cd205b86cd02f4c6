"""Payload storage: function blobs by their SHA-256, and where a sender on the
coordinator's machine may hand payloads off as files (:mod:`gpumesh.handoff`)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ... import protocol
from ...limits import MiB
from ...protocol import ErrorCode
from .. import people
from ..bodies import read_body
from ..schemas import bad, is_sha256
from .base import ctx, error, route


@route(protocol.HANDOFF, ["GET"], roles=people.CALLER_AND_WORKER,
       action="submit jobs")  # (a caller's probe before its first submit; a worker's after joining)
async def handoff_dirs(request: Request) -> Response:
    """Where a sender on this machine may leave payload files, and where the store's
    payload files are (see :mod:`gpumesh.handoff`)."""
    store = ctx(request).coord.store
    return JSONResponse({"blob_dir": str(store.blob_dir.resolve()),
                         "handoff_dir": str(store.handoff_dir.resolve()),
                         "nonce": store.handoff_nonce})


def _blob_name(request: Request) -> str:
    h = request.path_params["h"]
    if not is_sha256(h):
        raise bad("blob name must be a sha256 hex digest")
    return h


@route(protocol.BLOB, ["HEAD", "GET"], roles=people.CALLER_AND_WORKER,
       action="submit jobs")  # (a caller asks before it uploads its function)
async def get_blob(request: Request) -> Response:
    h = _blob_name(request)
    path = ctx(request).coord.store.blob_file(h)
    if path is None:
        return error(404, ErrorCode.UNKNOWN_BLOB, f"no blob {h}")
    size = path.stat().st_size
    if request.method == "HEAD":
        return Response(status_code=200, headers={"content-length": str(size)})

    async def body() -> AsyncIterator[bytes]:
        with open(path, "rb") as fh:
            while chunk := fh.read(4 * MiB):
                yield chunk
    return StreamingResponse(body(), media_type="application/octet-stream",
                             headers={"content-length": str(size)})


@route(protocol.BLOB, ["PUT"], action="upload function blobs")
async def put_blob(request: Request) -> Response:
    h = _blob_name(request)
    body = await read_body(request)
    if hashlib.sha256(body).hexdigest() != h:
        raise bad("blob content does not match its sha256 name")
    ctx(request).coord.store.put_blob(h, [body])
    return JSONResponse({"stored": True})


