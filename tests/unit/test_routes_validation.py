"""Validation at the boundary, in process: each route's body is read through its declared
schema (coordinator/schemas.py), and a bad field gets a 400 naming it, changing nothing.
The OpenAPI document is generated from the same declarations."""

from __future__ import annotations

import json

import pytest

from gpumesh import protocol, wire
from gpumesh._version import __version__
from gpumesh.coordinator import schemas
from gpumesh.limits import LONG_POLL_MAX_S, MAX_STRING_CHARS, MAX_TASKS_PER_JOB

from .routes_app import MAIN, WORKER, api_fixture

api = api_fixture

WID = "0123456789ab"


@pytest.mark.parametrize("body, message", [
    ({"slots": 0}, "field 'slots' must be between 1 and 1024, got 0"),
    ({"slots": 2.5}, "field 'slots' must be an integer"),
    ({"slots": True}, "field 'slots' must be a number, got bool"),
    ({"hostname": 3}, "field 'hostname' must be a string"),
    ({"hostname": None}, "field 'hostname' is required"),
    ({}, "field 'hostname' is required"),
    ({"hostname": "  "}, "field 'hostname' must not be empty"),
    ({"platform": "x" * (MAX_STRING_CHARS + 1)},
     f"field 'platform' is longer than {MAX_STRING_CHARS} characters"),
    ({"cores": -1}, "field 'cores' must be between 0 and 1000000000000.0, got -1"),
    ({"score": None}, "field 'score' is required"),  # present but null: as before the split
    ({"id": "not-hex"}, "worker id 'not-hex' is not a valid id"),
    ({"gpus": {"0": 1}}, "field 'gpus' must be a list of objects (at most 256)"),
    ({"allow_installs": "yes"}, "field 'allow_installs' must be bool, got str"),
])
def test_register_refuses_a_bad_field_naming_it(api, body, message):
    assert api.refusal("POST", protocol.WORKERS, 400, "bad_request", json=body) == message
    assert api.coord.workers == {}


def test_register_refuses_another_version_named_in_the_body(api):
    body = {"hostname": "box", "version": "0.0.1"}
    message = api.refusal("POST", protocol.WORKERS, 409, "version_mismatch", json=body)
    assert "runs gpumesh 0.0.1" in message and f"runs gpumesh {__version__}" in message
    assert api.coord.workers == {}
    body["version"] = __version__
    assert api.call("POST", protocol.WORKERS, json=body).status_code == 200
    assert [w.info["hostname"] for w in api.coord.workers.values()] == ["box"]


def test_register_keeps_what_the_schema_read(api):
    r = api.call("POST", protocol.WORKERS, token=WORKER,
                 json={"hostname": "box", "slots": 2, "cores": 8, "allow_installs": True,
                       "owner": None, "packages": {"numpy": "2.0"}})
    assert r.status_code == 200
    w = api.coord.workers[r.json()["id"]]
    assert w.slots == 2
    assert {k: w.info[k] for k in ("hostname", "cores", "score", "allow_installs", "owner", "packages")} \
        == {"hostname": "box", "cores": 8, "score": 0.0, "allow_installs": True, "owner": None,
            "packages": {"numpy": "2.0"}}
    assert [s["kind"] for s in w.info["slot_list"]] == ["cpu", "cpu"]


@pytest.mark.parametrize("body, message", [
    ({"running": ["zz"]}, "field 'running' must be a list of task ids (at most "),
    ({"running": "abcd"}, "field 'running' must be list, got str"),
    ({"score": "fast"}, "field 'score' must be a number, got str"),
    ({"receiving": "yes"}, "field 'receiving' must be bool, got str"),
    ({"gpu_telemetry": {"0": {"utilization_pct": 120}}},
     "gpu_telemetry.0.utilization_pct must be a number from 0 to 100"),
])
def test_heartbeat_refuses_a_bad_field(api, body, message):
    wid = api.worker()
    got = api.refusal("POST", protocol.worker_heartbeat(wid), 400, "bad_request", json=body)
    assert got.startswith(message)


@pytest.mark.parametrize("body, message", [
    ({"slots": 1025}, "field 'slots' must be between 1 and 1024, got 1025"),
    ({"wait": LONG_POLL_MAX_S + 1}, f"field 'wait' must be between 0 and {LONG_POLL_MAX_S}, "
                                    f"got {LONG_POLL_MAX_S + 1}"),
    ({"handoff": 1}, "field 'handoff' must be bool, got int"),
])
def test_lease_refuses_a_bad_field(api, body, message):
    wid = api.worker()
    assert api.refusal("POST", protocol.worker_lease(wid), 400, "bad_request", json=body) == message


