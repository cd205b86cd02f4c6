"""The agent's side of the runner processes (see :mod:`gpumesh.worker.runner`).

:class:`Executor` starts the zygote with the first function task (an idle worker keeps
no interpreter but its own), keeps up to ``MAX_WARM_FUNCTIONS`` warm function hosts
(the least recently used beyond that are closed, idle ones after ``WARM_IDLE_S``, but
never one in use: see :meth:`Executor._evict`), and runs one task at a time per calling thread through :meth:`Executor.run`. A task of a job that
asked for ``isolation="job"`` runs in the task process its slot kept from the job's last
task there (a forked child of the function's host, waiting on its socket), or in a fresh
one that is then kept; it is closed when the slot runs another job's task, after
``JOB_IDLE_S`` without one, or with its host.

Failures it names (each becomes an :class:`Outcome` with ``status="error"``):

* ``unpickle``   the function or its arguments cannot be loaded on this worker
* ``raised``     the function raised (the pickled exception travels when possible)
* ``crashed``    the task process died without a result (signal, ``os._exit``, segfault)
* ``timeout``    the task ran past its timeout; its whole process group was killed
* ``cancelled``  the coordinator cancelled the task; its process group was killed
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..limits import ERROR_TAIL_BYTES, MAX_WARM_FUNCTIONS, WARM_IDLE_S
from ..payloadref import PayloadRef
from ..protocol import FailureKind, TaskGrant, timeout_message
from . import ahead as ahead_mod
from . import framing, membody, procs, runner, tempdirs
from .ahead import Ahead
from .host import Host, Kept, Pending, Spare, hung_up, to_close
from .retire import Retirer, on_device

log = logging.getLogger("gpumesh.worker")


@dataclass
class Outcome:
    """What became of one task: ``status`` is ``ok``, ``error`` or ``retry``."""

    status: str
    error: dict | None = None
    #: The value or the pickled exception: bytes read from the task, or a read-only view
    #: of the memory file a big one came in.
    payload: bytearray | memoryview | None = None
    #: The payload is this file in the coordinator's handoff directory (gpumesh.handoff).
    handoff_file: str | None = None


#: A process a job keeps in a slot (isolation="job", either runtime) closes after this
#: long without a task (seconds): the job is over or has moved on (its next task in
#: that slot gets a new process).
JOB_IDLE_S = 30.0

#: Arguments up to this size are written to the task's socket without a helper thread
#: (they fit in the socket buffer, so the write cannot block).
INLINE_ARGS_BYTES = 64 * 1024


def _map_read_only(fd: int) -> memoryview:
    """A read-only view of a whole memory file (it stays mapped after ``fd`` closes)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return memoryview(b"")
    return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ))


