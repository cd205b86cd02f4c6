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
        │ forks task children ahead of their tasks (spares), one per {"op": "spare"},
        │ and passes the agent each one's socket: the host is off a task's path
        ▼
    task child      own session/process group; says it is ready, then (the agent, on its
                    own socket) reads the task and args, calls, writes the result, _exit;
                    or, for isolation="job", waits there for the job's next task in its slot

Isolation: every task runs in its own forked child, so what a task does to its
process (globals, leaked memory, a crash, ``os._exit``) dies with it and never reaches
the next task; the host only ever holds the freshly unpickled function. (A job that asks
for ``isolation="job"`` trades that away within itself: a slot keeps its child for the
job's tasks, one after another, and never gives it another job's.) Speed: the
heavy part (interpreter start, the function's imports) is paid once per function per
worker, not once per task.

A child talks straight to the agent over its own socket (stream), which its host made
when it forked it and passed to the agent with ``{"op": "spare", "pid"}``: the child
sends one byte (:data:`SPARE_READY`) once it leads its own process group (what a timeout
or cancel kills, by the pid the agent has from the host); the agent sends
``u64 len | JSON run message | u64 len | args`` in one write; the child answers
``u64 len | JSON meta | u64 len | payload``, also in one write. A result over 256 KiB
(``HANDOFF_MIN_BYTES``) is a memory file instead, passed with the meta (SCM_RIGHTS), and its payload frame is
empty; big arguments come the same way, as a descriptor and a range
(gpumesh.worker.membody). The host reports ``exited`` (pid and exit status) for a child
that did not exit cleanly, so a child that died without a result becomes a precise error.

Everything here is single-threaded on purpose: forking a multi-threaded process is unsafe.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any

from gpumesh import tracing
from gpumesh.protocol import FailureKind
from gpumesh.worker import ahead, forking, procs, strays, tempdirs
from gpumesh.worker.exits import CleanExits, tell_exit
from gpumesh.worker.framing import send_msg, recv_raw, recv_msg, recv_blob, send_frames, recv_blob_fds
from gpumesh.retries import type_name

#: Whether marks are written (gpumesh.tracing): one global read in a task process, where
#: every object touched costs a copy-on-write fault.
_TRACE = tracing.PATH is not None

#: Most module names one task reports for its host to preload (``import sklearn.ensemble``
#: alone loads a few hundred; the next task reports what did not fit).
MAX_PRELOAD = 4096
#: Environment variable set inside every task process (nested mesh calls run inline).
IN_TASK_ENV = "GPUMESH_IN_TASK"
#: Variables a task must never see (credentials of the worker).
SCRUBBED_ENV = ("GPUMESH_TOKEN", "GPUMESH_WORKER_TOKEN", "GPUMESH_CONFIG", "GPUMESH_URL",
                "GPUMESH_FINGERPRINT")


#: The agent's request for one more spare, as its bytes: a function host compares them
#: instead of decoding the message. Between two forks every object a host touches costs
#: it a copy-on-write fault (its spare shares its pages), and a JSON round trip ~80.
SPARE_REQUEST = b'{"op": "spare"}'


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
        from gpumesh.worker import loadfail  # (only on this failure: off every task's path)
        gap = loadfail.version_gap(exc)
        if gap is not None:
            # Not lacking after all: it has the package, in another version than the one
            # the pickle or the code needs. The coordinator words it so (and still tries
            # another worker: one may have the matching version).
            out["package"], out["package_version"] = gap[0][:200], gap[1][:100]
    return out


def describe_load_failure(exc: BaseException, what: str) -> dict:
    """:func:`describe_exception` (kind ``unpickle``) of a failure to load ``what`` ("the
    call's arguments", "the function") on this worker: its message says so, and names
    this worker's versions of the packages involved (gpumesh.worker.loadfail), since a
    pickle from another version of a package is the usual cause."""
    from gpumesh.worker import loadfail
    return loadfail.describe(describe_exception(exc, FailureKind.UNPICKLE), exc, what)


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)[:8000]
    except Exception:  # a broken __str__ must not hide the failure
        return f"<{type(exc).__name__} whose str() failed>"


