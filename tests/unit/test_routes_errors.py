"""Refusals, in process: the coordinator's errors carry their status and code and are
answered by the app's one handler; auth refusals (401, 403, 429 with Retry-After); a bug
in a route is a 500 that leaves the app serving."""

from __future__ import annotations

import logging

import pytest

from gpumesh import protocol, wire
from gpumesh.coordinator import model
from gpumesh.coordinator.core import JobReleased, NoWorkers, StaleLease, UnknownJob
from gpumesh.limits import AUTH_FAIL_MAX
from gpumesh.protocol import ErrorCode

from .routes_app import WORKER, api_fixture

api = api_fixture


@pytest.mark.parametrize("exc, status, code, message", [
    (model.NoWorkers(), 409, "no_workers", "no worker is alive in the mesh"),
    (model.UnknownWorker("ab12"), 404, "unknown_worker", "worker is not registered (register again)"),
    (model.UnknownJob("ab12"), 404, "unknown_job", "no such job ab12"),
    (model.Unsatisfiable("no GPU here"), 409, "unsatisfiable", "no GPU here"),
    (model.JobReleased("ab12"), 410, "released",
     "job ab12 cannot be retried: its results belong to the caller that submitted it "
     "(a function call or .map) or were already collected; call or submit it again"),
    (model.JobReleased("ab12", "gone"), 410, "released", "gone"),
    (model.StaleLease("t1"), 409, "stale_lease", "this lease is no longer current"),
    (model.StaleLease("t1", "why"), 409, "stale_lease", "this lease is no longer current (why)"),
    (model.HTTPError(418, ErrorCode.BAD_REQUEST, "teapot"), 418, "bad_request", "teapot"),
])
def test_each_error_carries_its_status_code_and_message(exc, status, code, message):
    assert (exc.status, exc.code, exc.message) == (status, code, message)
    assert ErrorCode(exc.code) == code


def test_core_reexports_the_model_classes():
    from gpumesh.coordinator import core
    for name in ("NoWorkers", "UnknownWorker", "UnknownJob", "Unsatisfiable", "JobReleased",
                 "StaleLease", "Worker", "Lease", "Job", "Grant"):
        assert getattr(core, name) is getattr(model, name)


def test_a_core_error_raised_anywhere_in_a_route_is_answered_by_the_handler(api, monkeypatch):
    def fail(*a, **kw):
        raise NoWorkers()
    monkeypatch.setattr(api.coord, "worker_view", fail)
    api.worker()
    assert api.refusal("GET", protocol.WORKERS, 409, "no_workers") == "no worker is alive in the mesh"


def test_unknown_worker_and_job(api):
    assert api.refusal("POST", protocol.worker_heartbeat("abcd1234"), 404, "unknown_worker",
                       json={}) == "worker is not registered (register again)"
    assert api.refusal("POST", protocol.worker_lease("abcd1234"), 404, "unknown_worker", json={})
    assert api.refusal("GET", protocol.job("abcd1234"), 404, "unknown_job") == "no such job abcd1234"
    assert api.refusal("POST", protocol.job_cancel("abcd1234"), 404, "unknown_job")
    assert api.refusal("GET", protocol.job_logs("abcd1234"), 404, "unknown_job")


def test_submit_without_a_worker_and_one_no_worker_can_run(api):
    assert api.refusal("POST", protocol.JOBS, 409, "no_workers", content=_body(api, require_worker=True)) \
        == "no worker is alive in the mesh"
    api.worker()
    message = api.refusal("POST", protocol.JOBS, 409, "unsatisfiable",
                          content=_body(api, require={"gpu": "cuda"}))
    assert "cuda" in message
    assert api.store.recent_job_ids(5) == []


def _body(api, **fields) -> bytes:
    import json
    blob, fn = api.fn_blob()
    meta = {"job_id": "abcdef01", "fn": fn, "fn_inline": True, "n_tasks": 1, **fields}
    chunks, _ = wire.pack_frames([json.dumps(meta).encode(), blob, wire.dumps(((), {}))])
    return b"".join(bytes(c) for c in chunks)


def _leased(api) -> tuple[str, dict]:
    wid = api.worker()
    assert api.submit().status_code == 200
    r = api.call("POST", protocol.worker_lease(wid), token=WORKER, json={"slots": 1})
    meta = wire.unpack_frames(r.content)[0]
    import json
    task = json.loads(bytes(meta))["tasks"][0]
    return wid, task


