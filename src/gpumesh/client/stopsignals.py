"""SIGTERM or SIGHUP to a caller cancels the jobs it is waiting on, as Ctrl+C does.

Ctrl+C raises KeyboardInterrupt, which unwinds the call and its backend cancels the job
(:meth:`~gpumesh.client.native.NativeBackend.run`). SIGTERM (``kill``, a batch
scheduler's time limit, ``docker stop``, systemd) and SIGHUP (the terminal or SSH session
closed) kill a Python process at once by default: the coordinator would run the job's
tasks to their end for nobody. So while a call waits on the mesh this module's handler
stands in for the default one of each: it cancels every job still registered here (and
lets go of its stored payloads), then puts the default back and sends the signal again,
so the process still ends *by that signal* (SIGTERM: status -15, shell ``$?`` 143;
SIGHUP: -1, 129) as its parent expects. Nothing is swallowed.

Before that it runs the clean-ups registered with :func:`at_stop`: a progress bar on a
terminal (:mod:`.progress`) has hidden the cursor, and a process ended by the default
action would leave the user's shell without one (Ctrl+C unwinds, and the bar's own
``close`` shows it again). A shown bar holds the handler as a job does, so ``gpumesh
submit --wait`` (no job waited on here) restores the cursor too.

:func:`cancelled_text` words what became of a cancelled job, for this handler and for
Ctrl+C's notice (:meth:`~gpumesh.client.native.NativeBackend.run`) alike: the number of
tasks the coordinator says it cancelled, not the job's size (those already ended are not
"stopped").

The rules (Python runs signal handlers in the main thread only, and a program's own
choice about a signal is its own):

* A handler is installed only by the main thread, only for a signal whose disposition
  is the default (``SIG_DFL``), and put back when the main thread's last job ends. A
  program that installed its own handler, or ignores the signal (``nohup`` ignores
  SIGHUP), keeps it: its handler decides (one that raises, e.g. ``sys.exit``, unwinds
  the call, which then cancels its job as Ctrl+C does). SIGHUP exists only where the
  platform has it (not on Windows). "Job" below stands for a clean-up too.
* Jobs waited on from other threads are registered too, and cancelled by the handler
  whenever it is installed (a main thread also waiting on the mesh). A program whose
  only callers are other threads keeps the default disposition: Python cannot install a
  handler from them.

Peers differ: Ray sets its SIGTERM handler with a plain ``signal.signal`` (replacing
whatever was there, for good); Dask's client sets none and relies on its scheduler
forgetting the futures of a client that went away. Here nothing is replaced, the
handler exists only while a job is outstanding (or a bar shown), and the exit status stays the
conventional one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import protocol

log = logging.getLogger("gpumesh.client")

#: Seconds the handler spends telling coordinators, at most, before the process ends.
CANCEL_BUDGET_S = 5.0

#: The signals whose default action (the process ends at once) would strand a job.
STOP_SIGNALS: tuple[int, ...] = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                                      if hasattr(signal, name))

_jobs: dict[str, Any] = {}  # job id -> the mesh it runs on (dict ops are atomic: no lock)
_totals: dict[str, int] = {}  # job id -> its number of tasks
_cleanups: dict[int, Callable[[], None]] = {}  # at_stop's, by registration
_main_holds = 0  # how many jobs and clean-ups the main thread registered (only it touches this)
_installed: set[int] = set()  # the signals whose handler is ours now


def _hold() -> bool:
    """Count a registration; from the main thread, install the handler. Returns whether it
    counted (pass that to :func:`_unhold`)."""
    global _main_holds
    if threading.current_thread() is not threading.main_thread():
        return False
    _main_holds += 1
    _install()
    return True


def _unhold(counted: bool) -> None:
    global _main_holds
    if not counted or threading.current_thread() is not threading.main_thread():
        return  # (released from another thread: the handler stays, harmless, until the next)
    _main_holds -= 1
    if _main_holds == 0:
        _uninstall()


@contextlib.contextmanager
def outstanding(mesh: Any, job_id: str, total: int | None = None) -> Iterator[None]:
    """Register ``job_id`` (on ``mesh``; ``total`` tasks) as waited on for the body of the
    ``with``."""
    _jobs[job_id] = mesh
    if total is not None:
        _totals[job_id] = total
    counted = _hold()
    try:
        yield
    finally:
        _jobs.pop(job_id, None)
        _totals.pop(job_id, None)
        _unhold(counted)


def at_stop(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run ``cleanup`` (from the signal handler, in the main thread, before any job is
    cancelled) if a stop signal ends the process; returns the function that unregisters
    it. ``cleanup`` must not block for long, and what it raises is ignored."""
    key = id(cleanup)
    _cleanups[key] = cleanup
    counted = _hold()

    def done() -> None:
        if _cleanups.pop(key, None) is not None:
            _unhold(counted)
    return done


def waited_on(mesh: Any) -> list[str]:
    """The ids of the jobs this process waits on at ``mesh`` now (any thread)."""
    return [job_id for job_id, m in list(_jobs.items()) if m is mesh]


