"""Whether the caller of each open function job is still there.

A function job's results are for the program that submitted it and waits on them (a
call, a ``.map``, an ``.imap``). Its long polls say it is there (``caller=1``: a status
read by anyone else, ``gpumesh status`` or ``mesh.wait``, does not), and so does the
keepalive it sends while the job is open (``client/keepalive.py``: ``POST
/v1/jobs/alive``, every quarter of ``CALLER_TIMEOUT_S`` or 30 s). A caller that stopped
without saying so (killed, its machine gone, or one that gave up on an unreachable
coordinator and raised ``MeshUnavailable``) would otherwise leave its job running to
the end, side effects included, and its results on disk until retention. So a function
job whose caller has not been heard from for ``CALLER_TIMEOUT_S`` is cancelled and
released, as the caller itself does when it gives up (Ray and Dask likewise end a
driver's or client's tasks when it goes). Script jobs are left alone: nobody waits on
them (``gpumesh submit``; ``mesh.wait`` comes later, from anywhere).

A caller on the coordinator's own machine (its submit came over loopback and names this
host) whose process is gone is given up sooner: after :data:`LOCAL_GONE_S` unheard, not
``CALLER_TIMEOUT_S``. The long timeout is for callers that may be cut off by a network and
reconnect; a local process that no longer exists will not (a notebook kernel restarted
with SIGKILL held the pool for six minutes). A live caller is heard at least every long
poll (``LONG_POLL_S``), so one whose pid the coordinator cannot see (another PID
namespace) is never mistaken for gone.

After a restart, a recovered function job's pending tasks are *held* (not granted) until
its caller is heard: a caller still waiting polls again within seconds (its reconnect
backoff is at most 5 s), and one that gave up while the coordinator was down never
will, so its job must not run on behind its back. Tasks that were running on workers at
the restart are not held: those workers finish them and post their results.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..limits import CALLER_TIMEOUT_S
from .diskfull import note

if TYPE_CHECKING:  # core imports this module: no import of core at run time
    from .core import Coordinator
    from .model import Job

log = logging.getLogger("gpumesh.coordinator")

#: Seconds between two looks for silent callers (the sweeper runs more often).
CHECK_EVERY_S = 1.0
#: Seconds unheard after which a caller on this machine whose process is gone is given
#: up: above LONG_POLL_S (20 s), the longest a waiting caller goes between two polls.
LOCAL_GONE_S = 30.0


def gone_here(caller: dict) -> bool:
    """Whether the caller ``caller`` (a job's ``meta["caller"]``: ``host``, ``pid``,
    ``loopback`` as the submit route records them) ran on this machine and its process
    no longer exists. False whenever it cannot tell (another host, no pid, not POSIX:
    Windows' ``os.kill`` would end the process instead of probing it)."""
    pid = caller.get("pid")
    if (os.name != "posix" or not caller.get("loopback") or not isinstance(pid, int)
            or pid <= 0 or caller.get("host") != socket.gethostname()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (PermissionError: it exists, as another user)
        return False
    return False


class Callers:
    """When each open function job's caller was last heard from (coordinator clock), and
    which recovered jobs wait for theirs. Owned by the coordinator (``coord.callers``)."""

    def __init__(self, clock: Callable[[], float], timeout: float = CALLER_TIMEOUT_S):
        self._clock = clock
        self.timeout = timeout
        self.last: dict[str, float] = {}  # open function job id -> when its caller was heard
        self.held: set[str] = set()  # recovered jobs whose tasks wait for their caller
        self._next_check = 0.0

    def hold(self, job: Job) -> None:
        """``job`` was recovered after a restart: hold its pending tasks until its caller
        is heard (a function job only; its timeout runs from now)."""
        if job.kind == "function":
            self.last[job.id] = self._clock()
            self.held.add(job.id)

    def heard(self, coord: Coordinator, job_ids: Iterable[str]) -> int:
        """The caller of ``job_ids`` is there (it submitted, polled or sent a keepalive).
        Releases the held tasks of those that were held. Returns how many of ``job_ids``
        are open function jobs."""
        now, n, freed = self._clock(), 0, False
        for jid in job_ids:
            job = coord.jobs.get(jid)
            if job is None or job.kind != "function":
                continue
            self.last[jid] = now
            n += 1
            if jid in self.held:
                self.held.discard(jid)
                freed = True
                log.info("job %s: its caller is back; its tasks run again", jid)
        if freed:
            coord._wake_idle()  # workers long-polling for work get the released tasks now
        return n

    def expire(self, coord: Coordinator) -> list[str]:
        """Cancel (if still running) and release every function job whose caller has
        been silent for longer than ``timeout``; forget jobs that are gone. Returns the
        expired jobs' ids. Cheap to call often: it looks at most every CHECK_EVERY_S."""
        now = self._clock()
        if now < self._next_check:
            return []
        self._next_check = now + CHECK_EVERY_S
        expired = []
        for jid, seen in list(self.last.items()):
            job = coord.jobs.get(jid)
            if job is None:  # released by its caller (or purged): nothing to watch
                del self.last[jid]
                self.held.discard(jid)
            elif now - seen > self.timeout or (now - seen > LOCAL_GONE_S
                                                and gone_here(job.meta.get("caller") or {})):
                why = (f"its caller was not heard from for {now - seen:.0f}s "
                       + (f"(GPUMESH_CALLER_TIMEOUT={self.timeout:g}s on the coordinator)"
                          if now - seen > self.timeout else
                          f"and its process (pid {job.meta['caller']['pid']} on this machine) "
                          f"has exited"))
                try:
                    if job.state == "active":
                        n = coord.cancel(jid, reason=f"the job was cancelled: {why}")
                        log.warning("job %s cancelled (%d task(s) not finished): %s", jid, n, why)
                    else:
                        log.info("job %s released: %s", jid, why)
                    coord.release(jid)
                except (OSError, sqlite3.Error) as e:  # the store cannot write: the next check tries again
                    if not note(coord.store.full, e):
                        log.error("job %s: could not be cancelled or released now (%s: %s)",
                                  jid, type(e).__name__, e)
                    continue
                del self.last[jid]
                self.held.discard(jid)
                expired.append(jid)
        return expired
