"""The pool calls agree while scores are pending, and count what the spec says.

A real coordinator; the workers register over its HTTP API (the same request ``gpumesh
join`` sends), so each test decides their hosts, GPUs and when their scores arrive.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Mesh

RTX = {"index": 0, "name": "NVIDIA GeForce RTX 4090", "memory_total_mb": 24564, "memory_free_mb": 20000}


@pytest.fixture
def pool(tmp_path):
    m = Mesh(tmp_path)
    m.start()
    c = m.client(output=False)
    h = {"authorization": f"Bearer {m.token}"}

    def join(hostname: str, gpus=(), **extra) -> str:
        slots = [{"id": i, "kind": "cuda", "gpu": g["index"]} for i, g in enumerate(gpus)]
        slots.append({"id": len(slots), "kind": "cpu"})
        body = dict(hostname=hostname, slots=len(slots), slot_list=slots, gpus=list(gpus),
                    cores=8, ram_mb=16384, device="GPU" if gpus else "CPU", **extra)
        r = httpx.post(f"{m.url}/v1/workers", json=body, headers=h, timeout=5)
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def scored(wid: str, scores: dict) -> None:
        r = httpx.post(f"{m.url}/v1/workers/{wid}/heartbeat", headers=h, timeout=5,
                       json={"running": [], "scores": scores, "score": max(scores.values())})
        assert r.status_code == 200, r.text

    def leave(wid: str) -> None:
        assert httpx.delete(f"{m.url}/v1/workers/{wid}", headers=h, timeout=5).status_code < 300

    yield c, join, scored, leave
    c.close()
    m.stop()


def test_pending_scores_are_none_everywhere_and_total_is_a_float(pool):
    c, join, scored, _ = pool
    assert c.total_score() == 0.0 and type(c.total_score()) is float  # an empty pool
    a = join("box-a", [RTX])  # just joined: its benchmark has not reported yet
    [w] = c.workers()
    assert w["id"] == a and w["score"] is None
    assert [(d["device"], d["score"]) for d in c.devices()] == [("cuda:0", None), ("cpu", None)]
    assert c.total_score() == 0.0 and type(c.total_score()) is float
    assert float(c.total_score()) == 0.0

    scored(a, {"cuda:0": 3000.0, "cpu": 1.5})
    assert c.workers()[0]["score"] == 3000.0
    assert [(d["device"], d["score"]) for d in c.devices()] == [("cuda:0", 3000.0), ("cpu", 1.5)]
    assert c.total_score() == 3001.5

    join("box-b")  # a second machine, still pending: counted as nothing, not as an error
    assert {w["hostname"]: w["score"] for w in c.workers()} == {"box-a": 3000.0, "box-b": None}
    assert c.total_score() == 3001.5 and type(c.total_score()) is float
    assert c.auto_device()["device"] == "cuda:0"


def test_device_count_is_machines_and_gpu_count_is_gpus(pool):
    c, join, _, leave = pool
    assert (c.device_count(), c.gpu_count()) == (0, 0)
    a = join("box-a", [RTX])  # a PC with one GPU (and its CPU) is one machine
    assert len(c.devices()) == 2
    assert (c.device_count(), c.gpu_count()) == (1, 1)
    b = join("box-b")  # a CPU-only machine contributes compute too
    assert (c.device_count(), c.gpu_count()) == (2, 1)
    # a second worker on box-a offering the same GPU: still two machines and one GPU
    a2 = join("box-a", [RTX])
    assert (c.device_count(), c.gpu_count()) == (2, 1)
    # a second GPU on box-c
    join("box-c", [RTX, dict(RTX, index=1)])
    assert (c.device_count(), c.gpu_count()) == (3, 3)
    for wid in (a, a2, b):  # machines that left count no longer
        leave(wid)
    assert (c.device_count(), c.gpu_count()) == (1, 2)


def test_total_score_counts_each_device_of_a_machine_once(pool):
    # device_count() counts machines; the combined score adds up their devices, not the
    # workers that share them (it added a host's CPU once per worker started there).
    c, join, scored, _ = pool
    a = join("box-a", [RTX])
    scored(a, {"cuda:0": 3000.0, "cpu": 1.5})
    a2 = join("box-a", [RTX])  # a second worker on box-a, given the same GPU
    scored(a2, {"cuda:0": 2990.0, "cpu": 1.25})
    assert len(c.devices()) == 4  # devices() still lists each worker's
    assert (c.device_count(), c.gpu_count()) == (1, 1)
    assert c.total_score() == 3001.5  # box-a's GPU and CPU, once each, at their best
    b = join("box-b")
    assert c.total_score() == 3001.5  # box-b pending: nothing yet
    scored(b, {"cpu": 2.0})
    assert (c.device_count(), c.gpu_count(), c.total_score()) == (2, 1, 3003.5)
