"""HTTP routes of the coordinator: validate at the boundary, then call :class:`Coordinator`.

Every route but ``GET /v1/health``, ``GET /v1/openapi.json`` and ``GET /v1/dist/...`` needs
``Authorization: Bearer <token>`` (see :mod:`.auth`: roles, lockout). Errors are JSON
``{"error": code, "message": text}`` with a 4xx status naming what was wrong; a malformed
request never changes state. Payload bodies are the ``frames`` layout of
:mod:`gpumesh.wire` (``application/x-gpumesh-frames``), never base64 in JSON.

This module only wires the app: the routes are module-level functions in
:mod:`.routes` (one module per resource, listed there), their JSON bodies are declared in
:mod:`.schemas` (which drives validation and :mod:`.openapi`), request and response
bodies are read and written by :mod:`.bodies`, and the errors that carry their status
(:mod:`.model`, :class:`~.auth.AuthRefused`) are answered by the handlers here.

Routes by module (paths are :mod:`gpumesh.protocol`'s)::

    routes.meta
    GET    /v1/health                          liveness (no auth)
    GET    /v1/openapi.json                    this API as OpenAPI 3.1 (no auth; :mod:`.openapi`)
    GET    /v1/dist/gpumesh-<version>-py3-none-any.whl  this gpumesh's wheel (no auth)
    routes.workers
    GET    /v1/workers                         the pool
    POST   /v1/workers                         register         {hostname, ..., slots, id?}
    POST   /v1/workers/{id}/heartbeat          keep alive       {running: [task ids]}
    GET    /v1/workers/{id}/session            the worker's pulse (held open; closing = gone)
    DELETE /v1/workers/{id}                    leave; leases are re-queued at once
    POST   /v1/workers/{id}/lease              long-poll for up to {slots} tasks
    routes.tasks
    POST   /v1/tasks/{id}/result?lease=L       a result, fenced by lease id
    POST   /v1/tasks/{id}/release?lease=L      hand a running task back (preempted)
    POST   /v1/tasks/{id}/output?lease=L       what a running task printed
    routes.blobs
    GET    /v1/handoff                         same-machine payload files (gpumesh.handoff)
    HEAD   /v1/blobs/{sha256}                  is this function blob here?
    GET    /v1/blobs/{sha256}                  download it
    PUT    /v1/blobs/{sha256}                  upload a function blob (hash verified)
    routes.jobs
    POST   /v1/jobs                            submit a job with all its arguments
    GET    /v1/jobs                            recent jobs
    GET    /v1/jobs/{id}                       status, counts and tasks
    GET    /v1/jobs/{id}/results?after=S&wait=W[&out_after=O]
                                               long-poll for results with seq > S (and
                                               task output with seq > O)
    GET    /v1/jobs/{id}/logs[?task=T]         what each task printed (kept per task)
    POST   /v1/jobs/release                    release several jobs {"jobs": [...]}
    POST   /v1/jobs/{id}/release               the caller holds every result
    POST   /v1/jobs/{id}/cancel                cancel what has not finished
    POST   /v1/jobs/{id}/retry                 re-queue its failed tasks (script jobs)
    routes.tokens
    GET    /v1/tokens                          the people's tokens (admin; never a token)
    POST   /v1/tokens                          add one {name, role, max_running} (admin)
    DELETE /v1/tokens/{name}                   revoke it at once (admin)
    metrics, ui (leaves, own modules)
    GET    /metrics                            Prometheus text
    GET    /ui[...]                            the dashboard

Who may call what is :mod:`.people`'s: each route names the roles it admits, and the
job routes that read results or output, cancel, retry or release admit only the job's
owner (or an admin).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from ..limits import HANDOFF_TTL_S, PURGE_INTERVAL_S, RETENTION_S, SWEEP_INTERVAL_S
from . import diskfull, dist, people
from .auth import Authenticator, AuthRefused
from .bodies import FRAMES, Part, frames_response  # noqa: F401  (the app's body helpers)
from .core import Coordinator
from .model import CoordinatorError, HTTPError  # noqa: F401
from .routes import Context, endpoint
from .routes.base import closing, error, ordered
from .routes.meta import bad_method, not_found

log = logging.getLogger("gpumesh.coordinator")


async def _refused(request: Request, exc: Exception) -> Response:
    """Every :class:`CoordinatorError` a route raises, answered the one way."""
    assert isinstance(exc, CoordinatorError)
    return error(exc.status, exc.code, exc.message, closing(request))


async def _auth_refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, AuthRefused)
    headers = {"retry-after": str(int(exc.retry_after) + 1)} if exc.retry_after else None
    return error(exc.status, exc.code, exc.message, closing(request, headers))


def create_app(coord: Coordinator, token: str, *, worker_token: str | None = None,
               safe_mode: bool = False, loopback_bound: bool = False,
               authenticator: Authenticator | None = None,
               metrics_token: str | None = None) -> Starlette:
    """Build the ASGI app around ``coord``.

    ``token``: the main bearer token (everything allowed); ``worker_token``: an optional
    token that may only act as a worker. ``safe_mode``: refuse function (pickle) jobs.
    ``loopback_bound``: the server listens on loopback only (see :mod:`.auth` for what
    that exempts). ``metrics_token``: a token that may read ``GET /metrics`` only (see
    :mod:`.metrics`). Only hashes of the tokens are kept.
    """
    auth = authenticator or Authenticator(token, worker_token, loopback_bound=loopback_bound)
    del token, worker_token

    def caps_changed(reg: people.People) -> None:
        coord.max_running.clear()
        coord.max_running.update(reg.caps())
        coord._wake_idle()  # a raised cap may let a waiting person start now
    if auth.people is None:
        auth.people = people.People(coord.store, on_change=caps_changed)
    caps_changed(auth.people)

    eps = ordered()
    routes = [Route(ep.path, endpoint(ep), methods=list(ep.methods)) for ep in eps]
    from . import metrics, ui  # leaves: GET /metrics, the dashboard at /ui
    from .usage import UsageCache
    usage = UsageCache(coord.store)  # per-person usage: one cached value for both
    routes.append(metrics.route(coord, auth, usage, metrics_token))
    routes.extend(ui.routes(coord, auth, usage))
    del metrics_token

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.ensure_future(_sweeper(coord))
        try:
            yield
        finally:
            task.cancel()

    app = _App(routes=routes, lifespan=lifespan,
               exception_handlers={CoordinatorError: _refused, AuthRefused: _auth_refused,
                                   404: not_found, 405: bad_method})
    app.hot = [(r, r.endpoint) for r, ep in zip(routes, eps) if ep.hot]
    app.state.gpumesh = Context(coord, auth, auth.people, safe_mode,
                                dist.WheelCache(coord.store.dir / "dist"))
    return app


class _App(Starlette):
    """Starlette, with a short way in for the hot routes (a request or two per task).

    A request whose method and path a hot route matches fully goes straight to that
    route's function (:func:`.routes.endpoint`: the same version, token and role checks,
    the same handler and clean-up), and its refusals to the same handlers as above.
    What it skips is Starlette's per-request machinery around them: two middlewares,
    the router's scan of every route, and three wrappers around each ``send``, which
    on this path add nothing (the route catches every other exception itself). Every
    other request, and one a hot route matches only by path (a 405), takes the whole
    stack as before."""

    hot: list[tuple[Route, Callable[[Request], Awaitable[Response]]]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for route, run in self.hot:
                match, child = route.matches(scope)
                if match is Match.FULL:
                    scope["app"] = self
                    scope.update(child)
                    request = Request(scope, receive, send)
                    try:
                        response = await run(request)
                    except CoordinatorError as e:
                        response = await _refused(request, e)
                    except AuthRefused as e:
                        response = await _auth_refused(request, e)
                    await response(scope, receive, send)
                    return
                if match is not Match.NONE:
                    break
        await super().__call__(scope, receive, send)


async def _sweeper(coord: Coordinator) -> None:
    """Expire workers and leases every SWEEP_INTERVAL_S; purge old jobs and stale
    handoff files every PURGE_INTERVAL_S, in a task of its own that yields between its
    batches (Coordinator.purge_in_slices), so the sweeps and every request go on meanwhile."""
    last_purge = 0.0
    purging: asyncio.Task | None = None
    try:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                coord.sweep()
                now = time.time()
                if now - last_purge > PURGE_INTERVAL_S and (purging is None or purging.done()):
                    last_purge = now
                    purging = asyncio.create_task(_purge(coord, now))
            except Exception as e:
                if not diskfull.note(coord.store.full, e):  # (a full disk: logged once per spell)
                    log.exception("sweep failed")
    finally:
        if purging is not None:
            purging.cancel()  # (between two batches: each one stands alone)


async def _purge(coord: Coordinator, now: float) -> None:
    try:
        await coord.purge_in_slices(now - RETENTION_S)
        coord.store.sweep_handoff(now - HANDOFF_TTL_S)
    except Exception as e:
        if not diskfull.note(coord.store.full, e):
            log.exception("purge failed")
