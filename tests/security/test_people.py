"""People's tokens: roles, ownership of jobs, revocation, hashed storage, old databases.

In-process (Starlette's test client) against a real store; the CLI test at the end runs
a real coordinator and the ``gpumesh token`` commands.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
import time
import warnings

import httpx
import pytest

from gpumesh import wire
from gpumesh.coordinator.app import create_app
from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store
from tests.conftest import TOKEN

MAIN = "main-token-0123456789abcdefghij"
WORKER = "worker-token-0123456789abcdefgh"


@pytest.fixture
def app(tmp_path, cheap_kdf):
    """``(client, store, coordinator)`` of an in-process coordinator with a worker token."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
        store = Store(tmp_path / "data")
        coord = Coordinator(store)
        c = TestClient(create_app(coord, MAIN, worker_token=WORKER), client=("192.0.2.7", 40000))
    yield c, store, coord
    c.close()
    store.close()


def bearer(tok):
    return {"authorization": f"Bearer {tok}"}


def add(c, name, role="submit", max_running=None, tok=MAIN):
    r = c.post("/v1/tokens", json={"name": name, "role": role, "max_running": max_running},
               headers=bearer(tok))
    assert r.status_code == 200, r.text
    return r.json()["token"]


def submit(c, tok, job_id, name="job"):
    blob = b"not really a function"
    fn = hashlib.sha256(blob).hexdigest()
    meta = {"job_id": job_id, "fn": fn, "fn_inline": True, "n_tasks": 1, "name": name,
            "require_worker": False}
    chunks, _ = wire.pack_frames([json.dumps(meta).encode(), blob, b"args"])
    return c.post("/v1/jobs", content=b"".join(bytes(x) for x in chunks), headers=bearer(tok))


def test_a_token_is_answered_once_and_stored_only_as_its_sha256(app):
    c, store, _ = app
    r = c.post("/v1/tokens", json={"name": "alice", "role": "submit", "max_running": 3},
               headers=bearer(MAIN))
    assert r.status_code == 200
    body = r.json()
    tok = body.pop("token")
    assert len(tok) >= 40 and body["name"] == "alice" and body["role"] == "submit"
    assert body["max_running"] == 3
    rows = store.db.execute("SELECT name, role, digest, max_running FROM tokens").fetchall()
    assert rows == [("alice", "submit", hashlib.sha256(tok.encode()).hexdigest(), 3)]
    raw = b"".join(open(p, "rb").read() for p in (store.dir).glob("gpumesh.db*"))
    assert tok.encode() not in raw
    listed = c.get("/v1/tokens", headers=bearer(MAIN)).json()
    assert [(p["name"], p["role"], p["max_running"]) for p in listed] == [("alice", "submit", 3)]
    assert "token" not in listed[0] and "digest" not in listed[0]
    # the new token works at once
    assert c.get("/v1/workers", headers=bearer(tok)).status_code == 200


@pytest.mark.parametrize("body, code", [
    ({"name": "admin"}, "bad_request"), ({"name": "worker"}, "bad_request"),
    ({"name": "<b>x</b>"}, "bad_request"), ({"name": ""}, "bad_request"),
    ({"name": "a" * 65}, "bad_request"), ({"name": "bob", "role": "root"}, "bad_request"),
    ({"name": "bob", "max_running": 0}, "bad_request"), ({"name": "bob", "max_running": "2"}, "bad_request"),
    ({}, "bad_request"),
])
def test_bad_token_requests_are_refused_and_change_nothing(app, body, code):
    c, store, _ = app
    r = c.post("/v1/tokens", json=body, headers=bearer(MAIN))
    assert r.status_code == 400 and r.json()["error"] == code, r.text
    assert store.tokens() == []


def test_a_taken_name_is_a_conflict(app):
    c, store, _ = app
    add(c, "alice")
    r = c.post("/v1/tokens", json={"name": "alice"}, headers=bearer(MAIN))
    assert r.status_code == 409 and r.json()["error"] == "exists"
    # two names that differ only in case would be two people nobody could tell apart
    r = c.post("/v1/tokens", json={"name": "ALICE"}, headers=bearer(MAIN))
    assert r.status_code == 409 and r.json() == {
        "error": "exists", "message": "'ALICE' is too like 'alice', who has a token: names are "
                                      "compared without case"}
    assert [t["name"] for t in store.tokens()] == ["alice"]


def test_only_admins_manage_tokens(app):
    c, _, _ = app
    alice = add(c, "alice")
    viewer = add(c, "vic", "view")
    boss = add(c, "boss", "admin")
    for tok in (alice, viewer, WORKER):
        assert c.get("/v1/tokens", headers=bearer(tok)).status_code == 403
        assert c.post("/v1/tokens", json={"name": "eve"}, headers=bearer(tok)).status_code == 403
        assert c.delete("/v1/tokens/alice", headers=bearer(tok)).status_code == 403
    # an added admin may, like the main token
    assert c.post("/v1/tokens", json={"name": "eve"}, headers=bearer(boss)).status_code == 200
    assert {p["name"] for p in c.get("/v1/tokens", headers=bearer(boss)).json()} == \
        {"alice", "vic", "boss", "eve"}