def test_json_bodies_that_are_not_objects(api):
    assert api.refusal("POST", protocol.WORKERS, 400, "bad_request", content=b"[1]") \
        == "body must be a JSON object"
    assert api.refusal("POST", protocol.WORKERS, 400, "bad_request", content=b"{") \
        == "body is not valid JSON"


@pytest.mark.parametrize("fields, message", [
    ({"job_id": None}, "field 'job_id' is required"),
    ({"job_id": "XYZ"}, "job id 'XYZ' is not a valid id"),
    ({"kind": "shell"}, "field 'kind' must be 'function' or 'script'"),
    ({"result_format": "xml"}, "field 'result_format' must be 'pickle' or 'json'"),
    ({"kind": "script", "isolation": "job"},
     "script jobs always run one process per task: isolation='job' is for function jobs"),
    ({"fn": "abc"}, "field 'fn' must be a sha256 hex digest"),
    ({"n_tasks": MAX_TASKS_PER_JOB + 1},
     f"field 'n_tasks' must be between 0 and {MAX_TASKS_PER_JOB}, got {MAX_TASKS_PER_JOB + 1}"),
    ({"n_tasks": 3}, "n_tasks is 3 but the body carries 3 payload frames"),
    ({"timeout": 0}, "field 'timeout' must be between 0.001 and 31536000, got 0"),
    ({"costs": [1, -1]}, "field 'costs' must hold one number >= 0 per task"),
    ({"costs": [1]}, "field 'costs' must hold one number >= 0 per task"),
    ({"caller": {"x": float("nan")}},
     "field 'caller' holds a value that is not plain JSON (non-finite number or invalid text)"),
    ({"retries": 2}, "field 'retry_on'"),
])
def test_submit_refuses_a_bad_meta_field_and_stores_nothing(api, fields, message):
    got = api.refusal("POST", protocol.JOBS, 400, "bad_request",
                      content=_submit_body(api, fields))
    assert got.startswith(message), got
    assert api.store.recent_job_ids(10) == []


def _submit_body(api, fields: dict) -> bytes:
    blob, fn = api.fn_blob()
    meta = {"job_id": "abcdef01", "fn": fn, "fn_inline": True, "n_tasks": 2}
    meta.update(fields)
    meta = {k: v for k, v in meta.items() if v is not None}
    args = [wire.dumps(((i,), {})) for i in range(2)]
    head = json.dumps(meta).encode()
    chunks, _ = wire.pack_frames([head, blob, *args])
    return b"".join(bytes(c) for c in chunks)


def test_submit_reads_its_defaults_from_the_schema(api):
    api.worker()
    r = api.submit()
    assert r.status_code == 200 and r.json() == {"job_id": "abcdef01", "n_tasks": 2, "created": True}
    job = api.coord.jobs["abcdef01"]
    assert job.kind == "function" and job.meta == {"timeout": None, "name": "", "caller": {"loopback": False}}
    assert api.store.recent_job_ids(5) == ["abcdef01"]
    # an id typed in capitals is the same job (ids are made and stored in lower case)
    r = api.call("GET", protocol.job("ABCDEF01"))
    assert r.status_code == 200 and r.json()["id"] == "abcdef01"


def test_result_meta_and_hand_back_and_output_validation(api):
    path = protocol.task_result("abcd1234") + "?lease=beef"
    head = wire.pack_frames([json.dumps({"status": "done"}).encode()])[0]
    assert api.refusal("POST", path, 400, "bad_request", content=b"".join(bytes(c) for c in head)) \
        == "field 'status' must be ok, error or retry"
    head = wire.pack_frames([json.dumps({"status": "ok"}).encode()])[0]
    assert api.refusal("POST", path, 400, "bad_request", content=b"".join(bytes(c) for c in head)) \
        == "an ok result needs a payload frame"
    missing = "query parameter 'lease' is missing: the lease id the task was granted under"
    for route in (protocol.task_result, protocol.task_output, protocol.task_release):
        assert api.refusal("POST", route("deadbeef"), 400, "bad_request", content=b"") == missing
        assert api.refusal("POST", route("deadbeef") + "?lease=", 400, "bad_request", content=b"") == missing
    assert api.refusal("POST", protocol.task_result("abcd1234") + "?lease=no!", 400, "bad_request",
                       content=b"") == "lease id 'no!' is not a valid id"
    back = protocol.task_release("abcd1234") + "?lease=beef"
    assert api.refusal("POST", back, 400, "bad_request", json={"reason": "a\nb"}) \
        == "field 'reason' must be a printable line of at most 200 characters"
    out = protocol.task_output("abcd1234") + "?lease=beef"
    one = b"".join(bytes(c) for c in wire.pack_frames([b"{}", b"x"])[0])
    assert api.refusal("POST", out, 400, "bad_request", content=one) \
        == "output needs two frames: stdout, stderr"


