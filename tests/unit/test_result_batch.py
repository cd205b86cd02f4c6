"""``POST /v1/tasks/results`` against an in-process coordinator: each result fenced by its
own lease, a slot's queue of grants in the answer, and the batch's checks at the boundary."""

from __future__ import annotations

import hashlib
import json
import warnings

import pytest

from gpumesh import protocol, wire
from gpumesh.coordinator.app import create_app
from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store
from gpumesh.limits import INLINE_BLOB_BYTES
from gpumesh.protocol import BatchedResult, JobSubmit, LeaseRequest, ResultBatch, TaskGrant

MAIN = "main-token-0123456789abcdefghij"
WORKER = "worker-token-0123456789abcdefgh"


@pytest.fixture
def coordinator(tmp_path):
    """``(TestClient, Coordinator)`` of an in-process coordinator with a worker token."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
        store = Store(tmp_path / "data")
        coord = Coordinator(store)
        c = TestClient(create_app(coord, MAIN, worker_token=WORKER), client=("192.0.2.7", 40000))
    yield c, coord
    c.close()
    store.close()


def _auth(tok: str = MAIN) -> dict:
    return {"authorization": f"Bearer {tok}"}


def _body(frames: list[bytes]) -> bytes:
    chunks, _ = wire.pack_frames(frames)
    return b"".join(bytes(x) for x in chunks)


def _setup(c, n_tasks: int, isolation: str | None = "job", slots: int = 1) -> None:
    r = c.post(protocol.WORKERS, json={"slots": slots, "hostname": "box"}, headers=_auth(WORKER))
    assert r.status_code == 200, r.text
    assert protocol.FEATURE_RESULT_BATCH in r.json()["features"]
    blob = b"not really a function"
    submit = JobSubmit(job_id="00aa11bb22cc", fn=hashlib.sha256(blob).hexdigest(),
                       n_tasks=n_tasks, fn_inline=True, isolation=isolation)
    args = [f"a{i}".encode() for i in range(n_tasks)]
    r = c.post(protocol.JOBS, content=_body([json.dumps(submit.as_dict()).encode(), blob, *args]),
               headers=_auth())
    assert r.status_code == 200, r.text


def _worker_id(c) -> str:
    return c.get(protocol.WORKERS, headers=_auth()).json()[0]["id"]


def _lease(c, wid: str, free: list[int]) -> list[TaskGrant]:
    r = c.post(protocol.worker_lease(wid), json=LeaseRequest(slots=len(free), free=free).as_dict(),
               headers=_auth(WORKER))
    assert r.status_code == 200, r.text
    return TaskGrant.list_from_dict(json.loads(bytes(wire.unpack_frames(bytearray(r.content))[0])))


def _post(c, results: list[BatchedResult], payloads: list[bytes], **kw):
    meta = ResultBatch(tuple(results), **kw)
    r = c.post(protocol.TASKS_RESULTS, content=_body([json.dumps(meta.as_dict()).encode(), *payloads]),
               headers=_auth(WORKER))
    return r


def _answer(r) -> tuple[dict, list[bytes]]:
    frames = wire.unpack_frames(bytearray(r.content))
    return json.loads(bytes(frames[0])), [bytes(f) for f in frames[1:]]


def _results(c) -> dict[int, tuple[str, bytes | None]]:
    r = c.get(protocol.job_results("00aa11bb22cc"), params={"after": -1}, headers=_auth())
    frames = wire.unpack_frames(bytearray(r.content))
    page = protocol.ResultPage.from_dict(json.loads(bytes(frames[0])))
    payloads = iter(frames[1:])
    return {it.index: (it.state, bytes(next(payloads)) if it.has_payload else None)
            for it in page.results}


def test_a_batch_with_one_stale_lease_lands_the_others_and_refuses_that_one(coordinator):
    c, coord = coordinator
    _setup(c, 3, slots=3)
    wid = _worker_id(c)
    g = _lease(c, wid, [0, 1, 2])
    assert len(g) == 3
    # the first task's lease goes stale: its worker was thought lost and it was re-queued
    coord._requeue([g[0].task_id], reason="test: lease taken away")
    r = _post(c, [BatchedResult(g[0].task_id, g[0].lease_id, "ok", has_payload=True),
                  BatchedResult(g[1].task_id, g[1].lease_id, "ok", has_payload=True),
                  BatchedResult(g[2].task_id, g[2].lease_id, "error",
                                error={"kind": "raised", "type": "ValueError", "message": "no"})],
              [b"v0", b"v1"])
    assert r.status_code == 200, r.text
    head, _ = _answer(r)
    assert [x["task_id"] for x in head["refused"]] == [g[0].task_id]
    assert head["refused"][0]["error"] == "stale_lease"
    assert head["tasks"] == []
    got = _results(c)
    assert got[g[1].index] == ("done", b"v1")
    assert got[g[2].index][0] == "failed"
    assert g[0].index not in got  # its stale result did not land: the task runs again
    again = _lease(c, wid, [0])
    assert [t.task_id for t in again] == [g[0].task_id] and again[0].attempt == 2


def test_the_answer_queues_grants_for_a_slot_and_each_is_a_lease(coordinator):
    c, coord = coordinator
    _setup(c, 6)
    wid = _worker_id(c)
    (g0,) = _lease(c, wid, [0])
    r = _post(c, [BatchedResult(g0.task_id, g0.lease_id, "ok", has_payload=True)], [b"r0"],
              next={0: 4}, idle=[0])
    head, args = _answer(r)
    grants = TaskGrant.list_from_dict(head)
    assert len(grants) == 4 and {t.slot for t in grants} == {0}
    assert args == [f"a{t.index}".encode() for t in grants]
    assert head["refused"] == []
    # queued grants are leases, re-queued when the worker goes; only one of them runs
    assert {t.task_id for t in grants} <= set(coord.leases)
    assert coord.running_by_owner()[coord.jobs["00aa11bb22cc"].owner] == 1
    assert coord.deregister(wid) == 4
    assert not coord.leases


def test_a_per_task_process_job_fills_the_queue_it_asks_for_too(coordinator):
    c, _ = coordinator
    _setup(c, 6, isolation=None)
    wid = _worker_id(c)
    (g0,) = _lease(c, wid, [0])
    r = _post(c, [BatchedResult(g0.task_id, g0.lease_id, "ok", has_payload=True)], [b"r0"],
              next={0: 4}, idle=[0])
    assert [t["index"] for t in _answer(r)[0]["tasks"]] == [1, 2, 3, 4]


@pytest.mark.parametrize("meta, frames, says", [
    ({"results": []}, [], "1 to 256 results"),
    ({"results": [{"task_id": "abcd", "lease_id": "beef", "status": "ok"}]}, [],
     "needs a payload frame"),
    ({"results": [{"task_id": "abcd", "lease_id": "beef", "status": "done",
                   "has_payload": True}]}, [b"x"], "ok, error or retry"),
    ({"results": [{"task_id": "abcd", "lease_id": "beef", "status": "ok", "has_payload": True}]},
     [], "one payload frame per result"),
    ({"results": [{"task_id": "ab/cd", "lease_id": "beef", "status": "retry"}]}, [], "task id"),
    ({"results": [{"task_id": "abcd", "lease_id": "beef", "status": "retry"}] * 2}, [],
     "more than once"),
    ({"results": [{"task_id": "abcd", "lease_id": "beef", "status": "retry"}],
      "next": {"0": 99}}, [], "field 'next'"),
    ({"results": [{"task_id": "abcd", "lease_id": "beef", "status": "retry"}],
      "next": {"x": 1}}, [], "field 'next'"),
    ({"results": [{"task_id": "abcd", "lease_id": "beef", "status": "retry"}],
      "next": {"0": 1}, "idle": [1]}, [], "field 'idle'"),
])
def test_a_malformed_batch_is_refused_whole_and_changes_nothing(coordinator, meta, frames, says):
    c, coord = coordinator
    _setup(c, 1)
    (g,) = _lease(c, _worker_id(c), [0])
    r = c.post(protocol.TASKS_RESULTS, content=_body([json.dumps(meta).encode(), *frames]),
               headers=_auth(WORKER))
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "bad_request" and says in r.json()["message"]
    assert coord.leases[g.task_id].lease_id == g.lease_id


def test_a_batch_round_trips_what_the_agent_sends():
    d = {"results": [{"task_id": "ab12", "lease_id": "cd34", "status": "ok", "has_payload": True}],
         "handoff": False, "next": {"0": 3}, "idle": [0]}
    assert ResultBatch.from_dict(d).as_dict() == d


def test_a_person_with_a_max_running_cap_gets_no_queue(coordinator):
    c, coord = coordinator
    _setup(c, 6)
    wid = _worker_id(c)
    (g0,) = _lease(c, wid, [0])
    coord.max_running[coord.jobs["00aa11bb22cc"].owner] = 4
    r = _post(c, [BatchedResult(g0.task_id, g0.lease_id, "ok", has_payload=True)], [b"r0"],
              next={0: 4}, idle=[0])
    assert len(_answer(r)[0]["tasks"]) == 1, "a queued grant would count against the cap"


def test_each_queued_grant_carries_the_keys_and_values_of_a_lease_answer(coordinator):
    c, coord = coordinator
    r = c.post(protocol.WORKERS, json={"slots": 1, "hostname": "box", "allow_installs": True},
               headers=_auth(WORKER))  # (it may build the job's environment)
    assert r.status_code == 200, r.text
    blob = b"not really a function"
    fn = hashlib.sha256(blob).hexdigest()
    submit = JobSubmit(job_id="00aa11bb22cc", fn=fn, n_tasks=4, fn_inline=True, isolation="job",
                       name="squares", timeout=7.5, require={"requires": ["numpy>=1"]})
    r = c.post(protocol.JOBS, content=_body([json.dumps(submit.as_dict()).encode(), blob,
                                             *[f"a{i}".encode() for i in range(4)]]), headers=_auth())
    assert r.status_code == 200, r.text
    wid = _worker_id(c)
    (g0,) = _lease(c, wid, [0])
    r = _post(c, [BatchedResult(g0.task_id, g0.lease_id, "ok", has_payload=True)], [b"r0"],
              next={0: 3}, idle=[0])
    head, args = _answer(r)
    leases = {tid: lease.lease_id for tid, lease in coord.leases.items()}
    assert head["tasks"] == [
        {"task_id": t["task_id"], "job_id": "00aa11bb22cc", "index": i, "lease_id": leases[t["task_id"]],
         "attempt": 1, "kind": "function", "fn": fn, "timeout": 7.5, "name": "squares", "slot": 0,
         "result_format": "pickle", "isolation": "job", "requires": ["numpy>=1"]}
        for i, t in zip((1, 2, 3), head["tasks"])]
    assert [list(t) for t in head["tasks"]] == [[
        "task_id", "job_id", "index", "lease_id", "attempt", "kind", "fn", "timeout", "name",
        "slot", "result_format", "isolation", "requires"]] * 3, "the wire's key order"
    assert args == [b"a1", b"a2", b"a3"]


def test_a_store_failure_mid_batch_keeps_what_was_stored_and_the_store_usable(coordinator):
    c, coord = coordinator
    _setup(c, 4, slots=2)
    wid = _worker_id(c)
    g = _lease(c, wid, [0, 1])
    real, calls = coord.store.finish, []

    def finish(*a, **kw):  # the second result's write fails (a full disk, say)
        calls.append(a[0])
        if len(calls) == 2:
            raise OSError("no space left on device")
        return real(*a, **kw)
    coord.store.finish = finish
    r = _post(c, [BatchedResult(g[0].task_id, g[0].lease_id, "ok", has_payload=True),
                  BatchedResult(g[1].task_id, g[1].lease_id, "ok", has_payload=True)], [b"v0", b"v1"],
              next={0: 1, 1: 1})
    assert r.status_code == 503 and r.json()["error"] == "internal"
    assert g[1].task_id in r.json()["message"] and "post the result again" in r.json()["message"]
    coord.store.finish = real
    assert not coord.store.db.in_transaction, "the batch's transaction was ended"
    assert _results(c)[g[0].index] == ("done", b"v0"), "the result stored before the failure is kept"
    assert g[0].task_id not in coord.leases
    assert coord.leases[g[1].task_id].lease_id == g[1].lease_id, "the failed one is still leased"
    # The worker's retry of the same batch: the first is already in, the second lands now.
    r = _post(c, [BatchedResult(g[0].task_id, g[0].lease_id, "ok", has_payload=True),
                  BatchedResult(g[1].task_id, g[1].lease_id, "ok", has_payload=True)], [b"v0", b"v1"])
    assert r.status_code == 200, r.text
    assert [x["task_id"] for x in _answer(r)[0]["refused"]] == [g[0].task_id]
    got = _results(c)
    assert got[g[0].index] == ("done", b"v0") and got[g[1].index] == ("done", b"v1")
    # the store takes the next batch as usual
    (again,) = [x for x in _lease(c, wid, [0]) if x.index not in (g[0].index, g[1].index)]
    r = _post(c, [BatchedResult(again.task_id, again.lease_id, "ok", has_payload=True)], [b"v2"])
    assert r.status_code == 200, r.text
    assert _results(c)[again.index] == ("done", b"v2")


def test_a_single_result_the_store_cannot_write_keeps_its_lease_and_its_retry_lands(coordinator):
    c, coord = coordinator
    _setup(c, 1)
    wid = _worker_id(c)
    (g,) = _lease(c, wid, [0])
    big = b"x" * (INLINE_BLOB_BYTES + 1)  # streamed into a file, renamed into place when stored
    real = coord.store._adopt

    def adopt(*a, **kw):  # the store's rename fails once
        coord.store._adopt = real
        raise OSError(5, "Input/output error")
    coord.store._adopt = adopt
    meta = json.dumps(protocol.ResultPost("ok").as_dict()).encode()
    post = {"content": _body([meta, big]), "params": {"lease": g.lease_id}, "headers": _auth(WORKER)}
    r = c.post(protocol.task_result(g.task_id), **post)
    assert r.status_code == 503 and r.json()["error"] == "internal", r.text
    assert "Input/output error" in r.json()["message"]
    assert coord.leases[g.task_id].lease_id == g.lease_id and g.task_id in coord.workers[wid].leases
    row = coord.store.task_rows("00aa11bb22cc")[0]
    assert (row["state"], row["attempts"]) == ("leased", 1), "nothing of the result is stored"
    assert not coord.store.db.in_transaction
    r = c.post(protocol.task_result(g.task_id), **post)  # the worker posts it again
    assert r.status_code == 200, r.text
    assert _results(c) == {0: ("done", big)}
    row = coord.store.task_rows("00aa11bb22cc")[0]
    assert (row["state"], row["attempts"]) == ("done", 1), "the task ran once"
    assert coord.jobs["00aa11bb22cc"].state == "finished"