# ---------------------------------------------------------------- task child ---------
def _reseed_after_fork() -> None:
    """Forked children share the parent's RNG state; give each task fresh entropy."""
    # (random's own at-fork reseed is registered before forking.record_hooks(): tempfile)
    rnd = sys.modules.get("random")
    if rnd is not None:
        rnd.seed()
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
             handoff_name: str | None = None, fds: list[int] | tuple = (),
             args_frame: bytearray | None = None, trace: bool = True) -> None:
    """Inside the task child: read arguments, call, send back value or failure.
    ``result_format="json"`` (strict results): the value travels as JSON, never pickled.
    ``args_ref``: the arguments are this payload reference (gpumesh.payloadref, as JSON;
    ``fds`` the descriptors it may name), mapped, not read; else ``args_frame`` (read
    already) or the socket's next blob.
    ``handoff_dir``: the coordinator's handoff directory when it shares this machine;
    a big result is written there, as ``handoff_name`` (chosen by the agent, which deletes
    it if the task dies while writing), and only that name is sent (gpumesh.handoff).
    Otherwise a big result is written into a memory file whose descriptor travels with
    the meta, so it crosses no socket (the agent maps it and posts it from there).
    ``trace=False``: no tracing mark (a spare's rehearsal, see :func:`_rehearse`)."""
    from gpumesh import handoff, payloadref, wire
    as_json = result_format == "json"

    def reply(meta: dict, payload=None) -> None:
        # Everything the task printed must be in its output files before the agent hears
        # of the result: it forwards the output once more, then posts the result.
        if _TRACE and trace:
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
        try:
            send_frames(data, [body, [] if payload is None else list(payload.chunks)],
                        () if fd is None else (fd,))
        finally:
            if fd is not None:
                os.close(fd)

    loaded_modules, loaded_path = _LOADED or (frozenset(sys.modules), tuple(sys.path))
    try:
        if args_ref is None:
            args, kwargs = wire.loads(recv_blob(data) if args_frame is None else args_frame)
        else:
            ref = payloadref.from_meta(args_ref, fds)
            try:
                args, kwargs = wire.loads(ref.open())
            finally:
                ref.release()  # (the map outlives its descriptor)
    except BaseException as e:  # noqa: BLE001 - any unpickling failure is the task's error
        reply({"status": "error", "error": describe_load_failure(e, "the call's arguments")})
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
            err = describe_exception(e, FailureKind.EXIT, own_frames=1)  # (from the function's frame)
            err["message"] = f"the task called sys.exit({e.code!r})"
            reply({"status": "error", "error": err})
            return
        if not isinstance(e, Exception):
            # KeyboardInterrupt, GeneratorExit...: re-raised at the caller they would look
            # like the caller's own Ctrl+C. They arrive as a RemoteError naming them.
            reply({"status": "error", "error": describe_exception(e, FailureKind.EXIT, own_frames=1)})
            return
        err = describe_exception(e, FailureKind.RAISED, own_frames=1)  # from the function's own frame
        # (strict callers never unpickle; None: it cannot travel, the caller gets its text)
        payload = None if as_json else wire.dumps_exception(e)
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


