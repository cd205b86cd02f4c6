"""A job's status counts the attempts its workers' owners handed back from the store, so
it still says so once the caller collected the results (the job left memory) and after
the coordinator restarted. Real Coordinator and Store, no sockets."""

from __future__ import annotations

import asyncio

from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.routes.jobs import job_view


def run_with_one_hand_back(coord) -> str:
    w = coord.register({"hostname": "box"}, None, 1)
    coord.submit("ad0001", "fn", "function", "f" * 64, {"timeout": None}, [b"a", b"b"],
                 [1.0, 1.0], False)
    first = asyncio.run(coord.lease(w.id, 1, 0.0))[0]
    coord.hand_back(first.task_id, first.lease_id, "owner paused")
    for _ in range(2):
        (g,) = asyncio.run(coord.lease(w.id, 1, 0.0))
        coord.post_result(g.task_id, g.lease_id, "ok", None, b"v")
    return "ad0001"


def test_the_hand_back_is_counted_while_the_job_is_held(coord):
    jid = run_with_one_hand_back(coord)
    view = job_view(coord, jid, with_tasks=True)
    assert view["counts"] == {"done": 2} and view["preempted"] == 1
    (run_twice,) = [t for t in view["tasks"] if t["history"]]
    assert [h.get("preempted") for h in run_twice["history"]] == [True]


def test_the_hand_back_is_still_counted_after_release_and_restart(coord, store, clock):
    jid = run_with_one_hand_back(coord)
    coord.release(jid)  # the caller has every result: the job leaves memory
    assert jid not in coord.jobs
    assert job_view(coord, jid, with_tasks=False)["preempted"] == 1
    again = Coordinator(store, clock=clock)  # a restart over the same store
    assert job_view(again, jid, with_tasks=False)["preempted"] == 1


def test_a_job_nothing_was_handed_back_from_has_no_count(coord):
    w = coord.register({"hostname": "box"}, None, 1)
    coord.submit("ad0002", "fn", "function", "f" * 64, {"timeout": None}, [b"a"], [1.0], False)
    (g,) = asyncio.run(coord.lease(w.id, 1, 0.0))
    coord.post_result(g.task_id, g.lease_id, "ok", None, b"v")
    assert "preempted" not in job_view(coord, "ad0002", with_tasks=False)
