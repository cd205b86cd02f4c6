"""The people's tokens (admin only): list them, give a person one, revoke it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import people
from ..bodies import json_body
from ..model import HTTPError
from ..schemas import NEW_TOKEN
from .base import ctx, route


@route("/v1/tokens", ["GET"], action="list tokens", roles=people.ADMIN)
async def list_tokens(request: Request) -> Response:
    return JSONResponse(ctx(request).people.list())


@route("/v1/tokens", ["POST"], action="add tokens", roles=people.ADMIN)
async def add_token(request: Request) -> Response:
    """A new person's token, drawn here and answered once (only its digest is kept)."""
    from ...config import generate_token
    v = NEW_TOKEN.read(await json_body(request))
    token = generate_token()
    try:
        row = ctx(request).people.add(v["name"], v["role"], v["max_running"], token)
    except ValueError as e:
        code = "exists" if "already has a token" in str(e) else "bad_request"
        raise HTTPError(409 if code == "exists" else 400, code, str(e)) from None
    return JSONResponse(dict(row, token=token))


@route("/v1/tokens/{name}", ["DELETE"], action="revoke tokens", roles=people.ADMIN)
async def revoke_token(request: Request) -> Response:
    name = request.path_params["name"]
    if not ctx(request).people.revoke(name):
        raise HTTPError(404, "unknown_token", f"nobody is called {name[:80]!r} here")
    return JSONResponse({"revoked": name})
