"""Timestamps at each hop of a call, to see where its time goes.

Off unless ``GPUMESH_TRACE`` names a file when a process starts. Then every gpumesh
process started with that variable (caller, coordinator, worker agents, function hosts
and their task processes) appends one line per :func:`mark` to that file::

    <CLOCK_MONOTONIC in ns> <pid> <label>

CLOCK_MONOTONIC is one clock for all processes of one machine, so the marks of one call
line up only when the whole mesh runs on one machine. ``benchmarks/critical_path.py``
runs sequential no-op calls with tracing on and prints the median time between
consecutive marks. Each line is one ``write`` to a file opened with ``O_APPEND``, so the
lines of concurrent processes never interleave. Off, a mark costs one comparison.
"""

from __future__ import annotations

import os
import time

from . import limits

#: The marks of one remote call, in the order they happen (a call that a waiting lease
#: long-poll picks up; its result comes back in the answer to the caller's submit).
CALL_HOPS = (
    "caller.submit",              # the caller sends POST /v1/jobs
    "coordinator.submit",         # the coordinator's route starts
    "coordinator.stored",         # the job is in the store and the run queue
    "coordinator.grant",          # a waiting lease long-poll is answered with the task
    "agent.leased",               # the worker's agent has that answer
    "agent.run",                  # the agent hands the task to the function host
    "task.start",                 # the task's own process has it
    "task.reply",                 # the task has its value and starts replying
    "agent.post",                 # the agent has the outcome and posts it
    "coordinator.result",         # the coordinator's result route starts
    "coordinator.result_stored",  # the result is in the store
    "coordinator.answer",         # the caller's waiting submit is woken with it
    "caller.answered",            # the caller has the answer
)

#: The trace file, or None (tracing off). Read once, at import.
PATH: str | None = limits.setting("GPUMESH_TRACE")
_fd: int | None = None
_fd_pid: int | None = None


def mark(label: str) -> None:
    """Append ``label`` with the time and this process's pid to the trace file, if on.
    ``label``: one word, ``<process>.<event>`` (e.g. ``agent.leased``). Never raises."""
    if PATH is None:
        return
    global _fd, _fd_pid
    try:
        pid = os.getpid()
        # Opened once per process. A forked child does not write to the fd it inherited:
        # the task may have closed that number and opened a file of its own under it.
        if _fd is None or _fd_pid != pid:
            _fd, _fd_pid = os.open(PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600), pid
        os.write(_fd, f"{time.monotonic_ns()} {pid} {label}\n".encode())
    except OSError:
        pass
