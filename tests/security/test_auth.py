"""Token verification, roles and the failed-auth lockout, without processes.

The app runs in-process (Starlette's test client); the client address is chosen per test,
so the loopback exemption can be checked both ways.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from gpumesh.coordinator import auth as auth_mod
from gpumesh.coordinator.auth import (ROLE_MAIN, ROLE_WORKER, Authenticator, FailureLimiter,
                                      TokenCheck, is_loopback)
from gpumesh.limits import AUTH_FAIL_MAX, AUTH_FAIL_WINDOW_S, AUTH_LOCKOUT_S

from tests.conftest import FakeClock

from .conftest import APP_MAIN as MAIN
WORKER = "worker-token-0123456789abcdefgh"


# ---------------------------------------------------------------- TokenCheck --------

def test_token_check_roles_and_refusal():
    tc = TokenCheck({ROLE_MAIN: MAIN, ROLE_WORKER: WORKER})
    assert tc.verify(MAIN.encode()) == ROLE_MAIN
    assert tc.verify(WORKER.encode()) == ROLE_WORKER
    assert tc.verify(b"nope-nope-nope-nope") is None
    assert tc.verify(MAIN.encode() + b"x") is None
    assert tc.verify(b"") is None


def test_token_check_keeps_only_salted_kdf_hashes():
    tc = TokenCheck({ROLE_MAIN: MAIN})
    tc.verify(MAIN.encode())  # fills the fast-path cache too
    state = repr(vars(tc)).encode() + b"".join(
        h for _, h in tc._hashes) + b"".join(t for t, _ in tc._known)
    assert MAIN.encode() not in state
    assert hashlib.sha256(MAIN.encode()).digest() not in state  # not a bare hash either
    (role, stored), = tc._hashes
    assert stored == auth_mod.kdf(MAIN.encode(), tc._salt)
    assert len(tc._salt) == auth_mod.SALT_BYTES
    # a fresh start draws a fresh salt: the same token hashes differently
    assert TokenCheck({ROLE_MAIN: MAIN})._hashes[0][1] != stored


def test_token_check_runs_the_kdf_once_per_distinct_token(monkeypatch):
    tc = TokenCheck({ROLE_MAIN: MAIN})
    calls = []
    real = auth_mod.kdf
    monkeypatch.setattr(auth_mod, "kdf", lambda t, s: calls.append(t) or real(t, s))
    for _ in range(5):
        assert tc.verify(MAIN.encode()) == ROLE_MAIN
        assert tc.verify(b"wrong-token-wrong-token") is None
    assert calls == [MAIN.encode(), b"wrong-token-wrong-token"]


def test_token_check_compares_in_constant_time(monkeypatch):
    seen = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth_mod.hmac, "compare_digest", lambda a, b: seen.append(1) or real(a, b))
    tc = TokenCheck({ROLE_MAIN: MAIN, ROLE_WORKER: WORKER})
    tc.verify(b"some-wrong-token-here")
    assert len(seen) >= 2  # one constant-time comparison per stored hash
    seen.clear()
    tc.verify(MAIN.encode())
    tc.verify(MAIN.encode())  # the cached path compares too
    assert len(seen) >= 3


# ---------------------------------------------------------------- FailureLimiter ----

def test_limiter_locks_out_after_max_failures_in_window():
    clock = FakeClock()
    lim = FailureLimiter(clock=clock)
    for _ in range(AUTH_FAIL_MAX - 1):
        assert lim.failed("192.0.2.7") is False
        clock.advance(1)
    assert lim.locked_for("192.0.2.7") == 0.0
    assert lim.failed("192.0.2.7") is True
    assert lim.locked_for("192.0.2.7") == pytest.approx(AUTH_LOCKOUT_S)
    assert lim.locked_for("192.0.2.8") == 0.0  # per address
    clock.advance(AUTH_LOCKOUT_S + 0.1)
    assert lim.locked_for("192.0.2.7") == 0.0


def test_limiter_window_slides_and_success_forgives():
    clock = FakeClock()
    lim = FailureLimiter(clock=clock)
    for _ in range(AUTH_FAIL_MAX - 1):
        lim.failed("a")
    clock.advance(AUTH_FAIL_WINDOW_S + 1)  # the old failures fall out of the window
    assert lim.failed("a") is False
    for _ in range(AUTH_FAIL_MAX - 2):
        lim.failed("b")
    lim.succeeded("b")
    assert lim.failed("b") is False


def test_limiter_memory_is_bounded():
    lim = FailureLimiter(max_tracked=100, clock=FakeClock())
    for i in range(1000):
        lim.failed(f"198.51.100.{i}")
    assert len(lim._failures) == 100


def test_is_loopback():
    for h in ("127.0.0.1", "127.9.9.9", "::1", "localhost", "::ffff:127.0.0.1", "[::1]"):
        assert is_loopback(h), h
    for h in ("0.0.0.0", "192.0.2.1", "::", "", None, "testclient", "10.0.0.1"):
        assert not is_loopback(h), h


def test_exemption_needs_loopback_bind_loopback_client_and_no_proxy_header():
    a = Authenticator(MAIN, loopback_bound=True, loopback_exempt=True)
    assert a.exempt("127.0.0.1", {})
    assert not a.exempt("192.0.2.1", {})
    for h in ("x-forwarded-for", "forwarded", "x-real-ip", "via"):
        assert not a.exempt("127.0.0.1", {h: "203.0.113.9"}), h
    assert not Authenticator(MAIN, loopback_bound=False, loopback_exempt=True).exempt("127.0.0.1", {})
    assert not Authenticator(MAIN, loopback_bound=True, loopback_exempt=False).exempt("127.0.0.1", {})


# ---------------------------------------------------------------- the app ------------

def bearer(tok):
    return {"authorization": f"Bearer {tok}"}


def test_missing_and_wrong_tokens_are_401_with_a_message(app_factory):
    c = app_factory()
    r = c.get("/v1/workers")
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert "Bearer" in r.json()["message"]
    r = c.get("/v1/workers", headers=bearer("x" * 40))
    assert r.status_code == 401 and r.json()["message"] == "the token was refused"
    r = c.get("/v1/workers", headers=bearer("y" * 5000))  # over MAX_TOKEN_CHARS: not hashed
    assert r.status_code == 401
    assert c.get("/v1/workers", headers=bearer(MAIN)).status_code == 200
    assert c.get("/v1/health").status_code == 200
    assert c.get("/v1/openapi.json").json()["openapi"].startswith("3.")


def test_remote_address_is_locked_out_and_right_token_then_refused(app_factory):
    c = app_factory(client=("192.0.2.50", 40000), loopback_bound=True)
    codes = [c.get("/v1/workers", headers=bearer("wrong-token-0123456789")).status_code
             for _ in range(AUTH_FAIL_MAX)]
    assert codes == [401] * (AUTH_FAIL_MAX - 1) + [429]
    r = c.get("/v1/workers", headers=bearer(MAIN))
    assert r.status_code == 429 and r.json()["error"] == "locked_out"
    assert int(r.headers["retry-after"]) > AUTH_LOCKOUT_S - 5
    assert "192.0.2.50" in r.json()["message"]
    assert c.get("/v1/health").status_code == 200  # health needs no token


def test_a_few_typos_never_lock_anyone_out(app_factory):
    c = app_factory(client=("192.0.2.51", 40000))
    for _ in range(3):
        assert c.get("/v1/workers", headers=bearer(MAIN + "-typo")).status_code == 401
    assert c.get("/v1/workers", headers=bearer(MAIN)).status_code == 200
    for _ in range(AUTH_FAIL_MAX - 1):  # the success forgave the earlier three
        assert c.get("/v1/workers", headers=bearer(MAIN + "-typo")).status_code == 401
    assert c.get("/v1/workers", headers=bearer(MAIN)).status_code == 200


def test_loopback_exempt_only_without_proxy_headers(app_factory):
    c = app_factory(client=("127.0.0.1", 40000), loopback_bound=True)
    for _ in range(AUTH_FAIL_MAX * 2):
        assert c.get("/v1/workers", headers=bearer("wrong-token-0123456789")).status_code == 401
    assert c.get("/v1/workers", headers=bearer(MAIN)).status_code == 200
    # the same loopback socket, but a tunnel/proxy says who the client really is
    proxied = {"x-forwarded-for": "203.0.113.5", **bearer("wrong-token-0123456789")}
    codes = [c.get("/v1/workers", headers=proxied).status_code for _ in range(AUTH_FAIL_MAX)]
    assert codes[-1] == 429
    r = c.get("/v1/workers", headers={"forwarded": "for=203.0.113.6", **bearer(MAIN)})
    assert r.status_code == 429
    # a local user with no proxy in between is still served
    assert c.get("/v1/workers", headers=bearer(MAIN)).status_code == 200


def test_loopback_not_exempt_when_bound_to_all_interfaces(app_factory):
    c = app_factory(client=("127.0.0.1", 40000), loopback_bound=False)
    codes = [c.get("/v1/workers", headers=bearer("wrong-token-0123456789")).status_code
             for _ in range(AUTH_FAIL_MAX)]
    assert codes[-1] == 429


WORKER_OK = [("POST", "/v1/workers", {"json": {"hostname": "w"}}, 200),
             ("POST", "/v1/workers/abcd1234/heartbeat", {"json": {}}, 404),
             ("GET", "/v1/workers/abcd1234/session", {}, 404),
             ("DELETE", "/v1/workers/abcd1234", {}, 200),
             ("POST", "/v1/workers/abcd1234/lease", {"json": {"wait": 0}}, 404),
             ("POST", "/v1/tasks/abcd1234/result?lease=abcd1234", {"content": b"x"}, 400),
             ("POST", "/v1/tasks/abcd1234/output?lease=abcd1234", {"content": b"x"}, 400),
             ("GET", "/v1/blobs/" + "0" * 64, {}, 404),
             ("HEAD", "/v1/blobs/" + "0" * 64, {}, 404)]
MAIN_ONLY = [("GET", "/v1/workers", "list the workers"),
             ("PUT", "/v1/blobs/" + "0" * 64, "upload function blobs"),
             ("POST", "/v1/jobs", "submit jobs"),
             ("GET", "/v1/jobs", "list jobs"),
             ("GET", "/v1/jobs/abcd1234", "read job status"),
             ("GET", "/v1/jobs/abcd1234/results", "read results"),
             ("GET", "/v1/jobs/abcd1234/logs", "read logs"),
             ("POST", "/v1/jobs/abcd1234/release", "release jobs"),
             ("POST", "/v1/jobs/release", "release jobs"),
             ("POST", "/v1/jobs/abcd1234/cancel", "cancel jobs")]


def test_worker_token_can_act_as_a_worker_only(app_factory):
    c = app_factory(worker_token=WORKER)
    for method, path, kw, want in WORKER_OK:
        r = c.request(method, path, headers=bearer(WORKER), **kw)
        assert r.status_code == want, (method, path, r.status_code, r.text)
        r = c.request(method, path, headers=bearer(MAIN), **kw)  # main may do it too
        assert r.status_code == want, (method, path, r.status_code, r.text)
    for method, path, action in MAIN_ONLY:
        r = c.request(method, path, headers=bearer(WORKER))
        assert r.status_code == 403, (method, path, r.status_code)
        assert r.json() == {"error": "forbidden",
                            "message": f"the worker token cannot {action}; this needs the main token"}
        assert c.request(method, path, headers=bearer(MAIN)).status_code != 403


def test_without_worker_token_only_the_main_token_works(app_factory):
    c = app_factory()
    assert c.post("/v1/workers", json={}, headers=bearer(WORKER)).status_code == 401


def test_safe_mode_refuses_function_jobs_and_stores_nothing(app_factory):
    from gpumesh import wire
    c = app_factory(safe_mode=True)
    blob = b"".join(bytes(x) for x in wire.dumps(len).chunks)
    fn = hashlib.sha256(blob).hexdigest()
    meta = {"job_id": "abcdef01", "fn": fn, "fn_inline": True, "n_tasks": 1, "require_worker": False}
    chunks, _ = wire.pack_frames([json.dumps(meta).encode(), blob, wire.dumps(((), {}))])
    body = b"".join(bytes(x) for x in chunks)
    r = c.post("/v1/jobs", content=body, headers=bearer(MAIN))
    assert r.status_code == 403 and r.json()["error"] == "safe_mode"
    assert "safe mode" in r.json()["message"] and "function" in r.json()["message"]
    assert c.get("/v1/jobs", headers=bearer(MAIN)).json() == []
    assert c.head(f"/v1/blobs/{fn}", headers=bearer(MAIN)).status_code == 404


def test_openapi_describes_every_route_and_nothing_else(app_factory):
    c = app_factory()
    spec = c.get("/v1/openapi.json").json()
    described = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    served = set()
    for r in c.app.routes:
        if r.path.startswith("/ui"):  # the dashboard's pages, not the API (test_dashboard.py)
            continue
        for m in r.methods or ():
            if m != "HEAD" or r.path.startswith("/v1/blobs"):
                served.add((m, r.path))
    assert described == served
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    open_ops = {(m.upper(), p) for p, ops in spec["paths"].items() for m, op in ops.items()
                if op.get("security") == []}
    assert open_ops == {("GET", "/v1/health"), ("GET", "/v1/openapi.json"), ("GET", "/v1/dist/{name}")}
