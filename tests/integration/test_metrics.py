"""``GET /metrics`` against a live coordinator with a worker (one fake GPU + one CPU slot):
parsed with prometheus_client's own parser, values checked against a known workload."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Proc, wait_for
from tests.security.conftest import SecureMesh

METRICS_TOKEN = "metrics-token-abcdefghijklmnopqrstuvwxyz"
GPU = {"name": "Fake A100", "memory_total_mb": 81920, "memory_free_mb": 80000, "score": 5000,
       "utilization_pct": 37, "temperature_c": 64}
SCRIPT = ("import json, sys, time\nx = json.load(sys.stdin)\ntime.sleep(0.1)\n"
          "assert x != 'boom', 'boom'\nprint(json.dumps(x))\n")


def scrape(url, token) -> dict:
    r = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, metric, /, **labels):
    return samples[(metric, tuple(sorted(labels.items())))]


@pytest.fixture
def mesh(tmp_path):
    m = SecureMesh(tmp_path / "mesh")
    m.start(extra=["--metrics-token", METRICS_TOKEN])
    env = dict(m.env, GPUMESH_FAKE_GPUS=json.dumps([GPU]))
    m.procs.append(Proc(["join", m.url, "--cpu-slots", "1"], env, m.root / "worker.log"))
    m.wait_alive(1, m.procs[-1])
    yield m
    m.stop()


def test_metrics_report_a_known_workload(mesh, tmp_path):
    from gpumesh import GPUMesh
    admin = mesh.client()
    alice = GPUMesh(mesh.url, token=admin.add_token("alice")["token"], output=False)
    bob = GPUMesh(mesh.url, token=admin.add_token("bob")["token"], output=False)
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    a_job = alice.submit("a", script, [1, 2, 3, "boom"])
    b_job = bob.submit("b", script, [4, 5])
    alice.wait(a_job, timeout=60)
    bob.wait(b_job, timeout=60)

    s = scrape(mesh.url, METRICS_TOKEN)
    assert value(s, "gpumesh_tasks", state="done") == 5
    assert value(s, "gpumesh_tasks", state="failed") == 1
    assert value(s, "gpumesh_tasks", state="pending") == 0
    assert value(s, "gpumesh_queue_depth") == 0
    assert value(s, "gpumesh_jobs_active") == 0
    assert value(s, "gpumesh_workers", state="alive") == 1
    assert value(s, "gpumesh_workers", state="dead") == 0
    assert value(s, "gpumesh_slots", kind="gpu", state="free") == 1
    assert value(s, "gpumesh_slots", kind="cpu", state="free") == 1
    assert value(s, "gpumesh_slots", kind="gpu", state="busy") == 0
    wid = mesh.workers()[0]["id"]
    host = mesh.workers()[0]["hostname"]
    gpu = dict(worker=wid, host=host, gpu="0", name="Fake A100")
    assert value(s, "gpumesh_gpu_memory_total_bytes", **gpu) == 81920 * 2**20
    assert value(s, "gpumesh_gpu_memory_free_bytes", **gpu) == 80000 * 2**20
    # utilisation and temperature as the worker's heartbeats report them
    wait_for(lambda: ("gpumesh_gpu_temperature_celsius", tuple(sorted(gpu.items())))
             in scrape(mesh.url, METRICS_TOKEN), 15, "a heartbeat with the GPU's telemetry")
    s = scrape(mesh.url, METRICS_TOKEN)
    assert value(s, "gpumesh_gpu_temperature_celsius", **gpu) == 64
    assert value(s, "gpumesh_gpu_utilization_ratio", **gpu) == pytest.approx(0.37)
    # latencies: every task was leased once and answered once
    assert value(s, "gpumesh_lease_wait_seconds_count") == 6
    assert value(s, "gpumesh_result_latency_seconds_count", state="done") == 5
    assert value(s, "gpumesh_result_latency_seconds_count", state="failed") == 1
    assert value(s, "gpumesh_result_latency_seconds_sum", state="done") >= 5 * 0.1
    # per person: nothing left running, and task time as long as the sleeps at least
    for person, n in (("alice", 4), ("bob", 2)):
        secs = sum(value(s, "gpumesh_person_task_seconds", person=person, device=d, window="1d")
                   for d in ("cpu", "gpu"))
        assert n * 0.1 <= secs < 60, (person, secs)
        week = sum(value(s, "gpumesh_person_task_seconds", person=person, device=d, window="7d")
                   for d in ("cpu", "gpu"))
        assert week == pytest.approx(secs)
    assert not any(k[0] == "gpumesh_person_running_tasks" and v for k, v in s.items())
    assert value(s, "gpumesh_info", version=__import__("gpumesh").__version__) == 1


def test_a_running_sweep_shows_in_queue_depth_and_per_person(mesh, tmp_path):
    admin = mesh.client()
    script = tmp_path / "slow.py"
    script.write_text("import json, sys, time\njson.load(sys.stdin)\ntime.sleep(30)\nprint(1)\n")
    job = admin.submit("slow", script, list(range(5)))
    wait_for(lambda: scrape(mesh.url, METRICS_TOKEN)[("gpumesh_tasks", (("state", "leased"),))] == 2,
             30, "both slots busy")
    s = scrape(mesh.url, METRICS_TOKEN)
    assert value(s, "gpumesh_queue_depth") == 3
    assert value(s, "gpumesh_person_running_tasks", person="admin") == 2
    assert value(s, "gpumesh_person_pending_tasks", person="admin") == 3
    assert value(s, "gpumesh_slots", kind="gpu", state="busy") == 1
    assert value(s, "gpumesh_slots", kind="cpu", state="busy") == 1
    assert value(s, "gpumesh_jobs_active") == 1
    admin.cancel(job)


def test_metrics_need_a_token_and_the_metrics_token_opens_nothing_else(mesh):
    assert httpx.get(f"{mesh.url}/metrics", timeout=10).status_code == 401
    r = mesh.request("GET", "/metrics", token="wrong-token-0123456789abcdef")
    assert r.status_code == 401
    assert mesh.request("GET", "/metrics").status_code == 200  # the main token may
    for path in ("/v1/jobs", "/v1/workers", "/v1/tokens"):
        assert mesh.request("GET", path, token=METRICS_TOKEN).status_code == 401
    admin = mesh.client()
    viewer = admin.add_token("vic", "view")["token"]
    worker = admin.add_token("rig", "worker")["token"]
    assert mesh.request("GET", "/metrics", token=viewer).status_code == 200
    assert mesh.request("GET", "/metrics", token=worker).status_code == 403


def test_a_paused_workers_slots_count_as_closed_and_the_dashboard_says_why(mesh):
    import subprocess
    import sys
    wid = mesh.workers()[0]["id"]
    r = subprocess.run([sys.executable, "-m", "gpumesh", "pause", "--worker", wid],
                       env=dict(mesh.env, GPUMESH_URL=mesh.url), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: value(scrape(mesh.url, METRICS_TOKEN), "gpumesh_slots", kind="gpu", state="closed") == 1,
             15, "the pause to reach the coordinator")
    s = scrape(mesh.url, METRICS_TOKEN)
    assert value(s, "gpumesh_slots", kind="cpu", state="closed") == 1
    assert value(s, "gpumesh_slots", kind="cpu", state="free") == 0
    assert value(s, "gpumesh_slots", kind="gpu", state="free") == 0
    with httpx.Client(base_url=mesh.url, timeout=10) as ui:
        assert ui.post("/ui/login", json={"token": mesh.token}).status_code == 200
        (w,) = ui.get("/ui/api/state").json()["workers"]
    assert w["owner_labels"] == ["paused: owner"]
