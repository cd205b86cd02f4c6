"""Which agent thread does what for a task: a lone result is posted by the slot's own
thread (no hand-over to the poster's thread and back), a result that comes while
another post is on its way goes with the poster's thread after it, and the grants of a
slot run one after another on that slot's own thread instead of a new thread each."""

from __future__ import annotations

import json
import threading

import pytest

from gpumesh import protocol, wire
from gpumesh.worker.executor import Outcome

from ..conftest import wait_for
from .conftest import stub_agent


class _Coordinator:
    """Stands in for the agent's transport: records which thread posted which tasks'
    results, answers with no next grant, and can hold a post until told to go on."""

    def __init__(self):
        self.posts: list[tuple[str, list[str]]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.holding = threading.Event()

    def stream_into(self, method, path, content=b"", **_kw):
        head = json.loads(bytes(_frame0(content)))
        self.posts.append((threading.current_thread().name, [r["task_id"] for r in head["results"]]))
        if not self.hold.is_set():
            self.holding.set()
            self.hold.wait(10)
        return b"".join(wire.pack_frames([b'{"tasks": []}'])[0])


def _frame0(body: bytes) -> memoryview:
    from gpumesh.worker import membody
    return membody.slices(memoryview(body))[0]


@pytest.fixture
def agent(tmp_path):
    a = stub_agent(tmp_path, _Coordinator())
    yield a
    a.executor.close()


def _grant(task_id: str, slot: int) -> protocol.TaskGrant:
    return protocol.TaskGrant(task_id, "lease-" + task_id, "f" * 64, slot=slot)


def test_a_lone_result_is_posted_by_its_slots_thread_and_a_concurrent_one_by_the_poster(agent):
    poster, coord = agent.poster, agent.http
    me = threading.current_thread().name
    assert poster.post(_grant("t1", 0), Outcome("ok"), 0) == (None, None)
    assert coord.posts == [(me, ["t1"])]          # this thread sent it, at once
    # While t2's post is on its way (held), t3 of the other slot is handed to the
    # poster's thread, which sends it once t2's answer is in.
    coord.hold.clear()
    first = threading.Thread(target=poster.post, args=(_grant("t2", 0), Outcome("ok"), 0), name="slot-a")
    first.start()
    assert coord.holding.wait(10)
    second = threading.Thread(target=poster.post, args=(_grant("t3", 1), Outcome("ok"), 1), name="slot-b")
    second.start()
    wait_for(lambda: poster._ready, 10, "t3 waiting for the poster")
    assert coord.posts[1:] == [("slot-a", ["t2"])]  # one post at a time
    coord.hold.set()
    first.join(10)
    second.join(10)
    assert coord.posts[1:] == [("slot-a", ["t2"]), ("results", ["t3"])]
    assert not poster.posting and not any(poster._inflight.values())


def test_a_slots_grants_run_on_that_slots_own_thread(agent, monkeypatch):
    ran: list[tuple[str, int | None, int]] = []
    done = threading.Semaphore(0)

    def run_task(task, args, slot=None):
        ran.append((task.task_id, slot, threading.get_ident()))
        done.release()

    monkeypatch.setattr(agent, "_run_task", run_task)
    for task_id, slot in (("a", 0), ("b", 1), ("c", 0), ("d", None)):
        agent._slot_thread(slot, _grant(task_id, slot or 0), None)
        assert done.acquire(timeout=10)
    by_task = {t: (slot, ident) for t, slot, ident in ran}
    assert by_task["a"][1] == by_task["c"][1]           # slot 0's thread ran both
    assert by_task["b"][1] != by_task["a"][1]           # slot 1 has a thread of its own
    assert by_task["d"][0] is None and by_task["d"][1] not in {by_task["a"][1], by_task["b"][1]}
    names = {t.ident: t.name for t in threading.enumerate()}
    assert names.get(by_task["a"][1]) == "slot-0" and names.get(by_task["b"][1]) == "slot-1"
