"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright against a
live coordinator with two workers.

Sign in, see both workers, watch a job progress and finish, open a failed task's
traceback, cancel a running job and see its tasks stop; markup in a job name and in a
hostname stays text in the DOM. ``GPUMESH_SCREENSHOTS=DIR`` saves the pool and a job page
there (docs/ holds the ones made so).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_for

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="needs Debian's chromium (apt-get install chromium; .ci/run does)")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
XSS = "<img src=x onerror=alert(1)>"
HOST_XSS = "<b>lab</b><script>alert(2)</script>"
WORK = ("import json, sys, time\nx = json.load(sys.stdin)\nprint('working on', x, flush=True)\n"
        "time.sleep(x.get('sleep', 0.4) if isinstance(x, dict) else 0.4)\n"
        "assert x != 3, 'three is not allowed'\nprint(json.dumps(x))\n")


@pytest.fixture
def mesh(make_mesh):
    return make_mesh(workers=2)


@pytest.fixture
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, mesh):
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = ctx.new_page()
    pg.dialogs = []
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.refused = []  # (status, url) of each answer >= 400 the page got
    pg.on("response", lambda r: r.status >= 400 and pg.refused.append((r.status, r.url)))
    yield pg
    ctx.close()


def shot(page, name):
    where = os.environ.get("GPUMESH_SCREENSHOTS")
    if where:
        page.screenshot(path=str(Path(where) / name), full_page=True)


def sign_in(page, url, token):
    page.goto(f"{url}/ui")
    page.wait_for_selector("#signin:not([hidden])")
    page.fill("#token", token)
    page.click("#signin-btn")
    page.wait_for_selector("#workers")


def test_sign_in_watch_a_job_open_a_traceback_and_cancel(mesh, page, tmp_path):
    from gpumesh import GPUMesh
    admin = mesh.client(output=False)
    alice_token = admin.add_token("alice")["token"]
    alice = GPUMesh(mesh.url, token=alice_token, output=False)
    script = tmp_path / "work.py"
    script.write_text(WORK)

    # a wrong token is refused on the page itself
    page.goto(f"{mesh.url}/ui")
    page.fill("#token", "not-the-token-0123456789abcdef")
    page.click("#signin-btn")
    # (polled from here: the page's CSP, rightly, refuses the eval wait_for_function needs)
    wait_for(lambda: page.text_content("#signin-error"), 10, "the refusal")
    assert "refused" in page.text_content("#signin-error")
    assert page.locator("#workers").count() == 0

    sign_in(page, mesh.url, alice_token)
    wait_for(lambda: page.locator("tr.worker").count() == 2, 15, "both workers")
    ids = sorted(w["id"] for w in mesh.workers())
    assert sorted(page.eval_on_selector_all("tr.worker", "rs => rs.map(r => r.dataset.id)")) == ids
    assert page.locator("tr.worker .state.alive").count() == 2
    assert page.text_content("#me") == "alice (submit)"

    # a job's progress advances and it finishes
    job = alice.submit("sweep", script, [0, 1, 2, 4, 5, 6, 7, 8])
    page.goto(f"{mesh.url}/ui#/job/{job}")
    page.wait_for_selector("#job-progress")
    seen = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen.add(page.text_content("#job-progress"))
        if page.get_attribute("#job", "data-state") == "finished":
            break
        time.sleep(0.1)
    seen.add(page.text_content("#job-progress"))
    assert page.get_attribute("#job", "data-state") == "finished"
    assert "8/8" in seen and len(seen) >= 3, seen  # watched it move, not only the end
    assert page.locator("tr.task-row[data-state=done]").count() == 8
    page.wait_for_selector("#output pre.stdout")
    assert "working on" in page.text_content("#output")
    shot(page, "dashboard-job.png")

    # a failed task's error and remote traceback
    bad = alice.submit("has a bad one", script, [1, 3])
    page.goto(f"{mesh.url}/ui#/job/{bad}")
    page.wait_for_selector("#job[data-state=finished]", timeout=60_000)
    page.click("tr.task-row[data-state=failed] button.task-error")
    page.wait_for_selector("pre.traceback")
    tb = page.text_content("pre.traceback")
    assert "Traceback" in tb and "AssertionError" in tb and "three is not allowed" in tb
    assert "three is not allowed" in page.text_content(".error-message")
    page.wait_for_selector("#retry-btn")
    # re-run (it fails again): the output shows each attempt's, each under its own line
    assert alice.retry(bad) == 1
    wait_for(lambda: alice.status(bad)["state"] == "finished", 60, "the re-run")
    page.reload()
    page.wait_for_selector("#output p.attempt")
    assert [line.split(":", 1)[1].strip() for line in page.eval_on_selector_all(
        "#output p.attempt", "ps => ps.map(p => p.textContent)")] == [
        "failed; re-run by gpumesh retry", "failed"]
    assert page.text_content("#output").count("working on 3") == 2

    # cancel a running job: its tasks stop on the workers
    slow = alice.submit("slow", script, [{"sleep": 60}] * 4)
    page.goto(f"{mesh.url}/ui#/job/{slow}")
    page.wait_for_selector("tr.task-row[data-state=leased]", timeout=30_000)
    page.goto(f"{mesh.url}/ui#/")  # the pool while it runs: both slots busy, alice running 2
    wait_for(lambda: page.locator("tr.worker").count() == 2 and
             page.text_content("#workers").count("1 / 1") == 2, 15, "both slots busy")
    assert [c.strip() for c in page.eval_on_selector_all(
        "tr.person td", "ts => ts.map(t => t.textContent)")][:3] == ["alice", "2", "2"]
    shot(page, "dashboard-pool.png")
    page.goto(f"{mesh.url}/ui#/job/{slow}")
    page.wait_for_selector("#cancel-btn")
    page.click("#cancel-btn")
    page.wait_for_selector("#job[data-state=cancelled]", timeout=10_000)
    assert "Cancelled 4 task(s)" in page.text_content("#action-message")
    assert page.locator("tr.task-row[data-state=cancelled]").count() == 4
    wait_for(lambda: all(w["running"] == 0 for w in mesh.workers()), 15, "the workers to stop")
    assert alice.status(slow)["counts"] == {"cancelled": 4}

    page.goto(f"{mesh.url}/ui#/")
    page.wait_for_selector(f"tr.job-row[data-id='{slow}'] .state.cancelled")
    assert page.dialogs == [] and page.errors == []


