"""Long-polls (a worker's lease, a caller's results) run in their request's own task
(routes/base.py's ``until_disconnect``): a client that leaves ends the wait (None) and
is granted nothing, and a server that stops still cancels them. The request is faked
at its narrowest boundary: the ASGI ``receive`` it reads."""

from __future__ import annotations

import asyncio

import pytest

from gpumesh.coordinator.routes.base import until_disconnect

from .test_scheduler_core import lease, submit, task_state


class Client:
    """A request's ``receive``: ``leave()`` makes it answer ``http.disconnect``."""

    def __init__(self):
        self.left = asyncio.Event()

    async def receive(self):
        await self.left.wait()
        return {"type": "http.disconnect"}

    def leave(self):
        self.left.set()


def test_a_long_poll_answers_with_what_it_waited_for(coord, store):
    w = coord.register({}, None, 1)

    async def scenario():
        client = Client()
        poll = asyncio.ensure_future(until_disconnect(client, coord.lease(w.id, 1, 5.0)))
        await asyncio.sleep(0.01)
        submit(coord, job_id="acac01")
        return await asyncio.wait_for(poll, 1.0)

    (g,) = asyncio.run(scenario())
    assert g.index == 0 and g.task_id in coord.leases
    assert w.id not in coord.idle


def test_a_lease_poll_whose_worker_left_ends_and_grants_nothing(coord, store):
    w = coord.register({}, None, 1)

    async def scenario():
        client = Client()
        poll = asyncio.ensure_future(until_disconnect(client, coord.lease(w.id, 1, 5.0)))
        await asyncio.sleep(0.01)
        client.leave()
        await asyncio.sleep(0)  # the watcher has seen it: the poll's task is being cancelled
        job, _ = submit(coord, job_id="acac02")
        return job, await asyncio.wait_for(poll, 1.0)

    job, got = asyncio.run(scenario())
    assert got is None
    assert coord.leases == {} and len(coord.queue) == 1, "nothing was granted to the gone poll"
    assert task_state(store, job.id) == {0: ("pending", 0)}
    assert w.id not in coord.idle
    (g,) = lease(coord, w.id)
    assert g.attempt == 1


def test_a_results_poll_whose_caller_left_ends_and_a_later_result_still_lands(coord, store):
    w = coord.register({}, None, 1)
    job, _ = submit(coord, job_id="acac03")
    (g,) = lease(coord, w.id)

    async def scenario():
        client = Client()
        poll = asyncio.ensure_future(until_disconnect(client, coord.wait_results(job.id, -1, 5.0)))
        await asyncio.sleep(0.01)
        client.leave()
        return await asyncio.wait_for(poll, 1.0)

    assert asyncio.run(scenario()) is None
    coord.post_result(g.task_id, g.lease_id, "ok", None, b"v")
    assert job.next_seq == 1 and job.waiters == []


def test_a_results_poll_that_times_out_leaves_no_waiter(coord, store):
    job, _ = submit(coord, job_id="acac04")

    async def scenario():
        return await until_disconnect(Client(), coord.wait_results(job.id, -1, 0.02))

    assert asyncio.run(scenario()) is job
    assert job.waiters == []


def test_a_stopping_server_still_cancels_a_long_poll(coord):
    w = coord.register({}, None, 1)

    async def scenario():
        poll = asyncio.ensure_future(until_disconnect(Client(), coord.lease(w.id, 1, 5.0)))
        await asyncio.sleep(0.01)
        poll.cancel()
        with pytest.raises(asyncio.CancelledError):
            await poll

    asyncio.run(scenario())
    assert w.id not in coord.idle
