"""The spawn runtime: task processes from a fresh interpreter, started ahead of need.

::

    worker agent ── TCP listener on 127.0.0.1 (one-time token per process)
        │ subprocess.Popen(python -m gpumesh.worker.spawnchild), own process group
        ▼
    spare process   imported gpumesh + cloudpickle; once the job's function is known,
        │           unpickled it and imported what earlier tasks of it imported
        │ {"op": "run"} over its socket
        ▼
    task            runs in that process, which then exits (isolation="task"), or waits
                    for the job's next task in this slot (isolation="job")

For every task a process is taken (one loaded with the task's function if there is one,
else the generic spare, else a new one) and a replacement, loaded with the same
function, is started at once: it pays the interpreter start and the function's imports
while this task runs, so with one task after another in a slot the next one finds a
process ready. Where the fork runtime forks a warm host (about 1 ms), this costs an
interpreter per task, but needs nothing Windows lacks: no fork, AF_UNIX, memfd or
descriptor passing. Big arguments and results change hands as files in the spool
directory, mapped by the side that reads them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from .. import handoff
from ..limits import HANDOFF_MIN_BYTES, MAX_WARM_FUNCTIONS, WARM_IDLE_S
from ..payloadref import PayloadRef
from ..protocol import TaskGrant, timeout_message
from . import framing, procs, runner, tempdirs
from .executor import INLINE_ARGS_BYTES, JOB_IDLE_S, Executor, Outcome
from .host import Pending
from .retire import on_device

log = logging.getLogger("gpumesh.worker")

#: How long a new process may take to start and connect back (seconds): an interpreter
#: on a loaded machine, not the function's imports (those come after).
CONNECT_TIMEOUT_S = 120.0
#: How often idle spares and idle job processes are looked at for closing (seconds).
JANITOR_S = 5.0
#: The isolation modes a job may ask for (see gpumesh.client.mesh).
ISOLATIONS = ("task", "job")


class _Child:
    """One spawned process: a spare until a task takes it."""

    def __init__(self, proc: subprocess.Popen, fn_hash: str | None, tmp: str | None = None):
        self.proc, self.pid = proc, proc.pid
        self.tmp = tmp  # its temporary directory (gpumesh.worker.tempdirs), removed at close
        self.fn_hash = fn_hash  # the function it loads or loaded (None: not yet told)
        self.sock: socket.socket | None = None
        self.connected = threading.Event()
        self.ready = False  # its "ready" was read
        self.preloaded: set[str] = set()
        self.last_used = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, msg: dict) -> None:
        assert self.sock is not None
        framing.send_blob(self.sock, json.dumps(msg).encode())

    def close(self) -> None:
        """Kill the process and its tree; reap it; remove its temporary directory. Never
        raises."""
        procs.kill_tree(self.pid)
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.connected.set()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            log.warning("process %s did not exit after being killed", self.pid)
        tempdirs.remove_task_dir(self.tmp)


class SpawnExecutor(Executor):
    """The :class:`Executor` interface over spawned processes (see the module docstring)."""

    runtime = "spawn"

    def __init__(self, spool=None, task_tmp=None, task_env=None) -> None:
        super().__init__(spool, task_tmp, task_env)
        self._listener: socket.socket | None = None
        self._connecting: dict[bytes, _Child] = {}
        self._spares: dict[str | None, list[_Child]] = {}  # None: not told a function yet
        self._jobs: dict[tuple, _Child] = {}  # (job id, slot) -> its kept process
        self._imports: dict[str, tuple[list, list]] = {}  # fn -> (modules, sys.path) tasks added
        self._blob_paths: dict[str, str] = {}
        self._fn_used: dict[str, float] = {}
        self._front_paths: dict[str, list[str]] = {}  # key -> its task environment's sys.path

    # ------------------------------------------------------------------ processes ---
    def _listen(self) -> int:
        """The loopback port processes connect back to, opened on first use. Called with
        ``self._lock`` held."""
        if self._listener is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            self._listener = sock
            threading.Thread(target=self._accept, args=(sock,), name="spawn-accept",
                             daemon=True).start()
            threading.Thread(target=self._janitor, name="spawn-janitor", daemon=True).start()
        return self._listener.getsockname()[1]

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _addr = listener.accept()
            except OSError:
                return  # closed
            try:
                conn.settimeout(5)  # whoever connects must say who it is at once
                token = bytes(framing.recv_exact(conn, 16))
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, EOFError):
                conn.close()
                continue
            with self._lock:
                child = self._connecting.pop(token, None)
            if child is None:  # not a process of ours
                conn.close()
                continue
            child.sock = conn
            child.connected.set()

    def _spawn(self, fn_hash: str | None = None) -> _Child:
        """Start a process; with ``fn_hash`` it loads that function (and the modules its
        tasks imported) as soon as it runs. Called with ``self._lock`` held. Raises
        ``OSError`` when no process can be started."""
        if self._closed:
            raise OSError("the executor is closed")
        port = self._listen()
        token = os.urandom(16)
        env = {k: v for k, v in os.environ.items() if k not in runner.SCRUBBED_ENV}
        env.update(self.task_env)
        env[runner.IN_TASK_ENV] = "1"
        proc = subprocess.Popen([sys.executable, "-m", "gpumesh.worker.spawnchild"],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, **procs.group_kwargs())
        child = _Child(proc, fn_hash, self._new_tmp())
        self._connecting[token] = child
        hello: dict = {"port": port, "token": token.hex(), "agent": os.getpid()}
        if fn_hash is not None:
            hello["load"] = self._load_msg(fn_hash, child)
        assert proc.stdin is not None  # stdin=PIPE
        try:
            proc.stdin.write(json.dumps(hello).encode() + b"\n")
            proc.stdin.close()
        except OSError:  # it died at once; whoever takes it finds out
            pass
        return child

    def _load_msg(self, fn_hash: str, child: _Child) -> dict:
        modules, path = self._imports.get(fn_hash, ([], []))
        child.preloaded.update(modules)
        return {"op": "load", "path": self._blob_paths[fn_hash], "modules": list(modules),
                "sys_path": list(path), "front_path": self._front_paths.get(fn_hash, [])}

    def _take(self, fn_hash: str) -> _Child:
        """A process for a task of ``fn_hash``, and a replacement spare for the next one.
        Called with ``self._lock`` held."""
        child = None
        for key in (fn_hash, None):
            pool = self._spares.get(key, [])
            while pool and child is None:
                c = pool.pop(0)
                if c.alive():
                    child = c
                else:
                    c.close()
            if child is not None:
                break
        if child is None:
            child = self._spawn(fn_hash)
        self._fn_used[fn_hash] = time.monotonic()
        try:
            self._spares.setdefault(fn_hash, []).append(self._spawn(fn_hash))
            if not self._spares.get(None):  # the next new function finds one started too
                self._spares[None] = [self._spawn()]
        except OSError as e:  # out of processes: this task still runs
            log.warning("could not start a spare task process: %s", e)
        self._evict()
        return child

    def _evict(self) -> None:
        """Close spares of functions not used for WARM_IDLE_S (``GPUMESH_WARM_IDLE``),
        beyond MAX_WARM_FUNCTIONS, the generic spare once no function was used for as
        long, and job processes idle for JOB_IDLE_S. Called with ``self._lock`` held."""
        now = time.monotonic()
        recent = sorted((h for h in self._spares if h is not None),
                        key=lambda h: self._fn_used.get(h, 0), reverse=True)
        for i, h in enumerate(recent):
            if i >= MAX_WARM_FUNCTIONS or now - self._fn_used.get(h, 0) > WARM_IDLE_S:
                for c in self._spares.pop(h):
                    c.close()
        # The generic spare waits for the next new function: kept only while some function
        # ran lately, so an idle worker holds no spawned process.
        if self._spares.get(None) and now - max(self._fn_used.values(), default=0) > WARM_IDLE_S:
            for c in self._spares.pop(None):
                c.close()
        for key, c in list(self._jobs.items()):
            if not c.alive() or (key[2] is None and now - c.last_used > JOB_IDLE_S):
                del self._jobs[key]
                c.close()

    def _janitor(self) -> None:
        while not self._closed:
            time.sleep(min(JANITOR_S, max(0.05, WARM_IDLE_S / 4)))
            with self._lock:
                if not self._closed:
                    self._evict()

    def functions_in_use(self) -> list[str]:
        """As :meth:`Executor.functions_in_use`: here each spare of a function loads its
        blob when it starts (and a new one starts with each task), so every function
        with spares."""
        with self._lock:
            return [h for h, spares in self._spares.items() if h is not None and spares]

    def forget(self, fn_hash: str) -> None:
        with self._lock:
            spares = self._spares.pop(fn_hash, [])
        for c in spares:
            c.close()

    # ------------------------------------------------------------------ tasks -------
    def run(self, task: TaskGrant, blob_path: str, args=None, *, env: dict | None = None,
            args_ref: PayloadRef | None = None,
            handoff_dir: str | None = None, handoff_name: str | None = None,
            sys_path: list[str] | None = None, slot=None, ahead=None,
            withdraw: bool = False) -> Outcome:
        """As :meth:`Executor.run`. ``isolation="job"``: the task runs in the process this
        ``slot`` keeps for its job (started on the job's first task there, replaced
        after a crash, timeout or cancel, never given another job's task). No task is
        sent ahead here (``ahead`` is not used), so none is withdrawn: one handed back
        (``withdraw``) is not run."""
        if withdraw:
            return self._not_begun("handed back")
        task_id, fn_hash, timeout, result_format = task.task_id, task.fn, task.timeout, task.result_format
        isolation, job_id = task.isolation, task.job_id
        if sys_path:  # a task environment (requires=): processes of its own, keyed by both
            fn_hash = "|".join([fn_hash, *sys_path])
            self._front_paths[fn_hash] = list(sys_path)
        keep = isolation == "job" and job_id is not None
        key = (job_id, slot if slot is not None else threading.get_ident(), None)
        left: list[_Child] = []  # the slot's previous job's process (see below)
        with self._lock:
            self._blob_paths[fn_hash] = blob_path
            child = self._jobs.get(key) if keep else None
            if child is not None and (not child.alive() or child.fn_hash != fn_hash):
                del self._jobs[key]
                child.close()
                child = None
            try:
                if child is None:
                    child = self._take(fn_hash)
                    if keep:
                        # the slot moved on to this job: the last one's process goes
                        left = [self._jobs.pop(k) for k in list(self._jobs) if k[1] == key[1]]
                        self._jobs[key] = child
                if keep:  # busy: not idle for the janitor while it runs
                    self._jobs.pop(key)
                    self._jobs[key[:2] + (task_id,)] = child
            except OSError as e:
                return Outcome("retry", {"kind": "host_died",
                                         "message": f"could not start a task process: {e}"})
        for other in left:
            if on_device(env):  # a device's slot: its memory is freed before the next job's task runs
                other.close()
            else:  # closed once this task is under way (gpumesh.worker.retire)
                self._retirer.later(other.close)
        pending = Pending()
        pending.pid = child.pid
        pending.started.set()
        self._running[task_id] = (None, pending)
        out, err = self.output_paths()
        result_name = None
        spooled = None  # arguments this run wrote to the spool: released at the end
        try:
            if not self._connected(child, pending):
                return self._lost(child, pending, "the task process did not start")
            if not child.ready:
                outcome = self._await_ready(child, fn_hash, blob_path, pending)
                if outcome is not None:
                    return outcome
            if handoff_dir is None:  # a big result comes back as a file of the spool
                handoff_dir, handoff_name = self._spool_str, handoff.new_name()
                result_name = handoff_name
            msg: dict[str, Any] = {
                "op": "run", "task_id": task_id, "stdout": out, "stderr": err,
                "result_format": result_format, "handoff_dir": handoff_dir,
                "handoff_name": handoff_name, "keep": keep, "tmp": child.tmp}
            if env:
                msg["env"] = env
            if args_ref is not None:
                if args_ref.path is not None:  # a file (shared memory, the store's): mapped there
                    msg["args"], args = args_ref.to_meta(by_path=True)[0], None
                else:  # a memory file, which a spawned process cannot be passed: copied below
                    args = args_ref.open()
            if args is not None and len(args) >= HANDOFF_MIN_BYTES:
                spooled = PayloadRef("handoff", owned=True, path=os.path.join(
                    self._spool_str, handoff.write_file(self._spool_str, [args])))
                msg["args"], args = spooled.to_meta(by_path=True)[0], None
            child.last_used = time.monotonic()
            child.send(msg)
            outcome = self._exchange_spawned(child, pending, args, timeout)
            if outcome.handoff_file is not None and outcome.handoff_file == result_name:
                outcome.payload, outcome.handoff_file = self._take_file(result_name), None
                result_name = None
            if outcome.status == "error" and outcome.error is not None:
                from .executor import _tail
                tail = _tail(err, 4096)
                if tail:
                    outcome.error["stderr_tail"] = tail
            return outcome
        except OSError as e:
            return self._lost(child, pending, f"could not run the task: {e}")
        finally:
            self._running.pop(task_id, None)
            child.last_used = time.monotonic()
            if result_name:
                handoff.discard(self._spool_str, result_name)
            if spooled is not None:
                spooled.release()
            with self._lock:
                self._fn_used[fn_hash] = time.monotonic()  # idle from the task's end
                if keep:
                    self._jobs.pop(key[:2] + (task_id,), None)
                    if child.alive() and not pending.killed_for and not self._closed:
                        self._jobs[key] = child
            if not keep or not child.alive() or pending.killed_for or self._closed:
                child.close()  # and whatever the task left running

    @staticmethod
    def _connected(child: _Child, pending: Pending) -> bool:
        """Wait for a new process to connect back; False once it died, was killed (a
        cancel before it started) or took CONNECT_TIMEOUT_S."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while not child.connected.wait(0.05):
            if pending.killed_for or not child.alive() or time.monotonic() > deadline:
                return False
        return child.sock is not None

    def _await_ready(self, child: _Child, fn_hash: str, blob_path: str,
                     pending: Pending) -> Outcome | None:
        """Wait for the process to have loaded the function (telling a generic spare which
        one first). None when ready, else the task's outcome."""
        try:
            if child.fn_hash is None:
                with self._lock:
                    child.fn_hash = fn_hash
                    msg = self._load_msg(fn_hash, child)
                child.send(msg)
            assert child.sock is not None  # (connected: see _connected)
            reply = json.loads(framing.recv_blob(child.sock))
        except (OSError, EOFError, ValueError):
            return self._lost(child, pending, "the task process died loading the function")
        if reply.get("op") == "load_error":
            self.forget(fn_hash)
            return Outcome("error", dict(reply["error"]))
        child.ready = True
        return None

    def _exchange_spawned(self, child: _Child, pending: Pending, args, timeout: float | None) -> Outcome:
        sock = child.sock
        assert sock is not None  # (connected: see _connected)
        deadline = None if timeout is None else time.monotonic() + timeout
        if args is not None:
            if len(args) <= INLINE_ARGS_BYTES:
                self._send_args(sock, args)
            else:
                threading.Thread(target=self._send_args, args=(sock, args), daemon=True).start()
        try:
            sock.settimeout(timeout)
            struct.unpack("<Q", framing.recv_exact(sock, 8))  # its pid: we know it already
            meta = framing.recv_blob(sock)
            if deadline is not None:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
            payload = framing.recv_blob(sock)
            sock.settimeout(None)
        except (socket.timeout, TimeoutError):
            self._kill(pending, "timeout")
            return Outcome("error", {"kind": "timeout", "type": "TaskTimeout",
                                     "message": timeout_message(timeout)})
        except (EOFError, OSError):
            return self._lost(child, pending, None)
        info = json.loads(meta)  # (whole: it stands even if a kill came meanwhile, as forked)
        self._learn(child.fn_hash, info.get("imports"), info.get("path"))
        handoff_file = info.get("handoff_file")
        return Outcome(info["status"], info.get("error"), payload if payload else None,
                       handoff_file if isinstance(handoff_file, str) else None)

    def _lost(self, child: _Child, pending: Pending, why: str | None) -> Outcome:
        """The process went away mid-task: killed by us, or crashed (with its exit code)."""
        if pending.killed_for:
            return self._killed_outcome(pending)
        try:
            code = child.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return Outcome("retry", {"kind": "host_died",
                                     "message": why or "the task process stopped answering"})
        return Outcome("error", {"kind": "crashed", "type": "TaskCrashed", "code": code,
                                 "message": procs.crash_message(code)})

    def _learn(self, fn_hash: str | None, modules, path) -> None:
        """Modules a task imported: later spares of its function import them while they
        wait, and spares already waiting are told now (a heavy import is paid ahead)."""
        if fn_hash is None:
            return
        new = [m for m in modules or () if isinstance(m, str)]
        added = [p for p in path or () if isinstance(p, str)]
        if not new and not added:
            return
        with self._lock:
            known, known_path = self._imports.setdefault(fn_hash, ([], []))
            have = set(known)
            known.extend(m for m in new if m not in have)
            known_path.extend(p for p in added if p not in known_path)
            del known[runner.MAX_PRELOAD:]
            waiting = [c for c in self._spares.get(fn_hash, ()) if c.connected.is_set()]
        for c in waiting:
            todo = [m for m in known if m not in c.preloaded]
            if todo:
                c.preloaded.update(todo)
                try:
                    c.send({"op": "preload", "modules": todo, "sys_path": list(known_path)})
                except OSError:
                    pass

    def _take_file(self, name: str) -> memoryview:
        """A result the task left in the spool: mapped, and the file removed (where a
        mapped file cannot be removed, Windows, it goes when the map does)."""
        ref = PayloadRef("handoff", path=os.path.join(self._spool_str, name), owned=True)
        view = ref.open()
        ref.release()
        assert ref.path is not None  # (made with one above)
        if os.path.exists(ref.path):
            import weakref
            weakref.finalize(view.obj, handoff.discard, self._spool_str, name)
        return view

    def close(self) -> None:
        """Kill every task and spare process. Leaves no process behind."""
        for task_id in list(self._running):
            self.cancel(task_id)
        with self._lock:
            self._closed = True
            children = [c for pool in self._spares.values() for c in pool]
            children += list(self._jobs.values()) + list(self._connecting.values())
            self._spares.clear()
            self._jobs.clear()
            self._connecting.clear()
            listener, self._listener = self._listener, None
        for c in children:
            c.close()
        if listener is not None:
            listener.close()
        super().close()
