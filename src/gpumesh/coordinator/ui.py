"""The dashboard at ``/ui``: the pool, the jobs and who uses what, in a browser.

A leaf over :class:`~.core.Coordinator`, the store and :mod:`.people`; nothing in the core
imports it. Its page, script and style ship in the package (``coordinator/static``): no
CDN, no external asset, so it works on a LAN with no internet and under TLS as is.

Routes (same port and TLS as the API)::

    GET  /ui                      the page (the sign-in form until a session exists)
    GET  /ui/static/{file}        app.js, app.css
    POST /ui/login                {"token": ...} -> session cookie + {"name","role","csrf"}
    POST /ui/logout
    GET  /ui/api/state            pool, recent jobs, per-person usage, who you are;
                                  ?before=JOB_ID: the next (older) page of jobs
    GET  /ui/api/jobs/{id}        one job: its counts and one page of its tasks (state,
                                  worker, duration, attempts): ?state=all|STATE&after=INDEX&limit=N
    GET  /ui/api/jobs/{id}/output what its tasks printed (owner or admin): ?after=INDEX
    POST /ui/api/jobs/{id}/cancel (owner or admin; X-CSRF-Token)
    POST /ui/api/jobs/{id}/retry  (owner or admin; X-CSRF-Token)

**Sessions.** Signing in checks the token exactly like an API request (:mod:`.auth`:
lockout included) and opens a session: a random 256-bit id in a cookie that is
``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page sends it),
scoped to the dashboard's path (no ``Path``: the browser's default, that of
``/ui/login``, also right under a proxy's path prefix) and, under TLS, ``Secure``. The token itself is never kept. A session of a
person's token ends the moment that token is revoked; every session ends after
:data:`SESSION_TTL_S`.

**CSRF.** A state-changing request must carry the session's CSRF token in an
``X-CSRF-Token`` header (a header no cross-site form can set), and an ``Origin`` header,
when the browser sends one, must be this coordinator's. Sign-in takes JSON only, which a
cross-site form cannot send.

**Escaping.** The script builds every element with ``textContent``; no user-supplied
string (job names, hostnames, output, error text) is ever parsed as HTML. A
``Content-Security-Policy`` of ``'self'`` refuses inline script as a second line.

**Big jobs.** The page polls every second, so a poll reads a bounded part of a job:
its counts (one ``GROUP BY``), one page of :data:`TASK_PAGE` tasks through the
``(job_id, idx)`` key (``next_after`` is the next page's cursor), and the output of at
most :data:`OUTPUT_PAGE` of the tasks that printed (:meth:`.output.OutputHub.printed`
knows which), never every task of the job.

**Who sees what.** Everyone signed in sees the pool, the job list (names, owners, states)
and per-person usage; a job's error texts, tracebacks and output only its owner or an
admin (as the API). A ``view`` session has no cancel or retry; a ``worker`` token cannot
sign in.
"""

from __future__ import annotations

import heapq
import hmac
import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from importlib import resources
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import availability
from . import people, views
from .auth import AuthRefused
from .model import HTTPError, JobReleased, UnknownJob
from .schemas import as_user_id
from .routes.base import query_choice, query_float
from .routes.jobs import listed_job_ids
from .usage import UsageCache

#: A dashboard session lasts this long (seconds) from sign-in.
SESSION_TTL_S = 12 * 3600.0
#: Most sessions kept; the oldest are forgotten first.
MAX_SESSIONS = 10_000
#: Most jobs one page of the job list shows (older ones: ``?before=`` its last job).
JOB_LIST = 50
#: Most bytes of each task's output the job page shows (the tail).
OUTPUT_TAIL_BYTES = 64 * 1024
#: Tasks in one page of a job's task list (``?limit=`` up to ``TASK_PAGE_MAX``): a poll of
#: a 20,000-task job reads one page, not every task.
TASK_PAGE = 100
TASK_PAGE_MAX = 500
#: What ``?state=`` may pick on a job's page: every task, or those in one state.
TASK_FILTERS = ("all", "pending", "leased", "done", "failed", "cancelled")
#: Tasks whose output one answer of ``/output`` carries (only tasks that printed count).
OUTPUT_PAGE = 20
COOKIE = "gpumesh_session"
STATIC = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8",
          "icon.svg": "image/svg+xml"}  # (the page names its icon: no 404 for /favicon.ico)
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self'; connect-src 'self'; form-action 'self'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


