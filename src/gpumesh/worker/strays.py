"""What the worker does about the processes its tasks leave running (Linux).

A task's child that starts a session of its own (``start_new_session=True``, a daemon's
double fork) is out of reach of the kill of its task's process group. So the zygote
(runner.zygote_main), the parent of every function host, is a *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``, as Ray's raylet is): such a process whose parent
ends is re-parented to the zygote, not to PID 1. Every :data:`SWEEP_S` the zygote kills
each of its children that is not a function host (a *stray*) with everything below it
(:func:`sweep`), and all of them as it exits (the agent gone: a worker that stops).

Why the zygote and not each host: a subreaper's own children cost more to fork and reap
(~0.1 ms of CPU per task process on the build VM, measured with a fork loop), and the
zygote forks only hosts, while a host forks a process per task. A stray is found when its
parent, the task process, has ended, so within :data:`SWEEP_S` of that. A process an
``isolation="job"`` job keeps becomes a subreaper itself with its first task (one
``prctl``): what its tasks orphan stays below it for the job, and comes up to the zygote
when it ends. A zygote killed outright (an OOM kill) leaves its strays to PID 1, as
before. Elsewhere than Linux none of this exists: a child that leaves its task's process
group is not followed.
"""

from __future__ import annotations

import os

from . import procs

#: Seconds between two looks for strays (one read of /proc per look, ~20 us).
SWEEP_S = 0.5
#: How long a zygote that is exiting goes on killing what is below it (seconds): a
#: process being killed re-parents its children only as it dies.
KILL_ALL_S = 1.0


def adopt() -> None:
    """Make this process (the zygote) a child subreaper (see the module's docstring)."""
    procs.adopt_orphans()


def sweep(hosts: set[int], wait: float = 0.0) -> int:
    """Kill every descendant of this process outside the subtrees of ``hosts`` (each one's
    process group too); with ``wait``, look again until none is left or ``wait`` seconds
    passed. Returns how many were found first (0 elsewhere than on Linux)."""
    if not procs.LINUX:
        return 0
    return procs.kill_descendants(os.getpid(), hosts, wait=wait)