def _paged(x):
    if x % 5 == 0:
        print(f"printed {x}")
    if x in (3, 117):
        raise ValueError(f"no {x}")
    return x


def test_a_big_jobs_tasks_and_output_page_through_and_filter_by_state(mesh, page):
    from gpumesh import accelerate
    from gpumesh.coordinator import ui
    admin = mesh.client(output=False)
    n = ui.TASK_PAGE + 30
    accelerate(admin)(_paged).map(range(n), return_exceptions=True)
    (job,) = [j["id"] for j in admin.jobs() if j["n_tasks"] == n]
    sign_in(page, mesh.url, mesh.token)
    page.goto(f"{mesh.url}/ui#/job/{job}")
    page.wait_for_selector("#tasks-next")

    def indexes():
        return [int(i) for i in page.eval_on_selector_all(
            "tr.task-row", "rs => rs.map(r => r.dataset.index)")]
    assert indexes() == list(range(ui.TASK_PAGE))  # one page, not the whole job
    assert page.text_content("#tasks-shown") == f"Showing {ui.TASK_PAGE} (#0–#{ui.TASK_PAGE - 1}) of {n}"
    assert page.is_disabled("#tasks-prev")
    # a .map's failed tasks are not re-run from here (its results are its caller's)
    assert page.locator("#cancel-btn, #retry-btn").count() == 0
    page.click("#tasks-next")
    wait_for(lambda: indexes() == list(range(ui.TASK_PAGE, n)), 10, "the second page")
    assert page.is_disabled("#tasks-next")
    time.sleep(1.5)  # the page polls on: it stays on the page it was sent to
    assert indexes() == list(range(ui.TASK_PAGE, n))
    page.click("#tasks-prev")
    wait_for(lambda: indexes() == list(range(ui.TASK_PAGE)), 10, "the first page again")

    # the state buttons carry the counts; one picks the failed tasks only
    labels = page.eval_on_selector_all("#task-filters button", "bs => bs.map(b => b.textContent)")
    assert labels == [f"all {n}", f"done {n - 2}", "failed 2"]
    page.click("#task-filters button[data-filter=failed]")
    wait_for(lambda: indexes() == [3, 117], 10, "the failed tasks")
    assert page.locator("tr.task-row[data-state=failed]").count() == 2
    assert page.locator("#tasks-next").count() == 0  # (one page: no pager)
    page.click("#task-filters button[data-filter=all]")
    wait_for(lambda: indexes() == list(range(ui.TASK_PAGE)), 10, "every task again")

    # the output of the tasks that printed, a page at a time
    printers = [i for i in range(n) if i % 5 == 0]

    def printed():
        return [int(h[1:]) for h in page.eval_on_selector_all("#output h3", "hs => hs.map(h => h.textContent)")]
    wait_for(lambda: printed() == printers[:ui.OUTPUT_PAGE], 10, "the first output page")
    assert page.text_content("#output-count") == f" ({len(printers)} tasks printed)"
    page.click("#output-next")
    wait_for(lambda: printed() == printers[ui.OUTPUT_PAGE:], 10, "the second output page")
    assert "printed 125" in page.text_content("#output")
    shot(page, "dashboard-big-job.png")
    assert page.dialogs == [] and page.errors == []


