"""What every route shares: registration, the auth gate, the app's state, small readers.

A route is a module-level ``async def handler(request) -> Response`` registered with
:func:`route`; :func:`endpoint` wraps it with the version check, the token check and
role gate (:mod:`..auth`, :mod:`..people`), and the clean-up of a body's temporary files.
What it needs of the coordinator comes from :func:`ctx` (``request.app.state``), never
from a closure, so a route can be called in process by Starlette's ``TestClient``.

Refusals are raised, not returned: a :class:`~..model.CoordinatorError` (which carries
its status and code) or an :class:`~..auth.AuthRefused`; the app's exception handlers
(:func:`..app.create_app`) turn them into ``{"error": code, "message": text}``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ... import handoff, protocol, versions
from ..._version import __version__
from ...protocol import ErrorCode
from .. import bodies, diskfull, dist, people
from ..auth import Authenticator, AuthRefused
from ..core import Coordinator
from ..model import CoordinatorError, HTTPError, NotStored, UnknownJob
from ..schemas import bad, check_id, user_id

log = logging.getLogger("gpumesh.coordinator")

Handler = Callable[[Request], Awaitable[Response]]


@dataclass
class Context:
    """What the routes of one app share (``request.app.state.gpumesh``)."""

    coord: Coordinator
    auth: Authenticator
    people: people.People
    #: serve --safe-mode: function (pickle) jobs are refused
    safe_mode: bool
    #: this gpumesh's wheel, for other machines to install (GET /v1/dist/...)
    wheels: dist.WheelCache


def ctx(request: Request) -> Context:
    return request.app.state.gpumesh


@dataclass(frozen=True)
class Endpoint:
    """A registered route. ``roles``: who may call it (:mod:`..people`); ``action``
    names what a refused role may not do, for its 403; ``worker``: a worker's route
    (the worker token may call it, and a version refusal names the worker); ``hot``: a
    route a request per task or two reaches, tried first (see :func:`ordered`)."""

    path: str
    methods: tuple[str, ...]
    handler: Handler
    auth_required: bool = True
    worker: bool = False
    action: str = ""
    roles: frozenset[str] | None = None
    hot: bool = False

    @property
    def allowed(self) -> frozenset[str]:
        return self.roles or (people.WORKER if self.worker else people.SUBMIT)


#: Every route in registration order (the app tries them in the order of :func:`ordered`).
ENDPOINTS: list[Endpoint] = []


def route(path: str, methods: list[str], auth_required: bool = True, worker: bool = False,
          action: str = "", roles: frozenset[str] | None = None,
          hot: bool = False) -> Callable[[Handler], Handler]:
    """Register the decorated handler at ``path``. ``roles`` default: callers who may
    submit, or with ``worker`` the worker token (and admins). ``action``: what a refused
    token could not do, as the user would name their own step ("submit jobs", "join as a
    worker"); every route that needs a token has one (a test checks). Routes that need no token
    answer every gpumesh version (a caller learns ours from health, and the wheel is how
    another version gets this one); the others refuse other versions."""
    def deco(fn: Handler) -> Handler:
        ENDPOINTS.append(Endpoint(path, tuple(methods), fn, auth_required, worker, action, roles, hot))
        return fn
    return deco


def ordered() -> list[Endpoint]:
    """Every route in the order the app tries them: the ``hot`` ones first, then the
    rest in registration order. Starlette tries routes one by one, and the worker's
    result post came thirteenth. No other route matches a hot route's path (a test
    checks it), so the order changes which route answers no request."""
    return [ep for ep in ENDPOINTS if ep.hot] + [ep for ep in ENDPOINTS if not ep.hot]


def endpoint(ep: Endpoint) -> Handler:
    """The ASGI-facing function of ``ep``: the gate, the handler, the clean-up."""
    async def run(request: Request) -> Response:
        try:
            if ep.auth_required:
                try:
                    await _admit(request, ep)
                except (CoordinatorError, AuthRefused):
                    if has_body(request):  # refused before its body was read: see CLOSE
                        request.scope[CLOSE] = True
                    raise
            return await ep.handler(request)
        except (CoordinatorError, AuthRefused):
            raise  # answered by the app's exception handlers
        except Exception as e:  # a bug must not take the coordinator down
            if isinstance(e, (OSError, sqlite3.Error)):
                store = ctx(request).coord.store
                if diskfull.note(store.full, e):  # (logged once per spell)
                    raise NotStored(e, store.dir) from None  # nothing changed: 503, again later
            log.exception("error handling %s %s", request.method, request.url.path)
            return error(500, ErrorCode.INTERNAL, "internal error; see the coordinator log")
        finally:  # payload files of the body that were not stored: gone
            if bodies.INCOMING in request.scope:
                bodies.discard_incoming(request)
    run.__name__ = ep.handler.__name__
    return run


#: ``request.scope`` key: its answer ends the connection (``Connection: close``). Set when
#: a request is refused at the gate (no token, a wrong one, another role's or version's)
#: before its body was read: kept open, the connection would wait for that body (or for
#: the next request) for as long as the client pleased, a file descriptor each.
CLOSE = "gpumesh.close"


def has_body(request: Request) -> bool:
    """Whether the request says a body follows its head."""
    h = request.headers
    return "transfer-encoding" in h or h.get("content-length", "0").strip() not in ("", "0")


def closing(request: Request, headers: dict | None = None) -> dict | None:
    """``headers`` with ``Connection: close`` added when the request's answer should end
    its connection (:data:`CLOSE`)."""
    if not request.scope.get(CLOSE):
        return headers
    return {**(headers or {}), "connection": "close"}


async def _admit(request: Request, ep: Endpoint) -> None:
    check_version(request, ep.worker)
    client = request.client.host if request.client else None
    who = await ctx(request).auth.identity(client, request.headers)
    if who.role not in ep.allowed:
        raise HTTPError(403, ErrorCode.FORBIDDEN, refusal(who, ep))
    request.scope["gpumesh.who"] = who


def refusal(who: people.Identity, ep: Endpoint) -> str:
    """The 403 text for ``who``, whose role may not call ``ep``: what they tried (the
    route's ``action``, worded as the user's own step: a caller's side request such as
    the handoff probe says "submit jobs") and who can give them a token that may. Never
    ``gpumesh token list``: only the main token (or an admin's) may run it, and an admin
    is never refused here."""
    if who.role == people.ROLE_WORKER:
        return f"the worker token cannot {ep.action}; this needs the main token"
    allowed = ep.allowed
    needed = next((r for r in (people.ROLE_SUBMIT, people.ROLE_WORKER) if r in allowed), None)
    if needed is None:  # admin's work
        how = "only the main token (or an admin's) may: ask whoever holds the main token"
    else:
        how = (f"that needs a {needed} token: ask whoever holds the main token for one "
               f"(they run `gpumesh token add NAME --role {needed}`)")
    return f"{who.name}'s token ({who.role}) cannot {ep.action}; {how}"


def error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "message": message}, status_code=status, headers=headers)


def base_url(request: Request) -> str:
    """The coordinator's URL as this client reached it (what it can reach again)."""
    return str(request.base_url).rstrip("/")


#: User-Agent -> :func:`versions.parse_agent`'s answer: every request sends one, and a
#: mesh's clients send a few distinct ones (bounded, so odd ones cannot fill memory).
_parse_agent = functools.lru_cache(maxsize=256)(versions.parse_agent)


def check_version(request: Request, worker_route: bool) -> None:
    """Refuse (409 ``version_mismatch``) a gpumesh caller or worker of another version."""
    agent = _parse_agent(request.headers.get("user-agent"))
    if agent is None or agent[0] == __version__:
        return  # not gpumesh's own client (curl, a test, a proxy's probe), or ours
    role = "worker" if worker_route and request.url.path.startswith(protocol.WORKER_PREFIXES) \
        else "caller"
    raise HTTPError(409, ErrorCode.VERSION_MISMATCH,
                    versions.refusal(role, agent[0][:40], __version__, base_url(request)))


# ---------------------------------------------------------------- request readers --
def who_of(request: Request) -> people.Identity:
    return request.scope.get("gpumesh.who", people.MAIN)


def maps_locked(request: Request) -> bool:
    """Whether the requester (a caller, a worker agent and its task processes) maps
    store files under locks (gpumesh.handoff's pool)."""
    return request.headers.get(handoff.MAP_LOCKS_HEADER) == "1"


def path_id(request: Request, name: str, what: str) -> str:
    """Path parameter ``name`` as a hex id, in lower case (as ids are made and stored;
    a user may have typed one in capitals, as the CLI accepts); 400 naming ``what``
    otherwise."""
    return user_id(request.path_params[name], what)


def query_id(request: Request, name: str, what: str) -> str | None:
    """Query parameter ``name`` (None when absent) as an id a person gives, in lower case
    as :func:`path_id`'s; 400 naming ``what`` otherwise."""
    value = request.query_params.get(name)
    return None if value is None else user_id(value, what)


def lease_of(request: Request) -> str:
    """The ``?lease=`` a task route is fenced by (400 unless an id)."""
    lease_id = request.query_params.get("lease")
    if not lease_id:
        raise bad("query parameter 'lease' is missing: the lease id the task was granted under")
    check_id(lease_id, "lease id")
    return lease_id


def query_float(request: Request, name: str, default: float, lo: float, hi: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise bad(f"query parameter {name!r} must be a number") from None
    if not lo <= v <= hi:
        raise bad(f"query parameter {name!r} must be between {lo} and {hi}")
    return v


def query_choice(request: Request, name: str, choices: tuple[str, ...], default: str | None) -> str | None:
    """Query parameter ``name``, one of ``choices`` (``default`` when absent); 400 otherwise."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw not in choices:
        raise bad(f"query parameter {name!r} must be one of {', '.join(choices)}, not {raw[:40]!r}")
    return raw


def owned(request: Request, jid: str, action: str) -> None:
    """Refuse (403 ``not_yours``) unless the caller may ``action`` job ``jid``;
    404 for an unknown job."""
    coord = ctx(request).coord
    who = who_of(request)
    job = coord.jobs.get(jid)
    if job is not None:
        owner = job.owner
    else:
        found = coord.store.job_owners([jid])
        if jid not in found:
            raise UnknownJob(jid)
        owner = found[jid]
    if not who.may_touch(owner):
        raise not_yours(jid, owner, who, action)


def not_yours(jid: str, owner: str | None, who: people.Identity, action: str) -> HTTPError:
    return HTTPError(403, ErrorCode.NOT_YOURS, f"job {jid} belongs to {owner or 'admin'}: "
                                       f"{who.name} cannot {action} it")


async def until_disconnect(request: Request, work: Awaitable) -> Any:
    """Run ``work``; cancel it if the client goes away first (then return None).

    ``work`` runs in the request's own task, not in one of its own: the future a
    long-poll waits on then wakes the route itself, with no task and no ``asyncio.wait``
    between them (each cost a turn of the event loop before the answer could leave).
    The watcher cancels the route's task when the client leaves."""
    me = asyncio.current_task()
    assert me is not None
    gone = False

    async def watch():
        nonlocal gone
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                gone = True
                me.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # (the server is stopping)
        if hasattr(me, "uncancel"):  # Python 3.11+: this cancel was ours, and is handled
            me.uncancel()
        return None
    finally:
        watcher.cancel()
