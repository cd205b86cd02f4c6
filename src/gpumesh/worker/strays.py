"""What a function host does about the processes its tasks leave running (Linux).

A task's child that starts a session of its own (``start_new_session=True``, a daemon's
double fork) is out of reach of the kill of its task's process group. So the host is a
*child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``, as Ray's raylet is): such a process
whose parent ends is re-parented to the host, not to PID 1. The host reaps it as any
child (gpumesh.worker.runner._reap) and, each time one of its task processes has ended,
kills every such *stray* with all below it (:func:`kill`); all of them when it closes
(:func:`kill_all`).

Why each host and not the agent: the host is where a task's process tree hangs (its task
processes are its children), it is single-threaded and already reaps every child it has
(any pid), while the agent is threaded and waits for the processes it starts by pid
(``subprocess``): a reaper there would steal their exit statuses. Each task process is a
subreaper too (runner._die_with_host): what its task orphans stays below it for as long
as it lives (an ``isolation="job"`` process keeps its daemons for the job), and comes up
to the host when it ends. A host killed outright (an OOM kill) leaves its strays to PID
1, as before. Elsewhere than Linux none of this exists: a child that leaves its task's
process group is not followed.
"""

from __future__ import annotations

import os

from . import procs

#: How long a host that is closing goes on killing what its tasks left (seconds): a
#: killed task process re-parents its children to the host only as it dies.
KILL_ALL_S = 1.0
#: Children of the host that are its own, not a task's: processes the function's imports
#: (its unpickling, preloads) started in the host itself. Never taken for strays.
_OWN: set[int] = set()


def adopt() -> None:
    """Make this host a child subreaper (see the module's docstring)."""
    procs.adopt_orphans()


def note_own(children: set[int]) -> None:
    """Count the host's children that are not task processes (``children``) as its own:
    call after loading the function and after each preload, strays reaped first."""
    _OWN.update(c for c in procs.children(os.getpid()) if c not in children)


def reaped(pid: int) -> None:
    """A child that was not a task process was reaped."""
    _OWN.discard(pid)


def kill(children: set[int]) -> None:
    """Kill every stray alive and all below it; the trees of the task processes
    (``children``) and the host's own children are left alone."""
    if procs.LINUX:
        procs.kill_descendants(os.getpid(), children | _OWN)


def kill_all() -> None:
    """The host is closing (its task processes were killed): kill every descendant but
    its own children, until none is left or ``KILL_ALL_S`` passed."""
    if procs.LINUX:
        procs.kill_descendants(os.getpid(), _OWN, wait=KILL_ALL_S)
