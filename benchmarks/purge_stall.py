"""The longest event-loop stall while the coordinator purges expired jobs, or releases
finished ones.

Builds a job store of JOBS finished jobs (TASKS_PER_JOB tasks each, small inline
payloads) through the Store API, marks them expired, and purges them the way the
coordinator's sweeper does (or, with ``--release``, releases them as a caller's release
request does, and waits for any release still running in the background), while a
coroutine measures how long the loop goes without running it. Run it against another
checkout (PYTHONPATH=/other/src) for a before/after: a gpumesh without
``Coordinator.purge_in_slices`` purges in one synchronous call, one without
``Coordinator.background`` releases in one.

    python benchmarks/purge_stall.py [JOBS] [TASKS_PER_JOB] [--release]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store


def build(store: Store, jobs: int, tasks: int) -> None:
    with store.transaction():
        for j in range(jobs):
            job, fn = f"job{j:06d}", f"{j:064x}"
            store.put_blob(fn, [b"code"])
            tids = [f"{job}t{i}" for i in range(tasks)]
            store.create_job(job, "f", "function", fn, {}, [(t, i, 1.0, b"args" * 8) for i, t in enumerate(tids)])
            for i, t in enumerate(tids):
                store.finish(t, "done", i, None, b"result" * 8, job, job_finished=i == tasks - 1)
    store.db.execute("UPDATE jobs SET finished=1000")
    store.db.execute("UPDATE blobs SET created=1000")


async def measure(coord: Coordinator, release: bool = False) -> tuple[float, float]:
    done, worst = asyncio.Event(), [0.0]

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst[0] = max(worst[0], now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    if release:  # as the callers' requests do: at most 1,000 jobs each
        ids = list(coord.jobs)
        for i in range(0, len(ids), 1000):
            coord.release(*ids[i:i + 1000])
            await asyncio.sleep(0)
        await asyncio.gather(*getattr(coord, "background", ()))
    elif hasattr(coord, "purge_in_slices"):
        await coord.purge_in_slices(2000.0)
    else:
        coord.purge(2000.0)
    took = time.perf_counter() - t0
    done.set()
    await tick
    return took, worst[0]


def main() -> None:
    release = "--release" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--release"]
    jobs = int(args[0]) if args else 12650
    tasks = int(args[1]) if len(args) > 1 else 8
    with tempfile.TemporaryDirectory() as d:
        store = Store(Path(d))
        build(store, jobs, tasks)
        if release:
            store.db.execute("UPDATE jobs SET finished=NULL")  # (not expired: just finished)
        coord = Coordinator(store)
        took, worst = asyncio.run(measure(coord, release))
        sql = "SELECT COUNT(*) FROM jobs" + (" WHERE released=0" if release else "")
        left = store.db.execute(sql).fetchone()[0]
        store.close()
    what = "release" if release else "purge"
    print(f"{jobs} jobs x {tasks} tasks: {what} took {took:.2f} s, longest event-loop stall "
          f"{worst * 1000:.0f} ms, {left} jobs left {'unreleased' if release else ''}".rstrip())


if __name__ == "__main__":
    main()
