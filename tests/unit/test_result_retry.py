"""A result post the coordinator answers 503 to (it could not store the result and kept
the lease: coordinator/model.py's ResultNotStored) is posted again after a backoff, on
both paths, batched and one at a time; any other refusal drops the result at once."""

from __future__ import annotations

import json

import pytest

from gpumesh import protocol, wire
from gpumesh.errors import RequestRejected
from gpumesh.worker.agent import WorkerAgent
from gpumesh.worker.executor import Outcome
from gpumesh.worker.poster import ResultPoster


class _Coordinator:
    """Stands in for the agent's transport: refuses the first ``refusals`` result posts
    with ``status``, then answers with no next grant; records each post's task ids."""

    def __init__(self, refusals: int, status: int):
        self.refusals, self.status = refusals, status
        self.posts: list[list[str]] = []

    def stream_into(self, method, path, content=b"", **_kw):
        if path == protocol.TASKS_RESULTS:
            from gpumesh.worker import membody
            head = json.loads(bytes(membody.slices(memoryview(bytes(content)))[0]))
            self.posts.append([r["task_id"] for r in head["results"]])
        else:
            self.posts.append([path.split("/")[3]])  # /v1/tasks/{tid}/result
        if self.refusals:
            self.refusals -= 1
            raise RequestRejected(f"refused (HTTP {self.status})", self.status)
        return b"".join(wire.pack_frames([b'{"tasks": []}'])[0])


@pytest.fixture
def make_agent(tmp_path):
    made = []

    def make(refusals: int, status: int) -> WorkerAgent:
        a = WorkerAgent("http://127.0.0.1:9", "t" * 32, slots=1, info={"gpus": [], "hostname": "h"},
                        cache_dir=tmp_path, bench=False)
        a.http.close()
        a.http = _Coordinator(refusals, status)  # type: ignore[assignment]
        a.poster = ResultPoster(a)
        made.append(a)
        return a
    yield make
    for a in made:
        a.executor.close()


def _grant(task_id: str) -> protocol.TaskGrant:
    return protocol.TaskGrant(task_id, "lease-" + task_id, "f" * 64, slot=0)


def test_a_batched_result_not_stored_is_posted_again(make_agent):
    agent = make_agent(refusals=2, status=503)
    assert agent.poster.post(_grant("t1"), Outcome("ok"), 0) == (None, None)
    assert agent.http.posts == [["t1"], ["t1"], ["t1"]]
    assert not agent.poster.posting  # answered: no longer reported as running


def test_a_batched_result_refused_otherwise_is_dropped_at_once(make_agent):
    agent = make_agent(refusals=1, status=400)
    assert agent.poster.post(_grant("t2"), Outcome("ok"), 0) == (None, None)
    assert agent.http.posts == [["t2"]]


@pytest.mark.parametrize("status, posts", [(503, 2), (409, 1)])
def test_a_single_result_is_posted_again_only_when_not_stored(make_agent, status, posts):
    agent = make_agent(refusals=1, status=status)
    frames = [json.dumps(protocol.ResultPost("ok").as_dict()).encode(), b"value"]
    assert agent._send_result(_grant("t3"), frames, 0) == (None, None)
    assert agent.http.posts == [["t3"]] * posts


def test_an_error_of_the_worker_itself_hands_the_task_back_to_be_run_again(make_agent, monkeypatch,
                                                                        tmp_path):
    """Not the task's failure (here its gpumesh was uninstalled under it: the script
    runner cannot be imported): the task is posted as ``retry`` with the reason, so the
    coordinator runs it again elsewhere, and it is no longer held (a held task's lease is
    renewed by every heartbeat: it would stay leased for ever)."""
    agent = make_agent(refusals=0, status=0)
    posted = []

    def broken(*_a, **_kw):
        raise ImportError("cannot import name 'scripts' from 'gpumesh.worker'")

    monkeypatch.setattr(agent.executor, "run_script", broken)
    monkeypatch.setattr(agent.functions, "acquire", lambda fn: tmp_path / "script.py")
    monkeypatch.setattr(agent.poster, "post", lambda task, outcome, slot: posted.append(
        (task.task_id, outcome.status, outcome.error)) or (None, None))
    grant = protocol.TaskGrant("t9", "lease-t9", "f" * 64, slot=0, kind="script")
    agent._run_task(grant, memoryview(b"{}"), 0)
    assert posted == [("t9", "retry", {
        "kind": protocol.FailureKind.HOST_DIED,
        "message": "the worker could not run it: ImportError: cannot import name 'scripts' "
                   "from 'gpumesh.worker'"})]
    assert "t9" not in agent._held  # heartbeats no longer renew its lease
