"""Purging expired jobs, and releasing a job of many tasks, never holds the coordinator's
event loop for long: a batch of jobs, or a slice of one job's tasks, per transaction, and
the loop served between two (Coordinator.purge_in_slices, Coordinator.release)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store
from gpumesh.limits import INLINE_BLOB_BYTES, TASK_SLICE_ROWS

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

    # The loop gets control between batches (the stall figures, measured, are in
    # benchmarks/purge_stall.py and docs/performance.md: a timed bound here would fail on
    # a loaded machine). One synchronous purge would let the ticker run 0 times.
    n, ticks = asyncio.run(_ticking(lambda: coord.purge_in_slices(cutoff)))
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


# A job of many tasks: released and purged a slice of task rows per transaction, with the
# event loop served between two (one commit of a million rows held it for seconds).
BIG = 3 * TASK_SLICE_ROWS + 5
BIG_FILE = b"x" * (INLINE_BLOB_BYTES + 1)  # a payload kept as a file beside the database
FILES_AT = (0, TASK_SLICE_ROWS, BIG - 1)  # tasks whose result is such a file


def build_big(store: Store, job: str) -> list[Path]:
    """``job``: BIG tasks, all done, three of them with a result file; returns those files."""
    with store.transaction():
        tids = [f"{job}t{i}" for i in range(BIG)]
        store.create_job(job, "f", "function", None, {}, [(t, i, 1.0, b"a") for i, t in enumerate(tids)])
        for i, t in enumerate(tids):
            store.finish(t, "done", i, None, BIG_FILE if i in FILES_AT else b"r", job,
                         job_finished=i == BIG - 1)
    files = [store.blob_dir / r[0] for r in store.db.execute(
        "SELECT result_file FROM tasks WHERE job_id=? AND result_file IS NOT NULL", (job,))]
    assert len(files) == len(FILES_AT) and all(f.exists() for f in files)
    return files


async def _ticking(coro_fn) -> tuple[object, int]:
    """Run ``coro_fn()`` beside a coroutine that counts how often the loop ran it (what a
    heartbeat or a request sees meanwhile)."""
    done, ticks = asyncio.Event(), [0]

    async def ticker() -> None:
        while not done.is_set():
            await asyncio.sleep(0)
            ticks[0] += 1

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    before = ticks[0]
    try:
        out = await coro_fn()
    finally:
        done.set()
        await tick
    return out, ticks[0] - before


def _gone(paths: list[Path], store: Store) -> bool:
    store.reaper.flush()
    return not any(p.exists() for p in paths)


def test_a_job_of_many_tasks_is_purged_a_slice_at_a_time(tmp_path, monkeypatch):
    store = Store(tmp_path)
    files = build_big(store, "big")
    store.create_job("kept", "f", "function", None, {}, [("keptt", 0, 1.0, b"a")])
    store.finish("keptt", "done", 0, None, b"r", "kept", job_finished=True)
    store.db.execute("UPDATE jobs SET finished=? WHERE id='big'", (OLD,))
    coord = Coordinator(store)
    slices: list[int] = []
    real = store.purge_task_slice
    monkeypatch.setattr(store, "purge_task_slice", lambda j, n: slices.append(real(j, n)) or slices[-1])

    n, ticks = asyncio.run(_ticking(lambda: coord.purge_in_slices(OLD + 1)))
    assert n == 1
    assert len(slices) >= 2 and sum(slices) >= BIG - max(slices)  # most of it in slices
    assert ticks >= len(slices)  # the loop ran between every two
    assert [r[0] for r in store.db.execute("SELECT id FROM jobs")] == ["kept"]
    assert store.db.execute("SELECT job_id, COUNT(*) FROM tasks GROUP BY job_id").fetchall() == [("kept", 1)]
    assert _gone(files, store)
    store.close()


def test_a_job_of_many_tasks_is_released_a_slice_at_a_time(tmp_path):
    store = Store(tmp_path)
    files = build_big(store, "big")
    coord = Coordinator(store)  # (it loads the unreleased job)
    assert coord.jobs["big"].n_tasks == BIG

    async def release() -> bool:
        coord.release("big")
        coord.release("big")  # a second release while the first runs starts nothing more
        assert len(coord.background) == 1
        unreleased_meanwhile = store.db.execute("SELECT released FROM jobs").fetchone()[0] == 0
        await asyncio.gather(*coord.background)
        return unreleased_meanwhile

    meanwhile, ticks = asyncio.run(_ticking(release))
    assert meanwhile  # release answered before the work was done
    assert ticks >= BIG // TASK_SLICE_ROWS  # the loop ran between every two slices
    assert store.db.execute("SELECT released FROM jobs WHERE id='big'").fetchone()[0] == 1
    assert store.db.execute("SELECT COUNT(*) FROM tasks WHERE result IS NOT NULL OR result_file IS NOT NULL"
                            " OR args IS NOT NULL").fetchone()[0] == 0
    assert store.db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0] == BIG  # (rows stay)
    assert "big" not in coord.jobs and not coord.releasing
    assert _gone(files, store)
    store.close()


def test_release_outside_the_event_loop_is_done_at_once(tmp_path):
    store = Store(tmp_path)
    files = build_big(store, "big")
    Coordinator(store).release("big")
    assert store.db.execute("SELECT released FROM jobs WHERE id='big'").fetchone()[0] == 1
    assert _gone(files, store)
    store.close()
