"""The processes that run tasks: a zygote, one warm host per function, one child per task.

::

    worker agent (threads, HTTP)           never unpickles user code
        │ control socket (SEQPACKET, JSON + passed fds)
        ▼
    zygote        python -m gpumesh.worker.runner FD      started with the first function task,
        │                                                 imports only gpumesh.wire and cloudpickle
        │ fork (≈1 ms) on {"op": "host"}
        ▼
    function host   unpickles ONE function (and so pays its imports) once
        │ keeps one spare child forked ahead; on {"op": "run"} hands it the task's
        │ data socket and forks the next spare
        ▼
    task child      own session/process group; reads args, calls, writes the result, _exit

Isolation: every task runs in its own forked child, so what a task does to its
process (globals, leaked memory, a crash, ``os._exit``) dies with it and never reaches
the next task; the host only ever holds the freshly unpickled function. Speed: the
heavy part (interpreter start, the function's imports) is paid once per function per
worker, not once per task.

A child talks straight to the agent over its own data socket (stream):
``u64 pid | u64 len | JSON meta | u64 len | payload`` - the pid first, so the agent can
kill the process group on timeout or cancel. A result of 1 MiB or more is a memory file
instead, passed with the meta (SCM_RIGHTS), and its payload frame is empty; big
arguments come the same way, as a descriptor and a range (gpumesh.worker.membody).
The host reports ``exited`` (with the exit status) only for a child that did not exit
cleanly, so a child that died without a result becomes a precise error.

Everything here is single-threaded on purpose: forking a multi-threaded process is unsafe.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import traceback

from gpumesh import tracing
from gpumesh.protocol import FailureKind
from gpumesh.retries import type_name

#: Whether marks are written (gpumesh.tracing): one global read in a task process, where
#: every object touched costs a copy-on-write fault.
_TRACE = tracing.PATH is not None

#: Control messages are single SEQPACKET datagrams; keep them well under the socket buffer.
MAX_CONTROL_BYTES = 60 * 1024
#: Most module names one task reports for its host to preload (``import sklearn.ensemble``
#: alone loads a few hundred; the next task reports what did not fit).
MAX_PRELOAD = 4096
#: Environment variable set inside every task process (nested mesh calls run inline).
IN_TASK_ENV = "GPUMESH_IN_TASK"
#: Variables a task must never see (credentials of the worker).
SCRUBBED_ENV = ("GPUMESH_TOKEN", "GPUMESH_WORKER_TOKEN", "GPUMESH_CONFIG", "GPUMESH_URL",
                "GPUMESH_FINGERPRINT")

CONTROL_TYPE = getattr(socket, "SOCK_SEQPACKET", socket.SOCK_DGRAM)


# ---------------------------------------------------------------- control messages ---
#: The first byte of a task's run message. A host hands such a message on to its spare
#: as it came, without decoding it: between two forks every object a host touches costs
#: it a copy-on-write fault (its spare shares its pages), a JSON round trip about 80.
RUN = b"R"


def send_msg(sock: socket.socket, msg: dict, fds: list[int] | tuple = (), prefix: bytes = b"") -> None:
    data = prefix + json.dumps(msg).encode()
    if len(data) > MAX_CONTROL_BYTES:
        raise ValueError("control message too large")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def send_run(sock: socket.socket, msg: dict, fds: list[int]) -> None:
    """A task's run message (``{"op": "run", "task_id": ...}``) to a function host."""
    send_msg(sock, msg, fds, RUN)


def recv_raw(sock: socket.socket) -> tuple[bytes | None, list[int]]:
    """One message, undecoded, and the fds passed with it; ``(None, [])`` at EOF."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_CONTROL_BYTES + 1024, 4)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return data, list(fds)


def decode(data: bytes) -> dict:
    """A control message as :func:`recv_raw` returned it, decoded."""
    return json.loads(data[1:] if data[:1] == RUN else data)


def recv_msg(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the fds passed with it; ``(None, [])`` at EOF."""
    data, fds = recv_raw(sock)
    return (None, []) if data is None else (decode(data), fds)


def control_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, CONTROL_TYPE)


# ---------------------------------------------------------------- data socket --------
def send_blob(sock: socket.socket, data) -> None:
    view = memoryview(data).cast("B")
    sock.sendall(struct.pack("<Q", view.nbytes))
    sock.sendall(view)


