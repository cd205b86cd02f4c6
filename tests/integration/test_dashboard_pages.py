"""The dashboard's job page on a live coordinator reads a job a page at a time: its
counts, one page of tasks (by state, by cursor) and the output of only the tasks that
printed, also after a restart (their logs on disk). (The page itself, in Chromium:
test_dashboard_browser.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from gpumesh import accelerate
from gpumesh.coordinator import ui

N = 66  # tasks: every third prints (22 of them), two fail


def _work(x):
    if x % 3 == 0:
        print(f"line {x}")
    if x in (7, 29):
        raise ValueError(f"bad {x}")
    return x


@contextmanager
def _signed_in(mesh) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mesh.url, timeout=30) as c:
        assert c.post("/ui/login", json={"token": mesh.token}).status_code == 200
        yield c


def test_a_jobs_tasks_and_output_come_a_page_at_a_time(make_mesh):
    mesh = make_mesh(workers=2)
    admin = mesh.client(output=False)
    got = accelerate(admin)(_work).map(range(N), return_exceptions=True)
    assert [isinstance(v, ValueError) for v in got].count(True) == 2
    (job,) = [j["id"] for j in admin.jobs() if j["n_tasks"] == N]
    with _signed_in(mesh) as c:
        whole = c.get(f"/ui/api/jobs/{job}").json()
        assert whole["counts"] == {"done": N - 2, "failed": 2} and whole["n_tasks"] == N
        assert [t["index"] for t in whole["tasks"]] == list(range(N))  # (fits one default page)
        assert whole["page"] == {"state": "all", "after": -1, "limit": ui.TASK_PAGE, "next_after": None}
        assert all(t["duration_s"] is not None and t["duration_s"] >= 0 for t in whole["tasks"])

        pages, after = [], -1
        while after is not None:
            p = c.get(f"/ui/api/jobs/{job}", params={"after": after, "limit": 25}).json()
            pages.append([t["index"] for t in p["tasks"]])
            after = p["page"]["next_after"]
        assert pages == [list(range(25)), list(range(25, 50)), list(range(50, N))]

        failed = c.get(f"/ui/api/jobs/{job}", params={"state": "failed"}).json()
        assert [(t["index"], t["state"], t["error"]["type"]) for t in failed["tasks"]] == \
            [(7, "failed", "ValueError"), (29, "failed", "ValueError")]
        assert "bad 29" in failed["tasks"][1]["error"]["message"]
        assert failed["counts"] == whole["counts"]  # the counts come with every page
        one = c.get(f"/ui/api/jobs/{job}", params={"state": "failed", "limit": 1}).json()
        assert [t["index"] for t in one["tasks"]] == [7] and one["page"]["next_after"] == 7
        assert c.get(f"/ui/api/jobs/{job}", params={"state": "leased"}).json()["tasks"] == []

        for params, message in (({"state": "bogus"}, "query parameter 'state' must be one of"),
                                ({"limit": 0}, "query parameter 'limit' must be between 1"),
                                ({"limit": ui.TASK_PAGE_MAX + 1}, "query parameter 'limit'"),
                                ({"after": "x"}, "query parameter 'after' must be a number")):
            r = c.get(f"/ui/api/jobs/{job}", params=params)
            assert r.status_code == 400 and r.json()["error"] == "bad_request", (params, r.text)
            assert r.json()["message"].startswith(message), r.json()
        assert c.get(f"/ui/api/jobs/{job}/output", params={"after": -2}).status_code == 400

        printers = [i for i in range(N) if i % 3 == 0]
        assert ui.OUTPUT_PAGE < len(printers)

        def output_pages() -> list[list[int]]:
            out, after = [], -1
            while after is not None:
                p = c.get(f"/ui/api/jobs/{job}/output", params={"after": after}).json()
                assert p["printed"] == len(printers)
                for t in p["tasks"]:
                    assert [r["stdout"] for r in t["runs"]] == [f"line {t['index']}\n"]
                out.append([t["index"] for t in p["tasks"]])
                after = p["next_after"]
            return out
        assert output_pages() == [printers[:ui.OUTPUT_PAGE], printers[ui.OUTPUT_PAGE:]]
    # a restarted coordinator finds which tasks printed from their logs on disk
    mesh.restart()
    with _signed_in(mesh) as c:
        assert output_pages() == [printers[:ui.OUTPUT_PAGE], printers[ui.OUTPUT_PAGE:]]