def test_stale_lease_answers(api):
    wid, task = _leased(api)
    stale = "?lease=" + "0" * 16
    ok = b"".join(bytes(c) for c in wire.pack_frames([b'{"status": "ok"}', wire.dumps(1)])[0])
    assert api.refusal("POST", protocol.task_result(task["task_id"]) + stale, 409, "stale_lease",
                       content=ok, token=WORKER) \
        == "this lease is no longer current (the task was re-queued or already has a result)"
    assert api.refusal("POST", protocol.task_release(task["task_id"]) + stale, 409, "stale_lease",
                       json={}, token=WORKER) == "this lease is no longer current"
    out = b"".join(bytes(c) for c in wire.pack_frames([b"{}", b"o", b"e"])[0])
    assert api.refusal("POST", protocol.task_output(task["task_id"]) + stale, 409, "stale_lease",
                       content=out, token=WORKER) == "this lease is no longer current"
    # under the current lease the result is taken, and a second post of it is stale
    good = f"?lease={task['lease_id']}"
    assert api.call("POST", protocol.task_result(task["task_id"]) + good, content=ok,
                    token=WORKER).status_code == 200
    assert api.refusal("POST", protocol.task_result(task["task_id"]) + good, 409, "stale_lease",
                       content=ok, token=WORKER)


def test_released_answers(api):
    api.worker()
    assert api.submit().status_code == 200
    assert api.refusal("POST", protocol.job_retry("abcdef01"), 410, "released").startswith(
        "job abcdef01 cannot be retried")
    assert api.call("POST", protocol.job_cancel("abcdef01")).json()["cancelled"] == 2
    assert api.call("POST", protocol.job_release("abcdef01")).json() == {"released": True}
    assert "abcdef01" not in api.coord.jobs and api.store.job_exists("abcdef01")
    assert api.refusal("GET", protocol.job_results("abcdef01"), 410, "released") \
        == "job abcdef01 was cancelled and released; `gpumesh status abcdef01` says why"


def test_auth_refusals(api):
    assert api.refusal("GET", protocol.WORKERS, 401, "unauthorized", token=None)
    assert api.refusal("POST", protocol.JOBS, 403, "forbidden", token=WORKER, content=b"") \
        == "the worker token cannot submit jobs; this needs the main token"
    assert api.refusal("GET", protocol.TOKENS, 403, "forbidden", token=WORKER) \
        == "the worker token cannot list tokens; this needs the main token"
    assert api.refusal("GET", protocol.job("abcd1234"), 409, "version_mismatch",
                       headers={"user-agent": "gpumesh/0.0.1 (python 3.11)"}).startswith("this ")
    for _ in range(AUTH_FAIL_MAX):
        api.call("GET", protocol.WORKERS, token="wrong-token-wrong-token-wrong")
    r = api.call("GET", protocol.WORKERS)  # even the right token, from a locked-out address
    assert r.status_code == 429 and r.json()["error"] == "locked_out"
    assert int(r.headers["retry-after"]) >= 1
    assert api.call("GET", protocol.HEALTH, token=None).status_code == 200  # open routes stay open


def test_a_bug_in_a_route_is_a_500_and_the_app_keeps_serving(api, monkeypatch, caplog):
    def broken(*a, **kw):
        raise ZeroDivisionError("oops")
    monkeypatch.setattr(api.coord, "deregister", broken)
    with caplog.at_level(logging.ERROR, logger="gpumesh.coordinator"):
        assert api.refusal("DELETE", protocol.worker("abcd1234"), 500, "internal") \
            == "internal error; see the coordinator log"
    assert "error handling DELETE /v1/workers/abcd1234" in caplog.text
    assert api.call("GET", protocol.WORKERS).status_code == 200


def test_unmatched_routes_and_methods(api):
    assert api.refusal("GET", "/v1/nothing", 404, "not_found") == "no route GET /v1/nothing"
    assert api.refusal("PATCH", protocol.JOBS, 405, "method_not_allowed") \
        == "PATCH is not allowed on /v1/jobs"
    r = api.call("POST", "/api/register", token=None)
    assert r.status_code == 426 and "another project" in r.json()["error"]


def test_every_registered_route_is_a_protocol_template(api):
    from gpumesh.coordinator.routes import ENDPOINTS
    assert {ep.path for ep in ENDPOINTS} <= protocol.TEMPLATES
    served = {r.path for r in api.app.routes}
    assert {ep.path for ep in ENDPOINTS} <= served


def test_exceptions_raised_by_core_keep_their_identity():
    # the routes catch and re-raise these by class; core still raises the same classes
    assert issubclass(StaleLease, model.CoordinatorError)
    assert JobReleased is model.JobReleased and UnknownJob is model.UnknownJob
