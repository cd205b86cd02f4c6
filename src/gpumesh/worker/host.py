"""The agent's handle on one function host (see :mod:`gpumesh.worker.runner`): the spares
it forks ahead of their tasks, the processes jobs keep (``isolation="job"``), and what the
host reports about them. :class:`gpumesh.worker.executor.Executor` owns the hosts."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from . import framing, procs, runner


class Pending:
    """One task in flight inside a host: its process (a spare's pid, known when the task
    takes it) and, should it die, its exit code, which the host reports asynchronously."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.code: int | None = None
        self.started = threading.Event()
        self.exited = threading.Event()
        self.killed_for: str | None = None
        self.answered = False  # its process replied (so it is alive and may be kept)


class Spare:
    """A task process its host forked ahead of its task (runner._fork_spare): our end of
    its socket, and its pid. (Its temporary directory is its host's to make and remove:
    runner.spare_temp_dir.)"""

    __slots__ = ("pid", "sock")

    def __init__(self, pid: int, sock: socket.socket):
        self.pid, self.sock = pid, sock


class Kept:
    """A task process a job keeps, idle, for its next task in a slot (isolation="job")."""

    __slots__ = ("host", "spare", "last_used")

    def __init__(self, host: Host, spare: Spare):
        self.host, self.spare, self.last_used = host, spare, time.monotonic()


def hung_up(sock: socket.socket) -> bool:
    """Whether an idle kept process's socket is unusable: its process is gone (EOF), or it
    sent something unasked. Never blocks."""
    try:
        sock.settimeout(None)  # (with a timeout, recv polls before it tries)
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False  # alive, waiting for its next task
    except OSError:
        pass
    return True