def send_chunks(sock: socket.socket, chunks, size: int) -> None:
    sock.sendall(struct.pack("<Q", size))
    for c in chunks:
        sock.sendall(c)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if k == 0:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_blob(sock: socket.socket) -> bytearray:
    (n,) = struct.unpack("<Q", recv_exact(sock, 8))
    return recv_exact(sock, n)


def send_blob_fd(sock: socket.socket, data: bytes, fd: int) -> None:
    """As :func:`send_blob`, passing ``fd`` along (SCM_RIGHTS, with the blob's first bytes)."""
    head = struct.pack("<Q", len(data)) + data
    sent = socket.send_fds(sock, [head], [fd])
    if sent < len(head):  # a stream socket may take a message in parts
        sock.sendall(head[sent:])


def recv_blob_fds(sock: socket.socket) -> tuple[bytearray, list[int]]:
    """As :func:`recv_blob`, also returning the descriptors passed with it (the caller
    closes them; on error they are closed here)."""
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    head, fds, _flags, _addr = socket.recv_fds(sock, 8, 2, flags)
    try:
        if not head:
            raise EOFError("connection closed before a message")
        if len(head) < 8:
            head += recv_exact(sock, 8 - len(head))
        (n,) = struct.unpack("<Q", head)
        return recv_exact(sock, n), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


# ---------------------------------------------------------------- errors --------------
def describe_exception(exc: BaseException, kind: str, own_frames: int = 0) -> dict:
    """JSON-safe description of an exception: kind, type, message, traceback text, and
    ``mro``: the type names of the exception's classes, most derived first (what a
    ``retry_on=`` is matched against). ``own_frames``: how many frames at the top of the
    traceback are gpumesh's (the task runner's call of the function), left out so that
    the traceback starts in the user's code."""
    t = type(exc)
    tb = exc.__traceback__
    for _ in range(own_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    out = {"kind": kind, "type": type_name(t), "message": _safe_str(exc),
           "mro": [type_name(c) for c in t.__mro__ if c is not object][:32],
           "traceback": "".join(traceback.format_exception(t, exc, tb))[-32_000:]}
    if isinstance(exc, ModuleNotFoundError) and isinstance(exc.name, str) and exc.name:
        # A module this worker lacks: the coordinator tries the task on another worker.
        out["module"] = exc.name[:200]
    return out


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)[:8000]
    except Exception:  # a broken __str__ must not hide the failure
        return f"<{type(exc).__name__} whose str() failed>"


# ---------------------------------------------------------------- task child ---------
def _reseed_after_fork() -> None:
    """Forked children share the parent's RNG state; give each task fresh entropy."""
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.seed()
        except Exception:
            pass


