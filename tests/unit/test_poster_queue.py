"""A slot's queue of grants sized from its job's observed time per task, and results
that wait for others while the slot still holds half its queue (``worker/poster.py``):
each post then carries several results and each answer several grants."""

from __future__ import annotations

import json
import threading
import time
from collections import deque

import pytest

from gpumesh import protocol, wire
from gpumesh.worker import membody, poster as poster_mod
from gpumesh.worker.executor import Outcome
from gpumesh.worker.poster import MAX_QUEUE_DEPTH, QUEUE_DEPTH, ResultPoster

from ..conftest import wait_for
from .conftest import stub_agent


class _Coordinator:
    """Stands in for the agent's transport: records each post's head (its results and
    the grants it asks for) and answers with no grant."""

    def __init__(self):
        self.heads: list[dict] = []

    def stream_into(self, method, path, content=b"", **_kw):
        self.heads.append(json.loads(bytes(membody.slices(memoryview(content))[0])))
        return b"".join(wire.pack_frames([b'{"tasks": []}'])[0])

    def posted(self) -> list[list[str]]:
        return [[r["task_id"] for r in h["results"]] for h in self.heads]


@pytest.fixture
def agent(tmp_path):
    a = stub_agent(tmp_path, _Coordinator())
    yield a
    a.executor.close()


def _grant(task_id: str, slot: int = 0, isolation: str = "job") -> protocol.TaskGrant:
    return protocol.TaskGrant(task_id, "lease-" + task_id, "f" * 64, job_id="j", slot=slot,
                              isolation=isolation)


def _queue(poster: ResultPoster, slot: int, n: int) -> None:
    poster.queues[slot] = deque((_grant(f"q{slot}-{i}", slot), b"") for i in range(n))


def _deep(monkeypatch, hold_s: float) -> None:
    """Every short job task's slot queues 16 grants, whatever its pace."""
    monkeypatch.setattr(poster_mod, "QUEUE_WORK_S", 1e3)
    monkeypatch.setattr(poster_mod, "MAX_QUEUE_DEPTH", 16)
    monkeypatch.setattr(poster_mod, "HOLD_S", hold_s)


def _post(poster: ResultPoster, task_id: str, slot: int = 0):
    """Post a result of a task that just ran (short: its slot took it a moment ago)."""
    poster._started[slot] = time.monotonic()
    return poster.post(_grant(task_id, slot), Outcome("ok", payload=b"x"), slot)


@pytest.mark.parametrize("per_task, isolation, short, depth", [
    (0.001, "job", True, 20),                 # 20 ms of work: 20 grants
    (0.00001, "job", True, MAX_QUEUE_DEPTH),  # very short tasks: capped
    (0.05, "job", True, QUEUE_DEPTH),         # longer ones: never fewer than QUEUE_DEPTH
    (0.001, "task", True, 20),                # a process per task queues the same
    (0.001, "job", False, 0),                 # the task ran long: no queue
])
def test_a_slots_queue_holds_about_twenty_ms_of_its_jobs_work(agent, per_task, isolation, short, depth):
    agent.poster._task_s[0] = per_task
    assert agent.poster.depth(0, _grant("t", 0, isolation), short) == depth


def test_the_time_per_task_follows_the_slots_short_tasks_only(agent):
    poster = agent.poster
    poster._started[0] = time.monotonic() - 10  # a long task says nothing of the pace
    poster.post(_grant("long"), Outcome("ok", payload=b"x"), 0)
    assert 0 not in poster._task_s
    _post(poster, "short")
    assert 0 < poster._task_s[0] < poster_mod.QUEUE_TASK_S


def test_results_wait_while_the_slot_holds_half_its_queue_then_go_in_one_post(agent, monkeypatch):
    _deep(monkeypatch, 60.0)  # only the queue's level lets them go
    poster, coord = agent.poster, agent.http
    _queue(poster, 0, 15)  # depth 16: the results wait while 8 or more are queued
    for i in range(7):  # the queue falls from 15 to 8
        assert _post(poster, f"t{i}")[0].task_id == f"q0-{i}"
    time.sleep(0.2)  # (a post would have been made by now)
    assert coord.heads == [] and len(poster._ready) == 7
    _post(poster, "t7")  # 7 left: under half the queue, the eight go together
    wait_for(lambda: coord.heads, 10, "the post")
    assert coord.posted() == [[f"t{i}" for i in range(8)]]
    # the answer is asked to top the queue up to its depth: 7 queued + the running task
    assert coord.heads[0]["next"] == {"0": 16 + 1 - 8}
    wait_for(lambda: not poster.posting, 10, "the answer")


def test_a_held_result_goes_alone_after_hold_s(agent, monkeypatch):
    _deep(monkeypatch, 0.05)
    poster, coord = agent.poster, agent.http
    _queue(poster, 0, 15)
    _post(poster, "t0")  # then the slot's next task runs long: nothing comes after it
    wait_for(lambda: coord.heads, 10, "the held result's post")
    assert coord.posted() == [["t0"]]


def test_a_slot_waiting_for_an_answer_takes_the_held_results_with_its_own(agent, monkeypatch):
    _deep(monkeypatch, 60.0)
    poster, coord = agent.poster, agent.http
    _queue(poster, 0, 15)
    _post(poster, "t0")
    assert coord.heads == []
    # slot 1 has nothing queued: its thread waits for the answer, which must not wait
    other = threading.Thread(target=_post, args=(poster, "u0", 1))
    other.start()
    other.join(10)
    assert not other.is_alive()
    assert len(coord.heads) == 1 and sorted(coord.posted()[0]) == ["t0", "u0"]


def test_a_lone_result_of_an_empty_queue_goes_at_once_and_asks_for_what_may_be_granted(
        agent, monkeypatch):
    monkeypatch.setattr(poster_mod, "MAX_QUEUE_DEPTH", 2 * protocol.MAX_QUEUED_GRANTS)
    poster, coord = agent.poster, agent.http
    poster._task_s[0] = 0.00001  # a deep queue (capped), none of it held yet
    assert _post(poster, "t0") == (None, None)
    assert coord.posted() == [["t0"]]
    # a coordinator refuses a batch that asks for more (and with it the results)
    assert coord.heads[0]["next"] == {"0": protocol.MAX_QUEUED_GRANTS}