def _install() -> None:
    for signum in STOP_SIGNALS:
        if signum in _installed:
            continue
        try:
            if signal.getsignal(signum) is not signal.SIG_DFL:
                continue  # the program's own handler, or SIG_IGN: its choice stands
            signal.signal(signum, _on_stop)
        except (ValueError, OSError):  # not the main interpreter / not allowed here
            return
        _installed.add(signum)


def _uninstall() -> None:
    if not _installed or threading.current_thread() is not threading.main_thread():
        return  # (an .imap closed from another thread: the next main-thread exit puts it back)
    for signum in list(_installed):
        _installed.discard(signum)
        try:
            if signal.getsignal(signum) is _on_stop:  # replaced meanwhile: leave theirs
                signal.signal(signum, signal.SIG_DFL)
        except (ValueError, OSError):
            pass


def _on_stop(signum: int, frame: Any) -> None:
    try:
        for cleanup in list(_cleanups.values()):
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 - the process ends by the signal all the same
                log.debug("stop signal: clean-up %r failed: %s", cleanup, e)
        cancel_all(dict(_jobs), why=signal.Signals(signum).name)
    finally:
        # The default action, as if this handler had never been there: the process ends
        # by the signal (no exception to catch, no exit status 0 or 1 to mislead). Only
        # this signal's: the other keeps its handler until the process is gone.
        _installed.discard(signum)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def cancel_all(jobs: dict[str, Any], budget_s: float = CANCEL_BUDGET_S, why: str = "stopped") -> None:
    """Cancel and release ``jobs`` (id -> mesh), within ``budget_s`` in all, saying so on
    stderr, one line per job (``why``: what stopped the caller, e.g. ``SIGTERM``), as
    Ctrl+C does. Each mesh gets a fresh connection: the handler may have interrupted the
    main thread inside a request on the mesh's own pool (whose locks it may hold)."""
    from ..transport import Transport
    deadline = time.monotonic() + budget_s
    by_mesh: dict[int, tuple[Any, list[str]]] = {}
    for job_id, mesh in jobs.items():
        by_mesh.setdefault(id(mesh), (mesh, []))[1].append(job_id)
    for mesh, ids in by_mesh.values():
        try:
            http = Transport(mesh.url, mesh.token, fingerprint=mesh.fingerprint)
        except Exception as e:  # noqa: BLE001 - best effort: the process ends anyway
            log.debug("stop signal: no connection to %s: %s", mesh.url, e)
            continue
        try:
            # (job id, path, body): each job's cancel, then one release of them all, as
            # nobody will collect their results
            calls: list[tuple[str | None, str, dict[str, Any] | None]] = [
                (j, protocol.job_cancel(j), None) for j in ids]
            calls.append((None, protocol.JOBS_RELEASE, {"jobs": ids}))
            for cancelled, path, body in calls:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                try:
                    resp = http.request("POST", path, json=body, timeout=min(left, 3.0))
                except Exception as e:  # noqa: BLE001 - best effort: the process ends anyway
                    log.debug("stop signal: %s on %s failed: %s", path, mesh.url, e)
                    continue
                if cancelled is not None:
                    _say(f"{why}: {cancelled_text(cancelled, answer_count(resp), _totals.get(cancelled))}")
        finally:
            http.close()


def answer_count(resp: Any) -> int | None:
    """How many tasks a cancel answer (``{"cancelled": n, ...}``) says it stopped; None
    when it does not say."""
    try:
        n = resp.json().get("cancelled")
    except Exception:  # noqa: BLE001 - not JSON, not a dict: unknown
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def cancelled_text(job_id: str, stopped: int | None, total: int | None = None) -> str:
    """What became of ``job_id`` once its cancel was answered: ``stopped`` tasks (the
    answer's count; None: unknown) of ``total`` (None: unknown) did not get to end.
    E.g. ``job 47d76918ea0a cancelled on the mesh; its 1820 unfinished task(s) stop there
    (180 of 2000 had already ended)``. The one wording of it (Ctrl+C, SIGTERM, SIGHUP)."""
    if stopped is None:
        return f"job {job_id} cancelled on the mesh; its unfinished tasks stop there"
    if stopped == 0:
        return f"job {job_id}: every task had already ended on the mesh; nothing was left to cancel"
    text = f"job {job_id} cancelled on the mesh; its {stopped} unfinished task(s) stop there"
    if total is not None and total > stopped:
        text += f" ({total - stopped} of {total} had already ended)"
    return text


def _say(text: str) -> None:
    """A notice line from inside a signal handler: straight to stderr (the notices'
    lock may be held by the very code the signal interrupted), never raising (stderr
    may be mid-write, or closed)."""
    try:
        # (not into a progress bar's redirect of stderr, which a signal that came while it
        # drew may leave unflushed: to the stream behind it)
        stream = getattr(sys.stderr, "rich_proxied_file", sys.stderr)
        stream.write(f"[gpumesh] {text}\n")
        stream.flush()
    except Exception:  # noqa: BLE001 - the process ends by the signal all the same
        pass