def test_a_revoked_token_is_refused_on_the_next_request(app):
    c, store, _ = app
    alice = add(c, "alice")
    assert c.get("/v1/jobs", headers=bearer(alice)).status_code == 200
    r = c.delete("/v1/tokens/ALICE", headers=bearer(MAIN))  # (names compared without case)
    assert r.status_code == 200 and r.json() == {"revoked": "alice"}
    r = c.get("/v1/jobs", headers=bearer(alice))
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    r = c.delete("/v1/tokens/alice", headers=bearer(MAIN))
    assert r.status_code == 404 and r.json()["message"] == "nobody is called 'alice' here"
    assert store.tokens() == []
    assert c.delete("/v1/tokens/alice", headers=bearer(MAIN)).status_code == 404


def test_every_job_records_its_owner_and_only_they_or_an_admin_may_touch_it(app):
    c, _, _ = app
    alice, bob, vic = add(c, "alice"), add(c, "bob"), add(c, "vic", "view")
    assert submit(c, alice, "aaaa0001", "alice's").status_code == 200
    assert submit(c, MAIN, "aaaa0002", "admin's").status_code == 200
    jobs = {j["id"]: j["owner"] for j in c.get("/v1/jobs", headers=bearer(vic)).json()}
    assert jobs == {"aaaa0001": "alice", "aaaa0002": "admin"}
    assert c.get("/v1/jobs/aaaa0001", headers=bearer(bob)).json()["owner"] == "alice"
    for tok in (bob, vic):
        for method, path in (("GET", "/v1/jobs/aaaa0001/results"), ("GET", "/v1/jobs/aaaa0001/logs"),
                             ("POST", "/v1/jobs/aaaa0001/cancel"), ("POST", "/v1/jobs/aaaa0001/retry"),
                             ("POST", "/v1/jobs/aaaa0001/release")):
            r = c.request(method, path, headers=bearer(tok))
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["error"] in ("not_yours", "forbidden")
        r = c.post("/v1/jobs/release", json={"jobs": ["aaaa0001"]}, headers=bearer(tok))
        assert r.status_code == 403
    r = c.post("/v1/jobs/aaaa0001/cancel", headers=bearer(bob))
    assert r.json()["error"] == "not_yours" and "alice" in r.json()["message"]
    # the job is untouched by all that
    assert c.get("/v1/jobs/aaaa0001", headers=bearer(alice)).json()["state"] == "active"
    # the owner and the admin may
    assert c.get("/v1/jobs/aaaa0001/logs", headers=bearer(alice)).status_code == 200
    assert c.get("/v1/jobs/aaaa0002/logs", headers=bearer(alice)).status_code == 403
    assert c.post("/v1/jobs/aaaa0001/cancel", headers=bearer(alice)).json()["cancelled"] == 1
    assert c.post("/v1/jobs/aaaa0002/cancel", headers=bearer(MAIN)).json()["cancelled"] == 1


def test_a_view_token_cannot_submit_or_upload_and_sees_no_error_text(app):
    c, store, coord = app
    vic = add(c, "vic", "view")
    r = submit(c, vic, "bbbb0001")
    assert r.status_code == 403 and "vic" in r.json()["message"]
    assert not store.job_exists("bbbb0001")
    blob = b"x"
    assert c.put(f"/v1/blobs/{hashlib.sha256(blob).hexdigest()}", content=blob,
                 headers=bearer(vic)).status_code == 403
    # a failed task's message and traceback are its owner's to read
    alice = add(c, "alice")
    submit(c, alice, "bbbb0002")
    tid = c.get("/v1/jobs/bbbb0002", headers=bearer(alice)).json()["tasks"][0]["id"]
    # (an earlier attempt that raised an exception the job retries: its text is kept too)
    store.add_history({tid: {"attempt": 1, "worker": "w1", "retried": True, "ended": "retried",
                             "error": {"type": "ValueError", "message": "secret=41"}}})
    coord._finalize("bbbb0002", tid, "failed", {"kind": "error", "type": "ValueError",
                                                "message": "secret=42", "traceback": "..."}, None)
    mine = c.get("/v1/jobs/bbbb0002", headers=bearer(alice)).json()["tasks"][0]
    assert mine["error"]["message"] == "secret=42"
    assert mine["history"][0]["error"]["message"] == "secret=41"
    theirs = c.get("/v1/jobs/bbbb0002", headers=bearer(vic)).json()["tasks"][0]
    assert theirs["error"] == {"kind": "error", "type": "ValueError"}
    assert theirs["history"] == [{"attempt": 1, "worker": "w1", "retried": True, "ended": "retried",
                                  "error": {"type": "ValueError"}}]