def host_main(ctrl: socket.socket, blob_path: str, sys_path: list | None = None,
              tmp_root: str | None = None) -> None:
    """Load one function, then fork a child per task until the agent hangs up.
    ``sys_path``: directories put first on ``sys.path`` before the function is loaded
    (its task environment: gpumesh.worker.envs). ``tmp_root``: where each of its task
    processes gets a temporary directory of its own (:func:`spare_temp_dir`)."""
    from gpumesh import handoff, payloadref, wire  # noqa: F401 - loaded once here, not in every child
    global _TMP_ROOT
    _TMP_ROOT = tmp_root

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
        send_msg(ctrl, {"op": "load_error", "error": describe_load_failure(e, "the function")})
        return
    send_msg(ctrl, {"op": "ready"})
    # Children write to files, and what they print should leave at each line (it is
    # forwarded live): set that up once here rather than in every child.
    stream: Any  # (a TextIOWrapper, or whatever stands in for one: hence the except)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, encoding="utf-8", errors="backslashreplace")
        except (AttributeError, ValueError):
            pass
    # Objects that exist now are never collected in the children: moving them out of the
    # GC's reach keeps each child from touching (and so copying) their pages.
    _arm_parent_death()
    _prepare_rehearsal()
    _warm_host()
    forking.prepare()
    gc.collect()
    _snapshot_loaded()
    gc.freeze()
    wake = _wakeup_pipe()
    children: set[int] = set()  # task processes (spares included) not yet reaped
    exits = CleanExits()  # the agent hears of a clean exit only when it asks
    preloads = 0  # preload messages handled: a spare forked before the last is stale
    _fork_spare(fn, ctrl, wake, children, preloads)  # the first task's process
    watched: list[socket.socket | int] = [ctrl, wake]
    while True:
        ready, _, _ = select.select(watched, [], [])
        if wake in ready:
            try:
                os.read(wake, 4096)
            except BlockingIOError:
                pass
        _reap(ctrl, children, exits)
        if ctrl not in ready:
            continue
        data, fds = recv_raw(ctrl)
        for fd in fds:  # (none is expected)
            os.close(fd)
        if data is None:  # let go, or the agent is gone: take our tasks with us
            for pid in children:
                _kill_group(pid)
                tempdirs.remove_task_dir(spare_temp_dir(pid))  # (no reap will come for it)
            return
        if data == SPARE_REQUEST:
            _fork_spare(fn, ctrl, wake, children, preloads)
            continue
        msg = json.loads(data)
        if msg.get("op") == "exit_code" and isinstance(msg.get("pid"), int):
            exits.asked(ctrl, msg["pid"], msg["pid"] in children)
        elif msg.get("op") == "preload":
            _preload(msg.get("modules", []), msg.get("path", []))
            forking.prepare()  # (a module may have registered at-fork hooks, or a thread)
            _snapshot_loaded()
            gc.freeze()
            preloads += 1


#: ``prctl`` (Linux), resolved once in the host so that a spare only makes the call, and
#: the host's pid, which a spare compares with its parent's (see _die_with_host).
_PRCTL: Any = None
_HOST_PID = 0
_PR_SET_PDEATHSIG = 1
_PR_GET_DUMPABLE = 3
#: (an int: converting the Signals enum in a fresh child costs ~15 us of page faults;
#: Windows has no SIGKILL, and no prctl either, so there it is never used)
_SIGKILL = int(getattr(signal, "SIGKILL", 9))


def _arm_parent_death() -> None:
    """Get ready to have every task process this host forks die with it.

    Why the host, and why ``PR_SET_PDEATHSIG``: a task process leads a session of its own
    (so that a timeout or cancel kills its whole group), so no signal sent to the agent's
    group reaches it, and it runs user code, so it cannot watch anything itself without a
    thread per task. Its host can: it runs in a session apart from the agent (the zygote
    is started with one), blocks in ``select`` on its control socket, and at the EOF that
    the agent's death makes (``kill -9``, an OOM kill, a crash alike) kills every task
    process group it forked, then exits. The death signal covers the host itself dying
    (killed with the agent, or OOM-killed): the kernel kills its task processes at once.
    It fires on the death of the thread that forked, which here is the host's only one,
    and reaches the task process only, not what that started; those are in its group,
    which the agent kills (Host._read) when it outlives the host."""
    global _PRCTL, _HOST_PID
    _HOST_PID = os.getpid()
    if not sys.platform.startswith("linux"):
        return  # (macOS has no such call: the host's kill at the agent's EOF stands alone)
    try:
        import ctypes
        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
        # A first call sets up the foreign function (~70 us of allocations): made here
        # once, with a harmless query (PR_GET_DUMPABLE), not in every child.
        _PRCTL(_PR_GET_DUMPABLE, 0)
    except (OSError, AttributeError):
        _PRCTL = None


