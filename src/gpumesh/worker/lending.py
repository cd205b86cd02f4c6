"""The agent's side of the machine owner's rules (:mod:`gpumesh.worker.owner`).

A mixin of :class:`gpumesh.worker.agent.WorkerAgent`, kept apart because it is one job:
every ``OWNER_TICK_S`` (and at once on ``gpumesh pause`` / ``resume``) it asks
:class:`~gpumesh.worker.owner.OwnerState` for a decision; a slot the decision closes asks
the coordinator for no task, and a task the decision takes back is killed and handed
back (``POST /v1/tasks/{id}/release``: re-queued as preempted). A change is announced to
the owner and reported to the coordinator at once, from the owner thread, so reports
arrive in order. It uses the agent's ``executor``, ``http``, ``_held``, ``_free_cv``,
``_registered``, ``stopping``, ``on_event`` and the fields set in ``__init__``
(``owner``, ``_decision``, ``_slot_gpu``, ``_slot_task``, ``_handing_back``, ...).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import protocol
from ..errors import RequestRejected
from ..transport import Unreachable
from .device import GpuMonitor, descends_from
from .owner import Decision, OwnerState, clock_time

if TYPE_CHECKING:
    from ..transport import Transport
    from .executor import Executor
    from .poster import ResultPoster

log = logging.getLogger("gpumesh.worker")

#: Seconds between two looks at the owner's rules (hours, GPU readings, a pause's end).
OWNER_TICK_S = 1.0
#: Seconds a handed-back task keeps trying to tell the coordinator before giving up
#: (the heartbeat then stops naming it, which re-queues it too).
HAND_BACK_S = 60.0


class OwnerRules:
    """The owner's rules applied by a running agent (a mixin; see the module docstring)."""

    # What it uses of the agent (WorkerAgent sets them in __init__), for type checkers.
    id: str | None
    info: dict
    slot_list: list[dict]
    http: Transport
    executor: Executor
    stopping: threading.Event
    on_event: Callable[[str, str], None]
    _registered: threading.Event
    _held: set[str]
    _free_cv: threading.Condition
    poster: ResultPoster | None

    @property
    def _wid(self) -> str:
        """The id the coordinator gave this worker: set by the first registration, before
        any loop that uses it starts, and never unset."""
        assert self.id is not None
        return self.id

    def _init_owner(self, owner: OwnerState, gpus: list[dict]) -> None:
        """Set up after the agent's ``slot_list``: the decision in force, the slot each
        task runs in, the tasks being handed back (task id -> why)."""
        self.owner = owner
        self._owner_lock = threading.Lock()
        self._decision = owner.decide()
        self._slot_gpu = {s["id"]: s.get("gpu") for s in self.slot_list}
        self._slot_task: dict[int | None, str] = {}
        self._handing_back: dict[str, str] = {}
        self._owner_due = threading.Event()  # a change the coordinator must hear of now
        # the owner thread reads the GPUs through its own monitor (one caller thread each)
        self._owner_gpus = GpuMonitor([g["index"] for g in gpus])

    def _announce_start(self) -> None:
        """Say at start what the owner's rules close now (outside the sharing hours, say,
        and until when): the rules' later changes are announced as they come."""
        if self._decision.worker is not None or self._decision.gpus:
            self._announce(Decision(), self._decision)

    def _slot_open(self, slot: int | None) -> bool:
        """Whether the owner's rules let ``slot`` start a new task now."""
        return self._decision.open(self._slot_gpu.get(slot))

    def _closed_reason(self, slot: int | None) -> str:
        d = self._decision
        if d.worker is not None:
            return d.worker["label"]
        gpu = self._slot_gpu.get(slot)
        st = d.gpus.get(gpu) if gpu is not None else None
        return st["label"] if st else "handed back by its worker"

    def _owner_report(self) -> dict:
        """The owner's rules as the coordinator sees them (gpumesh.availability)."""
        d = self._decision
        return {"owner": d.worker, "gpu_states": {str(i): st for i, st in d.gpus.items()}}

    def _owner_loop(self) -> None:
        """Look at the rules every OWNER_TICK_S, and tell the coordinator of a change at
        once (from this one thread, so that reports arrive in order)."""
        while not self.stopping.is_set():
            self._owner_due.wait(OWNER_TICK_S)
            try:
                self._owner_tick()
                if self._owner_due.is_set():
                    self._owner_due.clear()
                    if not self._registered.is_set():
                        continue  # the registration carries it
                    self.http.request("POST", protocol.worker_heartbeat(self._wid),
                                      json={"running": sorted(self._held), **self._owner_report()},
                                      timeout=5)
            except Exception as e:  # noqa: BLE001 - never let the owner thread die
                log.warning("owner rules check failed: %s", e)  # the heartbeat carries it too
                self.stopping.wait(OWNER_TICK_S)

    def _owner_tick(self) -> None:
        """Apply the owner's rules now: hand back what must go; a change is announced and
        marked for the owner thread to report."""
        readings = None
        if self.owner.policy.watches_gpus:
            me = os.getpid()
            readings = self._owner_gpus.readings(lambda pid: descends_from(pid, me))
        with self._owner_lock:
            old, new = self._decision, self.owner.decide(readings)
            self._decision = new
        for slot, task_id in list(self._slot_task.items()):
            gpu = self._slot_gpu.get(slot)
            if new.hand_back(gpu):
                if task_id not in self._handing_back:
                    self._handing_back[task_id] = self._closed_reason(slot)
                    log.info("handing task %s back: %s", task_id, self._handing_back[task_id])
                # again at every tick: a task may have been on its way into the executor
                self.executor.cancel(task_id)
        if (old.worker, old.gpus) != (new.worker, new.gpus):
            self._announce(old, new)
            with self._free_cv:
                self._free_cv.notify_all()
            self._owner_due.set()

    def _announce(self, old: Decision, new: Decision) -> None:
        if (old.worker or {}).get("label") != (new.worker or {}).get("label"):
            if new.worker is None:
                self.on_event("owner", "taking tasks again")
            else:
                what = {"paused": "paused by the owner", "outside_hours": "outside the sharing hours"}
                until = new.worker.get("until")
                self.on_event("owner", what.get(new.worker["state"], new.worker["label"])
                              + (f" until {clock_time(until, self.owner.clock())}" if until else "")
                              + ": no new tasks; running ones "
                              + ("handed back" if new.hand_back_all else "finish"))
        for i in sorted(set(old.gpus) | set(new.gpus)):
            was, now = old.gpus.get(i), new.gpus.get(i)
            if (was or {}).get("label") != (now or {}).get("label"):
                self.on_event("owner", f"cuda:{i} {now['label']}: no new tasks there" if now
                              else f"cuda:{i} taking tasks again")

    def _hand_back(self, task: protocol.TaskGrant, reason: str, delays) -> None:
        """Give a task back to the coordinator as preempted, retrying while it is away
        after each of ``delays`` (seconds, an iterator)."""
        deadline = time.monotonic() + HAND_BACK_S
        while time.monotonic() < deadline:
            try:
                self.http.request("POST", protocol.task_release(task.task_id),
                                  params={"lease": task.lease_id}, json={"reason": reason},
                                  timeout=10)
                self.on_event("handed_back", f"task {task.task_id} handed back ({reason})")
                return
            except RequestRejected as e:  # already re-queued or cancelled meanwhile
                log.info("hand-back of task %s refused: %s", task.task_id, e)
                return
            except Unreachable:
                if self.stopping.wait(next(delays)):
                    return

    def control(self, request: dict) -> dict:
        """Answer one control-channel request (gpumesh.worker.control): ``pause``
        (``now``, ``for_s``), ``resume`` or ``status``; ``worker`` names the one meant.
        Raises ``ValueError`` for a malformed request."""
        op, target = request.get("op"), request.get("worker")
        if target is not None and not isinstance(target, str):
            raise ValueError("'worker' must be a worker id")
        if target and target != self.id and not (self.id or "").startswith(target):
            return {"ok": True, "skipped": True, "worker": self.id}
        was_paused = self.owner.paused  # for the owner's CLI: "was not paused", "already paused"
        if op == "pause":
            now, for_s = request.get("now", False), request.get("for_s")
            if not isinstance(now, bool):
                raise ValueError("'now' must be true or false")
            if for_s is not None and (isinstance(for_s, bool) or not isinstance(for_s, (int, float))
                                      or not 0 < for_s <= 366 * 86400):
                raise ValueError("'for_s' must be a number of seconds, at most a year")
            with self._owner_lock:
                self.owner.pause(now=now, for_s=for_s)
        elif op == "resume":
            with self._owner_lock:
                self.owner.resume()
        elif op != "status":
            raise ValueError(f"unknown op {op!r}: pause, resume or status")
        # (held: running, and queued behind a slot's running task; a pause hands the
        # queued ones back at once, with or without --now)
        queued = self.poster.queued() if self.poster is not None else 0
        running = max(0, len(self._held) - queued)
        self._owner_tick()
        d = self._decision
        return {"ok": True, "worker": self.id, "hostname": self.info.get("hostname"),
                "state": (d.worker or {}).get("label", "open"), "until": self.owner.paused_until,
                "running": running, "queued": queued, "gpus": {str(i): st["label"] for i, st in d.gpus.items()},
                "was_paused": was_paused}
