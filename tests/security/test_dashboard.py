"""The dashboard's sign-in, session cookie, CSRF and who-sees-what, in-process.

(The real-browser test, with escaping checked in Chromium's DOM, is
tests/integration/test_dashboard_browser.py.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import warnings

import pytest

from gpumesh import wire
from gpumesh.coordinator.app import create_app
from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store

MAIN = "main-token-0123456789abcdefghij"
WORKER = "worker-token-0123456789abcdefgh"
API_ROUTES = [("GET", "/ui/api/state"), ("GET", "/ui/api/jobs/aaaa0001"),
              ("GET", "/ui/api/jobs/aaaa0001/output"), ("POST", "/ui/api/jobs/aaaa0001/cancel"),
              ("POST", "/ui/api/jobs/aaaa0001/retry"), ("POST", "/ui/logout")]


@pytest.fixture
def made(tmp_path, cheap_kdf):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    store = Store(tmp_path / "data")
    coord = Coordinator(store)
    app = create_app(coord, MAIN, worker_token=WORKER)
    clients = []

    def client(https: bool = False):
        c = TestClient(app, base_url="https://testserver" if https else "http://testserver",
                       client=("192.0.2.9", 5000))
        clients.append(c)
        return c
    admin = client()
    alice = admin.post("/v1/tokens", json={"name": "alice"},
                       headers={"authorization": f"Bearer {MAIN}"}).json()["token"]
    vic = admin.post("/v1/tokens", json={"name": "vic", "role": "view"},
                     headers={"authorization": f"Bearer {MAIN}"}).json()["token"]
    submit(admin, alice, "aaaa0001", "<img src=x onerror=alert(1)>")
    yield client, coord, {"alice": alice, "vic": vic}
    for c in clients:
        c.close()
    store.close()


def submit(c, tok, job_id, name):
    blob = b"fn"
    meta = {"job_id": job_id, "fn": hashlib.sha256(blob).hexdigest(), "fn_inline": True,
            "n_tasks": 2, "name": name, "kind": "script"}
    chunks, _ = wire.pack_frames([json.dumps(meta).encode(), blob, b"1", b"2"])
    r = c.post("/v1/jobs", content=b"".join(bytes(x) for x in chunks),
               headers={"authorization": f"Bearer {tok}"})
    assert r.status_code == 200, r.text


def sign_in(c, token):
    r = c.post("/ui/login", json={"token": token})
    assert r.status_code == 200, r.text
    return r


def test_without_a_session_every_dashboard_route_is_refused_and_the_page_holds_no_data(made):
    client, _, _ = made
    c = client()
    for method, path in API_ROUTES:
        r = c.request(method, path)
        assert r.status_code == 401 and r.json()["error"] == "signed_out", (method, path)
    page = c.get("/ui")
    assert page.status_code == 200 and 'id="signin"' in page.text
    assert "aaaa0001" not in page.text and "img src=x" not in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    # a bearer token on the dashboard's API is not a session
    r = c.get("/ui/api/state", headers={"authorization": f"Bearer {MAIN}"})
    assert r.status_code == 401
    # assets ship in the package; nothing else is served from there
    assert c.get("/ui/static/app.js").headers["content-type"].startswith("text/javascript")
    assert c.get("/ui/static/../app.py").status_code == 404
    assert c.get("/ui/static/index.py").status_code == 404


def test_sign_in_sets_a_strict_http_only_cookie_secure_under_tls(made):
    client, _, toks = made
    r = sign_in(client(), toks["alice"])
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    # no Path: the browser scopes it to /ui/login's path, /ui (or /PREFIX/ui behind a proxy)
    assert "path=" not in cookie.lower() and "Secure" not in cookie
    assert r.json()["name"] == "alice" and r.json()["role"] == "submit" and len(r.json()["csrf"]) > 30
    assert toks["alice"] not in cookie
    r = sign_in(client(https=True), toks["alice"])
    assert "Secure" in r.headers["set-cookie"]


@pytest.mark.parametrize("body, kind, status", [
    ({"token": "wrong-token-0123456789abcdef"}, "json", 401),
    ({"token": WORKER}, "json", 403),
    ({"token": ""}, "json", 400),
    ({}, "json", 400),
    ({"token": MAIN}, "form", 415),  # a cross-site form cannot send JSON
])
def test_bad_sign_ins_open_no_session(made, body, kind, status):
    client, _, _ = made
    c = client()
    r = c.post("/ui/login", json=body) if kind == "json" else c.post("/ui/login", data=body)
    assert r.status_code == status, r.text
    assert "set-cookie" not in r.headers
    assert c.get("/ui/api/state").status_code == 401


def test_state_changes_need_the_csrf_header_and_this_origin(made):
    client, coord, toks = made
    c = client()
    csrf = sign_in(c, toks["alice"]).json()["csrf"]
    # a cross-site POST carries the cookie at most, never our header
    r = c.post("/ui/api/jobs/aaaa0001/cancel")
    assert r.status_code == 403 and r.json()["error"] == "csrf"
    r = c.post("/ui/api/jobs/aaaa0001/cancel", headers={"x-csrf-token": "guess"})
    assert r.status_code == 403
    r = c.post("/ui/api/jobs/aaaa0001/cancel",
               headers={"x-csrf-token": csrf, "origin": "https://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.json()["message"]
    assert coord.jobs["aaaa0001"].state == "active"  # nothing happened
    r = c.post("/ui/api/jobs/aaaa0001/cancel", headers={"x-csrf-token": csrf, "origin": "http://testserver"})
    assert r.status_code == 200 and r.json() == {"cancelled": 2}
    assert coord.jobs["aaaa0001"].state == "cancelled"


def test_a_viewer_sees_states_but_not_errors_or_output_and_cannot_act(made):
    client, coord, toks = made
    w = coord.register({"hostname": "h"}, None, 1)
    (g,) = asyncio.run(coord.lease(w.id, 1, 0))
    coord.post_result(g.task_id, g.lease_id, "error", {"kind": "error", "type": "KeyError",
                                                       "message": "secret", "traceback": "Traceback..."}, None)
    v = client()
    csrf = sign_in(v, toks["vic"]).json()["csrf"]
    state = v.get("/ui/api/state").json()
    assert state["me"]["role"] == "view"
    assert [j["name"] for j in state["jobs"]] == ["<img src=x onerror=alert(1)>"]
    assert {p["person"]: p["queued"] for p in state["people"]} == {"alice": 1}
    job = v.get("/ui/api/jobs/aaaa0001").json()
    assert job["may_act"] is False and job["may_read"] is False
    assert job["tasks"][0]["error"] == {"kind": "error", "type": "KeyError"}
    assert job["tasks"][0]["host"] == "h" and job["tasks"][0]["duration_s"] >= 0
    assert v.get("/ui/api/jobs/aaaa0001/output").status_code == 403
    for what in ("cancel", "retry"):
        r = v.post(f"/ui/api/jobs/aaaa0001/{what}", headers={"x-csrf-token": csrf})
        assert r.status_code == 403
    assert coord.jobs["aaaa0001"].state == "active"
    a = client()
    sign_in(a, toks["alice"])
    mine = a.get("/ui/api/jobs/aaaa0001").json()
    assert mine["may_act"] is True and mine["tasks"][0]["error"]["traceback"] == "Traceback..."
    assert a.get("/ui/api/jobs/aaaa0001/output").status_code == 200


def test_revoking_a_token_ends_its_sessions_at_once(made):
    client, _, toks = made
    c = client()
    sign_in(c, toks["alice"])
    assert c.get("/ui/api/state").status_code == 200
    admin = client()
    assert admin.delete("/v1/tokens/alice", headers={"authorization": f"Bearer {MAIN}"}).status_code == 200
    assert c.get("/ui/api/state").status_code == 401


def test_sign_out_ends_the_session(made):
    client, _, toks = made
    c = client()
    csrf = sign_in(c, toks["alice"]).json()["csrf"]
    sid = c.cookies.get("gpumesh_session")
    assert c.post("/ui/logout", headers={"x-csrf-token": csrf}).status_code == 200
    c.cookies.set("gpumesh_session", sid, path="/ui")  # replaying the old cookie
    assert c.get("/ui/api/state").status_code == 401


def test_behind_a_tls_tunnel_the_cookie_is_secure_and_the_forwarded_host_is_same_origin(tmp_path):
    from gpumesh.coordinator.auth import Authenticator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    fwd = {"x-forwarded-proto": "https", "x-forwarded-host": "mesh.example.org"}
    for fronted in (False, True):
        store = Store(tmp_path / f"d{fronted}")
        coord = Coordinator(store)
        app = create_app(coord, MAIN, authenticator=Authenticator(MAIN, fronted=fronted))
        c = TestClient(app, client=("192.0.2.9", 5000))
        r = c.post("/ui/login", json={"token": MAIN}, headers=fwd)
        # only a coordinator told it is fronted believes the forwarded scheme and host
        assert ("Secure" in r.headers["set-cookie"]) is fronted
        sid = r.headers["set-cookie"].split(";")[0]  # (the client keeps Secure ones for https)
        submit(c, MAIN, "dddd0001", "j")
        r = c.post("/ui/api/jobs/dddd0001/cancel", headers={
            "x-csrf-token": r.json()["csrf"], "origin": "https://mesh.example.org",
            "cookie": sid, **fwd})
        assert r.status_code == (200 if fronted else 403), r.text
        c.close()
        store.close()


def test_the_pool_says_which_workers_allow_installs(made):
    # join --allow-installs is the owner's choice to let requires= build environments there:
    # the dashboard shows it, as `gpumesh workers` does
    client, coord, toks = made
    yes = coord.register({"hostname": "lets", "allow_installs": True}, None, 1)
    no = coord.register({"hostname": "keeps"}, None, 1)
    c = client()
    sign_in(c, toks["alice"])
    pool = {w["id"]: w for w in c.get("/ui/api/state").json()["workers"]}
    assert pool[yes.id]["allow_installs"] is True
    assert pool[no.id]["allow_installs"] is False
