"""Routes about the coordinator itself: health, its API description, its wheel; and the
answers for requests that match no route."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ... import protocol
from ..._version import __version__
from ...protocol import ErrorCode
from .. import dist
from ..model import HTTPError
from .base import base_url, ctx, error, route

log = logging.getLogger("gpumesh.coordinator")


@route(protocol.HEALTH, ["GET"], auth_required=False)
async def health(request: Request) -> Response:
    # caller_timeout: how often a caller must be heard from (its keepalive's pace).
    # safe_mode: so that `gpumesh doctor` can say function calls are refused here, even
    # with no worker (where it would otherwise say they run locally); it says no more
    # than the 403 every function job gets, and tells an attacker only that pickles
    # are closed to them.
    c = ctx(request)
    return JSONResponse({"ok": True, "version": __version__,
                         "caller_timeout": c.coord.callers.timeout, "safe_mode": c.safe_mode})


@route(protocol.OPENAPI, ["GET"], auth_required=False)
async def openapi(request: Request) -> Response:
    from ..openapi import spec
    return JSONResponse(spec())


@route(protocol.DIST_FILE, ["GET"], auth_required=False)
async def wheel(request: Request) -> Response:
    """The wheel of this gpumesh, for other machines to install (no token: public code)."""
    name = request.path_params["name"]
    if name != dist.wheel_name():
        raise HTTPError(404, ErrorCode.NOT_FOUND, f"no file {name[:100]!r} here: this coordinator "
                                          f"serves {dist.wheel_name()} (the gpumesh it runs)")
    try:
        data = await asyncio.to_thread(ctx(request).wheels.get)
    except (dist.DistUnavailable, OSError) as e:
        log.warning("cannot serve the wheel: %s", e)
        raise HTTPError(503, ErrorCode.DIST_UNAVAILABLE, f"cannot make the wheel: {e}") from None
    return Response(data, media_type="application/zip",
                    headers={"content-disposition": f'attachment; filename="{name}"'})


async def not_found(request: Request, exc: Exception) -> Response:
    if request.url.path.startswith("/api/"):  # PyPI's other gpumesh (3.x) speaks /api/...
        return other_project(request)
    return error(404, ErrorCode.NOT_FOUND, f"no route {request.method} {request.url.path}")


async def bad_method(request: Request, exc: Exception) -> Response:
    return error(405, ErrorCode.METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {request.url.path}")


def other_project(request: Request) -> Response:
    """An answer for the unrelated gpumesh 3.x on PyPI, in the shape its workers relay.

    Its worker first probes ``GET /api/workers`` and gives up with a network-sounding
    error on anything but a 200, then registers, and prints the ``error`` of a 426 answer
    as the reason. So the probe gets an empty list (no data of ours) and every other
    request the 426 with our one line."""
    line = (f"this is not the gpumesh this coordinator runs: PyPI's 'gpumesh' is another "
            f"project (with another protocol), and the coordinator at {base_url(request)} "
            f"runs gpumesh {__version__}; install it on this machine with: "
            f"{dist.install_command(base_url(request))}")
    if request.method == "GET" and request.url.path == "/api/workers":
        return JSONResponse({"workers": [], "error": line})
    return JSONResponse({"error": line, "message": line}, status_code=426)