def run_task(fn, data: socket.socket, result_format: str | None = None,
             args_ref: dict | None = None, handoff_dir: str | None = None,
             handoff_name: str | None = None, fds: list[int] | tuple = ()) -> None:
    """Inside the task child: read arguments, call, send back value or failure.
    ``result_format="json"`` (strict results): the value travels as JSON, never pickled.
    ``args_ref``: the arguments are this payload reference (gpumesh.payloadref, as JSON;
    ``fds`` the descriptors it may name), mapped, not read; else the socket's first blob.
    ``handoff_dir``: the coordinator's handoff directory when it shares this machine;
    a big result is written there, as ``handoff_name`` (chosen by the agent, which deletes
    it if the task dies while writing), and only that name is sent (gpumesh.handoff).
    Otherwise a big result is written into a memory file whose descriptor travels with
    the meta, so it crosses no socket (the agent maps it and posts it from there)."""
    from gpumesh import handoff, payloadref, wire
    as_json = result_format == "json"

    def reply(meta: dict, payload=None) -> None:
        # Everything the task printed must be in its output files before the agent hears
        # of the result: it forwards the output once more, then posts the result.
        if _TRACE:
            tracing.mark("task.reply")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001 - a broken stream must not lose the result
                pass
        fd = None
        if payload is not None and handoff.worth_it(payload.size):
            if handoff_dir:
                try:
                    meta = dict(meta, handoff_file=handoff.write_file(
                        handoff_dir, payload.chunks, handoff_name))
                    payload = None
                except (OSError, ValueError):  # (disk full...) the socket still works
                    pass
            if payload is not None:
                fd = handoff.memory_file(payload.chunks)
                if fd is not None:
                    payload = None
        body = _OK_META_BYTES if meta is _OK_META else json.dumps(meta).encode()
        if fd is None:
            send_blob(data, body)
        else:
            send_blob_fd(data, body, fd)
            os.close(fd)
        if payload is None:
            send_blob(data, b"")
        else:
            send_chunks(data, payload.chunks, payload.size)

    loaded_modules, loaded_path = _LOADED or (frozenset(sys.modules), tuple(sys.path))
    try:
        if args_ref is None:
            args, kwargs = wire.loads(recv_blob(data))
        else:
            ref = payloadref.from_meta(args_ref, fds)
            try:
                args, kwargs = wire.loads(ref.open())
            finally:
                ref.release()  # (the map outlives its descriptor)
    except BaseException as e:  # noqa: BLE001 - any unpickling failure is the task's error
        reply({"status": "error", "error": describe_exception(e, FailureKind.UNPICKLE)})
        return
    try:
        value = fn(*args, **kwargs)
        # Modules the call imported: the host imports them too, so the next task forks
        # with them loaded (a heavy import is paid once per host, not once per task).
        # Full dotted names: ``from pkg.heavy import x`` must preload ``pkg.heavy``, not just
        # the light ``pkg``. Private modules come with their public parents.
        imported = [] if len(sys.modules) == len(loaded_modules) else sorted(
            m for m in list(sys.modules) if m not in loaded_modules
            and not any(part.startswith("_") for part in m.split("."))
        )[:MAX_PRELOAD]
        added_path = [p for p in sys.path if p not in loaded_path and isinstance(p, str)][:16]
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, SystemExit):
            err = describe_exception(e, FailureKind.EXIT)
            err["message"] = f"the task called sys.exit({e.code!r})"
            reply({"status": "error", "error": err})
            return
        if not isinstance(e, Exception):
            # KeyboardInterrupt, GeneratorExit...: re-raised at the caller they would look
            # like the caller's own Ctrl+C. They arrive as a RemoteError naming them.
            reply({"status": "error", "error": describe_exception(e, FailureKind.EXIT)})
            return
        err = describe_exception(e, FailureKind.RAISED, own_frames=1)  # from the function's own frame
        try:
            payload = None if as_json else wire.dumps(e)  # strict callers never unpickle
        except BaseException:  # noqa: BLE001 - the exception itself cannot travel
            payload = None
        reply({"status": "error", "error": err}, payload)
        return
    if as_json:
        from gpumesh.strict import NotJSON, encode
        try:
            data_json = encode(value)
        except NotJSON as e:
            reply({"status": "error", "error": {"kind": FailureKind.RESULT_NOT_JSON, "type": "NotJSON",
                                                "message": str(e), "traceback": ""}})
            return
        reply(_ok_meta(imported, added_path), _Bytes(data_json))
        return
    try:
        payload = wire.dumps(value)
    except BaseException as e:  # noqa: BLE001
        err = describe_exception(e, FailureKind.RESULT_UNPICKLABLE)
        err["message"] = f"the return value ({type(value).__qualname__}) cannot be pickled: {err['message']}"
        reply({"status": "error", "error": err})
        return
    reply(_ok_meta(imported, added_path), payload)


#: The meta of a task that succeeded and changed nothing its host should copy: sent as
#: these bytes, since a first ``json.dumps`` in a fresh child costs ~40 page faults.
_OK_META = {"status": "ok"}
_OK_META_BYTES = b'{"status": "ok"}'


def _ok_meta(imported: list, added_path: list) -> dict:
    if not imported and not added_path:
        return _OK_META
    return {"status": "ok", "imports": imported, "path": added_path}


class _Bytes:
    """Bytes shaped like a :class:`gpumesh.wire.Payload` for ``reply``."""

    def __init__(self, data: bytes):
        self.chunks, self.size = [data], len(data)


# ---------------------------------------------------------------- function host ------
#: What the function host had loaded when it forked its current spare: module names and
#: ``sys.path``. A task compares against this to find what it added (for the host to
#: preload) instead of copying ``sys.modules`` itself: touching every module's name in
#: a freshly forked child costs it ~80 copy-on-write page faults, a tenth of its CPU.
_LOADED: tuple[frozenset, tuple] | None = None


def _snapshot_loaded() -> None:
    """Record what the host has loaded; call before forking a child after imports."""
    global _LOADED
    _LOADED = (frozenset(sys.modules), tuple(sys.path))


