"""``Coordinator.grant_queued``: a slot's queue of grants in one placement pass and one
store write, each grant an ordinary lease; and ``Store.transaction``, which puts the
writes of one result batch in one commit (real Store, fake clock)."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from gpumesh.coordinator.core import Coordinator, StaleLease
from gpumesh.coordinator.usage import task_time

from ..conftest import FakeClock


def submit(coord, job_id, n, isolation="job", owner=None):
    meta = {"timeout": None, "isolation": isolation}
    job, created = coord.submit(job_id, "fn", "function", "f" * 64, meta,
                                [f"{job_id}-{i}".encode() for i in range(n)], [1.0] * n, False,
                                owner=owner)
    assert created
    return job


def rows(store, job_id):
    """{index: (state, attempts, worker id)} of the job's tasks, as the store has them."""
    return {r["index"]: (r["state"], r["attempts"], r["worker_id"]) for r in store.task_rows(job_id)}


def counting_leases(store):
    """Replace ``store.lease`` by a wrapper that counts its calls; returns the count list."""
    calls = []
    real = store.lease

    def lease(grants, on_gpu=frozenset()):
        calls.append(len(grants))
        real(grants, on_gpu)
    store.lease = lease
    return calls


def test_n_grants_for_one_slot_come_in_index_order_as_leases_stored_in_one_write(coord, store):
    w = coord.register({"hostname": "h"}, None, 2)
    submit(coord, "aaaa01", 6)
    calls = counting_leases(store)
    grants = coord.grant_queued(w.id, 1, 4)
    assert [g.index for g in grants] == [0, 1, 2, 3]
    assert {g.slot for g in grants} == {1} and {g.attempt for g in grants} == {1}
    assert len({g.lease_id for g in grants}) == 4
    assert calls == [4], "one store write for the four leases"
    assert rows(store, "aaaa01") == {0: ("leased", 1, w.id), 1: ("leased", 1, w.id),
                                     2: ("leased", 1, w.id), 3: ("leased", 1, w.id),
                                     4: ("pending", 0, None), 5: ("pending", 0, None)}
    assert {coord.leases[g.task_id].lease_id for g in grants} == {g.lease_id for g in grants}
    assert w.leases == {g.task_id for g in grants}
    assert coord.running_by_owner()[None] == 1, "one runs; three are queued behind it"
    # fewer pending than asked: what there is, still in order
    assert [g.index for g in coord.grant_queued(w.id, 1, 4)] == [4, 5]
    assert coord.grant_queued(w.id, 1, 4) == []


def test_a_worker_lost_with_a_queue_has_every_queued_task_re_queued(coord, store):
    w = coord.register({"hostname": "h"}, None, 1)
    other = coord.register({"hostname": "o"}, None, 1)
    submit(coord, "aaaa01", 5)
    grants = coord.grant_queued(w.id, 0, 4)
    assert len(grants) == 4
    assert coord.deregister(w.id) == 4
    assert not coord.leases and not w.leases
    assert {i: s for i, (s, _a, _w) in rows(store, "aaaa01").items()} == dict.fromkeys(range(5), "pending")
    again = coord.grant_queued(other.id, 0, 5)
    # (back at the front of the job's queue, in the order the worker held them)
    assert sorted((g.index, g.attempt) for g in again) == [(0, 2), (1, 2), (2, 2), (3, 2), (4, 1)]
    assert again[-1].index == 4
    assert coord.grant_queued(w.id, 0, 4) == [], "a worker that is gone gets nothing"


def test_a_stale_queued_lease_is_refused_after_its_task_was_re_queued(coord):
    w = coord.register({"hostname": "h"}, None, 1)
    submit(coord, "aaaa01", 3)
    first, second, _third = coord.grant_queued(w.id, 0, 3)
    coord._requeue([second.task_id], reason="test: taken away")
    with pytest.raises(StaleLease):
        coord.post_result(second.task_id, second.lease_id, "ok", None, b"r")
    assert coord.post_result(first.task_id, first.lease_id, "ok", None, b"r") == w.id


def test_a_job_with_a_process_per_task_queues_as_well(coord):
    # (the slot starts each queued task in a fresh process: what the queue saves is
    # the round trip per task, in either isolation)
    w = coord.register({"hostname": "h"}, None, 1)
    submit(coord, "aaaa01", 4, isolation="task")
    got = coord.grant_queued(w.id, 0, 4)
    assert [(g.job_id, g.index) for g in got] == [("aaaa01", i) for i in range(4)]


def test_jobs_of_two_people_take_turns_in_a_queue(coord):
    w = coord.register({"hostname": "h"}, None, 1)
    submit(coord, "bbbb01", 4, owner="bob")               # isolation="job"
    submit(coord, "cccc01", 4, isolation="task", owner="carol")
    got = coord.grant_queued(w.id, 0, 3)
    assert [(g.job_id, g.index) for g in got] == [("bbbb01", 0), ("cccc01", 0), ("bbbb01", 1)]
    got = coord.grant_queued(w.id, 0, 3)
    assert [(g.job_id, g.index) for g in got] == [("cccc01", 1), ("bbbb01", 2), ("cccc01", 2)]


def test_a_person_with_a_max_running_cap_gets_one_grant_and_stays_under_the_cap(coord):
    w = coord.register({"hostname": "h"}, None, 2)
    submit(coord, "aaaa01", 6, owner="ann")
    coord.max_running["ann"] = 2
    assert [g.index for g in coord.grant_queued(w.id, 0, 4)] == [0]
    assert [g.index for g in coord.grant_queued(w.id, 1, 4)] == [1]
    assert coord.grant_queued(w.id, 0, 4) == [], "at the cap: nothing more"


