"""The owner's fields and the hand-back route at the boundary: 400 naming the field,
409 for a stale lease, never a 500 and never a changed state."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from tests.security.conftest import SecureMesh
    m = SecureMesh(tmp_path_factory.mktemp("ownerinput"))
    m.start()
    yield m
    m.stop()


def registered(mesh, **extra) -> str:
    r = mesh.request("POST", "/v1/workers", json={"hostname": "probe", **extra})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def probe(mesh, wid: str) -> dict:
    return next(w for w in mesh.workers() if w["id"] == wid)


@pytest.mark.parametrize("body, field", [
    ({"owner": "paused"}, "owner"),
    ({"owner": {"state": "asleep", "label": "zzz"}}, "owner.state"),
    ({"owner": {"state": "paused", "label": "x" * 81}}, "owner.label"),
    ({"owner": {"state": "paused", "label": "ok", "until": "soon"}}, "owner.until"),
    ({"owner": {"state": "paused", "label": "ok", "why": 1}}, "owner"),
    ({"gpu_states": [1]}, "gpu_states"),
    ({"gpu_states": {"zero": {"state": "hot", "label": "hot"}}}, "gpu_states"),
    ({"gpu_states": {"0": {"state": "paused", "label": "p"}}}, "gpu_states.0.state"),
])
def test_bad_owner_fields_are_refused_by_name(mesh, body, field):
    wid = registered(mesh)
    for path in (f"/v1/workers/{wid}/heartbeat", "/v1/workers"):
        r = mesh.request("POST", path, json=dict(body, hostname="probe") if path == "/v1/workers" else body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"] == "bad_request" and field in r.json()["message"]
    w = probe(mesh, wid)
    assert w.get("owner") is None and not w.get("gpu_states")   # nothing changed


def test_owner_fields_are_kept_and_cleared(mesh):
    wid = registered(mesh, owner={"state": "outside_hours", "label": "outside hours"})
    assert probe(mesh, wid)["owner"] == {"state": "outside_hours", "label": "outside hours"}
    r = mesh.request("POST", f"/v1/workers/{wid}/heartbeat",
                     json={"owner": None, "gpu_states": {}})
    assert r.status_code == 200
    assert probe(mesh, wid)["owner"] is None and probe(mesh, wid)["gpu_states"] == {}


@pytest.mark.parametrize("query, body, status, field", [
    ("lease=abcdef12", {"reason": "paused: owner"}, 409, "stale_lease"),
    ("", {"reason": "paused: owner"}, 400, "lease id"),
    ("lease=abcdef12", {"reason": 5}, 400, "reason"),
    ("lease=abcdef12", {"reason": "a\nb"}, 400, "reason"),
    ("lease=abcdef12", {"reason": "x" * 201}, 400, "reason"),
])
def test_hand_back_refusals(mesh, query, body, status, field):
    r = mesh.request("POST", f"/v1/tasks/abcdef123456/release?{query}", json=body)
    assert r.status_code == status, r.text
    assert field in (r.json()["error"] + r.json()["message"])
    r = mesh.request("POST", "/v1/tasks/abcdef123456/release?lease=abcdef12", content=b"{not json")
    assert r.status_code == 400