def test_each_role_refusal_names_the_users_action_and_who_can_help(app):
    # a side request (the caller's handoff probe, its blob check) is refused as the step
    # the user took; `gpumesh token list` is never the advice: only an admin may run it
    c, _, _ = app
    vic, alice = add(c, "vic", "view"), add(c, "alice")
    ask_submit = ("that needs a submit token: ask whoever holds the main token for one "
                  "(they run `gpumesh token add NAME --role submit`)")
    ask_worker = ("that needs a worker token: ask whoever holds the main token for one "
                  "(they run `gpumesh token add NAME --role worker`)")
    admins = "only the main token (or an admin's) may: ask whoever holds the main token"
    for method, path, who, said in [
            ("GET", "/v1/handoff", vic, f"vic's token (view) cannot submit jobs; {ask_submit}"),
            ("HEAD", "/v1/blobs/" + "0" * 64, vic, f"vic's token (view) cannot submit jobs; {ask_submit}"),
            ("POST", "/v1/jobs", vic, f"vic's token (view) cannot submit jobs; {ask_submit}"),
            ("POST", "/v1/jobs/abcd1234/cancel", vic, f"vic's token (view) cannot cancel jobs; {ask_submit}"),
            ("POST", "/v1/workers", vic, f"vic's token (view) cannot join as a worker; {ask_worker}"),
            ("POST", "/v1/workers", alice, f"alice's token (submit) cannot join as a worker; {ask_worker}"),
            ("POST", "/v1/workers/abcd1234/lease", alice,
             f"alice's token (submit) cannot act as a worker; {ask_worker}"),
            ("GET", "/v1/tokens", vic, f"vic's token (view) cannot list tokens; {admins}"),
            ("GET", "/v1/tokens", alice, f"alice's token (submit) cannot list tokens; {admins}")]:
        r = c.request(method, path, headers=bearer(who), **({"json": {}} if method == "POST" else {}))
        assert r.status_code == 403, (method, path, r.text)
        if method != "HEAD":
            assert r.json() == {"error": "forbidden", "message": said}, (method, path)


def test_every_route_that_needs_a_token_names_its_action():
    from gpumesh.coordinator.routes import ENDPOINTS
    assert [(ep.path, ep.methods) for ep in ENDPOINTS if ep.auth_required and not ep.action] == []


def test_the_worker_token_is_still_only_a_worker_and_the_main_token_an_admin(app):
    c, _, _ = app
    r = c.get("/v1/jobs", headers=bearer(WORKER))
    assert r.status_code == 403 and "worker token" in r.json()["message"]
    assert c.get("/v1/tokens", headers=bearer(MAIN)).status_code == 200
    r = c.post("/v1/workers", json={"hostname": "w", "slots": 1}, headers=bearer(WORKER))
    assert r.status_code == 200
    # a person with role worker may join; a submitter may not act as a worker
    w = add(c, "rig", "worker")
    alice = add(c, "alice")
    assert c.post("/v1/workers", json={"hostname": "w2"}, headers=bearer(w)).status_code == 200
    assert c.post("/v1/workers", json={"hostname": "w3"}, headers=bearer(alice)).status_code == 403


