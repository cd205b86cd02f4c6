"""A caller's results long-poll is answered when the last worker able to run its job is
lost, also while workers that cannot run it stay alive (the only GPU box goes, the CPU
boxes stay). Real Coordinator and Store, no sockets; each poll waits up to ``POLL_S``,
and what tells the cases apart is whether the poll was answered before the loss and
what the page then says, not how long anything took."""

from __future__ import annotations

import asyncio

from gpumesh import hardware as hw

POLL_S = 30.0
RTX = {"name": "NVIDIA GeForce RTX 4090", "memory_total_mb": 24564, "memory_free_mb": 20000}


def register(coord, n_gpus: int):
    gpus = [dict(RTX, index=i) for i in range(n_gpus)]
    slot_list = hw.slot_list(gpus, 1)
    scores = {"cpu": 10.0, **{f"cuda:{i}": 3000.0 for i in range(n_gpus)}}
    info = {"hostname": f"box{n_gpus}", "cpu": "CPU", "cores": 8, "ram_mb": 32000,
            "gpus": gpus, "slot_list": slot_list, "scores": scores}
    return coord.register(info, None, len(slot_list))


def submit(coord, job_id: str, require=None):
    meta: dict = {"timeout": None}
    if require:
        meta["require"] = hw.Requirements.from_options(**require).to_meta()
    job, _ = coord.submit(job_id, "fn", "function", "f" * 64, meta, [b"x"], [1.0], False)
    return job


def answered_by_the_loss(coord, job, lose) -> bool:
    """Open a results poll on ``job``, lose a worker; True if that answered the poll."""
    async def scenario():
        poll = asyncio.ensure_future(coord.wait_results(job.id, -1, POLL_S))
        await asyncio.sleep(0.01)
        assert not poll.done()
        lose()
        await asyncio.sleep(0.01)
        done = poll.done()
        if not done:
            poll.cancel()
            job.waiters.clear()
        return done
    return asyncio.run(scenario())


def test_losing_the_only_able_worker_wakes_the_caller_while_others_stay(coord):
    gpu_box, cpu_box = register(coord, n_gpus=1), register(coord, n_gpus=0)
    job = submit(coord, "ac0001", require={"gpu": "cuda"})
    assert coord.able_workers(job) == 1
    assert answered_by_the_loss(coord, job, lambda: coord.deregister(gpu_box.id))
    assert coord.able_workers(job) == 0 and len(coord.alive_workers()) == 1
    assert cpu_box.alive


def test_losing_one_of_two_able_workers_keeps_the_caller_waiting(coord):
    a, _b = register(coord, n_gpus=1), register(coord, n_gpus=1)
    job = submit(coord, "ac0002", require={"gpu": "cuda"})
    assert not answered_by_the_loss(coord, job, lambda: coord.deregister(a.id))
    assert coord.able_workers(job) == 1


def test_losing_the_last_worker_wakes_a_job_with_no_requirements(coord):
    (w,) = [register(coord, n_gpus=0)]
    job = submit(coord, "ac0003")
    assert answered_by_the_loss(coord, job, lambda: coord.deregister(w.id))
    assert coord.able_workers(job) == 0