def test_an_idle_slot_that_gets_nothing_joins_the_open_lease_poll_and_a_busy_one_does_not(coord):
    async def scenario(idle: bool) -> list[int | None]:
        c = Coordinator(coord.store, clock=FakeClock())
        w = c.register({"hostname": "h"}, None, 2)
        poll = asyncio.ensure_future(c.lease(w.id, 1, 5.0, free=[1]))
        await asyncio.sleep(0)  # the poll is open (nothing pending)
        assert c.grant_queued(w.id, 0, 4, idle=idle) == []
        submit(c, f"dd{int(idle)}001", 2)
        return sorted(g.slot for g in await asyncio.wait_for(poll, 5))
    assert asyncio.run(scenario(True)) == [0, 1]
    assert asyncio.run(scenario(False)) == [1]


def test_nothing_is_granted_for_zero_tasks_or_a_closed_slot(coord):
    w = coord.register({"hostname": "h"}, None, 1)
    submit(coord, "aaaa01", 2)
    assert coord.grant_queued(w.id, 0, 0) == []
    assert coord.grant_queued(w.id, 5, 2) == [], "a slot the worker does not have"
    assert len(coord.grant_queued(w.id, 0, 2)) == 2


# ------------------------------------------------------------ Store.transaction -------

def test_a_transaction_commits_every_write_once_and_also_when_its_block_raises(store, tmp_path):
    store.create_job("eeee01", "x", "function", "f" * 64, {}, [(f"t{i}", i, 1.0, b"a") for i in range(3)])
    other = sqlite3.connect(tmp_path / "data" / "gpumesh.db")  # another reader sees commits only

    def states():
        return [r[0] for r in other.execute("SELECT state FROM tasks WHERE job_id='eeee01' ORDER BY idx")]
    with store.transaction():
        store.lease([("t0", "l0", "w")])
        store.finish("t1", "done", 0, None, b"r", "eeee01")
        with store.transaction():  # nested: the outer one commits
            store.lease([("t2", "l2", "w")])
        assert states() == ["pending"] * 3, "nothing is visible before the commit"
    assert states() == ["leased", "done", "leased"]
    assert not store.db.in_transaction
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.requeue(["t0"])
            raise RuntimeError("a bug after a write")
    assert states() == ["pending", "done", "leased"], "what ran before the raise is kept"
    assert not store.db.in_transaction
    other.close()


def test_a_failed_write_inside_a_transaction_rolls_back_only_its_own_part(store):
    store.create_job("eeee01", "x", "function", "f" * 64, {}, [(f"t{i}", i, 1.0, b"a") for i in range(2)])
    with store.transaction():
        store.lease([("t0", "l0", "w")])
        with pytest.raises(sqlite3.Error):
            with store._tx():
                store.db.execute("UPDATE tasks SET state='leased' WHERE id='t1'")
                store.db.execute("INSERT INTO no_such_table VALUES (1)")
    assert [(r["state"], r["attempts"]) for r in store.task_rows("eeee01")] == [("leased", 1), ("pending", 0)]


def test_tasks_args_reads_many_tasks_at_once_and_names_unknown_ones(store, monkeypatch):
    from gpumesh.coordinator import store as store_mod
    monkeypatch.setattr(store_mod, "ARGS_PER_QUERY", 2)  # several queries
    store.create_job("eeee01", "x", "function", "f" * 64, {},
                     [(f"t{i}", i, 1.0, f"a{i}".encode()) for i in range(5)])
    got = store.tasks_args(["t4", "t0", "nope", "t2", "t1"])
    assert list(got) == ["t4", "t0", "nope", "t2", "t1"]
    assert got == {"t4": (b"a4", None), "t0": (b"a0", None), "nope": (None, None),
                   "t2": (b"a2", None), "t1": (b"a1", None)}
    assert store.tasks_args([]) == {}


def test_a_queued_grant_counts_as_running_and_uses_time_only_once_it_starts(coord, store, clock):
    """Grants queued behind a slot's running task have not started: a person's running
    tasks, a worker's, and the task time in usage (the metrics and the dashboard's people)
    count a queued task from its slot's previous result, not from its grant."""
    w = coord.register({"hostname": "h"}, None, 2)
    submit(coord, "aaaa01", 3, isolation="task", owner="alice")
    grants = coord.grant_queued(w.id, 0, 3)
    assert [g.index for g in grants] == [0, 1, 2]
    assert coord.running_by_owner() == {"alice": 1}
    view = coord.worker_view(w)
    assert view["running"] == 3 and view["busy_slots"] == [0]  # (its leases; one slot busy)
    for g, ran in zip(grants, (2.0, 0.5, 0.25)):
        clock.advance(ran)
        coord.post_result(g.task_id, g.lease_id, "ok", None, b"r")
    assert coord.running_by_owner() == {}
    usage = task_time(store, 0)["alice"]
    assert usage["tasks"] == 3
    assert usage["cpu_s"] == pytest.approx(2.75), "2 + 0.5 + 0.25 s, not 2 + 2.5 + 2.75"
    rows = store.task_page("aaaa01", -1, 10)
    assert [round(r["finished"] - r["started"], 6) for r in rows] == [2.0, 0.5, 0.25]