def _wakeup_pipe() -> int:
    r, w = os.pipe()
    os.set_blocking(w, False)
    os.set_blocking(r, False)
    signal.set_wakeup_fd(w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return r


def host_main(ctrl: socket.socket, blob_path: str, sys_path: list | None = None) -> None:
    """Load one function, then fork a child per task until the agent hangs up.
    ``sys_path``: directories put first on ``sys.path`` before the function is loaded
    (its task environment: gpumesh.worker.envs)."""
    from gpumesh import handoff, payloadref, wire  # noqa: F401 - loaded once here, not in every child

    if sys_path:
        sys.path[0:0] = [p for p in sys_path if isinstance(p, str)]

    # Set once here, not in every child: the host runs no user code but the function's
    # own imports (unpickling, preloads), and those are the task's code too.
    os.environ[IN_TASK_ENV] = "1"
    try:
        with open(blob_path, "rb") as fh:
            fn = wire.loads(bytearray(fh.read()))
        fn = getattr(fn, "__gpumesh_wrapped__", fn)  # a decorated function: run the original
        if not callable(fn):
            raise TypeError(f"the job's function is a {type(fn).__name__}, not callable")
    except BaseException as e:  # noqa: BLE001
        send_msg(ctrl, {"op": "load_error", "error": describe_exception(e, FailureKind.UNPICKLE)})
        return
    send_msg(ctrl, {"op": "ready"})
    # Children write to files, and what they print should leave at each line (it is
    # forwarded live): set that up once here rather than in every child.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, encoding="utf-8", errors="backslashreplace")
        except (AttributeError, ValueError):
            pass
    # Objects that exist now are never collected in the children: moving them out of the
    # GC's reach keeps each child from touching (and so copying) their pages.
    gc.collect()
    _snapshot_loaded()
    gc.freeze()
    wake = _wakeup_pipe()
    children: dict[int, bytes | None] = {}  # pid -> run message (None: the spare, not yet given one)
    spare: _Spare | None = _Spare.fork(fn, ctrl, wake, children)
    while True:
        ready, _, _ = select.select([ctrl, wake], [], [])
        if wake in ready:
            try:
                os.read(wake, 4096)
            except BlockingIOError:
                pass
        _reap(ctrl, children)
        if spare is not None and spare.pid not in children:
            spare.close()  # it died idle (killed from outside): the next task forks anew
            spare = None
        if ctrl not in ready:
            continue
        data, fds = recv_raw(ctrl)
        if data is None:  # the agent is gone: take our tasks with us
            for pid in children:
                _kill_group(pid)
            return
        if data[:1] == RUN and fds:
            for _attempt in range(2):  # a spare that died idle a moment ago: fork anew
                if spare is None:
                    spare = _Spare.fork(fn, ctrl, wake, children)
                if spare is None or spare.start(data, fds, children):
                    break  # started; or no fork possible: closing the socket fails the task
                spare = None
            for fd in fds:
                os.close(fd)
            # The next task's process is forked now, while this one runs, so a task
            # never waits for a fork: it finds a process ready for it.
            spare = _Spare.fork(fn, ctrl, wake, children)
            continue
        msg = decode(data)
        if msg.get("op") == "preload":
            _preload(msg.get("modules", []), msg.get("path", []))
            _snapshot_loaded()
            gc.freeze()
            if spare is not None:  # forked before these imports: replace it
                spare.discard(children)
                spare = _Spare.fork(fn, ctrl, wake, children)
            continue
        for fd in fds:
            os.close(fd)


class _Spare:
    """A task child forked ahead of its task, waiting for it on a socket of its own.

    It has done everything that does not depend on the task (own session, GC off,
    signal handlers reset, RNGs reseeded) before the task exists; given one, it only
    points its output at the task's files and runs it."""

    def __init__(self, pid: int, sock: socket.socket):
        self.pid, self.sock = pid, sock

    @classmethod
    def fork(cls, fn, ctrl: socket.socket, wake: int, children: dict) -> _Spare | None:
        """Fork a spare (None if the fork fails: the host then forks per task)."""
        mine, theirs = control_pair()
        try:
            pid = os.fork()
        except OSError:
            mine.close()
            theirs.close()
            return None
        if pid == 0:
            mine.close()
            _spare_main(fn, ctrl, wake, theirs)  # never returns
        theirs.close()
        children[pid] = None
        return cls(pid, mine)

    def start(self, run: bytes, fds: list[int], children: dict) -> bool:
        """Hand the spare its task: the run message as it came (see :data:`RUN`), the
        task's data socket and, when the arguments are a file, that file. False if the
        spare is gone; its pid is then reaped as an idle child."""
        try:
            socket.send_fds(self.sock, [run], fds)
        except OSError:
            return False
        finally:
            self.close()
        if self.pid in children:
            children[self.pid] = run  # the child tells the agent its pid itself
        return True

    def discard(self, children: dict) -> None:
        _kill_group(self.pid)
        children.pop(self.pid, None)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.close()

    def close(self) -> None:
        self.sock.close()


def _spare_main(fn, ctrl: socket.socket, wake: int, sock: socket.socket) -> None:
    code = 0
    try:
        os.setsid()  # own process group: a timeout kills everything the task started
        gc.disable()  # a short-lived process: collection would only copy shared pages
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        ctrl.close()
        os.close(wake)
        _reseed_after_fork()
        msg, fds = recv_msg(sock)  # blocks until a task comes (or the host goes: EOF)
        sock.close()
        if msg is not None and fds:
            _run_child(fn, fds, msg)
    except BaseException:  # noqa: BLE001 - report nothing more; the exit status speaks
        code = 70
    finally:
        flush_and_exit(code)


def flush_and_exit(code: int) -> None:
    """End a task process now with ``code``: flush what it printed, then ``os._exit``
    (no atexit handlers or inherited finalizers, which belong to the agent's process)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - a broken stream must not change the exit status
        pass
    os._exit(code)


def _redirect(fd: int, path: str | None) -> None:
    """Point ``fd`` at the task's output file (emptied by the agent before the task, see
    Executor.new_output): a task's output never blocks on a pipe nobody reads."""
    if not path:
        return
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, fd)
    os.close(out)