class Host:
    """A warm process that has loaded one function and forks a child per task.

    It keeps task processes forked ahead of their tasks (spares) and passes each one's
    socket here: a task is handed straight to its spare, and its result comes back the
    same way, so the host is off a task's path. Each task handed to the last idle spare
    has the host fork the next one at once."""

    def __init__(self, fn_hash: str, ctrl: socket.socket):
        self.fn_hash = fn_hash
        self.ctrl = ctrl
        self.lock = threading.Lock()  # held to send on ctrl, and for the state below
        self._cv = threading.Condition(self.lock)
        self.tasks: dict[str, Pending] = {}
        self._by_pid: dict[int, Pending] = {}  # the tasks' processes
        self._spares: deque[Spare] = deque()
        #: Idle task processes that jobs keep for their next task (isolation="job"),
        #: closed with the host (while a job still keeps one, the executor counts the
        #: host as in use: Executor._evict).
        self.kept: set[Spare] = set()
        #: Tasks handed this host (Executor._host) that have not ended, counted from
        #: before it has loaded their function (they are in ``tasks`` only from then):
        #: while any is, the host is in use and never closed to make room (to_close).
        self.users = 0
        self._asked = 1  # spares asked for and not yet come (the host forks one unasked)
        self._takers = 0  # threads waiting for a spare
        self._preloads = 0  # preload messages sent: a spare forked before them is stale
        self.spare_error: str | None = None  # why the host last could not fork
        self._fork_failures = 0
        self.ready = threading.Event()
        self.load_error: dict | None = None
        self.key = fn_hash  # its key among the executor's hosts
        self.dead = False
        self.closed = False  # by us (close): its tasks are the executor's to end
        self.closed_alive = False  # by us while it ran (not after it died): see close
        self.last_used = time.monotonic()
        self.preloaded: set[str] = set()
        self.reader = threading.Thread(target=self._read, name=f"host-{fn_hash[:8]}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg, fds = framing.recv_msg(self.ctrl)
            except (OSError, ValueError):
                msg, fds = None, []
            if msg is None:
                break
            op = msg.get("op")
            if op == "spare" and fds:
                self._add_spare(msg, fds[0])
                fds = fds[1:]
            elif op == "spare_failed":
                with self._cv:
                    self._asked = max(0, self._asked - 1)
                    self._fork_failures += 1
                    self.spare_error = str(msg.get("error"))
                    self._cv.notify_all()
            elif op == "ready":
                self.ready.set()
            elif op == "load_error":
                self.load_error = msg["error"]
                self.ready.set()
            elif op == "exited":
                self._exited(msg.get("pid"), msg.get("code"))
            for fd in fds:
                os.close(fd)
        with self._cv:
            self.dead = True
            self._drop_spares()
            self._drop_kept()
            self._cv.notify_all()
        self.ready.set()
        for p in list(self.tasks.values()):
            if p.pid and not p.answered and not self.closed:
                # The host died under its running tasks: the kernel killed their processes
                # with it (runner._arm_parent_death), not what those started, in their groups.
                procs.kill_tree(p.pid)
            p.started.set()
            p.exited.set()

    def _add_spare(self, msg: dict, fd: int) -> None:
        sock = socket.socket(fileno=fd)
        with self._cv:
            self._asked = max(0, self._asked - 1)
            if self.dead:
                sock.close()
            elif msg.get("preloads") != self._preloads:  # forked before our last preload
                sock.close()  # (it exits, unused)
                self._ask()
            else:
                self._spares.append(Spare(msg["pid"], sock))
            self._cv.notify_all()

    def _exited(self, pid, code) -> None:
        with self._cv:
            pending = self._by_pid.get(pid)
            if pending is not None:
                pending.code = code
                pending.exited.set()
                return
            for spare in self._spares:  # one that died idle (killed from outside)
                if spare.pid == pid:
                    self._spares.remove(spare)
                    spare.sock.close()
                    break

    def _ask(self) -> None:
        """Ask the host for one more spare. Called with the lock held."""
        try:
            self.ctrl.send(runner.SPARE_REQUEST)
            self._asked += 1
        except OSError:
            pass  # the host is gone: its reader wakes the waiters

    def take(self, pending: Pending, deadline: float | None = None) -> Spare | None:
        """A spare for ``pending``'s task (waiting for one if none is idle), registered as
        that task's process; None if the host died or could not fork, or the task was
        cancelled meanwhile. Raises ``TimeoutError`` at ``deadline`` (monotonic)."""
        with self._cv:
            self._takers += 1
            failures = self._fork_failures
            try:
                while not self._spares and not self.dead:
                    if self._fork_failures != failures or pending.killed_for:
                        return None  # (a failed fork: the next task asks again)
                    if self._asked < self._takers:
                        self._ask()
                    wait = 0.5  # (and look at pending.killed_for again)
                    if deadline is not None:
                        wait = min(wait, deadline - time.monotonic())
                        if wait <= 0:
                            raise TimeoutError("no task process came in time")
                    self._cv.wait(wait)
                if self.dead:
                    return None
                spare = self._spares.popleft()
                pending.pid = spare.pid
                self._by_pid[spare.pid] = pending
            finally:
                self._takers -= 1
        pending.started.set()
        return spare

    def replenish(self) -> None:
        """Have the next spare forked unless one is idle or coming: called once a task
        was handed to its spare, so the fork runs while the task does (asked for when
        the task ends instead, the fork competed with posting its result, measured on
        2 cores), and the next task finds a process ready for it."""
        with self._cv:
            if not self._spares and not self._asked and not self.dead:
                self._ask()

    def done(self, pending: Pending) -> None:
        """``pending``'s task is over (or its spare was dead): forget its process."""
        with self._cv:
            self._by_pid.pop(pending.pid, None)  # type: ignore[arg-type]

    def ask_exit(self, pid: int) -> None:
        """Have the host say how task process ``pid`` exited (code 0 included), now or
        when it is reaped: its ``exited`` message sets the task's ``code``."""
        with self._cv:
            try:
                framing.send_msg(self.ctrl, {"op": "exit_code", "pid": pid})
            except OSError:
                pass  # the host is gone: its reader wakes the task

    def preload(self, modules: list | None, path: list | None) -> None:
        """Have the host import the ``modules`` a task imported (with the ``path`` it
        had) that it has not yet, and replace the spares forked before them, so the next
        task starts with the modules loaded."""
        new = [m for m in modules or () if isinstance(m, str) and m not in self.preloaded]
        if not new:
            return
        self.preloaded.update(new)
        # One control message each up to ~32 KiB of names (messages are single datagrams).
        batches: list[list[str]] = [[]]
        size = 0
        for name in new:
            if size > 32 * 1024:
                batches.append([])
                size = 0
            batches[-1].append(name)
            size += len(name) + 4
        try:
            self._send_preloads([{"op": "preload", "modules": batch, "path": path or []}
                                 for batch in batches])
        except (OSError, ValueError):
            pass

    def _send_preloads(self, batches: list[dict]) -> None:
        with self._cv:
            for batch in batches:
                framing.send_msg(self.ctrl, batch)
                self._preloads += 1
            stale = len(self._spares)
            self._drop_spares()
            for _ in range(stale):
                self._ask()

    def _drop_spares(self) -> None:
        while self._spares:
            self._spares.pop().sock.close()  # it exits, unused

    def _drop_kept(self) -> None:
        # (a host that died took them with it: runner._arm_parent_death)
        while self.kept:
            self.kept.pop().sock.close()  # it exits at the EOF

    def adopt(self, pending: Pending, kept: Spare) -> bool:
        """Register ``kept`` (an idle process a job keeps here) as ``pending``'s task
        process, as :meth:`take` does a spare; False if it is no longer ours (the host
        died or closed, or it was released)."""
        with self._cv:
            if self.dead or kept not in self.kept:
                return False
            self.kept.discard(kept)
            pending.pid = kept.pid
            self._by_pid[kept.pid] = pending
        pending.started.set()
        return True

    def keep(self, spare: Spare) -> bool:
        """Count ``spare`` (whose task is over) as an idle process kept by a job; False if
        the host is gone."""
        with self._cv:
            if self.dead:
                return False
            self.kept.add(spare)
            return True

    def release(self, kept: Spare) -> None:
        """A job is done with ``kept``: close our end of its socket (it exits at the EOF)."""
        with self._cv:
            self.kept.discard(kept)
        kept.sock.close()

    def close(self) -> None:
        with self._cv:
            # (a task it fails then is not told its host died: Executor._host_lost)
            self.closed_alive = self.closed_alive or not self.dead
            self.closed = self.dead = True
            self._drop_spares()
            self._drop_kept()
            self._cv.notify_all()
        try:
            self.ctrl.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.ctrl.close()


def to_close(hosts: Iterable[Host], in_use: Callable[[Host], bool], most: int,
             idle_s: float, now: float) -> list[Host]:
    """The warm hosts to close, of ``hosts`` (least recently used first): of those not
    ``in_use``, the dead, those idle for longer than ``idle_s``, and the least recently
    used beyond ``most``. A host in use is never closed (a task it was handed would
    fail as if its host had died, and be retried into the same eviction), so while more
    than ``most`` are in use they all stay, and the count goes back to ``most`` as they
    become idle (the janitor, or the next new host, closes the extra ones)."""
    hosts = list(hosts)
    left = len(hosts)
    gone = []
    for host in hosts:
        if not in_use(host) and (host.dead or left > most or now - host.last_used > idle_s):
            gone.append(host)
            left -= 1
    return gone