#: ``prctl(PR_SET_CHILD_SUBREAPER)`` (see gpumesh.worker.procs.adopt_orphans).
_PR_SET_CHILD_SUBREAPER = procs.PR_SET_CHILD_SUBREAPER
def _die_with_host() -> None:
    """In a spare, just forked: have the kernel SIGKILL it when its host dies; if the host
    died already (before the call), exit now. Two syscalls, ~25 us in all with the page
    faults of a first ctypes call in the child (measured on 2 cores, against ~1 ms of CPU
    per fork), paid while the spare waits for its task, off the task's path."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, _SIGKILL)
    if os.getppid() != _HOST_PID:
        os._exit(0)


#: What a spare sends on its socket once it is set up: from then on it leads its own
#: process group (what a timeout or cancel kills) and waits for its task.
SPARE_READY = b"R"


def _fork_spare(fn, ctrl: socket.socket, wake: int, children: set[int], preloads: int) -> None:
    """Fork a task process ahead of its task (a *spare*) and pass the agent its end of the
    spare's socket: ``{"op": "spare", "pid", "preloads"}`` (``preloads``: how many preload
    messages this host had handled; the agent drops a spare forked before its last one).
    The agent then talks to the spare directly: the run message and arguments in, the
    result out; the host only forks, reaps and reports a child that did not exit cleanly.
    A failed fork is reported as ``{"op": "spare_failed", "error"}``."""
    mine, theirs = socket.socketpair()
    try:
        pid = forking.fork()  # (os.fork() less the other threads' at-fork hooks)
    except OSError as e:
        mine.close()
        theirs.close()
        try:
            send_msg(ctrl, {"op": "spare_failed", "error": str(e)[:500]})
        except OSError:
            pass
        return
    if pid == 0:
        mine.close()
        _spare_main(fn, ctrl, wake, theirs)  # never returns
    theirs.close()
    children.add(pid)
    try:
        # (formatted, not json.dumps: see SPARE_REQUEST)
        socket.send_fds(ctrl, [b'{"op": "spare", "pid": %d, "preloads": %d}' % (pid, preloads)],
                        [mine.fileno()])
    except OSError:  # the agent is gone (the main loop sees the EOF next)
        pass
    finally:
        mine.close()


def _spare_main(fn, ctrl: socket.socket, wake: int, sock: socket.socket) -> None:
    """A spare's life: set up everything that does not depend on the task (own session,
    GC off, signal handlers reset, RNGs reseeded), say so, wait for the task on its
    socket, run it, exit. The agent closing the socket first means: exit, unused. A task
    whose run message says ``"keep": true`` (isolation="job") leaves the process waiting
    on the same socket for the job's next task in its slot, until the agent closes it."""
    code = 0
    try:
        os.setsid()  # own process group: a timeout kills everything the task started
        _die_with_host()
        gc.disable()  # a short-lived process: collection would only copy shared pages
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        ctrl.close()
        os.close(wake)
        _reseed_after_fork()
        tempdirs.use_temp_dir(spare_temp_dir(os.getpid()))  # (before its task: off the task's path)
        sock.sendall(SPARE_READY)
        _rehearse(sock)
        while True:
            try:
                run, fds = recv_blob_fds(sock)  # blocks until a task comes
            except EOFError:  # not needed (any more): the agent dropped it, or is gone
                return
            msg = json.loads(run)
            if msg.get("op") == "skip":  # a withdrawn task that had begun: dropped
                continue
            args = None
            if msg.get("ahead"):
                # Sent while this process ran the job's previous task (isolation="job"
                # pipelining, gpumesh.worker.ahead): the agent may have withdrawn it
                # since, with a skip message behind its arguments. Looked for once, here:
                # a skip that comes after this look finds the task begun (its answer
                # says so, and the skip is read, and ignored, as the next message).
                if msg.get("args") is None:
                    args = recv_blob(sock)
                if ahead.skip_waiting(sock, msg.get("task_id")):
                    send_frames(sock, [ahead.SKIPPED_BYTES, b""])
                    continue
            if msg.get("keep") and _PRCTL is not None:
                # Kept for the job: what its tasks orphan stays below it while it lives
                # (gpumesh.worker.strays), not taken up and killed by the zygote.
                _PRCTL(_PR_SET_CHILD_SUBREAPER, 1)
            _run_child(fn, sock, msg, fds, args)
            if not msg.get("keep"):
                return
            # isolation="job": kept for the job's next task in this slot. Long-lived now,
            # so collect again; and the next task reports only modules it imports itself.
            gc.enable()
            if _LOADED is None or len(sys.modules) != len(_LOADED[0]) \
                    or len(sys.path) != len(_LOADED[1]):
                # (only when the task imported something: a set of sys.modules per task
                # cost ~10 us, ~40 us with NumPy loaded; run_task compares lengths first too)
                _snapshot_loaded()
    except BaseException:  # noqa: BLE001 - report nothing more; the exit status speaks
        code = 70
    finally:
        sock.close()
        flush_and_exit(code)


