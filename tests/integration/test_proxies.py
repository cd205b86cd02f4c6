"""A real nginx, and a real Caddy, in front of the coordinator under a path prefix
(``/gpumesh/``), each running the config docs/network.md gives: workers join, calls and
``.map`` run, the CLI reads and cancels jobs, same-machine handoff still hands big payloads
over as files, and refused tokens lock out the client the proxy names in
``X-Forwarded-For`` (``--trusted-proxy``).

The clients connect to the proxy from chosen loopback addresses (127.0.0.3, 127.0.0.4...),
so its ``X-Forwarded-For`` names a different client each time, as it would for machines
on other networks; the coordinator only ever sees the proxy's 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import cloudpickle
import httpx
import numpy as np
import pytest

from gpumesh import accelerate
from gpumesh.limits import AUTH_FAIL_MAX, HANDOFF_MIN_BYTES

from ..conftest import Mesh, Proc, free_port, wait_for
from ..proxies import Caddy, Nginx

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = HANDOFF_MIN_BYTES // 4 + 1000  # float32: just over the handoff threshold


def origin(a) -> str:
    """What the memory of array ``a`` belongs to ("mmap" for a handed-over file)."""
    b = a
    while True:
        nxt = b.base if isinstance(b, np.ndarray) else getattr(b, "obj", None)
        if nxt is None:
            return type(b).__name__
        b = nxt


def square(x):
    return x * x


def inc_and_say(a):
    return a + 1, origin(a)


@pytest.fixture(scope="module", params=[Nginx, Caddy], ids=["nginx", "caddy"])
def fronted(request, tmp_path_factory):
    """(mesh, proxy, url): a coordinator trusting 127.0.0.1 as its proxy, one worker joined
    through the proxy at ``url`` (``http://127.0.0.1:PORT/gpumesh/``)."""
    root = tmp_path_factory.mktemp(request.param.name)
    mesh = Mesh(root / "mesh")
    mesh.env["GPUMESH_PROGRESS"] = "0"
    mesh.start(extra=["--trusted-proxy", "127.0.0.1/32"])
    try:
        proxy = request.param(root / request.param.name, free_port(), mesh.port)
    except BaseException:
        mesh.stop()
        raise
    url = f"http://127.0.0.1:{proxy.port}/gpumesh/"
    try:
        worker = Proc(["join", url], mesh.env, root / "worker.log")
        mesh.procs.append(worker)
        mesh.wait_alive(1, worker)
        yield mesh, proxy, url
    finally:
        mesh.stop()
        proxy.stop()


def cli(mesh, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=mesh.env,
                          capture_output=True, text=True, timeout=60)


def test_the_worker_joined_and_calls_and_map_run_through_the_prefix(fronted):
    mesh, proxy, url = fronted
    from gpumesh import GPUMesh
    client = GPUMesh(url, token=mesh.token, output=False)
    try:
        remote = accelerate(client)(square)
        assert remote(7) == 49
        assert remote.map(range(6)) == [0, 1, 4, 9, 16, 25]
        assert [w["alive"] for w in client.workers()] == [True]
    finally:
        client.close()
    seen = proxy.requests_seen()
    # the worker's and the caller's requests all went through the proxy, under the prefix
    assert any(r.startswith("POST /gpumesh/v1/workers ") for r in seen), seen[:20]
    assert any(r.startswith("POST /gpumesh/v1/jobs") for r in seen), seen[:20]
    assert any("/gpumesh/v1/workers/" in r and "/lease" in r for r in seen), seen[:20]
    assert not [r for r in seen if " /v1/" in r]  # nothing lost its prefix


def test_same_machine_handoff_through_the_prefix(fronted):
    mesh, proxy, url = fronted
    from gpumesh import GPUMesh
    client = GPUMesh(url, token=mesh.token, output=False)
    try:
        a = np.arange(N, dtype=np.float32)
        out, arg_origin = accelerate(client)(inc_and_say)(a)
    finally:
        client.close()
    assert np.array_equal(out, a + 1)
    assert arg_origin == "mmap"  # the worker mapped the argument's file
    assert origin(out) == "mmap"  # and the caller the result's
    assert any(r.startswith("GET /gpumesh/v1/handoff ") for r in proxy.requests_seen())


def test_the_cli_reads_and_cancels_a_job_through_the_prefix(fronted):
    mesh, proxy, url = fronted
    from gpumesh import GPUMesh
    script = mesh.root / "slow.py"
    script.write_text("import json, sys, time\njson.load(sys.stdin)\ntime.sleep(60)\n")
    client = GPUMesh(url, token=mesh.token, output=False)
    try:
        job = client.submit(name="slow", script=script, payloads=[{"i": 1}, {"i": 2}])
    finally:
        client.close()
    r = cli(mesh, "status", job, "--url", url, "--json")
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert view["id"] == job and sum(view["counts"].values()) == 2
    r = cli(mesh, "cancel", job, "--url", url, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"job_id": job, "cancelled": 2, "state": "cancelled"}
    r = cli(mesh, "workers", "--url", url, "--json")
    assert r.returncode == 0, r.stderr
    assert [w["alive"] for w in json.loads(r.stdout)] == [True]
    assert any(f"/gpumesh/v1/jobs/{job}/cancel" in line for line in proxy.requests_seen())


def through(proxy, source: str, token: str, xff: str | None = None) -> httpx.Response:
    """GET /gpumesh/v1/jobs through the proxy, connecting from loopback address ``source``."""
    headers = {"authorization": f"Bearer {token}"}
    if xff:
        headers["x-forwarded-for"] = xff
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10) as c:
        return c.get(f"http://127.0.0.1:{proxy.port}/gpumesh/v1/jobs", headers=headers)


