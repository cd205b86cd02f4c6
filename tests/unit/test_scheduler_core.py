"""Unit tests for the run queue and the coordinator core (real Store, fake clock)."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from gpumesh.coordinator import core
from gpumesh.coordinator.core import Coordinator, NoWorkers, StaleLease, UnknownJob, UnknownWorker
from gpumesh.coordinator.scheduler import RunQueue
from gpumesh.coordinator.store import Store
from gpumesh.limits import HEARTBEAT_INTERVAL_S, INLINE_BLOB_BYTES

TTL = core.WORKER_TTL_S
MAX_ATTEMPTS = core.MAX_ATTEMPTS


# ---------------------------------------------------------------- RunQueue -----------

def test_queue_fifo_within_a_job():
    q = RunQueue()
    q.add("j1", ["a", "b", "c"])
    assert len(q) == 3
    assert q.pending("j1") == 3
    assert q.take(2) == [("j1", "a"), ("j1", "b")]
    assert q.take(5) == [("j1", "c")]
    assert q.take(1) == []
    assert len(q) == 0 and q.pending("j1") == 0


def test_queue_round_robin_between_jobs():
    q = RunQueue()
    q.add("j1", ["a1", "a2", "a3"])
    q.add("j2", ["b1", "b2"])
    assert q.take(10) == [("j1", "a1"), ("j2", "b1"), ("j1", "a2"), ("j2", "b2"), ("j1", "a3")]
    assert len(q) == 0


def test_queue_round_robin_one_at_a_time():
    q = RunQueue()
    q.add("j1", ["a1", "a2"])
    q.add("j2", ["b1", "b2"])
    got = [q.take(1)[0] for _ in range(4)]
    assert got == [("j1", "a1"), ("j2", "b1"), ("j1", "a2"), ("j2", "b2")]


def test_queue_push_front():
    q = RunQueue()
    q.add("j1", ["a", "b"])
    assert q.take(1) == [("j1", "a")]
    q.push_front("j1", "a")
    assert len(q) == 2
    assert q.take(2) == [("j1", "a"), ("j1", "b")]
    q.push_front("j9", "z")  # a job with no queue yet
    assert q.take(1) == [("j9", "z")]


def test_queue_drop_job():
    q = RunQueue()
    q.add("j1", ["a", "b"])
    q.add("j2", ["c"])
    assert q.drop_job("j1") == ["a", "b"]
    assert q.drop_job("j1") == []
    assert q.drop_job("nope") == []
    assert len(q) == 1
    assert q.take(5) == [("j2", "c")]


def test_queue_eligible_filter_keeps_skipped_jobs_in_line():
    q = RunQueue()
    q.add("gpu", ["g1", "g2"])
    q.add("cpu", ["c1", "c2", "c3"])
    assert q.take(2, eligible=lambda j: j == "cpu") == [("cpu", "c1"), ("cpu", "c2")]
    assert q.take(5, eligible=lambda j: False) == []
    assert len(q) == 3
    assert q.take(5) == [("gpu", "g1"), ("cpu", "c3"), ("gpu", "g2")]


def test_queue_take_zero_or_negative():
    q = RunQueue()
    q.add("j", ["a"])
    assert q.take(0) == [] and q.take(-1) == []
    assert len(q) == 1


def test_queue_add_empty_list():
    q = RunQueue()
    q.add("j", [])
    assert len(q) == 0
    assert q.take(1) == []


def test_queue_job_with_no_tasks_does_not_stand_in_line():
    q = RunQueue()
    q.add("empty", [])
    q.add("j", ["a"])
    assert q.job_ids() == ["j"]
    assert q.take_one(lambda j, tasks: 0) == ("j", "a")
    assert q.job_ids() == [] and q.lanes() == []


class Looks:
    """A ``choose`` for take_one that records which jobs it was shown."""

    def __init__(self, refuse=()):
        self.shown: list[str] = []
        self.refuse = set(refuse)

    def __call__(self, job_id, tasks):
        self.shown.append(job_id)
        return None if job_id in self.refuse else 0


def test_queue_lanes_offer_only_accepted_lanes_and_keep_turns():
    q = RunQueue()
    q.add("g1", ["g1a", "g1b"], lane="gpu")
    q.add("c1", ["c1a", "c1b"], lane="cpu")
    q.add("g2", ["g2a"], lane="gpu")
    q.add("c2", ["c2a"], lane="cpu")
    assert sorted(q.lanes()) == ["cpu", "gpu"]
    assert q.job_ids() == ["g1", "c1", "g2", "c2"]
    look = Looks()
    assert q.take_one(look, lane_ok=lambda lane: lane == "cpu") == ("c1", "c1a")
    assert look.shown == ["c1"]        # the gpu lane's jobs were never looked at
    assert q.job_ids() == ["g1", "g2", "c2", "c1"]  # skipped jobs kept their place
    assert q.take_one(Looks(), lane_ok=lambda lane: False) is None
    # across lanes, jobs still take turns in one line
    assert q.take(10) == [("g1", "g1a"), ("g2", "g2a"), ("c2", "c2a"), ("c1", "c1b"), ("g1", "g1b")]
    assert len(q) == 0 and q.lanes() == []


def test_queue_refused_job_keeps_its_place_within_its_lane():
    q = RunQueue()
    q.add("a", ["a1"], lane="x")
    q.add("b", ["b1"], lane="x")
    look = Looks(refuse={"a"})
    assert q.take_one(look) == ("b", "b1")
    assert look.shown == ["a", "b"]
    assert q.job_ids() == ["a"]


def test_queue_requeued_task_of_a_drained_job_rejoins_its_lane():
    q = RunQueue()
    q.add("j", ["t"], lane="gpu")
    assert q.take_one(lambda j, tasks: 0) == ("j", "t")
    assert q.lanes() == []
    q.push_front("j", "t", lane="gpu")
    assert q.lanes() == ["gpu"] and q.pending("j") == 1
    assert q.take_one(lambda j, tasks: 0, lane_ok=lambda lane: lane == "cpu") is None
    assert q.take_one(lambda j, tasks: 0, lane_ok=lambda lane: lane == "gpu") == ("j", "t")


def test_queue_take_one_looks_at_one_job_however_deep_the_queue():
    q = RunQueue()
    for j in range(1000):
        q.add(f"j{j}", [f"j{j}-{i}" for i in range(100)], lane="gpu" if j % 2 else "cpu")
    assert len(q) == 100_000
    for n in range(3):
        look = Looks()
        assert q.take_one(look) == (f"j{n}", f"j{n}-0")
        assert look.shown == [f"j{n}"]
    look = Looks()
    assert q.take_one(look, lane_ok=lambda lane: lane == "gpu") == ("j3", "j3-0")
    assert look.shown == ["j3"]
    assert len(q) == 100_000 - 4


# ---------------------------------------------------------------- Coordinator --------

def lease(coord, wid, slots=1, wait=0.0):
    return asyncio.run(coord.lease(wid, slots, wait))


def submit(coord, job_id="aaaa01", n=1, require_worker=False, args=None):
    args = args if args is not None else [f"args{i}".encode() for i in range(n)]
    return coord.submit(job_id, "fn", "function", "f" * 64, {"timeout": None}, args,
                        [1.0] * len(args), require_worker)


def results(store, job_id):
    return list(store.results_after(job_id, -1, 1000))


def task_state(store, job_id):
    return {r["index"]: (r["state"], r["attempts"]) for r in store.task_rows(job_id)}


def test_submit_lease_result(coord, store):
    w = coord.register({"hostname": "h"}, None, 2)
    job, created = submit(coord, n=3)
    assert created and job.n_tasks == 3 and job.state == "active"
    assert store.task_args(store.task_rows(job.id)[0]["id"]) == (b"args0", None)

    grants = lease(coord, w.id, slots=2)
    assert [g.index for g in grants] == [0, 1]
    assert all(g.attempt == 1 and g.job_id == job.id for g in grants)
    assert len({g.lease_id for g in grants}) == 2
    assert task_state(store, job.id) == {0: ("leased", 1), 1: ("leased", 1), 2: ("pending", 0)}

    assert coord.post_result(grants[1].task_id, grants[1].lease_id, "ok", None, b"R1") == w.id
    assert coord.post_result(grants[0].task_id, grants[0].lease_id, "error",
                             {"kind": "raised", "message": "bad"}, b"E0") == w.id
    res = results(store, job.id)
    assert [(r.idx, r.state, r.seq, r.result) for r in res] == [(1, "done", 0, b"R1"), (0, "failed", 1, b"E0")]
    assert res[1].error == {"kind": "raised", "message": "bad", "worker": w.id, "hostname": "h", "attempt": 1}
    assert job.n_final == 2 and job.state == "active"

    (g3,) = lease(coord, w.id, slots=5)
    assert g3.index == 2
    coord.post_result(g3.task_id, g3.lease_id, "ok", None, b"R2")
    assert job.state == "finished"
    assert store.job_row(job.id)["state"] == "finished"
    assert lease(coord, w.id) == []


@pytest.mark.parametrize("fails", ["payload file", "row"])
def test_a_result_the_store_cannot_write_changes_nothing_and_its_retry_is_accepted(coord, store, fails):
    w = coord.register({"hostname": "h"}, None, 1)
    job, _ = submit(coord, n=1)
    (g,) = lease(coord, w.id)
    value = b"V" * (INLINE_BLOB_BYTES + 1) if fails == "payload file" else b"V"
    name = "_write_file" if fails == "payload file" else "set_job_state"
    real = getattr(store, name)

    def broken(*a, **kw):  # fails once: a full disk, a busy database
        setattr(store, name, real)
        raise OSError(28, "No space left on device") if fails == "payload file" \
            else sqlite3.OperationalError("database is locked")
    setattr(store, name, broken)
    with pytest.raises(core.ResultNotStored) as e:
        coord.post_result(g.task_id, g.lease_id, "ok", None, value)
    assert e.value.status == 503 and g.task_id in e.value.message
    assert coord.leases[g.task_id].lease_id == g.lease_id and g.task_id in w.leases
    assert (job.n_final, job.next_seq, job.state) == (0, 0, "active")
    assert task_state(store, job.id) == {0: ("leased", 1)}, "the row was rolled back"
    assert store.job_row(job.id)["state"] == "active"
    assert results(store, job.id) == []
    assert [p for p in (store.blob_dir / "results").rglob("*") if p.is_file()] == []
    assert not store.db.in_transaction
    # the worker's retry of the same post
    assert coord.post_result(g.task_id, g.lease_id, "ok", None, value) == w.id
    assert [(r.idx, r.state, r.seq) for r in results(store, job.id)] == [(0, "done", 0)]
    got = results(store, job.id)[0]
    assert (got.result or store.file_path(got.result_file).read_bytes()) == value
    assert task_state(store, job.id) == {0: ("done", 1)}, "the task ran once"
    assert job.state == "finished" and store.job_row(job.id)["state"] == "finished"
    assert g.task_id not in coord.leases


def test_stale_lease_is_refused_and_does_not_overwrite(coord, store, clock):
    w1 = coord.register({}, None, 1)
    job, _ = submit(coord)
    (g1,) = lease(coord, w1.id)
    # w1 falls silent, TTL sweep requeues, w2 gets the task under a new lease
    clock.advance(TTL + 1)
    w2 = coord.register({}, None, 1)
    coord.sweep()
    assert not coord.workers[w1.id].alive
    (g2,) = lease(coord, w2.id)
    assert g2.task_id == g1.task_id and g2.lease_id != g1.lease_id and g2.attempt == 2
    with pytest.raises(StaleLease):
        coord.post_result(g1.task_id, g1.lease_id, "ok", None, b"OLD")
    coord.post_result(g2.task_id, g2.lease_id, "ok", None, b"NEW")
    # a second result, even under the right lease, never replaces the first
    with pytest.raises(StaleLease):
        coord.post_result(g2.task_id, g2.lease_id, "ok", None, b"AGAIN")
    with pytest.raises(StaleLease):
        coord.post_result(g1.task_id, g1.lease_id, "ok", None, b"OLD")
    res = results(store, job.id)
    assert [(r.result, r.seq, r.worker_id) for r in res] == [(b"NEW", 0, w2.id)]
    assert job.n_final == 1


def test_ttl_sweep_requeues_until_max_attempts_then_lost(coord, store, clock):
    job, _ = submit(coord)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        w = coord.register({}, None, 1)
        (g,) = lease(coord, w.id)
        assert g.attempt == attempt
        clock.advance(TTL / 2)
        coord.sweep()  # not yet expired
        assert coord.workers[w.id].alive
        assert task_state(store, job.id)[0] == ("leased", attempt)
        clock.advance(TTL / 2 + 1)
        coord.sweep()
        assert not coord.workers[w.id].alive
        if attempt < MAX_ATTEMPTS:
            assert task_state(store, job.id)[0] == ("pending", attempt)
            assert len(coord.queue) == 1
    assert len(coord.queue) == 0
    (res,) = results(store, job.id)
    assert res.state == "failed"
    assert res.error["kind"] == "lost"
    assert f"{MAX_ATTEMPTS} times" in res.error["message"]
    assert job.state == "finished"


def test_alive_worker_keeps_its_lease_through_heartbeats(coord, store, clock):
    w = coord.register({}, None, 1)
    job, _ = submit(coord)
    (g,) = lease(coord, w.id)
    for _ in range(5):
        clock.advance(TTL * 0.6)
        assert coord.heartbeat(w.id, [g.task_id], None) == {"cancel": []}
        coord.sweep()
    assert coord.workers[w.id].alive
    assert task_state(store, job.id)[0] == ("leased", 1)
    coord.post_result(g.task_id, g.lease_id, "ok", None, b"v")
    assert results(store, job.id)[0].result == b"v"


def test_heartbeat_requeues_forgotten_and_cancels_unknown(coord, store, clock):
    w = coord.register({}, None, 1)
    job, _ = submit(coord)
    (g,) = lease(coord, w.id)
    # right after the grant, a heartbeat that does not list it yet is tolerated
    assert coord.heartbeat(w.id, [], None) == {"cancel": []}
    assert g.task_id in coord.leases
    # so is any heartbeat while the lease answer is still on its way (a slow link)
    clock.advance(10)
    assert coord.heartbeat(w.id, [], None) == {"cancel": []}
    assert g.task_id in coord.leases
    coord.lease_delivered([(g.task_id, g.lease_id)], True)
    clock.advance(10)
    assert coord.heartbeat(w.id, ["deadbeef"], None) == {"cancel": ["deadbeef"]}
    assert g.task_id not in coord.leases
    assert task_state(store, job.id)[0] == ("pending", 1)


def test_a_worker_still_receiving_its_lease_answer_keeps_the_lease(coord, store, clock):
    # Behind a slow link the answer's last bytes leave the coordinator seconds before the
    # worker has read them: until then its heartbeats say "receiving", not the task.
    w = coord.register({}, None, 1)
    job, _ = submit(coord)
    (g,) = lease(coord, w.id)
    coord.lease_delivered([(g.task_id, g.lease_id)], True)
    for _ in range(4):
        clock.advance(3 * HEARTBEAT_INTERVAL_S)
        assert coord.heartbeat(w.id, [], None, receiving=True) == {"cancel": []}
    assert g.task_id in coord.leases
    assert task_state(store, job.id)[0] == ("leased", 1)
    # the answer broke off after all: the next heartbeat, not receiving, gives it up
    assert coord.heartbeat(w.id, [], None) == {"cancel": []}
    assert g.task_id not in coord.leases
    assert task_state(store, job.id)[0] == ("pending", 1)


def test_lease_answer_that_broke_off_is_requeued_at_once(coord, store):
    w = coord.register({}, None, 1)
    job, _ = submit(coord)
    (g,) = lease(coord, w.id)
    coord.lease_delivered([(g.task_id, g.lease_id)], False)
    assert g.task_id not in coord.leases
    assert task_state(store, job.id)[0] == ("pending", 1)


def test_deregister_requeues_at_once(coord, store):
    w1 = coord.register({}, None, 1)
    w2 = coord.register({}, None, 1)
    job, _ = submit(coord, n=2)
    (g1,) = lease(coord, w1.id)
    (g2,) = lease(coord, w2.id)
    assert coord.deregister(w1.id) == 1
    assert not coord.workers[w1.id].alive
    assert [w.id for w in coord.alive_workers()] == [w2.id]
    assert task_state(store, job.id)[g1.index] == ("pending", 1)
    assert coord.deregister("nonexistent") == 0
    with pytest.raises(UnknownWorker):
        lease(coord, w1.id)
    # w2 picks the re-queued task after finishing its own
    coord.post_result(g2.task_id, g2.lease_id, "ok", None, b"2")
    (g3,) = lease(coord, w2.id)
    assert (g3.task_id, g3.attempt) == (g1.task_id, 2)


def test_requeued_task_goes_first(coord, store):
    w1 = coord.register({}, None, 1)
    w2 = coord.register({}, None, 1)
    job, _ = submit(coord, n=3)
    (g0,) = lease(coord, w1.id)
    coord.deregister(w1.id)
    assert [g.index for g in lease(coord, w2.id, slots=3)] == [0, 1, 2]


def test_retry_status_requeues(coord, store):
    w = coord.register({}, None, 1)
    job, _ = submit(coord)
    (g,) = lease(coord, w.id)
    assert coord.post_result(g.task_id, g.lease_id, "retry", {"message": "fetch failed"}, None) == w.id
    assert task_state(store, job.id)[0] == ("pending", 1)
    (g2,) = lease(coord, w.id)
    assert g2.attempt == 2


def test_restart_recovers_pending_and_keeps_leases_until_ttl(tmp_path, clock):
    data = tmp_path / "data"
    s1 = Store(data)
    c1 = Coordinator(s1, clock=clock)
    w = c1.register({}, None, 1)
    job, _ = submit(c1, job_id="bbbb02", n=3)
    (g0,) = lease(c1, w.id)
    (g1,) = lease(c1, w.id)
    c1.post_result(g1.task_id, g1.lease_id, "ok", None, b"one")
    s1.close()  # the coordinator process dies

    s2 = Store(data)
    try:
        c2 = Coordinator(s2, clock=clock)
        c2.callers.heard(c2, ["bbbb02"])  # its caller polls again (coordinator.callers)
        assert set(c2.jobs) == {"bbbb02"}
        j2 = c2.jobs["bbbb02"]
        assert (j2.n_tasks, j2.n_final, j2.next_seq) == (3, 1, 1)
        assert len(c2.queue) == 1               # task 2 is pending
        assert set(c2.leases) == {g0.task_id}   # task 0 keeps its lease
        # the old worker comes back under its id and delivers under its old lease
        w_again = c2.register({}, w.id, 1)
        assert w_again.leases == {g0.task_id}
        c2.post_result(g0.task_id, g0.lease_id, "ok", None, b"zero")
        (g2,) = lease(c2, w.id)
        assert g2.index == 2
        c2.post_result(g2.task_id, g2.lease_id, "ok", None, b"two")
        res = results(s2, "bbbb02")
        assert {r.idx: (r.result, r.seq) for r in res} == {1: (b"one", 0), 0: (b"zero", 1), 2: (b"two", 2)}
        assert j2.state == "finished"
    finally:
        s2.close()


def test_restart_orphan_lease_requeued_after_ttl(tmp_path, clock):
    data = tmp_path / "data"
    s1 = Store(data)
    c1 = Coordinator(s1, clock=clock)
    w = c1.register({}, None, 1)
    submit(c1, job_id="cccc03")
    (g,) = lease(c1, w.id)
    s1.close()

    s2 = Store(data)
    try:
        c2 = Coordinator(s2, clock=clock)
        c2.callers.heard(c2, ["cccc03"])  # its caller polls again
        assert set(c2.leases) == {g.task_id}
        clock.advance(TTL / 2)
        c2.sweep()
        assert set(c2.leases) == {g.task_id}      # still waiting for the worker
        assert len(c2.queue) == 0
        clock.advance(TTL / 2 + 1)
        c2.sweep()
        assert c2.leases == {}
        assert len(c2.queue) == 1
        w2 = c2.register({}, None, 1)
        (g2,) = lease(c2, w2.id)
        assert (g2.task_id, g2.attempt) == (g.task_id, 2)
        with pytest.raises(StaleLease):
            c2.post_result(g.task_id, g.lease_id, "ok", None, b"late")
    finally:
        s2.close()


def test_submit_is_idempotent_on_job_id(coord, store):
    coord.register({}, None, 1)
    job, created = submit(coord, job_id="dddd04", n=2)
    again, created2 = submit(coord, job_id="dddd04", n=5)
    assert created and not created2
    assert again is job and again.n_tasks == 2
    assert len(store.task_rows("dddd04")) == 2
    assert len(coord.queue) == 2


def test_submit_is_idempotent_after_release(coord, store):
    w = coord.register({}, None, 1)
    job, _ = submit(coord, job_id="eeee05")
    (g,) = lease(coord, w.id)
    coord.post_result(g.task_id, g.lease_id, "ok", None, b"x")
    coord.release("eeee05")
    assert "eeee05" not in coord.jobs
    again, created = submit(coord, job_id="eeee05")
    assert not created and again.n_tasks == 1
    assert len(store.task_rows("eeee05")) == 1
    assert len(coord.queue) == 0


def test_require_worker_without_workers_raises_and_stores_nothing(coord, store):
    with pytest.raises(NoWorkers):
        submit(coord, job_id="ffff06", n=2, require_worker=True)
    assert not store.job_exists("ffff06")
    assert "ffff06" not in coord.jobs
    assert len(coord.queue) == 0
    # a dead worker does not count either
    w = coord.register({}, None, 1)
    coord.deregister(w.id)
    with pytest.raises(NoWorkers):
        submit(coord, job_id="ffff06", require_worker=True)
    assert not store.job_exists("ffff06")
    coord.register({}, None, 1)
    job, created = submit(coord, job_id="ffff06", require_worker=True)
    assert created and store.job_exists("ffff06")


def test_empty_job_is_finished(coord, store):
    job, created = submit(coord, job_id="abab07", args=[])
    assert created and job.state == "finished" and job.n_tasks == 0
    assert store.job_row("abab07")["state"] == "finished"


def test_cancel_finishes_pending_and_leased(coord, store):
    w = coord.register({}, None, 1)
    job, _ = submit(coord, n=3)
    (g,) = lease(coord, w.id)
    assert coord.cancel(job.id) == 3
    assert job.state == "cancelled"
    assert {r.state for r in results(store, job.id)} == {"cancelled"}
    assert len(coord.queue) == 0
    with pytest.raises(StaleLease):
        coord.post_result(g.task_id, g.lease_id, "ok", None, b"late")
    with pytest.raises(UnknownJob):
        coord.cancel("nope")


def test_long_poll_lease_is_woken_by_submit(coord, store):
    w = coord.register({}, None, 1)

    async def scenario():
        waiter = asyncio.ensure_future(coord.lease(w.id, 1, 5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        job, _ = submit(coord, job_id="acac08")
        grants = await asyncio.wait_for(waiter, 1.0)
        return job, grants

    job, grants = asyncio.run(scenario())
    assert [g.index for g in grants] == [0]
    assert task_state(store, job.id)[0] == ("leased", 1)


def test_lease_wait_times_out_with_nothing(coord):
    w = coord.register({}, None, 1)
    assert lease(coord, w.id, wait=0.05) == []
    assert w.id not in coord.idle


def test_wait_results_wakes_on_result(coord, store):
    w = coord.register({}, None, 1)
    job, _ = submit(coord, job_id="adad09")
    (g,) = lease(coord, w.id)

    async def scenario():
        waiter = asyncio.ensure_future(coord.wait_results(job.id, -1, 5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        coord.post_result(g.task_id, g.lease_id, "ok", None, b"v")
        return await asyncio.wait_for(waiter, 1.0)

    assert asyncio.run(scenario()) is job
    assert job.next_seq == 1
    with pytest.raises(UnknownJob):
        asyncio.run(coord.wait_results("nope", -1, 0))


def test_release_frees_payloads(coord, store):
    w = coord.register({}, None, 1)
    job, _ = submit(coord, job_id="aeae10", n=2)
    g = lease(coord, w.id, slots=2)
    coord.post_result(g[0].task_id, g[0].lease_id, "ok", None, b"x")
    coord.release(job.id)        # not everything is final: nothing is released
    assert job.id in coord.jobs
    coord.post_result(g[1].task_id, g[1].lease_id, "ok", None, b"y")
    coord.release(job.id)
    assert job.id not in coord.jobs
    assert store.job_row(job.id)["released"] == 1
    assert [r.result for r in results(store, job.id)] == [None, None]


def test_big_payloads_go_to_files(coord, store):
    w = coord.register({}, None, 1)
    big = bytes(range(256)) * 4096  # 1 MiB > INLINE_BLOB_BYTES
    job, _ = submit(coord, job_id="afaf11", args=[big])
    (g,) = lease(coord, w.id)
    inline, fname = store.task_args(g.task_id)
    assert inline is None and fname is not None
    assert store.file_path(fname).read_bytes() == big
    coord.post_result(g.task_id, g.lease_id, "ok", None, big)
    (r,) = results(store, job.id)
    assert r.result is None and r.result_size == len(big)
    assert store.file_path(r.result_file).read_bytes() == big
    coord.release(job.id)
    assert store.reaper.flush(10)  # (the files go on the store's reaper thread)
    assert not store.file_path(r.result_file).exists()
    assert not store.file_path(fname).exists()


# ---------------------------------------------------------------- lanes in the core ---

GPU0 = {"index": 0, "name": "NVIDIA A100", "memory_total_mb": 40000, "memory_free_mb": 40000}


def register_gpu_box(coord):
    """A worker with one GPU slot (id 0) and one CPU slot (id 1)."""
    from gpumesh import hardware
    slot_list = hardware.slot_list([dict(GPU0)], 1)
    assert [s["kind"] for s in slot_list] == ["cuda", "cpu"]
    info = {"hostname": "box", "cpu": "CPU", "cores": 8, "ram_mb": 32000, "gpus": [dict(GPU0)],
            "slot_list": slot_list, "scores": {"cpu": 10.0}}
    return coord.register(info, None, len(slot_list))


def submit_req(coord, job_id, n, gpu=None):
    meta = {"timeout": None}
    if gpu:
        meta["require"] = {"gpu": gpu}
    args = [f"{job_id}-{i}".encode() for i in range(n)]
    return coord.submit(job_id, "fn", "function", "f" * 64, meta, args, [1.0] * n, False)[0]


def count_choose(coord, monkeypatch) -> list[str]:
    shown: list[str] = []
    real = coord._choose

    def spy(job_id, q, slot, ctx):
        shown.append(job_id)
        return real(job_id, q, slot, ctx)
    monkeypatch.setattr(coord, "_choose", spy)
    return shown


def test_zero_task_job_does_not_block_later_leases(coord):
    w = coord.register({}, None, 1)
    empty, _ = submit(coord, job_id="ee0000", n=0)
    assert empty.state == "finished"
    job, _ = submit(coord, job_id="ee0001", n=1)
    (g,) = lease(coord, w.id)
    assert g.job_id == job.id


def test_cpu_slot_never_looks_at_jobs_that_need_a_gpu(coord, monkeypatch):
    box = register_gpu_box(coord)
    for j in range(200):
        submit_req(coord, f"9a{j:04x}", 5, gpu="cuda")
    cpu_job = submit_req(coord, "9b0000", 3)
    shown = count_choose(coord, monkeypatch)
    got = asyncio.run(coord.lease(box.id, 1, 0, [1]))
    assert [(g.job_id, g.slot) for g in got] == [(cpu_job.id, 1)]
    assert shown == [cpu_job.id]
    # the GPU slot takes GPU jobs first, in their order, looking at one job per lease
    shown.clear()
    got = asyncio.run(coord.lease(box.id, 1, 0, [0]))
    assert [(g.job_id, g.index, g.slot) for g in got] == [("9a0000", 0, 0)]
    assert shown == ["9a0000"]


def test_gpu_first_rule_does_not_scan_cpu_jobs(coord, monkeypatch):
    box = register_gpu_box(coord)
    for j in range(200):
        submit_req(coord, f"9c{j:04x}", 5)
    gpu_job = submit_req(coord, "9d0000", 2, gpu="cuda")
    shown = count_choose(coord, monkeypatch)
    got = asyncio.run(coord.lease(box.id, 1, 0, [0]))
    assert [g.job_id for g in got] == [gpu_job.id]
    assert shown == [gpu_job.id]


def test_restart_rebuilds_lanes(tmp_path, clock):
    data = tmp_path / "data"
    s1 = Store(data)
    c1 = Coordinator(s1, clock=clock)
    submit_req(c1, "9e0000", 2, gpu="cuda")
    submit_req(c1, "9e0001", 2)
    s1.close()
    s2 = Store(data)
    try:
        c2 = Coordinator(s2, clock=clock)
        c2.callers.heard(c2, ["9e0000", "9e0001"])  # their callers poll again
        assert len(c2.queue) == 4
        box = register_gpu_box(c2)
        got = asyncio.run(c2.lease(box.id, 2, 0, [0, 1]))
        assert sorted((g.slot, g.job_id) for g in got) == [(0, "9e0000"), (1, "9e0001")]
    finally:
        s2.close()
