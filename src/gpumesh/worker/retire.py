"""Closing a slot's previous job's process a moment after its next job's task started.

A slot that runs a task of another job than the one whose process it keeps
(``isolation="job"``) lets that process go. Closed at once, on the task's path, its end
(an exit and its host's reap on the fork runtime; a kill and a wait on the spawn one)
competed with the new task for the machine's cores, and a single ``isolation="job"``
call is always a new job's first task. Handed here instead, the close runs on this
module's thread once ``RETIRE_S`` has passed: after the call it was in the way of, as a
rule (a call takes a few milliseconds).

Only for slots without a device: a process that holds GPU memory must let it go before
the next job's task asks for it, so the executors close those at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

log = logging.getLogger("gpumesh.worker")

#: Seconds a let-go process lives on before it is closed (see the module docstring).
RETIRE_S = 0.1


def on_device(env: dict | None) -> bool:
    """Whether a slot whose tasks get ``env`` has a device (its GPU named there): a
    process of its previous job is closed at once (see the module docstring)."""
    return bool(env and env.get("CUDA_VISIBLE_DEVICES"))


class Retirer:
    """Runs each close it is given ``RETIRE_S`` later, in order, on one thread of its own
    (started with the first); :meth:`flush` runs those still waiting at once."""

    def __init__(self, delay: float = RETIRE_S) -> None:
        self.delay = delay
        self._due: deque[tuple[float, Callable[[], None]]] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = threading.Lock()  # held while a close runs (see flush)

    def later(self, close: Callable[[], None]) -> None:
        with self._cv:
            self._due.append((time.monotonic() + self.delay, close))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="retire", daemon=True)
                self._thread.start()
            elif len(self._due) == 1:
                self._cv.notify()

    def flush(self) -> None:
        """Close everything still waiting, now, and wait for a close under way (the
        executor is closing: it leaves no process behind)."""
        with self._cv:
            due, self._due = list(self._due), deque()
        with self._closing:
            for _at, close in due:
                self._run(close)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._cv.wait(None if not self._due else self._due[0][0] - time.monotonic())
                _at, close = self._due.popleft()
                self._closing.acquire()  # (before the lock goes: flush waits for it)
            try:
                self._run(close)
            finally:
                self._closing.release()

    @staticmethod
    def _run(close: Callable[[], None]) -> None:
        try:
            close()
        except Exception:  # noqa: BLE001 - one failed close must not stop the others
            log.exception("closing a job's process failed")
