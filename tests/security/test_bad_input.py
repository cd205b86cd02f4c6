"""Bad input at the boundary: 4xx naming the field, never 500, never a changed state.

Each case here is one the fuzz test might only stumble on; they are pinned as values.
"""

from __future__ import annotations

import json
import sys
import time

import cloudpickle
import pytest

from gpumesh import PayloadTooLarge, RequestRejected, wire

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def double(x):
    return 2 * x


def frames(meta, *payloads) -> bytes:
    chunks, _ = wire.pack_frames([json.dumps(meta).encode(), *payloads])
    return b"".join(bytes(c) for c in chunks)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from tests.security.conftest import SecureMesh
    m = SecureMesh(tmp_path_factory.mktemp("badinput"),
                   env={"GPUMESH_MAX_BODY_MB": "1", "GPUMESH_MAX_JSON_KB": "64"})
    m.start()
    m.join()
    yield m
    m.stop()


def registered(mesh) -> str:
    r = mesh.request("POST", "/v1/workers", json={"hostname": "probe"})
    assert r.status_code == 200
    return r.json()["id"]


def assert_400(r, field: str):
    assert r.status_code == 400, (r.status_code, r.text)
    body = r.json()
    assert body["error"] == "bad_request"
    assert field in body["message"], body


def test_heartbeat_with_a_string_score_is_refused_and_nothing_breaks(mesh):
    wid = registered(mesh)
    assert_400(mesh.request("POST", f"/v1/workers/{wid}/heartbeat", json={"score": "fast"}), "'score'")
    assert_400(mesh.request("POST", f"/v1/workers/{wid}/heartbeat", json={"score": 1e300}), "'score'")
    assert_400(mesh.request("POST", f"/v1/workers/{wid}/heartbeat", json={"running": ["x" * 5]}),
               "'running'")
    assert_400(mesh.request("POST", f"/v1/workers/{wid}/heartbeat", json={"running": "abcd"}), "'running'")
    listed = mesh.workers()
    probe = [w for w in listed if w["id"] == wid][0]
    assert probe["score"] is None  # unchanged: still pending (never measured)
    assert mesh.request("GET", "/v1/jobs").status_code == 200
    assert mesh.request("DELETE", f"/v1/workers/{wid}").status_code == 200


@pytest.mark.parametrize("body, field", [
    ({"hostname": "\ud800"}, "'hostname'"),                   # a lone surrogate
    ({"hostname": "h" * 5000}, "'hostname'"),
    ({"hostname": 7}, "'hostname'"),
    ({"slots": 0}, "'slots'"),
    ({"slots": True}, "'slots'"),
    ({"slots": 1.5}, "'slots'"),
    ({"cores": -1}, "'cores'"),
    ({"ram_mb": "lots"}, "'ram_mb'"),
    ({"gpus": "rtx"}, "'gpus'"),
    ({"gpus": [1, 2]}, "'gpus'"),
    ({"gpus": [{"name": "\udfff"}]}, "'gpus'"),
    ({"id": "not-hex!"}, "worker id"),
    ({"id": "abcd\n"}, "worker id"),
])
def test_register_refuses_bad_fields_by_name(mesh, body, field):
    before = len(mesh.workers())
    raw = json.dumps(body)  # json.dumps escapes the surrogate as \ud800, as an attacker would
    r = mesh.request("POST", "/v1/workers", content=raw, headers={"content-type": "application/json"})
    assert_400(r, field)
    assert len(mesh.workers()) == before
    assert mesh.request("GET", "/v1/workers").status_code == 200


def test_malformed_bodies(mesh):
    wid = registered(mesh)
    deep = "[" * 100_000 + "]" * 100_000
    r = mesh.request("POST", f"/v1/workers/{wid}/lease", content=deep[:60_000])
    assert r.status_code == 400 and "JSON" in r.json()["message"]
    assert mesh.request("POST", f"/v1/workers/{wid}/lease", content=b"[1]").json()["message"] == \
        "body must be a JSON object"
    r = mesh.request("POST", "/v1/jobs", content=b"GMF1\xff\xff\xff\xff")
    assert r.status_code == 400 and "frames" in r.json()["message"]
    r = mesh.request("POST", "/v1/jobs", content=frames(["not", "an", "object"]))
    assert_400(r, "frame 0")
    r = mesh.request("POST", "/v1/tasks/abcd1234/result?lease=abcd1234", content=frames({"status": "maybe"}))
    assert_400(r, "'status'")
    r = mesh.request("POST", "/v1/tasks/abcd1234/result?lease=abcd1234",
                     content=frames({"status": "error", "error": {"message": float("nan")}}))
    assert_400(r, "'error'")
    r = mesh.request("POST", "/v1/tasks/abcd1234/result", content=frames({"status": "ok"}, b"x"))
    assert_400(r, "lease id")
    r = mesh.request("GET", "/v1/jobs/abcd1234/results?after=nan")
    assert_400(r, "'after'")
    r = mesh.request("GET", "/v1/jobs/abcd1234/results?wait=1e9")
    assert_400(r, "'wait'")
    r = mesh.request("GET", "/v1/blobs/xyz")
    assert_400(r, "sha256")
    r = mesh.request("GET", "/v1/jobs/abcd1234/logs?task=..%2F..")
    assert_400(r, "task id")
    assert mesh.request("PATCH", "/v1/jobs").status_code == 405
    assert mesh.request("GET", "/v1/nothing").status_code == 404