def test_the_job_list_pages_to_older_jobs(mesh, page, tmp_path):
    from gpumesh.coordinator import ui
    admin = mesh.client(output=False)
    script = tmp_path / "s.py"
    script.write_text("import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    made = [admin.submit(f"job {i}", script, [i]) for i in range(ui.JOB_LIST + 3)]
    newest_first = made[::-1]
    sign_in(page, mesh.url, mesh.token)

    def listed():
        return page.eval_on_selector_all("tr.job-row", "rs => rs.map(r => r.dataset.id)")
    wait_for(lambda: listed() == newest_first[:ui.JOB_LIST], 15, "the newest page")
    assert page.is_disabled("#jobs-prev") and page.text_content("#jobs-next") == "Older →"
    page.click("#jobs-next")
    wait_for(lambda: listed() == newest_first[ui.JOB_LIST:], 10, "the older jobs")
    assert page.is_disabled("#jobs-next")
    time.sleep(1.5)  # the page polls on: it stays on the older page
    assert listed() == newest_first[ui.JOB_LIST:]
    page.click(f"tr.job-row[data-id='{made[0]}'] a.job-link")  # an old job's page, and back
    page.wait_for_selector(f"#job[data-id='{made[0]}']")
    page.go_back()
    wait_for(lambda: listed() == newest_first[ui.JOB_LIST:], 10, "the older page again")
    page.click("#jobs-prev")
    wait_for(lambda: listed() == newest_first[:ui.JOB_LIST], 10, "the newest again")
    assert page.dialogs == [] and page.errors == []


def test_markup_in_job_names_and_hostnames_stays_text(mesh, page, tmp_path):
    admin = mesh.client(output=False)
    script = tmp_path / "s.py"
    script.write_text("import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    job = admin.submit(XSS, script, [1])
    r = httpx.post(f"{mesh.url}/v1/workers", json={"hostname": HOST_XSS, "slots": 1},
                   headers={"authorization": f"Bearer {mesh.token}"}, timeout=10)
    assert r.status_code == 200
    sign_in(page, mesh.url, mesh.token)
    wait_for(lambda: page.locator("tr.worker").count() == 3, 15, "three workers")
    page.wait_for_selector(f"tr.job-row[data-id='{job}']")
    assert page.text_content(f"tr.job-row[data-id='{job}'] a.job-link") == XSS
    hosts = page.eval_on_selector_all("tr.worker .hostname", "es => es.map(e => e.textContent)")
    assert HOST_XSS in hosts
    # a worker not scored yet says so, as `gpumesh workers` does (not 0.000)
    scores = page.eval_on_selector_all(
        "tr.worker", "rs => rs.map(r => [r.querySelector('.hostname').textContent, r.cells[3].textContent])")
    assert [score for host, score in scores if host == HOST_XSS] == ["pending"]
    # the markup was never parsed: no element came of it anywhere in the document
    assert page.eval_on_selector_all("main img", "es => es.length") == 0
    assert page.eval_on_selector_all("main b, main script", "es => es.length") == 0
    page.goto(f"{mesh.url}/ui#/job/{job}")
    page.wait_for_selector("#job-name")
    assert page.text_content("#job-name") == XSS
    assert page.eval_on_selector_all("#job img", "es => es.length") == 0
    time.sleep(1.5)  # a few polls: an onerror or script would have run by now
    assert page.dialogs == [] and page.errors == []
    # nothing the page asked for was missing; the one refusal is the state asked for
    # before signing in
    assert [r for r in page.refused if r[0] != 401] == []
    # the page names its own icon (else the browser asks for /favicon.ico, a 404 in the
    # console at every load) and it is served
    href = page.get_attribute("link[rel=icon]", "href")
    icon = httpx.get(f"{mesh.url}/{href}", timeout=10)
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert icon.content.startswith(b"<svg")


def test_the_pool_and_a_job_fit_a_phone_screen(mesh, browser, tmp_path):
    admin = mesh.client(output=False)
    script = tmp_path / "s.py"
    script.write_text("import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    job = admin.submit("a rather long job name for a narrow screen " * 2, script, [1, 2])
    admin.wait(job, timeout=60)
    ctx = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    page = ctx.new_page()
    try:
        sign_in(page, mesh.url, mesh.token)
        wait_for(lambda: page.locator("tr.worker").count() == 2, 15, "both workers")
        for where in ("#/", f"#/job/{job}"):
            page.goto(f"{mesh.url}/ui{where}")
            page.wait_for_selector("#workers" if where == "#/" else "#job")
            # nothing wider than the screen: tables scroll inside their own boxes
            assert page.evaluate("document.documentElement.scrollWidth") <= 390, where
        shot(page, "dashboard-phone.png")
    finally:
        ctx.close()