def test_tokens_survive_a_restart_and_an_old_database_gains_owners(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    db = sqlite3.connect(data / "gpumesh.db")  # the schema before people
    db.executescript("""
        CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, kind TEXT NOT NULL,
            fn_hash TEXT, meta TEXT NOT NULL, n_tasks INTEGER NOT NULL, created REAL NOT NULL,
            state TEXT NOT NULL, released INTEGER NOT NULL DEFAULT 0, finished REAL);
        CREATE TABLE tasks (id TEXT PRIMARY KEY, job_id TEXT NOT NULL, idx INTEGER NOT NULL,
            state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, cost REAL NOT NULL DEFAULT 1.0,
            lease_id TEXT, worker_id TEXT, args BLOB, args_file TEXT, result BLOB, result_file TEXT,
            error TEXT, seq INTEGER, finished REAL, UNIQUE (job_id, idx));
        INSERT INTO jobs VALUES ('cccc0001', 'old', 'script', NULL, '{}', 0, 1.0, 'finished', 0, 2.0);
    """)
    db.commit()
    db.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    store = Store(data)
    c = TestClient(create_app(Coordinator(store), MAIN), client=("192.0.2.7", 1))
    alice = add(c, "alice")
    assert c.get("/v1/jobs/cccc0001", headers=bearer(MAIN)).json()["owner"] == "admin"
    assert c.post("/v1/jobs/cccc0001/cancel", headers=bearer(alice)).status_code == 403
    c.close()
    store.close()
    store = Store(data)  # a restart: the token is still there, still works
    c = TestClient(create_app(Coordinator(store), MAIN), client=("192.0.2.7", 1))
    assert c.get("/v1/jobs", headers=bearer(alice)).status_code == 200
    assert [p["name"] for p in c.get("/v1/tokens", headers=bearer(MAIN)).json()] == ["alice"]
    c.close()
    store.close()


# ---------------------------------------------------------------- the CLI, for real --
def twice(x):
    return 2 * x


def cli(mesh, *args, token=TOKEN):
    env = dict(mesh.env, GPUMESH_URL=mesh.url, GPUMESH_TOKEN=token)
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_token_commands_against_a_live_coordinator(make_mesh, tmp_path):
    m = make_mesh(workers=1)
    if True:
        r = cli(m, "token", "add", "alice", "--role", "submit", "--max-running", "2")
        assert r.returncode == 0, r.stderr
        assert "token for alice (submit, at most 2 running)" in r.stdout
        alice = r.stdout.splitlines()[1].strip()
        r = cli(m, "token", "add", "alice")
        assert r.returncode == 1 and "already has a token" in r.stderr
        # a name no person can have is a usage error, found before any request
        for bad, why in [("bad name!", "a name is 1 to 64 letters"), ("admin", "is reserved"),
                         ("x" * 65, "a name is 1 to 64 letters")]:
            r = cli(m, "token", "add", bad)
            assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert [t["name"] for t in m.client(output=False).tokens()] == ["alice"]
        r = cli(m, "token", "add", "vic", "--role", "view", "--json")
        vic = json.loads(r.stdout)["token"]
        r = cli(m, "token", "list")
        assert r.returncode == 0
        lines = r.stdout.splitlines()
        assert lines[0].split()[:3] == ["alice", "submit", "max-running=2"]
        assert lines[1].split()[:3] == ["vic", "view", "no"]
        assert alice not in r.stdout and vic not in r.stdout
        # alice runs a job of her own; jobs and status name her
        script = tmp_path / "s.py"
        script.write_text("import json, sys\nprint(json.dumps(json.load(sys.stdin) * 2))\n")
        payloads = tmp_path / "p.json"
        payloads.write_text("[1, 2]")
        r = cli(m, "submit", str(script), "--payloads", str(payloads), "--wait", token=alice)
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.split("Submitted job ")[1].split()[0]
        r = cli(m, "jobs")
        assert f"{job_id}" in r.stdout and " alice " in r.stdout
        r = cli(m, "status", job_id, token=alice)
        assert "  Owner: alice" in r.stdout.splitlines()
        r = cli(m, "status", job_id, "--json", token=alice)
        assert [t["result"] for t in json.loads(r.stdout)["tasks"]] == [2, 4]
        # the viewer sees the job but not its results, and cannot cancel it
        r = cli(m, "status", job_id, "--json", token=vic)
        assert r.returncode == 0, r.stderr
        view = json.loads(r.stdout)
        assert view["owner"] == "alice" and all("result" not in t for t in view["tasks"])
        r = cli(m, "cancel", job_id, token=vic)
        assert r.returncode == 1 and "cannot cancel" in r.stderr
        r = cli(m, "submit", str(script), "--payloads", str(payloads), token=vic)
        assert r.returncode == 1 and "cannot submit" in r.stderr
        # joining with it is refused as joining, in one line (no traceback), and the
        # advice is someone who can help, not a command this token may not run
        r = cli(m, "join", m.url, "--slots", "1", token=vic)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1] == (
            f"Error: the coordinator at {m.url} does not allow this: vic's token (view) cannot "
            f"join as a worker; that needs a worker token: ask whoever holds the main token for "
            f"one (they run `gpumesh token add NAME --role worker`) (HTTP 403)")
        # a .map with it: refused as submitting (not as its handoff probe, a side request)
        from gpumesh import AuthError, GPUMesh, accelerate
        viewer = GPUMesh(m.url, token=vic, output=False)
        with pytest.raises(AuthError) as refused:
            accelerate(viewer)(twice).map([1, 2])
        assert str(refused.value) == (
            f"the coordinator at {m.url} does not allow this: vic's token (view) cannot submit "
            f"jobs; that needs a submit token: ask whoever holds the main token for one (they "
            f"run `gpumesh token add NAME --role submit`) (HTTP 403)")
        viewer.close()
        # revoked: refused within a second, no restart
        r = cli(m, "token", "revoke", "alice")
        assert r.returncode == 0 and "revoked alice" in r.stdout
        t0 = time.monotonic()
        r = httpx.get(f"{m.url}/v1/jobs", headers=bearer(alice), timeout=5)
        assert r.status_code == 401 and time.monotonic() - t0 < 1.0
        assert cli(m, "token", "list", token=vic).returncode == 1