def test_a_result_asking_for_a_bad_slot_is_refused_before_anything_is_stored(api):
    wid = api.worker(slots=1)
    assert api.submit().status_code == 200
    r = api.call("POST", protocol.worker_lease(wid), json={"slots": 1, "free": [0]})
    (grant,) = protocol.TaskGrant.list_from_dict(json.loads(bytes(wire.unpack_frames(bytearray(r.content))[0])))
    head = b"".join(bytes(c) for c in wire.pack_frames([json.dumps({"status": "ok"}).encode(), b"v"])[0])
    path = protocol.task_result(grant.task_id) + f"?lease={grant.lease_id}&next=1&slot=99999"
    assert api.refusal("POST", path, 400, "bad_request", content=head) \
        == "query parameter 'slot' must be a slot id"
    # the result was not stored: the lease is still current, and a good post lands
    assert api.coord.leases[grant.task_id].lease_id == grant.lease_id
    path = protocol.task_result(grant.task_id) + f"?lease={grant.lease_id}&next=1&slot=0"
    r = api.call("POST", path, content=head)
    assert r.status_code == 200, r.text
    (nxt,) = protocol.TaskGrant.list_from_dict(json.loads(bytes(wire.unpack_frames(bytearray(r.content))[0])))
    assert (nxt.index, nxt.slot) == (1, 0)
    assert {t["index"]: t["state"] for t in api.store.task_rows("abcdef01")} == {0: "done", 1: "leased"}


def test_release_many_and_tokens_validation(api):
    assert api.refusal("POST", protocol.JOBS_RELEASE, 400, "bad_request", json={"jobs": []}) \
        == f"field 'jobs' must be a list of 1 to {schemas.MAX_RELEASE_JOBS} job ids"
    assert api.refusal("POST", protocol.JOBS_RELEASE, 400, "bad_request", json={}) \
        == "field 'jobs' is required"
    assert api.refusal("POST", protocol.TOKENS, 400, "bad_request",
                       json={"name": "ann", "max_running": 0}).startswith(
        "field 'max_running' must be between 1 and ")
    r = api.call("POST", protocol.TOKENS, json={"name": "ann"})
    assert r.status_code == 200 and r.json()["role"] == "submit"
    assert api.refusal("POST", protocol.TOKENS, 409, "exists", json={"name": "ann"})


def test_query_parameters_and_path_ids(api):
    assert api.refusal("GET", protocol.JOBS + "?limit=0", 400, "bad_request") \
        == "query parameter 'limit' must be between 1 and 1000"
    assert api.refusal("GET", protocol.job_results("abcd1234") + "?wait=soon", 400, "bad_request") \
        == "query parameter 'wait' must be a number"
    assert api.refusal("GET", protocol.job("NOPE"), 400, "bad_request") \
        == "job id 'NOPE' is not a valid id"
    assert api.refusal("GET", protocol.blob("abc"), 400, "bad_request") \
        == "blob name must be a sha256 hex digest"


