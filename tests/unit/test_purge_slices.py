"""Purging expired jobs never holds the coordinator's event loop for long: it deletes a
batch of jobs per transaction and yields between batches (Coordinator.purge_in_slices)."""

from __future__ import annotations

import asyncio

from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store

EXPIRED, KEPT, TASKS = 3000, 50, 8
OLD = 1000.0  # epoch seconds: long past any cutoff


def build(store: Store) -> None:
    """EXPIRED jobs finished at OLD, KEPT finished now, one still running: through the
    Store API, in one transaction."""
    with store.transaction():
        for j in range(EXPIRED + KEPT + 1):
            job = f"job{j:05d}"
            fn = f"{j:064x}"
            store.put_blob(fn, [b"code"])
            tids = [f"{job}t{i}" for i in range(TASKS)]
            store.create_job(job, "f", "function", fn, {}, [(t, i, 1.0, b"args") for i, t in enumerate(tids)])
            if j == EXPIRED + KEPT:
                continue  # still running
            for i, t in enumerate(tids):
                store.finish(t, "done", i, None, b"result", job, job_finished=i == TASKS - 1)
    store.db.execute("UPDATE jobs SET finished=? WHERE id < ?", (OLD, f"job{EXPIRED:05d}"))
    store.db.execute("UPDATE blobs SET created=?", (OLD,))
    store.db.execute("UPDATE jobs SET created=? WHERE id=?", (OLD, f"job{EXPIRED + KEPT:05d}"))


def test_purge_in_slices_keeps_the_event_loop_responsive(tmp_path):
    store = Store(tmp_path)
    build(store)
    coord = Coordinator(store)
    cutoff = OLD + 1

    async def main() -> tuple[int, int]:
        done = asyncio.Event()
        ticks = [0]

        async def ticker() -> None:  # what a heartbeat or a request sees meanwhile
            while not done.is_set():
                await asyncio.sleep(0)
                ticks[0] += 1

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        before = ticks[0]
        try:
            n = await coord.purge_in_slices(cutoff)
        finally:
            done.set()
            await tick
        return n, ticks[0] - before

    # The loop gets control between batches (the stall figures, measured, are in
    # benchmarks/purge_stall.py and docs/performance.md: a timed bound here would fail on
    # a loaded machine). One synchronous purge would let the ticker run 0 times.
    n, ticks = asyncio.run(main())
    assert n == EXPIRED
    assert ticks >= 3, f"the event loop ran {ticks} times during the purge"
    jobs = {r[0] for r in store.db.execute("SELECT id FROM jobs")}
    assert jobs == {f"job{j:05d}" for j in range(EXPIRED, EXPIRED + KEPT + 1)}  # nothing unexpired touched
    assert store.db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0] == (KEPT + 1) * TASKS
    assert store.db.execute("SELECT COUNT(*) FROM tasks WHERE result IS NOT NULL").fetchone()[0] == KEPT * TASKS
    # the blobs of purged jobs go; those of kept jobs (the running one's too) stay
    blobs = {r[0] for r in store.db.execute("SELECT hash FROM blobs")}
    assert blobs == {f"{j:064x}" for j in range(EXPIRED, EXPIRED + KEPT + 1)}
    assert store.db.execute("SELECT COUNT(*) FROM jobs WHERE released=1").fetchone()[0] == 0
    store.close()


def test_a_purge_batch_is_one_transaction_and_stops_at_its_limit(tmp_path):
    store = Store(tmp_path)
    for j in range(5):
        job = f"j{j}"
        store.create_job(job, "f", "function", None, {}, [(f"{job}t", 0, 1.0, b"a")])
        store.finish(f"{job}t", "done", 0, None, b"r", job, job_finished=True)
    store.db.execute("UPDATE jobs SET finished=? WHERE id != 'j4'", (OLD,))
    ran: list[str] = []
    store.db.set_trace_callback(ran.append)
    assert store.purge_jobs(OLD + 1, 3) == ["j0", "j1", "j2"]
    store.db.set_trace_callback(None)
    # one commit releases the batch's payloads, one deletes its rows
    assert sum(q.strip().upper() == "COMMIT" for q in ran) == 2
    assert store.purge_jobs(OLD + 1, 3) == ["j3"]                   # fewer: no more expired
    assert store.purge_jobs(OLD + 1, 3) == []
    assert [r[0] for r in store.db.execute("SELECT id FROM jobs")] == ["j4"]
    store.close()