@dataclass
class Session:
    who: people.Identity
    csrf: str
    expires: float
    digest: str | None  # a person's token digest (None: the serve tokens, never revoked)


def _static(name: str) -> bytes:
    return resources.files("gpumesh.coordinator").joinpath("static").joinpath(name).read_bytes()


def _json(data, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status, headers=HEADERS)


def _refuse(status: int, code: str, message: str) -> JSONResponse:
    return _json({"error": code, "message": message}, status)


def routes(coord, auth, usage: UsageCache) -> list[Route]:
    """The dashboard's routes for ``coord``, signing in through ``auth`` (the app's
    :class:`~.auth.Authenticator`); per-person usage from ``usage`` (the app's one
    :class:`~.usage.UsageCache`, shared with ``/metrics``)."""
    sessions: OrderedDict[str, Session] = OrderedDict()

    def session_of(request: Request) -> Session | None:
        sid = request.cookies.get(COOKIE)
        s = sessions.get(sid) if sid else None
        if s is None or sid is None:
            return None
        if s.expires < time.time() or (s.digest is not None and
                                       (auth.people is None or not auth.people.has_digest(s.digest))):
            sessions.pop(sid, None)  # expired, or its token was revoked
            return None
        return s

    def changing(request: Request, s: Session) -> JSONResponse | None:
        """Refuse a state change without the session's CSRF token or from another origin."""
        sent = request.headers.get("x-csrf-token", "")
        if not hmac.compare_digest(sent.encode(), s.csrf.encode()):
            return _refuse(403, "csrf", "missing or wrong X-CSRF-Token (reload the page)")
        origin = request.headers.get("origin")
        if origin is not None and urlsplit(origin).netloc not in hosts_of(request):
            return _refuse(403, "csrf", "cross-origin request refused")
        return None

    def hosts_of(request: Request) -> set[str]:
        """The names this request reached us by: its Host, and behind a tunnel or proxy
        (``serve --public``, ``--trusted-proxy``) the host it forwarded."""
        out = {request.headers.get("host", request.url.netloc)}
        if getattr(auth, "fronted", False) and request.headers.get("x-forwarded-host"):
            out.add(request.headers["x-forwarded-host"])
        return out

    def secure(request: Request) -> bool:
        """HTTPS here, or at the tunnel or proxy in front of us."""
        return request.url.scheme == "https" or (
            getattr(auth, "fronted", False) and request.headers.get("x-forwarded-proto") == "https")

    def guarded(fn, change: bool = False):
        async def endpoint(request: Request) -> Response:
            s = session_of(request)
            if s is None:
                return _refuse(401, "signed_out", "sign in first")
            if change and (bad := changing(request, s)) is not None:
                return bad
            try:
                return await fn(request, s)
            except UnknownJob as e:
                return _refuse(404, "unknown_job", f"no such job {e}")
            except HTTPError as e:  # a query parameter out of bounds (400)
                return _refuse(e.status, e.code, e.message)
        return endpoint

    async def page(request: Request) -> Response:
        if request.url.path.endswith("/"):  # the page's relative links are for .../ui
            return Response(status_code=307, headers={"location": "../ui", **HEADERS})
        return Response(_static("index.html"), media_type="text/html; charset=utf-8", headers=HEADERS)

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return _refuse(404, "not_found", "no such file")
        return Response(_static(name), media_type=STATIC[name], headers=HEADERS)

    async def login(request: Request) -> Response:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return _refuse(415, "bad_request", "sign in with a JSON body {\"token\": ...}")
        try:
            body = json.loads(await request.body())
            token = body["token"]
            if not isinstance(token, str) or not token.strip():
                raise ValueError
        except (ValueError, KeyError, TypeError, RecursionError):
            return _refuse(400, "bad_request", "sign in with a JSON body {\"token\": ...}")
        headers = {"authorization": f"Bearer {token.strip()}"}
        for h in ("forwarded", "x-forwarded-for", "via", "x-real-ip"):  # as auth counts them
            if h in request.headers:
                headers[h] = request.headers[h]
        try:
            who = await auth.identity(request.client.host if request.client else None, headers)
        except AuthRefused as e:
            return _refuse(e.status, e.code, e.message)
        if who.role not in people.READ:
            return _refuse(403, "forbidden", f"the {who.role} token cannot sign in to the dashboard")
        digest = None
        if who is not people.MAIN and who is not people.WORKER_IDENTITY:
            digest = people.digest(token.strip().encode("latin-1", "replace"))
        sid, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        sessions[sid] = Session(who, csrf, time.time() + SESSION_TTL_S, digest)
        while len(sessions) > MAX_SESSIONS:
            sessions.popitem(last=False)
        resp = _json({"name": who.name, "role": who.role, "csrf": csrf})
        # No Path: the browser takes that of /ui/login (/ui, or /PREFIX/ui behind a proxy)
        resp.set_cookie(COOKIE, sid, max_age=int(SESSION_TTL_S), path=None, httponly=True,
                        samesite="strict", secure=secure(request))
        return resp

    async def logout(request: Request, s: Session) -> Response:
        sessions.pop(request.cookies.get(COOKIE, ""), None)
        resp = _json({"signed_out": True})
        resp.delete_cookie(COOKIE, path=None)  # type: ignore[arg-type]  # as set: no Path
        return resp

    async def state(request: Request, s: Session) -> Response:
        now = time.time()
        windows = usage.windows()
        day, week = windows["1d"], windows["7d"]
        per: dict[str, dict] = {}

        def add(source: dict, field: str, pick=lambda v: v) -> None:
            for owner, v in source.items():  # None: jobs from before people, the admin's
                u = per.setdefault(owner or people.MAIN_PERSON, dict.fromkeys(
                    ("running", "queued", "gpu_hours_day", "gpu_hours_week", "cpu_hours_day",
                     "cpu_hours_week"), 0))
                u[field] += pick(v)
        add(coord.running_by_owner(), "running")
        add(coord.queue.pending_by_owner(), "queued")
        for src, span in ((day, "day"), (week, "week")):
            add(src, f"gpu_hours_{span}", lambda v: v["gpu_s"] / 3600)
            add(src, f"cpu_hours_{span}", lambda v: v["cpu_s"] / 3600)
        usage_rows = [{"person": name, **u} for name, u in sorted(per.items())]
        # ?before=JOB_ID (&owner=, &state=): an older page of the list, as GET /v1/jobs
        rows = [row for jid in listed_job_ids(request, coord, JOB_LIST + 1)
                if (row := coord.store.job_row(jid)) is not None]
        return _json({"me": {"name": s.who.name, "role": s.who.role, "csrf": s.csrf},
                      "workers": [_worker(coord, w) for w in coord.workers.values()],
                      "jobs": [_job_summary(coord, row) for row in rows[:JOB_LIST]],
                      # the cursor of the next (older) page of jobs; None: no older job
                      "jobs_next": rows[JOB_LIST - 1]["id"] if len(rows) > JOB_LIST else None,
                      "people": usage_rows, "queue_depth": len(coord.queue), "now": now})

    async def job(request: Request, s: Session) -> Response:
        jid = _jid(request)
        row = coord.store.job_row(jid)
        if row is None:
            raise UnknownJob(jid)
        which = query_choice(request, "state", TASK_FILTERS, "all")
        after = int(query_float(request, "after", -1, -1, 1e15))
        limit = int(query_float(request, "limit", TASK_PAGE, 1, TASK_PAGE_MAX))
        view = _job_summary(coord, row)
        mine = s.who.may_touch(row.get("owner"))
        hosts = {w.id: w.info.get("hostname", "") for w in coord.workers.values()}
        state = None if which == "all" else which
        rows = [] if state and not view["counts"].get(state) else \
            coord.store.task_page(jid, after, limit + 1, state)
        tasks = []
        for t in rows[:limit]:
            started, finished = t["started"], t["finished"]
            err = t["error"] if mine else people.error_outline(t["error"])
            tasks.append({"id": t["id"], "index": t["index"], "state": t["state"],
                          "attempts": t["attempts"], "worker": t["worker_id"],
                          "host": hosts.get(t["worker_id"] or "", ""),
                          "duration_s": (finished or time.time()) - started
                          if started and t["state"] != "pending" else None,
                          "error": err})
        # next_after: the cursor of the next page (this one's last index), None at the end
        view.update(tasks=tasks, page={"state": which, "after": after, "limit": limit,
                                       "next_after": tasks[-1]["index"] if len(rows) > limit else None},
                    may_read=mine, may_act=mine and s.who.role in people.SUBMIT)
        return _json(view)

    async def output(request: Request, s: Session) -> Response:
        jid = _jid(request)
        row = coord.store.job_row(jid)
        if row is None:
            raise UnknownJob(jid)
        if not s.who.may_touch(row.get("owner")):
            return _refuse(403, "not_yours", f"job {jid} belongs to {row.get('owner') or 'admin'}")
        after = int(query_float(request, "after", -1, -1, 1e15))
        # only the tasks that printed: the hub knows which (not a walk over every task)
        printed = coord.output.printed(jid, lambda ids: {
            t["id"]: t["index"] for t in coord.store.task_rows(jid, ids)})
        page = heapq.nsmallest(OUTPUT_PAGE + 1, ((i, t) for t, i in printed.items() if i > after))
        out = []
        for t in coord.store.task_rows(jid, [tid for _, tid in page[:OUTPUT_PAGE]]):
            # every attempt's (a task retried, crashed and re-run, or handed back printed
            # once per run), the last part of each
            attempts = [a for a in views.attempt_logs(coord, jid, t, tail=OUTPUT_TAIL_BYTES)
                        if a["stdout"] or a["stderr"]]
            if attempts:
                out.append({"index": t["index"], "id": t["id"], "attempts": t["attempts"],
                            "runs": attempts})
        return _json({"job_id": jid, "tasks": out, "printed": len(printed), "after": after,
                      "next_after": page[OUTPUT_PAGE - 1][0] if len(page) > OUTPUT_PAGE else None})

    def acting(name: str, act):
        async def fn(request: Request, s: Session) -> Response:
            jid = _jid(request)
            row = coord.store.job_row(jid)
            if row is None:
                raise UnknownJob(jid)
            if s.who.role not in people.SUBMIT or not s.who.may_touch(row.get("owner")):
                return _refuse(403, "not_yours", f"{s.who.name} cannot {name} job {jid}")
            try:
                return _json(act(jid))
            except JobReleased:
                return _refuse(410, "released", f"job {jid} cannot be retried here: its results "
                                                "belong to the caller that submitted it")
        return fn

    def do_cancel(jid: str) -> dict:
        if jid not in coord.jobs:
            return {"cancelled": 0}
        return {"cancelled": coord.cancel(jid)}

    return [
        Route("/ui", page, methods=["GET"]),
        Route("/ui/", page, methods=["GET"]),
        Route("/ui/static/{name}", static, methods=["GET"]),
        Route("/ui/login", login, methods=["POST"]),
        Route("/ui/logout", guarded(logout, change=True), methods=["POST"]),
        Route("/ui/api/state", guarded(state), methods=["GET"]),
        Route("/ui/api/jobs/{jid}", guarded(job), methods=["GET"]),
        Route("/ui/api/jobs/{jid}/output", guarded(output), methods=["GET"]),
        Route("/ui/api/jobs/{jid}/cancel", guarded(acting("cancel", do_cancel), change=True),
              methods=["POST"]),
        Route("/ui/api/jobs/{jid}/retry", guarded(acting("retry", lambda j: {"retried": coord.retry(j)}),
                                                  change=True), methods=["POST"]),
    ]


