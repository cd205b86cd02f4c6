"""Older jobs can be listed: ``GET /v1/jobs`` pages by ``before=JOB_ID`` and filters by
``owner`` and ``state`` (400 for a bad value), ``gpumesh jobs --before/--owner/--state``
and the dashboard's job list (``jobs_next``), on a live coordinator."""

from __future__ import annotations

import httpx
from click.testing import CliRunner

from gpumesh import GPUMesh
from gpumesh.cli import main
from gpumesh.coordinator import ui

SCRIPT = "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n"


def test_jobs_page_by_before_and_filter_by_owner_and_state(make_mesh, tmp_path):
    mesh = make_mesh(workers=0)  # (no worker: the jobs stay active until cancelled)
    admin = mesh.client(output=False)
    alice = GPUMesh(mesh.url, token=admin.add_token("alice")["token"], output=False)
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    made = [(who, who.submit(f"job{i}", script, [i])) for i, who in
            enumerate([admin, alice, admin, admin, alice, admin, alice])]
    newest_first = [jid for _, jid in reversed(made)]
    admin.cancel(made[2][1])
    alice.cancel(made[4][1])

    pages, before = [], None
    while True:
        page = [j["id"] for j in admin.jobs(limit=3, before=before)]
        pages.append(page)
        if len(page) < 3:
            break
        before = page[-1]
    assert pages == [newest_first[:3], newest_first[3:6], newest_first[6:]]
    assert [j["id"] for j in admin.jobs(limit=1000)] == newest_first

    alices = [jid for who, jid in reversed(made) if who is alice]
    assert [j["id"] for j in admin.jobs(owner="alice")] == alices
    assert [j["owner"] for j in admin.jobs(owner="admin")] == ["admin"] * 4
    assert [j["id"] for j in admin.jobs(owner="alice", before=alices[0])] == alices[1:]
    assert [j["id"] for j in admin.jobs(state="cancelled")] == [made[4][1], made[2][1]]
    assert [j["id"] for j in admin.jobs(state="cancelled", owner="alice")] == [made[4][1]]
    assert admin.jobs(owner="nobody") == []
    # (a person lists everyone's jobs, as before: the filter is a choice, not a right)
    assert [j["id"] for j in alice.jobs(owner="admin", limit=2)] == newest_first[1:2] + newest_first[3:4]

    def refusal(**params) -> str:
        r = httpx.get(f"{mesh.url}/v1/jobs", params=params, timeout=10,
                      headers={"authorization": f"Bearer {mesh.token}"})
        assert r.status_code == 400 and r.json()["error"] == "bad_request", r.text
        return r.json()["message"]
    assert refusal(before="zz!") == "query parameter 'before': job id 'zz!' is not a valid id"
    assert refusal(before="0123456789ab") == \
        "query parameter 'before': no job 0123456789ab here (it may have been purged)"
    assert refusal(owner="no one").startswith("query parameter 'owner' must be a person's name")
    assert refusal(state="done") == \
        "query parameter 'state' must be one of active, finished, cancelled, not 'done'"
    assert refusal(limit=0) == "query parameter 'limit' must be between 1 and 1000"

    # the CLI: a full page ends with the command for the next one (on stderr)
    env = {"GPUMESH_URL": mesh.url, "GPUMESH_TOKEN": mesh.token,
           "GPUMESH_CONFIG": mesh.env["GPUMESH_CONFIG"]}
    r = CliRunner().invoke(main, ["jobs", "--limit", "2", "--owner", "alice"], env=env)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["JOB", "CREATED", "STATE"]
    assert [ln.split()[0] for ln in lines[1:]] == alices[:2]
    assert r.stderr.strip() == f"older: gpumesh jobs --before {alices[1]} --limit 2 --owner alice"
    r = CliRunner().invoke(main, ["jobs", "--before", alices[1], "--limit", "2", "--owner", "alice",
                                  "--json"], env=env)
    assert r.exit_code == 0 and [j["id"] for j in __import__("json").loads(r.stdout)] == alices[2:]
    assert r.stderr == ""
    r = CliRunner().invoke(main, ["jobs", "--state", "cancelled", "--before", made[2][1]], env=env)
    assert r.exit_code == 0 and r.stdout.strip() == "no older jobs"
    r = CliRunner().invoke(main, ["jobs", "--state", "done"], env=env)
    assert r.exit_code == 2 and "'done' is not one of" in r.stderr
    r = CliRunner().invoke(main, ["jobs", "--before", "xyz"], env=env)  # not an id: usage, no request
    assert r.exit_code == 2 and "Invalid value for '--before'" in r.stderr and "HTTP" not in r.stderr
    r = CliRunner().invoke(main, ["jobs", "--before", "0123456789ab"], env=env)
    assert r.exit_code == 1 and r.stderr.strip() == (
        "Error: --before 0123456789ab: no such job on this coordinator (it may have been "
        "purged, or never existed): start from the newest with `gpumesh jobs`")

    # the dashboard's list: JOB_LIST at a time, then the older ones
    more = [admin.submit(f"more{i}", script, [i]) for i in range(ui.JOB_LIST - 5)]
    everything = list(reversed(more)) + newest_first
    with httpx.Client(base_url=mesh.url, timeout=30) as c:
        assert c.post("/ui/login", json={"token": mesh.token}).status_code == 200
        first = c.get("/ui/api/state").json()
        assert [j["id"] for j in first["jobs"]] == everything[:ui.JOB_LIST]
        assert first["jobs_next"] == everything[ui.JOB_LIST - 1]
        older = c.get("/ui/api/state", params={"before": first["jobs_next"]}).json()
        assert [j["id"] for j in older["jobs"]] == everything[ui.JOB_LIST:]
        assert older["jobs_next"] is None and len(older["workers"]) == 0
        r = c.get("/ui/api/state", params={"before": "0123456789ab"})
        assert r.status_code == 400 and "no job 0123456789ab" in r.json()["message"]