def _preload(modules: list[str], path: list[str]) -> None:
    import importlib
    for entry in path:
        if isinstance(entry, str) and entry not in sys.path:
            sys.path.append(entry)
    for name in modules:
        if (not isinstance(name, str) or name in sys.modules
                or not all(part.isidentifier() for part in name.split("."))):
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module that fails here just stays unloaded
            pass


def _run_child(fn, fds: list[int], msg: dict) -> None:
    """In a spare that was given its task: run it over its data socket (``fds[0]``); its
    arguments' reference (``msg["args"]``) may name ``fds[1:]`` (gpumesh.payloadref)."""
    if _TRACE:
        tracing.mark("task.start")
    data = socket.socket(fileno=fds[0])
    data.sendall(struct.pack("<Q", os.getpid()))  # first: the agent may need to kill us
    env = msg.get("env")
    if env:
        # The slot's device, e.g. CUDA_VISIBLE_DEVICES=<its GPU>: set before the
        # function runs; CUDA libraries read it when they first initialise CUDA.
        os.environ.update({str(k): str(v) for k, v in env.items()})
    _redirect(1, msg.get("stdout"))
    _redirect(2, msg.get("stderr"))
    run_task(fn, data, msg.get("result_format"), msg.get("args"), msg.get("handoff_dir"),
             msg.get("handoff_name"), fds[1:])
    data.close()


def _reap(ctrl: socket.socket, children: dict[int, bytes | None]) -> None:
    """Reap exited children; tell the agent of a task's process that did not exit cleanly
    (``children``: pid -> its run message, None for the idle spare)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        run = children.pop(pid, None)
        if run is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code == 0:
            continue  # a clean exit follows a delivered result: nobody is waiting for it
        try:
            task_id = decode(run)["task_id"]  # decoded only now: this is the rare case
            send_msg(ctrl, {"op": "exited", "task_id": task_id, "pid": pid, "code": code})
        except (OSError, ValueError, KeyError):
            pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # not (yet) the leader of its own group: kill the process alone
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# ---------------------------------------------------------------- zygote -------------
def zygote_main(ctrl: socket.socket) -> None:
    """Fork a function host per request; reap them; exit when the agent hangs up."""
    # Warm: every host gets these for free (a function blob is a cloudpickle stream).
    import cloudpickle  # noqa: F401
    import gpumesh.wire  # noqa: F401

    signal.signal(signal.SIGCHLD, lambda *_: _reap_all())
    while True:
        msg, fds = recv_msg(ctrl)
        if msg is None:
            return
        if msg.get("op") == "host" and fds:
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                ctrl.close()
                host = socket.socket(fileno=fds[0])
                code = 0
                try:
                    host_main(host, msg["path"], msg.get("sys_path"))
                except BaseException:  # noqa: BLE001
                    code = 70
                os._exit(code)
            os.close(fds[0])
        else:
            for fd in fds:
                os.close(fd)


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> None:
    for name in SCRUBBED_ENV:
        os.environ.pop(name, None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when we stop
    ctrl = socket.socket(fileno=int(argv[1]))
    zygote_main(ctrl)


if __name__ == "__main__":
    main(sys.argv)
