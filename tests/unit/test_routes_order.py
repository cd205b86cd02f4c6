"""The app tries its hot routes first (``routes.base.ordered``): that must change which
route answers no request, nor which one a 405 comes from. And a request a hot route
matches skips Starlette's router and middlewares (``app._App``), with the same answer."""

from __future__ import annotations

import re

from starlette.routing import Match, Route

from gpumesh.coordinator.routes import ENDPOINTS
from gpumesh.coordinator.routes.base import ordered

from .routes_app import WORKER, api_fixture

api = api_fixture

METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH")


def _winner(routes: list[Route], method: str, path: str) -> tuple | None:
    """What Starlette's router picks: the first full match, else the first partial one."""
    partial = None
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    for r in routes:
        match, _ = r.matches(scope)
        if match == Match.FULL:
            return "full", r.path, sorted(r.methods or ())
        if match == Match.PARTIAL and partial is None:
            partial = ("partial", r.path, sorted(r.methods or ()))
    return partial


def _paths() -> list[str]:
    out = []
    for ep in ENDPOINTS:
        for value in ("0a1b2c3d4e5f", "results", "release"):  # ids, and words other routes use
            out.append(re.sub(r"\{[^}]+\}", value, ep.path))
    return out


def _routes(eps) -> list[Route]:
    async def handler(request):  # never called
        raise AssertionError
    return [Route(ep.path, handler, methods=list(ep.methods)) for ep in eps]


def test_the_hot_routes_come_first_and_every_request_finds_the_route_it_did():
    hot = [ep for ep in ordered() if ep.hot]
    assert {(ep.methods, ep.path) for ep in hot} == {
        (("POST",), "/v1/tasks/results"), (("POST",), "/v1/tasks/{tid}/result"),
        (("POST",), "/v1/workers/{wid}/lease"), (("GET",), "/v1/jobs/{jid}/results"),
        (("POST",), "/v1/jobs")}
    assert ordered()[:len(hot)] == hot
    assert sorted(map(id, ordered())) == sorted(map(id, ENDPOINTS)), "the same routes, each once"
    before, after = _routes(ENDPOINTS), _routes(ordered())
    checked = 0
    for path in _paths():
        for method in METHODS:
            assert _winner(after, method, path) == _winner(before, method, path), (method, path)
            checked += _winner(before, method, path) is not None
    assert checked > len(ENDPOINTS), "the samples reach the routes"


def test_hot_requests_skip_the_router_and_get_the_answers_the_whole_stack_gives(api, monkeypatch):
    from starlette.routing import Router
    routed = []
    real = Router.__call__

    async def counting(self, scope, receive, send):
        routed.append(scope["path"])
        await real(self, scope, receive, send)
    monkeypatch.setattr(Router, "__call__", counting)
    wid = api.worker(slots=1)
    requests = [  # (method, path, token, kwargs, hot: a hot route matches it fully)
        ("POST", "/v1/jobs", "main", {"content": b"not frames"}, True),  # bad input
        ("POST", "/v1/jobs", None, {"content": b""}, True),  # no token
        ("POST", "/v1/jobs", "worker", {"content": b""}, True),  # the wrong role
        ("POST", "/v1/jobs", "main", {"content": b"", "headers": {"user-agent": "gpumesh/0.0.1 (x)"}},
         True),  # another gpumesh version
        ("GET", "/v1/jobs/0a1b2c3d/results", "main", {}, True),  # an unknown job
        ("GET", "/v1/jobs/nothex!/results", "main", {}, True),  # a bad id
        ("POST", f"/v1/workers/{wid}/lease", "worker", {"json": {"slots": "x"}}, True),
        ("POST", "/v1/tasks/0a1b/result?lease=zz!", "worker", {"content": b""}, True),
        ("POST", "/v1/tasks/results", "worker", {"content": b"x"}, True),
        ("PUT", "/v1/jobs", "main", {}, False),  # a hot path, another method: 405
        ("GET", "/v1/jobs", "main", {}, False),  # not hot
    ]
    tokens = {"main": "main-token-for-route-tests-0123456789", "worker": WORKER, None: None}
    answers = {}
    for hot_path in (True, False):
        if not hot_path:
            monkeypatch.setattr(api.app, "hot", [])  # every request through the whole stack
        for method, path, token, kw, hot in requests:
            routed.clear()
            r = api.call(method, path, token=tokens[token], **kw)
            assert routed == ([] if hot and hot_path else [path.split("?")[0]]), (method, path)
            answers.setdefault((method, path, token, str(kw)), []).append(
                (r.status_code, r.headers.get("content-type"), r.headers.get("retry-after"), r.text))
    for key, (fast, whole) in answers.items():
        assert fast == whole, key
    statuses = [a[0][0] for a in answers.values()]
    assert statuses == [400, 401, 403, 409, 404, 400, 400, 400, 400, 405, 200], statuses
