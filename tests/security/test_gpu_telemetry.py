"""A heartbeat's GPU utilisation and temperature (shown on the dashboard and /metrics) are
checked like every field: bad values are refused and never stored."""

from __future__ import annotations

import warnings

import pytest

from gpumesh.coordinator.app import create_app
from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store

MAIN = "main-token-0123456789abcdefghij"


@pytest.fixture
def client(tmp_path, cheap_kdf):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
        store = Store(tmp_path / "d")
        c = TestClient(create_app(Coordinator(store), MAIN), client=("192.0.2.1", 1),
                       headers={"authorization": f"Bearer {MAIN}"})
    yield c
    c.close()
    store.close()


@pytest.mark.parametrize("tele", [
    [], "hot", {"x": {}}, {"0": {"temperature_c": 999}}, {"0": {"utilization_pct": -1}},
    {"0": {"utilization_pct": True}}, {"0": {"fan": 3}}, {"0": 5},
    {str(i): {} for i in range(300)},
])
def test_bad_gpu_telemetry_is_refused_and_kept_out(client, tele):
    wid = client.post("/v1/workers", json={"hostname": "h", "gpus": [{"index": 0, "name": "G"}]}).json()["id"]
    r = client.post(f"/v1/workers/{wid}/heartbeat", json={"gpu_telemetry": tele})
    assert r.status_code == 400 and "gpu_telemetry" in r.json()["message"], r.text
    (w,) = client.get("/v1/workers").json()
    assert "temperature_c" not in w["gpus"][0] and "gpu_telemetry" not in w


def test_good_gpu_telemetry_lands_on_its_gpu(client):
    wid = client.post("/v1/workers", json={"hostname": "h", "gpus": [{"index": 0, "name": "G"},
                                                                      {"index": 1, "name": "G"}]}).json()["id"]
    r = client.post(f"/v1/workers/{wid}/heartbeat",
                    json={"gpu_telemetry": {"1": {"temperature_c": 61, "utilization_pct": 12.5}}})
    assert r.status_code == 200
    (w,) = client.get("/v1/workers").json()
    assert "temperature_c" not in w["gpus"][0]
    assert w["gpus"][1]["temperature_c"] == 61 and w["gpus"][1]["utilization_pct"] == 12.5
