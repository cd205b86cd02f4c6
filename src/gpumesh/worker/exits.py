"""How a function host tells its agent that a task process exited.

A host reaps its task processes (gpumesh.worker.runner) and reports each exit with a
code other than 0 at once (``{"op": "exited", "pid", "code"}``): the task crashed, and
its agent is waiting for a reply that will not come. A code of 0 is every task process's
exit after its reply, so it is not reported unasked (a message per task would cost every
task): :class:`CleanExits` remembers the recent ones for the agent's ask.
"""

from __future__ import annotations

import socket

from gpumesh.worker.framing import send_msg


class CleanExits:
    """The task processes that exited with code 0, which a host does not report: after
    its reply every task process does, and a message per task would cost each task. One
    that exited so *without* a reply (``os._exit(0)`` in the function) leaves its agent
    with no result and no exit code: the agent asks (``{"op": "exit_code", "pid"}``) and
    hears ``exited`` with code 0 now, or when the process is reaped."""

    KEEP = 256  # the most recent clean exits remembered (an ask comes within ms of one)

    def __init__(self) -> None:
        self.recent: dict[int, None] = {}  # (insertion-ordered: the oldest first)
        self.waiting: set[int] = set()

    def reaped(self, ctrl: socket.socket, pid: int) -> None:
        if pid in self.waiting:
            self.waiting.discard(pid)
            tell_exit(ctrl, pid, 0)
            return
        self.recent[pid] = None
        if len(self.recent) > self.KEEP:
            del self.recent[next(iter(self.recent))]

    def asked(self, ctrl: socket.socket, pid: int, running: bool) -> None:
        if self.recent.pop(pid, 0) is None:  # (present: its value is None)
            tell_exit(ctrl, pid, 0)
        elif running:
            self.waiting.add(pid)


def tell_exit(ctrl: socket.socket, pid: int, code: int) -> None:
    try:
        send_msg(ctrl, {"op": "exited", "pid": pid, "code": code})
    except OSError:
        pass