def _jid(request: Request) -> str:
    """The path's job id in lower case, as the API's (a person may type it in capitals);
    anything else is no job (404), as the pages show it."""
    jid = request.path_params["jid"]
    got = as_user_id(jid)
    if got is None:
        raise UnknownJob(jid[:80])
    return got


def _worker(coord, w) -> dict:
    view = coord.worker_view(w)
    keep = ("id", "hostname", "user", "device", "device_name", "platform", "version", "score",
            "alive", "slots", "running", "busy_slots", "slot_list", "gpus", "cores", "ram_mb",
            "state", "state_reason", "owner_state")
    out = {k: view[k] for k in keep if k in view}
    out["allow_installs"] = bool(view.get("allow_installs"))  # join --allow-installs
    out["last_seen_s"] = max(0.0, coord.clock() - w.last_seen)
    out["owner_labels"] = availability.labels(view)  # paused, outside hours, yielding, hot
    return out


def _job_summary(coord, row: dict) -> dict:
    counts = coord.store.task_counts(row["id"])
    return {"id": row["id"], "name": row["name"], "kind": row["kind"], "state": row["state"],
            "owner": row.get("owner") or people.MAIN_PERSON, "n_tasks": row["n_tasks"],
            "counts": counts, "created": row["created"], "released": bool(row["released"])}
