"""What a worker needs from the operating system, in one place: which task runtime this
Python can run, how a task's process is started in a group of its own, how its whole
process tree is killed, and how an exit status reads.

POSIX: a task's process leads its own session (``start_new_session``), and killing it
is ``killpg(SIGKILL)``: everything the task started dies with it, wherever it was
reparented to. Windows (and any Python without ``os.killpg``): the process starts in a
new process group (so the worker's Ctrl+C does not reach it) and its tree is killed
child-first through ``psutil`` when it is installed, else with ``taskkill /T /F``. Unlike a
Windows job object, a tree walk cannot find a grandchild whose parent already exited.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys

from .. import limits

log = logging.getLogger("gpumesh.worker")

#: The task runtimes (see docs/architecture.md, "Inside a worker").
RUNTIMES = ("fork", "spawn")
#: Environment variable that picks the runtime (``gpumesh join --runtime`` wins over it).
RUNTIME_ENV = "GPUMESH_RUNTIME"

WINDOWS = sys.platform == "win32"
#: What kills a process outright: SIGKILL, or where there is none (Windows) SIGTERM, which
#: ``os.kill`` there turns into TerminateProcess.
_HARD_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)
MACOS = sys.platform == "darwin"
LINUX = sys.platform.startswith("linux")
#: ``prctl`` option: orphaned descendants are re-parented to the caller, not to PID 1
#: (Linux 3.4+; include/uapi/linux/prctl.h).
PR_SET_CHILD_SUBREAPER = 36


#: The variables that cap the threads of the math libraries a task may load (OpenMP,
#: MKL, OpenBLAS, numexpr, Apple's Accelerate), as Dask's nanny and Ray's workers set them.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def thread_env(cores: int | None, slots: int) -> dict[str, str]:
    """The task processes' share of the machine's cores, as :data:`THREAD_VARS` (each
    ``cores // slots``, at least 1): ``--cpu-slots 2`` on 8 cores gives each task 4
    threads, not 8 that would all compete (the lender's machine stays usable). A variable
    the owner set for ``gpumesh join`` is left as it is; nothing when ``cores`` is unknown."""
    if not cores or cores < 1:
        return {}
    share = str(max(1, int(cores) // max(1, slots)))
    return {name: share for name in THREAD_VARS if name not in os.environ}


def fork_missing() -> list[str]:
    """What this Python lacks for the fork runtime (empty: it can run it)."""
    need = [("os.fork", hasattr(os, "fork")), ("os.killpg", hasattr(os, "killpg")),
            ("os.setsid", hasattr(os, "setsid")), ("socket.AF_UNIX", hasattr(socket, "AF_UNIX")),
            ("socket.send_fds", hasattr(socket, "send_fds")),
            ("signal.SIGCHLD", hasattr(signal, "SIGCHLD"))]
    return [name for name, ok in need if not ok]


def choose_runtime(requested: str | None = None) -> tuple[str, str]:
    """The runtime to use and why: ``requested`` (``--runtime``), else ``$GPUMESH_RUNTIME``,
    else the platform's default (``fork`` on Linux, ``spawn`` elsewhere, where forking is
    missing or unsafe once system frameworks are loaded). Raises ``ValueError`` for an
    unknown name, or for ``fork`` where this Python cannot fork."""
    source = "--runtime"
    if not requested:
        requested, source = limits.setting(RUNTIME_ENV), f"${RUNTIME_ENV}"
    if requested:
        name = requested.strip().lower()
        if name not in RUNTIMES:
            raise ValueError(f"{source}={requested!r}: the runtime must be 'fork' or 'spawn'")
        missing = fork_missing()
        if name == "fork" and missing:
            raise ValueError(f"{source}=fork: this Python lacks {', '.join(missing)}; use spawn")
        return name, f"{source}={name}"
    missing = fork_missing()
    if missing:
        return "spawn", f"default here: this Python lacks {', '.join(missing)}"
    if MACOS:
        return "spawn", "default on macOS: forking is unsafe once Apple's frameworks are loaded"
    if not sys.platform.startswith("linux"):
        return "spawn", f"default on {sys.platform}"
    return "fork", "default on Linux"


def group_kwargs() -> dict:
    """``subprocess.Popen`` arguments that put the new process in a group of its own."""
    if hasattr(os, "killpg"):
        return {"start_new_session": True}
    if sys.platform == "win32":  # (WINDOWS, spelled so that type checkers know the platform)
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}  # a POSIX Python without killpg (tests/winsurface)


def kill_tree(pid: int) -> None:
    """Kill the process ``pid`` and everything it started (``SIGKILL`` or the Windows
    equivalent). Never raises; a process already gone is not an error. On Linux that
    includes its descendants in other sessions (found before ``pid`` dies, while they
    are still below it)."""
    if LINUX and hasattr(os, "killpg"):
        strays = descendants(pid)
        _kill_group_or_process(pid)
        for p in strays:
            _kill_group_or_process(p)
        return
    if hasattr(os, "killpg"):
        try:
            os.killpg(pid, signal.SIGKILL)
            return
        except OSError:  # not (yet) the leader of its own group: kill the process alone
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        return
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            tree = root.children(recursive=True) + [root]
        except psutil.Error:
            return
        for p in reversed(tree):  # the parent first: it cannot start anything new then
            try:
                if WINDOWS:
                    p.kill()  # TerminateProcess
                else:
                    os.kill(p.pid, _HARD_KILL)
            except (psutil.Error, OSError):
                pass
        return
    if WINDOWS:
        subprocess.run(["taskkill", "/T", "/F", "/PID", str(pid)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        return
    try:  # no tree to walk: at least the process itself
        os.kill(pid, _HARD_KILL)
    except OSError:
        pass


def _kill_group_or_process(pid: int) -> None:
    if hasattr(os, "killpg"):  # (a POSIX Python without it: tests/winsurface)
        try:
            os.killpg(pid, _HARD_KILL)  # a group (or session) leader: its whole group
            return
        except OSError:  # not the leader of a group: the process alone
            pass
    try:
        os.kill(pid, _HARD_KILL)
    except OSError:
        pass


# ---------------------------------------------------------------- Linux: descendants --
def adopt_orphans() -> bool:
    """Make this process a child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``, as
    Ray's raylet does): a descendant whose parent ends is re-parented to it, not to PID 1,
    so it stays in this process's tree, where :func:`descendants` finds it. The caller
    must then reap such children (they are its own). Returns whether it took effect
    (never elsewhere than on Linux)."""
    if not LINUX:
        return False
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        return prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _state(pid: int) -> tuple[str, int] | None:
    """``(state letter, ppid)`` of ``pid`` from /proc, or None when it is gone. (The name
    field may hold spaces or parentheses: split after the last one.)"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        return fields[0].decode(), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (zombies included), from
    ``/proc/PID/task/TID/children``; where the kernel lacks those files, from one pass
    over every ``/proc/*/stat``. Empty when ``pid`` is gone, and on other systems."""
    if not LINUX:
        return []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                out.extend(int(x) for x in fh.read().split())
        except FileNotFoundError:
            if os.path.isdir(f"/proc/{pid}/task/{tid}"):  # (no CONFIG_PROC_CHILDREN)
                return _children_by_scan(pid)
        except (OSError, ValueError):
            pass
    return out


def _children_by_scan(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _state(int(entry))
            if st is not None and st[1] == pid:
                out.append(int(entry))
    return out


def descendants(pid: int, keep: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """Every live descendant of ``pid`` (children, theirs, ...; zombies left out), not
    entering the subtree of any pid in ``keep``. Linux only (empty elsewhere)."""
    out: list[int] = []
    todo = [pid]
    seen = {pid}
    while todo:
        for c in children(todo.pop()):
            if c in keep or c in seen:
                continue
            seen.add(c)
            st = _state(c)
            if st is None or st[0] == "Z":
                continue
            out.append(c)
            todo.append(c)
    return out


def kill_descendants(pid: int, keep: frozenset[int] | set[int] = frozenset(),
                     wait: float = 0.0) -> int:
    """Kill every descendant of ``pid`` outside the subtrees of ``keep`` (each one's
    process group too, where it leads one: a session a task's child started). With
    ``wait``, look again until none is left alive or ``wait`` seconds passed (a process
    being killed re-parents its children only as it dies). Returns how many were found
    the first time. Linux only (0 elsewhere)."""
    import time
    first = None
    deadline = time.monotonic() + wait
    while True:
        found = descendants(pid, keep)
        if first is None:
            first = len(found)
        for p in found:
            _kill_group_or_process(p)
        if not found or time.monotonic() >= deadline:
            return first
        time.sleep(0.01)


def crash_message(code: int) -> str:
    """The words of a task process that ended without its result, one wording on both
    runtimes: ``the task process was killed by SIGSEGV``, ``the task process exited
    with code 3 before returning a result``."""
    said = describe_exit(code)
    if said.startswith("killed"):
        return f"the task process was {said}"
    return f"the task process {said} before returning a result"


def describe_exit(code: int) -> str:
    """``"killed by SIGSEGV"``, ``"exited with code 3"``, a Windows NTSTATUS in hex."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if WINDOWS and code >= 0xC0000000:
        return f"exited with status 0x{code:08X}"
    return f"exited with code {code}"