#: A stand-in task for a spare's rehearsal: its run message (as the agent sends one,
#: with no output files) and its arguments, ``(0,)`` and no keywords, as wire frames.
_REHEARSAL_RUN = b'{"op": "run", "task_id": "rehearsal", "keep": false, "result_format": null}'
_REHEARSAL_ARGS: bytes | None = None


def _stand_in(x):
    return x


def _rehearse(sock: socket.socket) -> None:
    """In a spare whose task has not come yet: walk the task's own path once (receive a
    run message and arguments, decode them, call a stand-in function, encode and send its
    result), over a private socket pair, without the user's function.

    A fresh child pays a copy-on-write page fault for each page of the host it first
    writes, and running Python code writes many (reference counts; in 3.11+ the
    interpreter's inline caches in the code objects it runs): ~3-5 us each on a VM,
    hundreds per task. Paid here, while the spare waits, they are off the task's path,
    and its real task finds those pages copied already. Skipped when the task is already
    waiting on ``sock``; never raises (a spare that cannot rehearse just runs colder)."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
        if ready or _REHEARSAL_ARGS is None:
            return
        _walk_task_path()
    except BaseException:  # noqa: BLE001 - a rehearsal's failure changes nothing
        pass


def _walk_task_path() -> None:
    """One rehearsal: the stand-in task over a private socket pair (see :func:`_rehearse`).
    Raises whatever goes wrong."""
    ours, theirs = socket.socketpair()
    try:
        send_frames(theirs, [_REHEARSAL_RUN, _REHEARSAL_ARGS])
        run, fds = recv_blob_fds(ours)
        msg = json.loads(run)
        run_task(_stand_in, ours, msg.get("result_format"), msg.get("args"),
                 msg.get("handoff_dir"), msg.get("handoff_name"), fds, trace=False)
    finally:
        ours.close()
        theirs.close()


#: How many times the host walks the task's path before its first fork (see _warm_host).
HOST_WARM_RUNS = 16


def _warm_host() -> None:
    """In the host, once, before it forks: walk the task's path ``HOST_WARM_RUNS`` times.

    CPython (3.11+) rewrites a function's bytecode in place once it has run a few times,
    specializing each instruction to the types it meets (PEP 659). A child starts with
    the host's code objects as they were at the fork, and the host itself never runs the
    task's path: so every task process ran that path unspecialized, paid for specializing
    it, and lost the work at its exit. Walked here first, every child inherits it done:
    ~5 % less CPU and ~20 fewer page faults per task process ("Thirteenth session" in
    docs/performance.md).
    Stops at the first failure; never raises (the children then just specialize alone)."""
    if _REHEARSAL_ARGS is None:
        return
    for _ in range(HOST_WARM_RUNS):
        try:
            _walk_task_path()
        except BaseException:  # noqa: BLE001 - a warm-up's failure changes nothing
            return


def _prepare_rehearsal() -> None:
    """In the host, once: encode the rehearsal's arguments (see :func:`_rehearse`)."""
    global _REHEARSAL_ARGS
    try:
        from gpumesh import wire
        _REHEARSAL_ARGS = b"".join(bytes(c) for c in wire.dumps(((0,), {})).chunks)
    except Exception:  # noqa: BLE001 - spares then simply skip it
        _REHEARSAL_ARGS = None


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


def _run_child(fn, sock: socket.socket, msg: dict, fds: list[int], args=None) -> None:
    """In a spare that was given its task: run it over its socket (the arguments follow
    the run message there, unless ``msg["args"]`` is a reference, which may name ``fds``:
    gpumesh.payloadref, or ``args``, the frame already read)."""
    if _TRACE:
        tracing.mark("task.start")
    env = msg.get("env")
    if env:
        # The slot's device, e.g. CUDA_VISIBLE_DEVICES=<its GPU>: set before the
        # function runs; CUDA libraries read it when they first initialise CUDA.
        os.environ.update({str(k): str(v) for k, v in env.items()})
    _redirect(1, msg.get("stdout"))
    _redirect(2, msg.get("stderr"))
    run_task(fn, sock, msg.get("result_format"), msg.get("args"), msg.get("handoff_dir"),
             msg.get("handoff_name"), fds, args)


#: In a function host: the directory its task processes' temporary directories go in.
_TMP_ROOT: str | None = None


