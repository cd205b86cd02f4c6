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
    if WINDOWS:
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}  # a POSIX Python without killpg (tests/winsurface)


def kill_tree(pid: int) -> None:
    """Kill the process ``pid`` and everything it started (``SIGKILL`` or the Windows
    equivalent). Never raises; a process already gone is not an error."""
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