def test_refused_tokens_through_the_proxy_lock_out_that_client_only(fronted):
    mesh, proxy, url = fronted
    guess = "guess-guess-guess-guess-guess"
    codes = [through(proxy, "127.0.0.3", guess).status_code for _ in range(AUTH_FAIL_MAX)]
    assert codes == [401] * (AUTH_FAIL_MAX - 1) + [429]
    r = through(proxy, "127.0.0.3", mesh.token)  # the right token, from the locked-out client
    assert r.status_code == 429 and "127.0.0.3" in r.json()["message"]
    assert int(r.headers["retry-after"]) > 0
    # claiming to be someone else in its own X-Forwarded-For changes nothing
    assert through(proxy, "127.0.0.3", mesh.token, xff="198.51.100.9").status_code == 429
    # another client behind the same proxy, and the worker, are still served
    assert through(proxy, "127.0.0.4", mesh.token).status_code == 200
    assert wait_for(lambda: mesh.alive() == 1, 5, "the worker to stay alive")


def test_the_dashboard_signs_in_and_out_through_the_prefix(fronted):
    # the page, its script and its API calls all live under /gpumesh/ui, and so must its
    # session cookie and the same-origin check of a state change (here: sign out)
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    from .test_dashboard_browser import ARGS, CHROMIUM
    if not os.path.exists(CHROMIUM):
        pytest.skip("needs Debian's chromium")
    mesh, proxy, url = fronted
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{url}ui/")  # the trailing slash lands on the page too
            page.wait_for_selector("#signin:not([hidden])", timeout=15_000)
            page.fill("#token", mesh.token)
            page.click("#signin-btn")
            wait_for(lambda: page.locator("tr.worker").count() == 1, 15, "the worker listed")
            assert [c["path"] for c in page.context.cookies()] == ["/gpumesh/ui"]
            page.click("#signout")
            page.wait_for_selector("#signin:not([hidden])", timeout=15_000)
            wait_for(lambda: page.context.cookies() == [], 10, "the session cookie cleared")
        finally:
            browser.close()
