"""The longest event-loop stall while the coordinator purges expired jobs.

Builds a job store of JOBS finished jobs (TASKS_PER_JOB tasks each, small inline
payloads) through the Store API, marks them expired, and purges them the way the
coordinator's sweeper does, while a coroutine measures how long the loop goes without
running it. Run it against another checkout (PYTHONPATH=/other/src) for a before/after:
a gpumesh without ``Coordinator.purge_in_slices`` purges in one synchronous call.

    python benchmarks/purge_stall.py [JOBS] [TASKS_PER_JOB]
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


async def measure(coord: Coordinator) -> tuple[float, float]:
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
    if hasattr(coord, "purge_in_slices"):
        await coord.purge_in_slices(2000.0)
    else:
        coord.purge(2000.0)
    took = time.perf_counter() - t0
    done.set()
    await tick
    return took, worst[0]


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 12650
    tasks = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    with tempfile.TemporaryDirectory() as d:
        store = Store(Path(d))
        build(store, jobs, tasks)
        coord = Coordinator(store)
        took, worst = asyncio.run(measure(coord))
        left = store.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
        store.close()
    print(f"{jobs} jobs x {tasks} tasks: purge took {took:.2f} s, longest event-loop stall "
          f"{worst * 1000:.0f} ms, {left} jobs left")


if __name__ == "__main__":
    main()