def test_json_body_limit_is_named_and_configurable(mesh):
    r = mesh.request("POST", "/v1/workers", json={"hostname": "x", "pad": "y" * 100_000})
    assert r.status_code == 413
    assert r.json()["message"] == ("request body is over the coordinator's limit of 64 KiB "
                                   "(set GPUMESH_MAX_JSON_KB on the coordinator to raise it)")


def submit_meta(job_id: str, n: int, **kw) -> dict:
    blob = b"".join(bytes(c) for c in wire.dumps(double).chunks)
    import hashlib
    meta = {"job_id": job_id, "fn": hashlib.sha256(blob).hexdigest(), "fn_inline": True,
            "n_tasks": n, "require_worker": True, **kw}
    return meta, blob


@pytest.mark.parametrize("extra, field", [
    ({"wait": -1}, "'wait'"),
    ({"wait": "soon"}, "'wait'"),
    ({"output": "yes"}, "'output'"),
    ({"timeout": 0}, "'timeout'"),
    ({"costs": [1, "x"]}, "'costs'"),
    ({"costs": [1]}, "'costs'"),
    ({"name": "\ud800"}, "'name'"),
    ({"caller": {"host": "\udc00"}}, "'caller'"),
    ({"caller": "me"}, "'caller'"),
    ({"kind": "shell"}, "'kind'"),
    ({"result_format": "xml"}, "'result_format'"),
    ({"isolation": "process"}, "'isolation'"),
    ({"isolation": 1}, "'isolation'"),
    ({"kind": "script", "isolation": "job"}, "isolation='job' is for function jobs"),
    ({"n_tasks": 3}, "n_tasks"),
    ({"retries": 2}, "'retry_on'"),
    ({"retry_on": ["OSError"]}, "'retries'"),
    ({"retries": 99, "retry_on": ["OSError"]}, "'retries'"),
    ({"retries": True, "retry_on": ["OSError"]}, "'retries'"),
    ({"retries": 1, "retry_on": "OSError"}, "'retry_on'"),
    ({"retries": 1, "retry_on": ["os.system('x')"]}, "'retry_on'"),
    ({"retries": 1, "retry_on": ["A"] * 40}, "'retry_on'"),
])
def test_a_bad_submit_creates_no_job(mesh, extra, field):
    job_id = f"bad{abs(hash(field + json.dumps(extra))) % 10**9:09d}"
    meta, blob = submit_meta(job_id, 2)
    meta.update(extra)
    args = b"".join(bytes(c) for c in wire.dumps(((1,), {})).chunks)
    body = json.dumps(meta).encode()  # surrogates escaped, as a hostile client would send
    chunks, _ = wire.pack_frames([body, blob, args, args])
    r = mesh.request("POST", "/v1/jobs", content=b"".join(bytes(c) for c in chunks))
    assert_400(r, field)
    assert mesh.request("GET", f"/v1/jobs/{job_id}").status_code == 404
    assert all(j["id"] != job_id for j in mesh.request("GET", "/v1/jobs", params={"limit": 1000}).json())


def test_oversized_submit_is_refused_with_its_size_never_run_locally(mesh, no_local_fallback):
    c = mesh.client()
    big = b"x" * (2 * 2**20)  # over the 1 MiB limit this coordinator was started with
    t0 = time.monotonic()
    with pytest.raises(PayloadTooLarge) as info:
        c.run_calls(len, [((big,), {})])
    assert time.monotonic() - t0 < 20
    assert "1 MiB" in str(info.value) and "GPUMESH_MAX_BODY_MB" in str(info.value)
    # and the mesh still works for a normal call
    assert c.run_calls(double, [((21,), {})]) == [42]
    c.close()


def test_unknown_ids_and_stale_leases_are_clear_4xx(mesh):
    r = mesh.request("GET", "/v1/jobs/abcdef123456")
    assert r.status_code == 404 and r.json()["error"] == "unknown_job"
    r = mesh.request("POST", "/v1/workers/abcdef123456/lease", json={"wait": 0})
    assert r.status_code == 404 and r.json()["error"] == "unknown_worker"
    r = mesh.request("POST", "/v1/tasks/abcdef123456/result?lease=abcdef12",
                     content=frames({"status": "ok"}, b"x"))
    assert r.status_code == 409 and r.json()["error"] == "stale_lease"
    with pytest.raises(RequestRejected) as info:
        mesh.client().status("abcdef123456")
    assert info.value.status == 404