def spare_temp_dir(pid: int) -> str | None:
    """The temporary directory of the host's task process ``pid``: made by the process as
    it is forked, before its task (:func:`gpumesh.worker.tempdirs.use_temp_dir`), removed by the host as it reaps
    it (:func:`_reap`); an ``isolation="job"`` process keeps its one for the job."""
    return f"{_TMP_ROOT}/p{pid}" if _TMP_ROOT else None


def _reap(ctrl: socket.socket, children: set[int], exits: CleanExits) -> None:
    """Reap exited children; tell the agent of each task process (an idle spare's too)
    that did not exit cleanly: ``{"op": "exited", "pid", "code"}``. A clean exit follows
    a delivered result, or a spare the agent let go.

    Whatever a task process started and left running dies with it: its process group is
    killed as it is reaped (a finished task's, and a kept ``isolation="job"`` process's
    once the agent closes it), as a timeout or cancel kills it. It is killed before the
    reap where ``os.waitid`` can look without reaping: until then the exited process
    keeps its pid, so no new process can have taken its group's id.

    What a task started in a session of its own is not in that group: it ends up below
    the zygote, which kills it (gpumesh.worker.strays)."""
    while True:
        status = None
        try:
            if hasattr(os, "waitid"):
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                pid = info.si_pid if info is not None else 0
            else:  # (macOS) reaped first: a window of microseconds for the pid to be reused
                pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        try:
            os.killpg(pid, signal.SIGKILL)  # its own group (setsid); none if it died before
        except OSError:
            pass
        if status is None:
            try:
                _, status = os.waitpid(pid, 0)  # (exited: does not block)
            except ChildProcessError:
                break
        if pid not in children:  # one the function's own imports started: no report
            continue
        children.discard(pid)
        tempdirs.remove_task_dir(spare_temp_dir(pid))  # (after its result: off its path)
        code = os.waitstatus_to_exitcode(status)
        if code == 0:
            exits.reaped(ctrl, pid)
            continue
        tell_exit(ctrl, pid, code)


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
    """Fork a function host per request; reap them; exit when the agent hangs up.

    It also watches the agent for the script tasks it starts itself (not our children):
    ``{"op": "watch", "pid"}`` while one runs, ``{"op": "unwatch", "pid"}`` once it has
    ended. At the agent's EOF (its death, whatever killed it) the process group of each
    script still watched is killed: a script leads a session of its own, so nothing else
    would end it, and it would run on while its task re-runs elsewhere."""
    # Warm: every host gets these for free (a function blob is a cloudpickle stream).
    import cloudpickle  # noqa: F401
    import gpumesh.wire  # noqa: F401

    hosts: set[int] = set()  # the function hosts forked here and not reaped yet
    signal.signal(signal.SIGCHLD, lambda *_: _reap_all(hosts))
    strays.adopt()
    watched: set[int] = set()
    while True:
        if not select.select([ctrl], [], [], strays.SWEEP_S)[0]:
            strays.sweep(hosts)
            continue
        msg, fds = recv_msg(ctrl)
        if msg is None:
            for pid in watched:
                _kill_group(pid)
            strays.sweep(set(), wait=strays.KILL_ALL_S)  # everything below: the agent is gone
            return
        op = msg.get("op")
        if op in ("watch", "unwatch") and isinstance(msg.get("pid"), int):
            (watched.add if op == "watch" else watched.discard)(msg["pid"])
        elif op == "host" and fds:
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                ctrl.close()
                host = socket.socket(fileno=fds[0])
                code = 0
                try:
                    host_main(host, msg["path"], msg.get("sys_path"), msg.get("tmp"))
                except BaseException:  # noqa: BLE001
                    code = 70
                os._exit(code)
            hosts.add(pid)
            os.close(fds[0])
        else:
            for fd in fds:
                os.close(fd)


def _reap_all(hosts: set[int]) -> None:
    """The zygote reaps every child: its hosts, and the strays it took up and killed."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        hosts.discard(pid)


def main(argv: list[str]) -> None:
    forking.record_hooks()  # before the zygote imports cloudpickle (and, later, preloads)
    for name in SCRUBBED_ENV:
        os.environ.pop(name, None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when we stop
    ctrl = socket.socket(fileno=int(argv[1]))
    zygote_main(ctrl)


if __name__ == "__main__":
    main(sys.argv)