def _tail(path: str, n: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


class Executor:
    """Runs tasks in isolated processes. Thread-safe: one task per calling thread.

    This is the fork runtime; :class:`gpumesh.worker.spawn.SpawnExecutor` is the same
    interface without fork (see :func:`make_executor`)."""

    runtime = "fork"
    #: Where the agent reads big answers for this executor's tasks (see membody.Bodies).
    bodies: membody.Bodies = membody.MEMORY

    def __init__(self, spool: Path | None = None, task_tmp: Path | None = None,
                 task_env: dict[str, str] | None = None) -> None:
        self.spool = Path(spool or tempfile.mkdtemp(prefix="gpumesh-spool-"))
        self.spool.mkdir(parents=True, exist_ok=True)
        self._spool_str = str(self.spool)
        # Each task process's temporary directory is made in here, and removed when the
        # process is done (gpumesh.worker.tempdirs): a task's temporary files never stay.
        #: Set in every task process's environment (procs.thread_env: its share of cores).
        self.task_env = dict(task_env or {})
        self.task_tmp = Path(task_tmp or self.spool / "tmp")
        self.task_tmp.mkdir(parents=True, exist_ok=True)
        self._tmp_str = str(self.task_tmp)
        self._tmp_seq = itertools.count(1)
        self._lock = threading.Lock()
        self._hosts: OrderedDict[str, Host] = OrderedDict()
        # The zygote starts with the first function task (see _zygote_socket), not here:
        # an idle worker, or one that only runs scripts, keeps no interpreter around.
        self._zygote: subprocess.Popen | None = None
        self._zygote_ctrl: socket.socket | None = None
        self._zygote_used = 0.0  # when the zygote last started (see _janitor)
        self._janitor_started = False
        self._closed = False
        self._running: dict[str, tuple[Host | None, Pending]] = {}  # None: a script
        # isolation="job": the idle task process each (job id, slot) keeps for the job's
        # next task there (a forked child of the function's host, which ran its last one).
        self._kept: dict[tuple, Kept] = {}
        # Processes of a slot's previous job, closed a moment after its next job's first
        # task started, off that task's path (gpumesh.worker.retire).
        self._retirer = Retirer()
        # isolation="job" pipelining: the task each slot thread sent ahead to its kept
        # process, and which of the thread's two pairs of output files its current task
        # writes (the one sent ahead writes the other: see output_paths).
        self._ahead: dict[int, Ahead] = {}
        self._pair: dict[int, int] = {}

    def _new_tmp(self) -> str:
        """A name for a new task process's temporary directory (made by the process)."""
        return f"{self._tmp_str}/t{next(self._tmp_seq)}"

    # ------------------------------------------------------------------ hosts -------
    def _zygote_socket(self) -> socket.socket:
        """The zygote's control socket, starting the zygote on first use (~0.1 s: an
        interpreter plus gpumesh.wire; the function host it then forks pays the
        function's own imports either way). Called with ``self._lock`` held."""
        if self._closed:
            raise OSError("the executor is closed")
        if self._zygote is not None and self._zygote.poll() is not None:
            log.warning("the zygote exited with %s; starting a new one", self._zygote.returncode)
            if self._zygote_ctrl is not None:
                self._zygote_ctrl.close()
            self._zygote = self._zygote_ctrl = None
        if self._zygote is None:
            ctrl, child = framing.control_pair()
            env = {k: v for k, v in os.environ.items() if k not in runner.SCRUBBED_ENV}
            env.update(self.task_env)
            try:
                # Its own session: what kills the agent's process group (kill -9 -PGID, a
                # supervisor, a terminal hanging up) must not take the function hosts with
                # it, for a host is what kills its task processes' groups when it sees the
                # agent gone (runner.host_main); tasks lead sessions of their own, so nothing
                # else would (see docs/architecture.md, "When the agent dies").
                self._zygote = subprocess.Popen(
                    [sys.executable, "-m", "gpumesh.worker.runner", str(child.fileno())],
                    pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL,
                    **procs.group_kwargs())
            except BaseException:
                ctrl.close()
                raise
            finally:
                child.close()
            self._zygote_ctrl = ctrl
            self._zygote_used = time.monotonic()
            if not self._janitor_started:
                self._janitor_started = True
                threading.Thread(target=self._janitor, name="fork-janitor", daemon=True).start()
        assert self._zygote_ctrl is not None
        return self._zygote_ctrl

    def _janitor(self) -> None:
        """Release what idles: processes jobs kept that ran no task for JOB_IDLE_S, hosts
        not in use whose function ran no task for WARM_IDLE_S (with their spare) or beyond
        MAX_WARM_FUNCTIONS (see _evict), then the zygote once it hosts none and has forked
        none for as long (the next function task starts it again, ~0.1 s)."""
        while not self._closed:
            time.sleep(min(5.0, max(0.05, min(WARM_IDLE_S, JOB_IDLE_S) / 4)))
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                busy = {a.spare for a in self._ahead.values()}  # (running a task sent ahead)
                for job_slot, kept in list(self._kept.items()):
                    if kept.host.dead or (now - kept.last_used > JOB_IDLE_S and kept.spare not in busy):
                        del self._kept[job_slot]
                        kept.host.release(kept.spare)
                self._evict()
                last = max([self._zygote_used, *(h.last_used for h in self._hosts.values())])
                idle = time.monotonic() - last
                zygote, ctrl = self._zygote, self._zygote_ctrl
                if zygote is None or self._hosts or self._running or idle <= WARM_IDLE_S:
                    continue
                self._zygote = self._zygote_ctrl = None
            if ctrl is not None:
                ctrl.close()  # the zygote exits when its control socket closes
            try:
                zygote.wait(5)
            except subprocess.TimeoutExpired:
                zygote.kill()
                zygote.wait()

    def _host(self, fn_hash: str, blob_path: str, sys_path: list[str] | None = None) -> Host:
        """The function's host, started if need be, with one more user (the caller's
        task, until it drops it: :meth:`run`), so that no eviction closes it meanwhile."""
        # A function run in a task environment (requires=) has a host of its own, whose
        # sys.path starts with that environment: keyed by both.
        key = fn_hash if not sys_path else "|".join([fn_hash, *sys_path])
        with self._lock:
            host = self._hosts.get(key)
            if host is not None and not host.dead:
                self._hosts.move_to_end(key)
                host.last_used = time.monotonic()
                host.users += 1
                return host
            zygote = self._zygote_socket()
            mine, theirs = framing.control_pair()
            msg: dict[str, Any] = {"op": "host", "path": blob_path, "tmp": self._tmp_str}
            if sys_path:
                msg["sys_path"] = list(sys_path)
            framing.send_msg(zygote, msg, [theirs.fileno()])
            theirs.close()
            host = Host(fn_hash, mine)
            host.key = key
            host.users = 1
            self._hosts[key] = host
            self._evict()
        return host

    def _evict(self) -> None:
        """Close the hosts :func:`~gpumesh.worker.host.to_close` picks. In use: a host a
        task was handed (``users``, counted from before it has loaded, so the host just
        started for a task is one), or one a job keeps a process of for its next task. A
        process its slot has let go, closed a moment later (gpumesh.worker.retire), does
        not count: its job is done there. (Counted, a run of one-call jobs of new
        functions kept its last few hosts in use, and the one started for the next call
        was the only one left to close, under its task.) With ``self._lock`` held."""
        kept = {id(k.host) for k in self._kept.values()}
        for host in to_close(self._hosts.values(),
                             lambda h: bool(h.users or h.tasks or id(h) in kept),
                             MAX_WARM_FUNCTIONS, WARM_IDLE_S, time.monotonic()):
            del self._hosts[host.key]
            host.close()

    def functions_in_use(self) -> list[str]:
        """The function hashes (``hash`` or ``hash|sys.path...``) whose blob file processes
        of this executor may still read: hosts still loading theirs (a host reads its blob
        once, when it starts; its tasks are forks of it)."""
        with self._lock:
            return [key for key, host in self._hosts.items() if not host.ready.is_set()]

    def _forget(self, host: Host) -> None:
        """Drop ``host`` (its function failed to load, or it died) so the next task starts
        afresh; not another host since started under its key."""
        with self._lock:
            if self._hosts.get(host.key) is host:
                del self._hosts[host.key]
        if not host.tasks:
            host.close()

    def _host_lost(self, host: Host) -> Outcome:
        """The outcome of a task whose host went before the task could run: re-queued.
        Its words name who ended the host, which the task's history keeps: a host this
        worker closed (it is stopping) is no crash of the function's host."""
        why = "the function's host process died"
        if host.closed_alive:
            why = ("this worker closed the function's host" +
                   (" (it is stopping)" if self._closed else ""))
        return Outcome("retry", {"kind": FailureKind.HOST_DIED, "message": why})

    # ------------------------------------------------------------------ tasks -------
    def run(self, task: TaskGrant, blob_path: str, args: bytes | bytearray | memoryview | None = None,
            *, env: dict | None = None, args_ref: PayloadRef | None = None,
            handoff_dir: str | None = None, handoff_name: str | None = None,
            sys_path: list[str] | None = None, slot=None, ahead=None,
            withdraw: bool = False) -> Outcome:
        """Run the granted ``task`` (function blob at ``blob_path``, arguments ``args``) to
        completion; never raises for anything the task does. From the grant: its id,
        function, ``timeout``, ``result_format`` (``"json"``: the task sends its value as
        JSON, strict results), ``isolation`` and job.
        ``env``: variables set in the task's process (its slot's GPU, for one).
        ``args_ref`` (instead of ``args``): the arguments as a file or shared memory,
        which the task maps (gpumesh.payloadref; the caller releases it). ``handoff_dir``: let
        the task leave a big result there, named ``handoff_name`` (see gpumesh.handoff;
        ``Outcome.handoff_file``). ``sys_path``: directories put in front of the function's
        ``sys.path`` (a task environment, see gpumesh.worker.envs). ``isolation="job"``: run it in the
        process ``slot`` (None: this thread) keeps for the job: the task process of its last
        task there, kept unless it crashed, timed out or was cancelled, and never given another
        job's task (the slot running one closes it, as do JOB_IDLE_S without a task).
        ``ahead`` (isolation="job"): a callable giving the slot's next grant ``(grant,
        args)``, or None; such a task of the same job is sent to the kept process behind
        this one (see :meth:`_send_ahead`), and its own ``run`` then only waits for it.
        ``withdraw``: the slot hands the task back (its owner paused it): one sent ahead
        is withdrawn, and its outcome says whether it had begun (its result, which
        stands) or not (``cancelled``); one not sent ahead is not run."""
        keep = task.isolation == "job" and task.job_id is not None
        slot_key = (task.job_id, slot if slot is not None else threading.get_ident())
        if self._kept:
            left = self._leave_slot(slot_key[1], task.job_id if keep else None)
            if on_device(env):  # a device's slot: its memory is freed before the next job's task runs
                self._release(left)
            elif left:  # closed once this task is under way (gpumesh.worker.retire)
                self._retirer.later(lambda: self._release(left))
        try:
            host = self._host(task.fn, blob_path, sys_path)
        except OSError as e:  # the zygote could not be started, or we are closing
            return Outcome("retry", {"kind": FailureKind.HOST_DIED,
                                     "message": f"could not start the function's host: {e}"})
        try:
            return self._run_in(host, task, args, env, args_ref, handoff_dir, handoff_name,
                                slot_key, keep, ahead, withdraw)
        finally:
            with self._lock:
                host.users -= 1  # (the task's end: the host may be evicted from now on)

    def _run_in(self, host: Host, task: TaskGrant, args, env, args_ref, handoff_dir,
                handoff_name, slot_key: tuple, keep: bool, ahead, withdraw: bool) -> Outcome:
        """:meth:`run`'s task, in ``host``, which counts it among its users."""
        task_id, timeout = task.task_id, task.timeout
        host.ready.wait()
        host.last_used = time.monotonic()  # a slow load is not idle time (see _janitor)
        if host.load_error is not None:
            self._forget(host)
            return Outcome("error", dict(host.load_error))
        if host.dead:
            self._forget(host)
            return self._host_lost(host)
        me = threading.get_ident()
        with self._lock:
            sent = self._ahead.pop(me, None)
        if sent is not None and (sent.task_id != task_id or (sent.withdrawn and not withdraw)):
            # Not the task it was sent ahead for (that one was dropped: cancelled, handed
            # back), or withdrawn (it may have begun; if it has not, it answers "skipped"):
            # its process is not reused, for nothing must read that answer as this task's.
            self._abandon(sent)
            if sent.task_id == task_id:  # (cancelled between the queue and this run)
                return self._not_begun("cancelled")
            sent = None
        if withdraw and sent is None:
            return self._not_begun("handed back")
        kept = self._take_kept(slot_key, host, sent.spare if sent else None) if keep else None
        if sent is not None and kept is not sent.spare:  # (its process went meanwhile)
            self._abandon(sent)
            sent = None
        pending = Pending()
        host.tasks[task_id] = pending
        self._running[task_id] = (host, pending)
        out, err = self.output_paths()
        fds: list[int] = []
        run = b""
        if sent is None:
            msg = self._run_msg(task, out, err, env, keep)
            if handoff_dir:
                msg["handoff_dir"], msg["handoff_name"] = handoff_dir, handoff_name
            if args_ref is not None:
                msg["args"], fds = args_ref.to_meta()
            run = json.dumps(msg).encode()
        # A task sent ahead began when the one before it ended, which its slot's thread
        # has just read: its timeout starts now, a little after it began.
        deadline = None if timeout is None else time.monotonic() + timeout
        spare: Spare | Outcome | None = None
        try:
            spare = self._start(host, pending, run, fds, None if args_ref is not None else args,
                                deadline, timeout, kept, sent=sent is not None)
            if isinstance(spare, Outcome):
                return spare
            if withdraw and sent is not None:
                self._skip(sent)
            elif keep and ahead is not None:
                self._send_ahead(task, spare, ahead, env)
            outcome = self._exchange(host, pending, spare.sock, deadline, timeout)
            if outcome.status == ahead_mod.SKIPPED:  # (withdrawn: it had not begun)
                return self._not_begun("handed back")
            if outcome.status == "error" and outcome.error is not None:
                tail = _tail(err, ERROR_TAIL_BYTES)
                if tail:
                    outcome.error["stderr_tail"] = tail
            return outcome
        finally:
            self._running.pop(task_id, None)
            host.done(pending)
            if isinstance(spare, Spare):
                if not (keep and pending.answered and not pending.killed_for
                        and self._keep(slot_key, host, spare)):
                    self._close_spare(spare)
            host.tasks.pop(task_id, None)
            host.last_used = time.monotonic()

    # ------------------------------------------------------------------ kept --------
    def _take_kept(self, key: tuple, host: Host, sent: Spare | None = None) -> Spare | None:
        """The idle process (job id, slot) ``key`` keeps, if it is ``host``'s and alive
        (``sent``: the process the task was sent ahead to, which may have answered it)."""
        with self._lock:
            kept = self._kept.pop(key, None)
        if kept is None:
            return None
        if kept.host is host and (kept.spare is sent or not hung_up(kept.spare.sock)):
            return kept.spare
        self._let_go(kept)  # (another function's, or gone: a fresh one instead)
        return None

    def _keep(self, key: tuple, host: Host, spare: Spare) -> bool:
        """Keep ``spare``, whose task is over, for the next task of (job id, slot) ``key``;
        False when it cannot be (the host or this executor is closing)."""
        with self._lock:
            if self._closed or not host.keep(spare):
                return False
            self._kept[key] = Kept(host, spare)
        return True

    def _leave_slot(self, slot, job_id) -> list[Kept]:
        """``slot`` runs a task of ``job_id`` (None: a task no job keeps a process for):
        the processes other jobs keep there, no longer kept, for the caller to close."""
        with self._lock:
            return [self._kept.pop(k) for k in list(self._kept) if k[1] == slot and k[0] != job_id]

    def _release(self, gone: list[Kept]) -> None:
        for kept in gone:
            self._let_go(kept)

    def _let_go(self, kept: Kept) -> None:
        """Close a process a job kept (it exits at the EOF), killing it first if a task
        was sent ahead to it, which it would otherwise run."""
        self._close_spare(kept.spare, kept.host)

    def _close_spare(self, spare: Spare, host: Host | None = None) -> None:
        with self._lock:
            sent = [t for t, a in self._ahead.items() if a.spare is spare]
            for t in sent:
                del self._ahead[t]
        if sent:
            procs.kill_tree(spare.pid)
        if host is not None:
            host.release(spare)
        else:
            spare.sock.close()

    def _abandon(self, sent: Ahead) -> None:
        """The process ``sent`` went to is not used again: killed, and no longer kept."""
        procs.kill_tree(sent.spare.pid)
        with self._lock:
            gone = [k for k, kept in self._kept.items() if kept.spare is sent.spare]
            kept_list = [self._kept.pop(k) for k in gone]
        for kept in kept_list:
            kept.host.release(kept.spare)
        if not kept_list:
            sent.spare.sock.close()

    # ------------------------------------------------------------------ ahead -------
    @staticmethod
    def _run_msg(task: TaskGrant, out: str, err: str, env: dict | None, keep: bool) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": "run", "task_id": task.task_id, "stdout": out,
                               "stderr": err, "result_format": task.result_format}
        if env:
            msg["env"] = env
        if keep:
            msg["keep"] = True  # the process waits for the job's next task afterwards
        return msg

    def _send_ahead(self, task: TaskGrant, spare: Spare, ahead, env: dict | None) -> None:
        """Send the slot's next grant to ``spare`` behind ``task`` (just handed to it) when
        it is a task of the same job and function with small arguments inline: the kept
        process begins it as soon as ``task`` ends, without waiting for this thread to
        read the answer and send it (a wake-up of each, per task, on the busy cores of a
        short job's map). It writes the thread's other output files; it has no handoff
        name (a big result comes as a memory file). Withdrawn by :meth:`withdraw`."""
        nxt = ahead()
        if nxt is None:
            return
        grant, args = nxt
        if not ahead_mod.fits(task, grant, args, INLINE_ARGS_BYTES):
            return
        me = threading.get_ident()
        pair = 1 - self._pair.get(me, 0)
        out, err = self._truncate(self._paths(pair))
        msg = self._run_msg(grant, out, err, env, True)
        msg["ahead"] = True
        record = Ahead(grant.task_id, spare, pair)
        with self._lock:
            self._ahead[me] = record
        try:
            framing.send_frames(spare.sock, [json.dumps(msg).encode(), args])
        except OSError:  # (its process died: this task's exchange says how)
            with self._lock:
                self._ahead.pop(me, None)

    def withdraw(self, task_id: str) -> bool:
        """A task sent ahead (see :meth:`_send_ahead`) must not run: a skip message goes
        behind it, which its process reads before it begins it (it then answers
        "skipped"); one that has begun is killed with its process when its slot next
        runs a task or lets the process go. Returns whether it had been sent ahead."""
        with self._lock:
            record = next((a for a in self._ahead.values() if a.task_id == task_id), None)
            if record is None or record.withdrawn:
                return record is not None
            record.withdrawn = True  # (under the lock: one skip per task)
        self._skip(record)
        return True

    @staticmethod
    def _skip(record: Ahead) -> None:
        record.withdrawn = True
        try:
            # (one write: the process looks for it without blocking, ahead.skip_waiting)
            framing.send_frames(record.spare.sock, [ahead_mod.skip_message(record.task_id)])
        except OSError:
            pass  # (its process is gone: the task with it)

    @staticmethod
    def _not_begun(why: str) -> Outcome:
        return Outcome("error", {"kind": FailureKind.CANCELLED, "type": "Cancelled",
                                 "message": f"the task was {why} before it began"})

    def sent_ahead(self, task_id: str) -> bool:
        """Whether ``task_id`` was sent ahead to its slot's process (see withdraw)."""
        with self._lock:
            return any(a.task_id == task_id for a in self._ahead.values())

    def _start(self, host: Host, pending: Pending, run: bytes, fds: list[int],
               args: bytes | bytearray | memoryview | None, deadline: float | None,
               timeout: float | None, kept: Spare | None = None,
               sent: bool = False) -> Spare | Outcome:
        """Hand the task to a spare of ``host`` (or to ``kept``, the idle process its job
        keeps in this slot): its run message (``run``, with ``fds``) and, unless they are a
        reference, its ``args``, on that process's own socket (``sent``: they were, ahead
        of it, to ``kept``). Returns the process, or the task's outcome when it cannot
        start (no spare: ``retry``)."""
        for _attempt in range(3):  # a spare killed while idle: take the next one
            spare = None
            if kept is not None:
                if host.adopt(pending, kept):
                    spare = kept
                else:  # (the host died or closed meanwhile: a fresh one, or retry)
                    host.release(kept)
            fresh, kept = spare is None, None
            if fresh and sent:  # (sent ahead to a process whose host went meanwhile)
                pending.started.set()
                return self._host_lost(host)
            if fresh:
                try:
                    spare = host.take(pending, deadline)
                except TimeoutError:  # (no process to kill: none was taken)
                    pending.started.set()
                    return self._timed_out(pending, timeout)
            if pending.killed_for:
                if spare is not None:
                    spare.sock.close()
                pending.started.set()  # (the canceller waits for it)
                return self._killed_outcome(pending)
            if spare is None:
                if host.dead:
                    return self._host_lost(host)
                return Outcome("retry", {"kind": FailureKind.HOST_DIED, "message":
                                         f"could not start the task's process: {host.spare_error}"})
            sock = spare.sock
            try:
                if deadline is not None:
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                # A fresh spare's first byte says it leads its own process group (the kill
                # of a timeout or cancel reaches all it starts); it came long ago, as a
                # rule. A kept process said so before its job's first task.
                alive = not fresh or sock.recv(1) == runner.SPARE_READY
                if alive and not sent:
                    inline = args is not None and len(args) <= INLINE_ARGS_BYTES
                    framing.send_frames(sock, [run, args] if inline else [run], fds)
            except (socket.timeout, TimeoutError):
                sock.close()
                return self._timed_out(pending, timeout)
            except OSError:
                alive = False
            if pending.killed_for:  # cancelled meanwhile (its process is killed)
                sock.close()
                return self._killed_outcome(pending)
            if alive:
                if args is not None and not sent and not inline:
                    # The child reads while we write; we must be free to read its result.
                    threading.Thread(target=self._send_args, args=(sock, args), daemon=True).start()
                if fresh:
                    host.replenish()
                return spare
            sock.close()
            host.done(pending)
        return Outcome("retry", {"kind": FailureKind.HOST_DIED,
                                 "message": "the task's process died before it could start"})

    def _exchange(self, host: Host, pending: Pending, sock: socket.socket,
                  deadline: float | None, timeout: float | None) -> Outcome:
        fds: list[int] = []  # a big result's memory file (runner.run_task)
        try:
            if deadline is not None:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
            meta, fds = framing.recv_blob_fds(sock)
            if deadline is not None:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
            payload: bytearray | memoryview = framing.recv_blob(sock)
            if fds:
                payload = _map_read_only(fds[0])
        except (socket.timeout, TimeoutError):
            return self._timed_out(pending, timeout)
        except (EOFError, OSError):
            return self._died(pending, host)
        finally:
            for fd in fds:
                os.close(fd)
        info = json.loads(meta)
        # A whole answer stands even if a kill came meanwhile: the function returned, and
        # a task handed back for its owner (pause --now) must not run to completion twice
        # (a cancelled job's coordinator refuses the post; a timeout never gets here).
        pending.answered = True
        host.preload(info.get("imports"), info.get("path"))
        handoff_file = info.get("handoff_file")
        return Outcome(info["status"], info.get("error"), payload if payload else None,
                       handoff_file if isinstance(handoff_file, str) else None)

    def _timed_out(self, pending: Pending, timeout: float | None) -> Outcome:
        self._kill(pending, "timeout")
        return Outcome("error", {"kind": FailureKind.TIMEOUT, "type": "TaskTimeout",
                                 "message": timeout_message(timeout)})

    @staticmethod
    def _send_args(sock: socket.socket, args: bytes | bytearray | memoryview) -> None:
        try:
            framing.send_blob(sock, args)
        except OSError:
            pass  # the child died before reading; the reader side reports why

    def _died(self, pending: Pending, host: Host) -> Outcome:
        """The task's process hung up without its reply: its exit code says how (a host
        reports only the codes other than 0 by itself: it is asked for a clean one, as an
        ``os._exit(0)`` in the function makes), else its host died."""
        if pending.killed_for:
            return self._killed_outcome(pending)
        if not pending.exited.is_set() and pending.pid:
            host.ask_exit(pending.pid)
        pending.exited.wait(5)
        code = pending.code
        if code is None:
            return self._host_lost(host)
        return Outcome("error", {"kind": FailureKind.CRASHED, "type": "TaskCrashed",
                                 "message": procs.crash_message(code), "code": code})

    @staticmethod
    def _killed_outcome(pending: Pending) -> Outcome:
        return Outcome("error", {"kind": pending.killed_for, "type": "Cancelled",
                                 "message": f"the task was {pending.killed_for}"})

    def _kill(self, pending: Pending, why: str) -> None:
        pending.killed_for = why
        pending.started.wait(5)
        if pending.pid:
            procs.kill_tree(pending.pid)

    def run_script(self, task_id: str, script_path: str, payload: bytes | bytearray | memoryview,
                   timeout: float | None, env: dict | None = None,
                   name: str | None = None) -> Outcome:
        """Run a script task: the script at ``script_path`` (the cached blob), copied under
        its file name ``name`` (default ``script.py``), as ``python`` in a fresh process in
        its own process group, ``payload`` (JSON) on its stdin, stdout/stderr to this
        thread's output files. The result is the last stdout line that parses as JSON (see
        :mod:`gpumesh.worker.scripts`). Never raises for anything the script does."""
        from . import scripts
        out, err = self.output_paths()
        pending = Pending()
        self._running[task_id] = (None, pending)
        try:
            return scripts.run(script_path, bytes(payload), timeout, out, err, pending, self._kill,
                               env, self._watch_script if self.runtime == "fork" else None,
                               name=name)
        finally:
            self._running.pop(task_id, None)

    def _watch_script(self, pid: int, running: bool) -> None:
        """Have the zygote kill script ``pid``'s process group should this agent die while
        it runs (``running``), or no longer (runner.zygote_main): a script is the agent's
        own child, in a session of its own, so no host sees the agent's death for it. The
        zygote is started for it if need be (~0.1 s, once; a script-only worker's janitor
        lets it go when idle, as it does a function worker's)."""
        try:
            with self._lock:
                if running or self._zygote_ctrl is not None:
                    framing.send_msg(self._zygote_socket(),
                                    {"op": "watch" if running else "unwatch", "pid": pid})
        except OSError:  # (closing) the script is killed with its task by the caller
            pass

    def output_paths(self) -> tuple[str, str]:
        """Files that receive stdout and stderr of the task this thread runs. Two pairs per
        slot thread, used in turns when a task is sent ahead (it writes the other pair
        while the thread still reads this one's last output), each emptied before the
        task that writes it: no file is created or removed per task."""
        return self._paths(self._pair.get(threading.get_ident(), 0))

    def _paths(self, pair: int) -> tuple[str, str]:
        base = f"{self._spool_str}/{threading.get_ident()}" + (".1" if pair else "")
        return base + ".out", base + ".err"

    @staticmethod
    def _truncate(paths: tuple[str, str]) -> tuple[str, str]:
        for path in paths:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        return paths

    def new_output(self, task_id: str | None = None) -> tuple[str, str]:
        """The output files of this thread's next task (``task_id``), emptied, unless
        that task was sent ahead: it had them emptied then, and may have written to them
        since. Called before anything reads them for that task (the task only appends),
        so no reader ever sees the previous task's output as this one's."""
        me = threading.get_ident()
        with self._lock:
            sent = self._ahead.get(me)
        if sent is not None and sent.task_id == task_id:
            self._pair[me] = sent.pair
            return self._paths(sent.pair)
        if sent is not None:  # (its process is killed before this task runs; off its files)
            self._pair[me] = 1 - sent.pair
        return self._truncate(self.output_paths())

    def cancel(self, task_id: str) -> bool:
        """Kill a running task's process group. Returns whether it was running here."""
        entry = self._running.get(task_id)
        if entry is None:
            # (one sent ahead whose slot took it from the queue but has not run it yet:
            # withdrawn, its run ends at once as cancelled)
            self.withdraw(task_id)
            return False
        self._kill(entry[1], "cancelled")
        return True

    def running(self) -> list[str]:
        return list(self._running)

    def close(self) -> None:
        """Kill every task and host, then the zygote. Leaves no process behind."""
        for task_id in list(self._running):
            self.cancel(task_id)
        self._retirer.flush()
        with self._lock:
            sent, self._ahead = list(self._ahead.values()), {}
        for record in sent:  # (they would run them: a stopping worker's leases go back)
            procs.kill_tree(record.spare.pid)
        with self._lock:
            self._closed = True  # no zygote starts after this, and no process is kept
            for kept in self._kept.values():
                kept.host.release(kept.spare)
            self._kept.clear()
            for host in self._hosts.values():
                host.close()  # (and so its spares and kept processes)
            self._hosts.clear()
            zygote, ctrl = self._zygote, self._zygote_ctrl
        if ctrl is not None:
            try:
                ctrl.close()
            except OSError:
                pass
        if zygote is not None:
            try:
                zygote.wait(5)
            except subprocess.TimeoutExpired:
                zygote.kill()
                zygote.wait()
        self._remove_task_dirs()

    def _remove_task_dirs(self) -> None:
        """Remove every task process's temporary directory (closing: none runs now)."""
        try:
            entries = os.listdir(self._tmp_str)
        except OSError:
            return
        for name in entries:
            tempdirs.remove_task_dir(os.path.join(self._tmp_str, name))


def make_executor(runtime: str | None = None, spool: Path | None = None,
                  task_tmp: Path | None = None, task_env: dict[str, str] | None = None) -> Executor:
    """The executor of ``runtime`` (``fork`` or ``spawn``; None: chosen as
    :func:`gpumesh.worker.procs.choose_runtime` says). Raises ``ValueError`` for an
    unknown runtime or one this Python cannot run."""
    name, _why = procs.choose_runtime(runtime)
    if name == "spawn":
        from .spawn import SpawnExecutor
        executor: Executor = SpawnExecutor(spool, task_tmp, task_env)
    else:
        executor = Executor(spool, task_tmp, task_env)
    if name == "spawn" or not hasattr(os, "memfd_create"):
        executor.bodies = membody.Bodies(executor.spool)  # files its task processes map
    return executor
