"""The people's tokens (admin only): list them, give a person one, revoke it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ... import protocol
from ...protocol import ErrorCode
from .. import people
from ..bodies import json_body
from ..model import HTTPError
from ..schemas import NEW_TOKEN
from .base import ctx, route


@route(protocol.TOKENS, ["GET"], action="list tokens", roles=people.ADMIN)
async def list_tokens(request: Request) -> Response:
    return JSONResponse(ctx(request).people.list())


@route(protocol.TOKENS, ["POST"], action="add tokens", roles=people.ADMIN)
async def add_token(request: Request) -> Response:
    """A new person's token, drawn here and answered once (only its digest is kept)."""
    from ...config import generate_token
    v = NEW_TOKEN.read(await json_body(request))
    token = generate_token()
    try:
        row = ctx(request).people.add(v["name"], v["role"], v["max_running"], token)
    except people.NameTaken as e:
        raise HTTPError(409, ErrorCode.EXISTS, str(e)) from None
    except ValueError as e:
        raise HTTPError(400, ErrorCode.BAD_REQUEST, str(e)) from None
    return JSONResponse(dict(row, token=token))


@route(protocol.TOKEN, ["DELETE"], action="revoke tokens", roles=people.ADMIN)
async def revoke_token(request: Request) -> Response:
    name = request.path_params["name"]
    revoked = ctx(request).people.revoke(name)
    if revoked is None:
        raise HTTPError(404, ErrorCode.UNKNOWN_TOKEN, f"nobody is called {name[:80]!r} here")
    return JSONResponse({"revoked": revoked})
