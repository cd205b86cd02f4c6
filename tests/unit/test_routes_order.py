"""The app tries its hot routes first (``routes.base.ordered``): that must change which
route answers no request, nor which one a 405 comes from."""

from __future__ import annotations

import re

from starlette.routing import Match, Route

from gpumesh.coordinator.routes import ENDPOINTS
from gpumesh.coordinator.routes.base import ordered

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
        (("POST",), "/v1/workers/{wid}/lease"), (("GET",), "/v1/jobs/{jid}/results")}
    assert ordered()[:len(hot)] == hot
    assert sorted(map(id, ordered())) == sorted(map(id, ENDPOINTS)), "the same routes, each once"
    before, after = _routes(ENDPOINTS), _routes(ordered())
    checked = 0
    for path in _paths():
        for method in METHODS:
            assert _winner(after, method, path) == _winner(before, method, path), (method, path)
            checked += _winner(before, method, path) is not None
    assert checked > len(ENDPOINTS), "the samples reach the routes"
