"""Fair share between people on a real mesh: one coordinator, one worker with 2 slots.

Person A floods the pool with many jobs of 0.2 s tasks; person B then submits one task.
What is checked is *order*, read from the API, not speed: how many of A's tasks started
between B's submit and B's result (round-robin between jobs, as before people, lets
every one of A's jobs go first).
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import wait_for

SLEEPY = "import json, sys, time\nx = json.load(sys.stdin)\ntime.sleep(0.2)\nprint(json.dumps(x))\n"
A_JOBS, A_TASKS = 24, 10


def started(client, job_ids) -> dict[str, int]:
    """Tasks handed out (running or final) per job, from one job listing."""
    listed = client.http.request("GET", "/v1/jobs", params={"limit": 1000}, timeout=10).json()
    return {j["id"]: sum(v for k, v in j["counts"].items() if k != "pending")
            for j in listed if j["id"] in job_ids}


@pytest.fixture
def people(make_mesh, tmp_path):
    from gpumesh import GPUMesh
    mesh = make_mesh(workers=1, slots=2)
    admin = mesh.client(output=False)
    script = tmp_path / "sleepy.py"
    script.write_text(SLEEPY)

    def person(name, **kw):
        tok = admin.add_token(name, "submit", **kw)["token"]
        return GPUMesh(mesh.url, token=tok, output=False)
    yield admin, person, script
    admin.close()


def test_a_one_task_job_is_not_queued_behind_another_persons_many_jobs(people):
    admin, person, script = people
    a, b = person("alice"), person("bob")
    a_jobs = [a.submit(f"sweep{j}", script, list(range(A_TASKS))) for j in range(A_JOBS)]
    wait_for(lambda: sum(started(admin, a_jobs).values()) >= 4, 30, "alice's tasks to start")
    before = sum(started(admin, a_jobs).values())
    t0 = time.monotonic()
    b_job = b.submit("one", script, [7])
    between = None
    while between is None and time.monotonic() - t0 < 60:
        now = started(admin, set(a_jobs) | {b_job})
        if now.get(b_job):  # B's task has its slot: how many of A's started meanwhile?
            between = sum(v for k, v in now.items() if k != b_job) - before
    (res,) = b.wait(b_job, timeout=60)
    took = time.monotonic() - t0
    assert res["result"] == 7 and res["state"] == "done"
    # B's task took the next free slot: only the tasks already on their way to the two
    # slots began before it (taking turns between jobs instead, 24 of A's began first).
    assert between is not None and between <= 3, (between, took)
    jobs = {j["id"]: j["owner"] for j in admin.jobs(limit=100)}
    assert jobs[b_job] == "bob" and {jobs[j] for j in a_jobs} == {"alice"}
    for jid in a_jobs:
        a.cancel(jid)


def test_a_capped_person_never_holds_more_than_the_cap(people):
    admin, person, script = people
    a = person("alice", max_running=1)
    b = person("bob")
    a_job = a.submit("capped", script, list(range(8)))
    most = 0
    b_job, b_done_first = None, False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        view = a.http.request("GET", f"/v1/jobs/{a_job}", timeout=10).json()
        most = max(most, view["counts"].get("leased", 0))
        if b_job is None and view["counts"].get("done", 0) >= 1:
            b_job = b.submit("free slot", script, [1, 2])
        elif b_job is not None and not b_done_first:
            b_view = b.http.request("GET", f"/v1/jobs/{b_job}", timeout=10).json()
            b_done_first = b_view["state"] == "finished" and view["state"] == "active"
        if view["state"] != "active":
            break
        time.sleep(0.02)
    assert view["state"] == "finished" and view["counts"] == {"done": 8}
    assert most == 1  # she ran one at a time, though a second slot was free
    assert [r["result"] for r in b.wait(b_job, timeout=60)] == [1, 2]
    # bob used the slot alice could not: his job ended while hers still ran
    assert b_done_first
