"""The agent's result poster for a coordinator with ``result_batch``: one thread posts
every result that is ready, several per request, and fills each slot's queue of grants
from the answers (see :mod:`gpumesh.coordinator.routes.batch`).

A slot's thread hands its result over and carries on with the next grant of its queue
at once; only a slot whose queue is empty waits for the answer (which carries its next
grants), and such a slot posts its result itself when no other post is on its way (one
post at a time either way). A lone result goes at once and adds no latency. A slot that
still holds at least half its queue lets its results wait for more (at most
``HOLD_S``): the request, the store's commit and the answer then carry several tasks,
and the slot never waits for them. A result stays in the heartbeat's "running" list
until its post is answered, and each is fenced by its own lease: one the coordinator
refuses as stale is dropped alone.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from .. import protocol, tracing, wire
from ..errors import LockedOut, RequestRejected, WireError
from ..transport import Unreachable
from . import membody

log = logging.getLogger("gpumesh.worker")

#: Grants a slot holds beyond its running task when that task's job's tasks are short
#: (in either isolation: with a process per task the next one still forks, but starts
#: without a round trip), at least: enough that its next task never waits for one. The queue holds about ``QUEUE_WORK_S`` of the job's
#: work (from the slot's observed time per task), from ``QUEUE_DEPTH`` up to
#: ``MAX_QUEUE_DEPTH`` grants: another person's job waits about that long for the slot.
QUEUE_DEPTH = 3
#: Seconds of a short job's work a slot's queue holds (see QUEUE_DEPTH). Measured on 2
#: shared cores: 10 ms gave ~6 results per post, 20 ms ~9 (and ~1.9 with 3 grants); the
#: time per task grows with the machine's load, and a shallow queue then holds too few.
QUEUE_WORK_S = 0.02
#: The deepest queue a slot holds (one post asks for at most protocol.MAX_QUEUED_GRANTS
#: of it: a slot that posts at half its queue asks for about half of it).
MAX_QUEUE_DEPTH = 32
#: Longest a result waits for others to go with it (seconds), only while its slot still
#: holds half its queue (about QUEUE_WORK_S / 2 of work): a task that then runs long
#: does not keep it back longer.
HOLD_S = 0.01
#: A batch this big goes without waiting for more.
HOLD_RESULTS = 64
#: A slot queues only behind tasks that ran for less than this (seconds): a round trip
#: is then a large part of each task, and the queue can delay the end of a map by at
#: most QUEUE_DEPTH such tasks, or about QUEUE_WORK_S of shorter ones (a longer task
#: gains little from a queue and would make the last tasks of a map wait behind each
#: other while another slot is idle).
QUEUE_TASK_S = 0.1
#: A result whose payload is bigger goes alone (the one-at-a-time path): a batch is
#: built in memory, and a big payload costs its copy, not a request.
MAX_BATCHED_PAYLOAD = 256 * 1024


@dataclass
class _Pending:
    task: protocol.TaskGrant
    result: protocol.BatchedResult
    payload: bytes | memoryview | None
    slot: int | None
    short: bool = False                 # the task ran for less than QUEUE_TASK_S
    at: float = 0.0                     # when it was handed over (time.monotonic())


class ResultPoster:
    """Posts results for ``agent`` (a :class:`~gpumesh.worker.agent.WorkerAgent`) and
    keeps its slots' queues of grants (``queues[slot]``: ``(grant, args)`` in order)."""

    def __init__(self, agent):
        self.agent = agent
        self.queues: dict[int | None, deque] = {}
        self.posting: set[str] = set()   # task ids whose result is on its way
        self.waiting: set[int | None] = set()  # slots whose thread waits for an answer
        self._inflight: dict[int | None, int] = {}  # results per slot not yet answered
        self._started: dict[int | None, float] = {}  # when the slot's thread took its task
        self._task_s: dict[int | None, float] = {}  # the slot's time per task (moving average)
        self._ready: list[_Pending] = []
        self._sending = False  # a batch is on its way (one at a time, from either thread)
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="results", daemon=True)
        self._thread.start()

    # -- what a slot's thread calls ------------------------------------------------------
    @staticmethod
    def batchable(outcome) -> bool:
        return outcome.handoff_file is None and (
            outcome.payload is None or memoryview(outcome.payload).nbytes <= MAX_BATCHED_PAYLOAD)

    def post(self, task: protocol.TaskGrant, outcome, slot: int | None):
        """Hand ``outcome`` over; returns the slot's next ``(grant, args)`` or ``(None, None)``
        (waiting for the answer only when the slot's queue is empty)."""
        tracing.mark("agent.post")
        payload = outcome.payload
        result = protocol.BatchedResult(task.task_id, task.lease_id, outcome.status, outcome.error,
                                        has_payload=payload is not None)
        now = time.monotonic()
        took = now - self._started.get(slot, float("-inf"))
        if took < QUEUE_TASK_S:  # (a long task, or the first, says nothing of a short job's pace)
            last = self._task_s.get(slot)
            self._task_s[slot] = took if last is None else 0.8 * last + 0.2 * took
        item = _Pending(task, result, payload, slot, short=took < QUEUE_TASK_S, at=now)
        try:
            return self._post(item)
        finally:
            self._started[slot] = time.monotonic()

    def _post(self, item: _Pending):
        slot = item.slot
        with self._cv:
            self.posting.add(item.task.task_id)
            self._inflight[slot] = self._inflight.get(slot, 0) + 1
            queue = self.queues.get(slot)
            if queue:  # the slot carries on; the poster's thread sends the result
                nxt = queue.popleft()
                self._ready.append(item)
                # The poster's thread wakes for a batch's first result (to time its hold)
                # and when the batch is to go, not for each result in between.
                if len(self._ready) == 1 or self._hold_for() <= 0:
                    self._cv.notify_all()
                return nxt
            self.waiting.add(slot)
            inline = not self._sending and not self._ready
            if inline:
                self._sending = True
            else:
                self._ready.append(item)
                self._cv.notify_all()
        try:
            if inline:
                # Nothing else is on its way, and this thread would only wait for the
                # answer: it sends the result itself, which spares a hand-over to the
                # poster's thread and back (two thread wake-ups per result).
                self._deliver([item])
            return self.next_queued(slot)
        finally:
            with self._cv:
                self.waiting.discard(slot)

    def next_queued(self, slot: int | None):
        """The slot's next queued grant ``(grant, args)``, or ``(None, None)`` (also once
        the agent stops: the coordinator re-queues what it leased us). Waits for the
        answers to the slot's results still on their way first: they may queue grants,
        which nobody would run once the slot's thread has ended."""
        with self._cv:
            while self._inflight.get(slot):
                self._cv.wait()
            queue = self.queues.get(slot)
            if queue and not self.agent.stopping.is_set():
                return queue.popleft()
            if queue:
                for grant, _args in queue:
                    self.agent._held.discard(grant.task_id)
                queue.clear()
        return None, None

    def peek(self, slot: int | None):
        """The slot's next queued grant ``(grant, args)``, left in the queue, or None
        (also while the slot is closed or the agent stops: it is not to run then)."""
        agent = self.agent
        if agent.stopping.is_set() or (slot is not None and not agent._slot_open(slot)):
            return None
        with self._cv:
            queue = self.queues.get(slot)
            return queue[0] if queue else None

    def queued(self) -> int:
        """How many grants the slots' queues hold (leased, not begun)."""
        with self._cv:
            return sum(len(q) for q in self.queues.values())

    def drop(self, task_id: str) -> bool:
        """Forget a queued grant the coordinator cancelled (True if one was queued)."""
        with self._cv:
            for queue in self.queues.values():
                for entry in list(queue):
                    if entry[0].task_id == task_id:
                        queue.remove(entry)
                        self.agent._held.discard(task_id)
                        return True
        return False

    # -- the poster's thread -----------------------------------------------------------
    def depth(self, slot: int | None, task: protocol.TaskGrant, short: bool) -> int:
        """How many grants ``slot`` holds beyond its running ``task`` (see QUEUE_DEPTH)."""
        if not short:
            return 0
        per_task = self._task_s.get(slot) or QUEUE_TASK_S
        return max(QUEUE_DEPTH, min(MAX_QUEUE_DEPTH, int(QUEUE_WORK_S / max(per_task, 1e-6))))

    def _hold_for(self) -> float:
        """Seconds the ready results may still wait for others (0: send them now).
        They wait only while no slot's thread waits for an answer and every slot they
        came from still holds at least half its queue, for HOLD_S at most."""
        if self.waiting or len(self._ready) >= HOLD_RESULTS or self.agent.stopping.is_set():
            return 0.0
        seen = set()
        for item in self._ready:
            if item.slot in seen:
                continue
            seen.add(item.slot)
            depth = self.depth(item.slot, item.task, item.short)
            if not depth or len(self.queues.get(item.slot) or ()) * 2 < depth:
                return 0.0
        return self._ready[0].at + HOLD_S - time.monotonic()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if not self._ready or self._sending:
                        self._cv.wait()
                        continue
                    hold = self._hold_for()
                    if hold <= 0:
                        break
                    self._cv.wait(hold)
                batch, self._ready = self._ready, []
                self._sending = True
            self._deliver(batch)

    def _deliver(self, batch: list[_Pending]) -> None:
        """Post ``batch`` (``_sending`` set by the caller) and account for it."""
        try:
            self._send(batch)
        except Exception:  # noqa: BLE001 - the thread must outlive any one batch
            log.exception("posting %d results failed", len(batch))
        finally:
            with self._cv:
                for item in batch:
                    self.posting.discard(item.task.task_id)
                    self._inflight[item.slot] -= 1
                self._sending = False
                self._cv.notify_all()

    def _want(self, batch: list[_Pending]) -> tuple[dict[int, int], list[int]]:
        """How many grants each slot of ``batch`` asks for (its queue topped up to its
        depth, counting the task it runs), and which of them are idle (their thread
        waits for this answer: the coordinator may serve an idle one by a later lease)."""
        agent = self.agent
        want: dict[int, int] = {}
        idle: list[int] = []
        if agent.stopping.is_set():
            return want, idle
        with self._cv:
            for item in batch:
                slot = item.slot
                if slot is None or slot in want or not agent._slot_open(slot):
                    continue
                depth = 1 + self.depth(slot, item.task, item.short)
                held = len(self.queues.get(slot) or ()) + (slot not in self.waiting)
                if depth - held > 0:
                    want[slot] = min(protocol.MAX_QUEUED_GRANTS, depth - held)
                    if slot in self.waiting:
                        idle.append(slot)
        return want, idle

    def _send(self, batch: list[_Pending]) -> None:
        agent = self.agent
        delays = agent_backoff()
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            want, idle = self._want(batch)
            meta = protocol.ResultBatch(tuple(i.result for i in batch), want or None, idle or None,
                                        handoff=agent.handoff is not None)
            frames: list[wire.Chunk] = [json.dumps(meta.as_dict()).encode()]
            frames += [i.payload for i in batch if i.payload is not None]
            chunks, size = wire.pack_frames(frames)
            try:
                body = agent.http.stream_into(
                    "POST", protocol.TASKS_RESULTS, content=b"".join(chunks),
                    headers={"content-length": str(size)}, timeout=600,
                    buffer_for=membody.buffer_for)
            except RequestRejected as e:
                if not e.retry_later:
                    log.warning("%d results refused: %s", len(batch), e)
                    return
                # Not stored (the coordinator kept the leases): the same batch again;
                # what it did store of it comes back refused as stale, the rest lands.
                log.warning("%d results not stored yet, posting them again: %s", len(batch), e)
                if agent.stopping.wait(next(delays)):
                    return
                continue
            except LockedOut as e:  # (this address, for a while): the same batch after it
                agent._locked_out(e)
                if agent.stopping.is_set():
                    return
                continue
            except Unreachable:
                if agent.stopping.is_set():
                    return
                agent.stopping.wait(next(delays))
                continue
            self._take(body)
            return

    def _take(self, body) -> None:
        got = membody.slices(body)
        try:
            head = json.loads(bytes(got[0]))
            grants = protocol.TaskGrant.list_from_dict(head)
        except (ValueError, WireError) as e:  # the results stand; a bad grant is skipped
            log.error("ignored a results answer that is not one: %s", e)
            return
        for r in head.get("refused") or ():
            log.info("result for task %s refused: %s", r.get("task_id"), r.get("message"))
        if grants:
            tracing.mark("agent.leased")
        with self._cv:
            for grant, args in zip(grants, got[1:]):
                self.agent._held.add(grant.task_id)  # reported by heartbeats from now on
                self.queues.setdefault(grant.slot, deque()).append((grant, args))


def agent_backoff():
    from .agent import backoff_delays
    return backoff_delays()