def test_ids_a_person_gives_are_taken_in_capitals_wherever_they_go(api):
    """A path took a job id in capitals (``gpumesh jobs`` lists them in lower case, people
    type them either way), but a query's ``before=``/``task=`` and a body's ``jobs`` were
    400s: every id a person gives is read the one way (schemas.user_id)."""
    api.worker()
    assert api.submit().status_code == 200
    r = api.submit(job_id="ABCDEF02")  # a raw-API caller's own id, in capitals
    assert r.status_code == 200 and r.json()["job_id"] == "abcdef02"
    assert api.store.recent_job_ids(5) == ["abcdef02", "abcdef01"]
    r = api.call("GET", protocol.JOBS + "?before=ABCDEF02")
    assert r.status_code == 200, r.text
    assert [j["id"] for j in r.json()] == ["abcdef01"]
    task = api.store.task_rows("abcdef01")[1]["id"]
    r = api.call("GET", protocol.job_logs("ABCDEF01") + f"?task={task.upper()}")
    assert r.status_code == 200, r.text
    assert r.json()["job_id"] == "abcdef01" and [t["id"] for t in r.json()["tasks"]] == [task]
    r = api.call("POST", protocol.JOBS_ALIVE, json={"jobs": ["ABCDEF01", "abcdef02"]})
    assert r.status_code == 200 and r.json() == {"alive": 2}, r.text
    r = api.call("POST", protocol.JOBS_RELEASE, json={"jobs": ["ABCDEF01", "abcdef01"]})
    assert r.status_code == 200 and r.json() == {"released": 1}, r.text
    # the dashboard's job view, too
    assert api.client.post("/ui/login", json={"token": MAIN}).status_code == 200
    r = api.client.get("/ui/api/jobs/ABCDEF02")
    assert r.status_code == 200 and r.json()["id"] == "abcdef02", r.text
    # what is not an id is still refused, named as the person wrote it
    assert api.refusal("GET", protocol.JOBS + "?before=NOPE", 400, "bad_request") \
        == "query parameter 'before': job id 'NOPE' is not a valid id"
    assert api.refusal("GET", protocol.job_logs("abcdef02") + "?task=XYZ", 400, "bad_request") \
        == "task id 'XYZ' is not a valid id"
    assert api.refusal("POST", protocol.JOBS_ALIVE, 400, "bad_request",
                       json={"jobs": ["ABCDEF01", "XYZ"]}) \
        == f"field 'jobs' must be a list of 1 to {schemas.MAX_RELEASE_JOBS} job ids"
    # ids only machines send stay exact: gpumesh makes them in lower case
    assert api.refusal("POST", protocol.task_result(task) + "?lease=BEEF", 400, "bad_request",
                       content=b"") == "lease id 'BEEF' is not a valid id"
    wid = api.worker()
    assert api.refusal("POST", protocol.worker_heartbeat(wid), 400, "bad_request",
                       json={"running": [task.upper()]}).startswith(
        "field 'running' must be a list of task ids")


def test_openapi_request_bodies_are_the_declared_schemas(api):
    spec = api.call("GET", protocol.OPENAPI, token=None).json()
    components = spec["components"]["schemas"]
    for body in schemas.BODIES:
        assert components[body.name] == body.json_schema()
        for f in body.fields:  # the bounds the validator enforces are the ones described
            prop = components[body.name]["properties"][f.name]
            if f.lo is not None:
                assert prop["minimum"] == f.lo, (body.name, f.name)
            if f.hi is not None:
                assert prop["maximum"] == f.hi, (body.name, f.name)
    assert components["JobSubmit"]["required"] == ["job_id", "fn", "n_tasks"]
    assert components["LeaseRequest"]["properties"]["slots"] == {
        "type": "integer", "minimum": 1, "maximum": 1024}
    refs = json.dumps(spec["paths"])
    for body in schemas.BODIES:
        assert f'"#/components/schemas/{body.name}"' in refs, body.name


@pytest.mark.parametrize("body, path, field", [
    (schemas.REGISTRATION, protocol.WORKERS, "slots"),
    (schemas.LEASE_REQUEST, "lease", "wait"),
    (schemas.NEW_TOKEN, protocol.TOKENS, "max_running"),
])
def test_one_past_a_described_bound_is_refused_naming_the_field(api, body, path, field):
    f = next(f for f in body.fields if f.name == field)
    if path == "lease":
        path = protocol.worker_lease(api.worker())
    extra = {"name": "bob"} if body is schemas.NEW_TOKEN else {}
    message = api.refusal("POST", path, 400, "bad_request", json={field: f.hi + 1, **extra})
    assert message.startswith(f"field {field!r} must be between {f.lo} and {f.hi}")


def test_json_bodies_are_read_whatever_their_content_type_on_every_json_route(api):
    """One rule for the API's JSON routes (register, heartbeat, lease, hand-back, tokens,
    release): the body is JSON whatever the Content-Type says, as curl's ``-d`` sends it.
    Every such route needs a bearer token, which a browser does not attach to a
    cross-site request without asking first, so a form's ``text/plain`` post cannot act
    for anyone; only the dashboard's cookie-based sign-in refuses other types (415)."""
    plain = {"content-type": "text/plain"}
    r = api.call("POST", "/v1/workers", content=json.dumps({"hostname": "w", "slots": 1}), headers=plain)
    assert r.status_code == 200, r.text
    wid = r.json()["id"]
    r = api.call("POST", protocol.worker_heartbeat(wid), content=json.dumps({"running": []}), headers=plain)
    assert r.status_code == 200, r.text
    r = api.call("POST", "/ui/login", token=None, content=json.dumps({"token": "x"}), headers=plain)
    assert r.status_code == 415
