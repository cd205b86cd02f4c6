"""Fair share between people: the run queue's person level and the per-person cap, pure
(RunQueue) and through the Coordinator with a real store and a fake clock."""

from __future__ import annotations

import asyncio
from collections import Counter


from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.scheduler import RunQueue
from gpumesh.coordinator.store import Store

from ..conftest import FakeClock


def fifo(job_id, q):
    return 0


def drain(q, n, **kw):
    out = []
    for _ in range(n):
        got = q.take_one(fifo, **kw)
        if got is None:
            break
        out.append(got)
    return out


# ---------------------------------------------------------------- RunQueue -----------
def test_people_take_turns_before_their_jobs_do():
    q = RunQueue()
    for j in range(10):  # alice: ten jobs of many tasks
        q.add(f"a{j}", [f"a{j}-{i}" for i in range(100)], owner="alice")
    q.add("b0", ["b0-0", "b0-1"], owner="bob")
    got = drain(q, 6)
    # bob's job is served at the second free slot, not after alice's ten jobs
    assert [j for j, _ in got] == ["a0", "b0", "a1", "b0", "a2", "a3"]
    assert q.owners() == ["alice"]


def test_a_late_persons_single_task_is_next_whatever_is_queued():
    q = RunQueue()
    for j in range(50):
        q.add(f"a{j}", [f"a{j}-{i}" for i in range(20)], owner="alice")
    drain(q, 7)
    q.add("b0", ["b0-0"], owner="bob")
    assert q.take_one(fifo) == ("b0", "b0-0")
    assert q.pending_by_owner() == {"alice": 50 * 20 - 7}


def test_within_one_person_jobs_still_take_turns():
    q = RunQueue()
    q.add("a0", ["a0-0", "a0-1", "a0-2"], owner="alice")
    q.add("a1", ["a1-0", "a1-1"], owner="alice")
    q.add("b0", ["b0-0", "b0-1", "b0-2"], owner="bob")
    got = [t for _, t in drain(q, 8)]
    assert got == ["a0-0", "b0-0", "a1-0", "b0-1", "a0-1", "b0-2", "a1-1", "a0-2"]
    assert len(q) == 0 and q.owners() == [] and q.lanes() == []


def test_a_person_passed_over_keeps_their_place():
    q = RunQueue()
    q.add("a0", [f"a{i}" for i in range(5)], owner="alice")
    q.add("b0", [f"b{i}" for i in range(5)], owner="bob")
    q.add("c0", [f"c{i}" for i in range(5)], owner="carol")
    assert q.take_one(fifo, owner_ok=lambda o: o != "alice") == ("b0", "b0")
    # alice was skipped, not sent to the back: she is first once allowed again
    assert q.owners() == ["alice", "carol", "bob"]
    assert q.take_one(fifo) == ("a0", "a0")


def test_lanes_are_asked_per_person():
    q = RunQueue()
    q.add("a-gpu", ["g0", "g1"], lane="gpu", owner="alice")
    q.add("a-cpu", ["c0"], lane=None, owner="alice")
    q.add("b-cpu", ["d0"], lane=None, owner="bob")
    asked = Counter()

    def lane_ok(lane):
        asked[lane] += 1
        return lane is None
    assert q.take_one(fifo, lane_ok=lane_ok) == ("a-cpu", "c0")
    assert q.take_one(fifo, lane_ok=lane_ok) == ("b-cpu", "d0")
    assert q.take_one(fifo, lane_ok=lane_ok) is None
    assert sorted(q.lanes(), key=str) == ["gpu"]
    assert all(n <= 3 for n in asked.values())  # once per call at most, not per job


def test_no_owner_at_all_is_the_old_round_robin_between_jobs():
    q = RunQueue()
    q.add("j1", ["1a", "1b"])
    q.add("j2", ["2a", "2b"])
    assert [t for _, t in drain(q, 4)] == ["1a", "2a", "1b", "2b"]


# ---------------------------------------------------------------- Coordinator --------
def submit(coord, job_id, owner, n):
    return coord.submit(job_id, "fn", "function", "f" * 64, {"timeout": None},
                        [b"x"] * n, [1.0] * n, False, owner=owner)[0]


def lease(coord, wid, slots):
    return asyncio.run(coord.lease(wid, slots, 0.0))


def finish(coord, g):
    coord.post_result(g.task_id, g.lease_id, "ok", None, b"r")


def test_coordinator_shares_slots_between_people_and_records_owners(coord):
    w = coord.register({"hostname": "h"}, None, 2)
    for j in range(20):
        submit(coord, f"aa{j:04d}", "alice", 50)
    (g1, g2) = lease(coord, w.id, 2)
    assert {coord.jobs[g.job_id].owner for g in (g1, g2)} == {"alice"}
    submit(coord, "bb0001", "bob", 1)
    finish(coord, g1)
    (g3,) = coord.grant_now(w.id, 1)
    assert g3.job_id == "bb0001"  # bob's only task runs at the very next free slot
    assert coord.store.job_row("bb0001")["owner"] == "bob"
    assert coord.running_by_owner() == Counter({"alice": 1, "bob": 1})


def test_a_cap_holds_a_person_to_their_running_tasks_and_others_get_the_rest(coord):
    w = coord.register({"hostname": "h"}, None, 4)
    coord.max_running["alice"] = 1
    submit(coord, "aa0001", "alice", 10)
    got = lease(coord, w.id, 4)
    assert len(got) == 1  # the other three slots stay free rather than exceed her cap
    submit(coord, "bb0001", "bob", 10)
    more = lease(coord, w.id, 3)
    assert [coord.jobs[g.job_id].owner for g in more] == ["bob"] * 3
    assert coord.running_by_owner() == Counter({"alice": 1, "bob": 3})
    # her task ends: the next slot may take another of hers, still one at a time
    finish(coord, got[0])
    (nxt,) = coord.grant_now(w.id, 1)
    assert coord.jobs[nxt.job_id].owner == "alice"
    assert coord.grant_now(w.id, 1) == [] or coord.running_by_owner()["alice"] == 1
    # the cap lifted: she fills what is free
    coord.max_running.clear()
    for g in more:
        finish(coord, g)
    assert Counter(coord.jobs[g.job_id].owner for g in lease(coord, w.id, 3))["alice"] >= 1


def test_the_owner_survives_a_restart_and_keeps_sharing(tmp_path):
    store = Store(tmp_path / "data")
    c1 = Coordinator(store, clock=FakeClock())
    submit(c1, "aa0001", "alice", 5)
    submit(c1, "aa0002", "alice", 5)
    submit(c1, "bb0001", "bob", 5)
    c2 = Coordinator(store, clock=FakeClock())
    c2.callers.heard(c2, list(c2.jobs))  # their callers poll again (coordinator.callers)
    assert {j.id: j.owner for j in c2.jobs.values()} == {"aa0001": "alice", "aa0002": "alice",
                                                         "bb0001": "bob"}
    w = c2.register({"hostname": "h"}, None, 4)
    owners = [c2.jobs[g.job_id].owner for g in lease(c2, w.id, 4)]
    assert owners == ["alice", "bob", "alice", "bob"]
    store.close()
