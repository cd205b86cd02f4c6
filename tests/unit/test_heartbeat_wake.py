"""A heartbeat that changes what placement reads places the pending tasks again at once:
the worker's open lease poll is answered with the task that now fits, instead of empty
when the poll runs out (and the task only at the worker's next poll).

Real Coordinator and Store, fake clock, no sockets. Each poll below waits up to
``POLL_S``; a poll the heartbeat did not serve ends empty, which is what the assertions
tell apart (no timing is asserted)."""

from __future__ import annotations

import asyncio

from gpumesh import hardware as hw

POLL_S = 5.0
RTX = {"name": "NVIDIA GeForce RTX 4090", "memory_total_mb": 24564, "memory_free_mb": 2000}
YIELDING = {"state": "yielding", "label": "yielding: GPU busy"}


def register(coord, n_gpus: int, cpu_slots: int):
    gpus = [dict(RTX, index=i) for i in range(n_gpus)]
    slot_list = hw.slot_list(gpus, cpu_slots)
    scores = {"cpu": 10.0, **{f"cuda:{i}": 3000.0 for i in range(n_gpus)}}
    info = {"hostname": "box", "cpu": "CPU", "cores": 8, "ram_mb": 32000, "gpus": gpus,
            "slot_list": slot_list, "scores": scores}
    return coord.register(info, None, len(slot_list))


def submit(coord, job_id: str, n: int = 1, require=None, vram=None) -> None:
    meta = {"timeout": None}
    if require:
        meta["require"] = hw.Requirements.from_options(**require).to_meta()
    if vram:
        meta["gpu_memory_mb"] = {str(i): v for i, v in vram.items()}
    coord.submit(job_id, "fn", "function", "f" * 64, meta, [b"x"] * n, [1.0] * n, False)


def poll_then(coord, wid: str, free: list[int], before, heartbeat) -> list:
    """Open a lease poll naming ``free``; ``before()`` while it waits (nothing may be
    granted yet); then ``heartbeat()``; return what the poll was answered."""
    async def scenario():
        fut = asyncio.ensure_future(coord.lease(wid, len(free), POLL_S, free))
        await asyncio.sleep(0.01)
        before()
        await asyncio.sleep(0.01)
        assert not fut.done(), "granted before the heartbeat's news"
        heartbeat()
        return await fut
    return asyncio.run(scenario())


def test_a_gpu_that_stops_yielding_joins_the_open_poll(coord):
    # GPU 0 yields to another program; the worker's poll names its free, open slot: the CPU
    box = register(coord, n_gpus=1, cpu_slots=1)
    coord.heartbeat(box.id, [], {"gpu_states": {"0": YIELDING}})
    got = poll_then(coord, box.id, [1],
                    lambda: submit(coord, "ab0001", require={"gpu": "cuda"}),
                    lambda: coord.heartbeat(box.id, [], {"gpu_states": {}}))
    assert [(g.job_id, g.slot) for g in got] == [("ab0001", 0)]


def test_one_gpu_reopening_as_another_closes_counts(coord):
    # GPU 0 reopens in the same heartbeat that closes GPU 1: as many closed as before
    box = register(coord, n_gpus=2, cpu_slots=1)
    coord.heartbeat(box.id, [], {"gpu_states": {"0": YIELDING}})
    submit(coord, "ab0002", n=2, require={"gpu": "cuda"})
    (first,) = asyncio.run(coord.lease(box.id, 2, 0, [1, 2]))
    assert first.slot == 1                           # the open GPU takes one at once
    got = poll_then(coord, box.id, [2], lambda: None,
                    lambda: coord.heartbeat(box.id, [first.task_id],
                                            {"gpu_states": {"1": YIELDING}}))
    assert [(g.job_id, g.slot) for g in got] == [("ab0002", 0)]


def test_a_reopened_slot_that_still_runs_a_task_gets_no_second_one(coord):
    box = register(coord, n_gpus=1, cpu_slots=1)
    submit(coord, "ab0003", n=2, require={"gpu": "cuda"})
    (running,) = asyncio.run(coord.lease(box.id, 1, 0, [0]))
    # GPU 0 yields with its task still running within the grace, and comes back
    coord.heartbeat(box.id, [running.task_id], {"gpu_states": {"0": YIELDING}})
    got = poll_then(coord, box.id, [1], lambda: None,
                    lambda: coord.heartbeat(box.id, [running.task_id], {"gpu_states": {}}))
    assert got == []                                 # slot 0 is busy: its result asks next
    assert sorted(coord.workers[box.id].leases) == [running.task_id]


def test_a_resumed_worker_is_served_by_its_poll(coord):
    box = register(coord, n_gpus=0, cpu_slots=2)
    got = poll_then(coord, box.id, [0, 1],
                    lambda: (coord.heartbeat(box.id, [], {"owner": {"state": "paused",
                                                                    "label": "paused: owner"}}),
                             submit(coord, "ab0004")),
                    lambda: coord.heartbeat(box.id, [], {"owner": None}))
    assert [g.job_id for g in got] == ["ab0004"]


def test_packages_and_free_memory_in_one_heartbeat(coord):
    # The slots' description is rebuilt after every change the heartbeat brings: the
    # packages news must not leave the memory news unseen.
    box = register(coord, n_gpus=1, cpu_slots=0)
    got = poll_then(coord, box.id, [0],
                    lambda: submit(coord, "ab0005", vram={0: 4000}),  # 2000 MiB free < 4000
                    lambda: coord.heartbeat(box.id, [], {"packages": {"numpy": "2.0.0"},
                                                         "gpu_free_mb": {0: 9000}}))
    assert [(g.job_id, g.slot) for g in got] == [("ab0005", 0)]
    assert coord.workers[box.id].slot_views()[0].vram_free_mb == 9000


def test_a_heartbeat_with_no_news_places_nothing(coord):
    box = register(coord, n_gpus=1, cpu_slots=0)
    got = asyncio.run(_poll_short(coord, box.id))
    assert got == []


async def _poll_short(coord, wid):
    fut = asyncio.ensure_future(coord.lease(wid, 1, 0.2, [0]))
    await asyncio.sleep(0.01)
    submit(coord, "ab0006", vram={0: 4000})
    coord.heartbeat(wid, [], {"gpu_free_mb": {0: 2000}})  # the same as before: still too little
    return await fut
