"""A caller's keepalive: while this process waits on jobs, it tells their coordinator so.

The coordinator cancels and releases a function job whose caller it has not heard from
for its ``GPUMESH_CALLER_TIMEOUT`` (``coordinator/callers.py``): that is how a killed
caller's job stops. A caller waiting on results is heard through its long polls, but an
``.imap`` whose consumer takes its time between items polls only when asked for the
next one. So one thread per mesh sends ``POST /v1/jobs/alive`` with the ids of the jobs
this process still waits on there (``stopsignals.waited_on``), every quarter of that
timeout (``health``'s ``caller_timeout``), at most every ``KEEPALIVE_MAX_S``. A job is
named only once it was open at the previous tick too: short calls never cost a request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .. import protocol
from ..limits import KEEPALIVE_MAX_S, MAX_RELEASE_JOBS
from . import stopsignals

log = logging.getLogger("gpumesh.client")

#: The shortest interval (s): a coordinator's tiny timeout must not make a busy loop.
KEEPALIVE_MIN_S = 0.25


def interval(caller_timeout: float | None) -> float:
    """Seconds between keepalives for a coordinator whose ``caller_timeout`` is given
    (None: not known, e.g. an older coordinator): a quarter of it, within
    [KEEPALIVE_MIN_S, KEEPALIVE_MAX_S]."""
    if caller_timeout is None or caller_timeout <= 0:
        return KEEPALIVE_MAX_S
    return min(KEEPALIVE_MAX_S, max(KEEPALIVE_MIN_S, caller_timeout / 4))


class Keepalive:
    """The keepalive thread of one mesh (started by ``mesh._start_keepalive()`` at its first job)."""

    def __init__(self, mesh: Any):
        self._mesh = mesh
        threading.Thread(target=self._run, name="gpumesh-keepalive", daemon=True).start()

    def _run(self) -> None:
        before: set[str] = set()
        while True:
            time.sleep(interval(self._mesh._caller_timeout))
            now = set(stopsignals.waited_on(self._mesh))
            due = sorted(now & before)[:MAX_RELEASE_JOBS]
            before = now
            if not due:
                continue
            try:
                self._mesh.http.request("POST", protocol.JOBS_ALIVE, json={"jobs": due}, timeout=10)
            except Exception as e:  # noqa: BLE001 - best effort: the long polls say it too
                log.debug("keepalive of %d job(s) failed: %s", len(due), e)
