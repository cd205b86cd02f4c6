"""A Python that looks like Windows' to gpumesh (tests/integration/test_winsurface.py).

Put this directory on ``PYTHONPATH`` and every interpreter started with it (coordinator,
workers, task processes, caller) loses what CPython on Windows does not have:

* ``os``: fork, forkpty, killpg, setsid, getsid, getpgid, setpgid, getuid, geteuid,
  getgid, getegid, memfd_create, register_at_fork;
* ``socket``: AF_UNIX, SCM_RIGHTS, send_fds, recv_fds (no descriptor passing), and
  ``socketpair`` is a TCP pair over loopback, as on Windows;
* ``signal``: SIGKILL, SIGSTOP, SIGCONT, SIGALRM, SIGCHLD, SIGHUP, SIGQUIT, SIGUSR1/2,
  alarm, setitimer, getitimer, siginterrupt, pause;
* ``fcntl``, ``resource``, ``pwd``, ``grp``, ``termios`` (and ``uvloop``, which has no
  Windows build) cannot be imported; ``msvcrt.locking`` exists (over flock).

The standard library's asyncio event loop keeps the full ``signal`` module, and psutil is imported first,
with its Linux backend whole (on Windows both use other backends that need none of it). And, as on Windows, ``os.kill(pid, SIGTERM)`` and ``Popen.kill()`` end a process outright
(TerminateProcess does not ask), so code cannot lean on SIGTERM being catchable.

What it proves: gpumesh's code paths make no call Windows would refuse. What it does not:
the real Windows behaviours (paths, consoles, the loader, antivirus, job objects, ``spawn``
of a real Windows interpreter); those are verified on Windows only.
"""

import asyncio.unix_events
import os
import signal
import socket
import subprocess
import sys
import types

_real_kill = os.kill
# The standard library's own POSIX code (asyncio's unix event loop here; Windows' Python
# runs its proactor loop instead) keeps the whole signal module: only what gpumesh and
# user code reach through ``signal`` looks like Windows.
_full_signal = types.ModuleType("signal")
_full_signal.__dict__.update(signal.__dict__)
asyncio.unix_events.signal = _full_signal
try:  # psutil loads its Linux backend now, while it is whole (Windows has its own backend)
    import psutil  # noqa: F401
except ImportError:
    pass

for _name in ("fork", "forkpty", "killpg", "setsid", "getsid", "getpgid", "setpgid", "getuid",
              "geteuid", "getgid", "getegid", "memfd_create", "register_at_fork"):
    if hasattr(os, _name):
        delattr(os, _name)

for _name in ("AF_UNIX", "SCM_RIGHTS", "send_fds", "recv_fds", "CMSG_LEN", "CMSG_SPACE"):
    if hasattr(socket, _name):
        delattr(socket, _name)

_TERM = int(signal.SIGTERM)
for _name in ("SIGKILL", "SIGSTOP", "SIGCONT", "SIGALRM", "SIGCHLD", "SIGHUP", "SIGQUIT",
              "SIGUSR1", "SIGUSR2", "alarm", "setitimer", "getitimer", "siginterrupt", "pause"):
    if hasattr(signal, _name):
        delattr(signal, _name)


def _kill(pid, sig):
    """Windows: any signal but CTRL_C/CTRL_BREAK is TerminateProcess (here: SIGKILL)."""
    if int(sig) == _TERM:
        sig = 9
    return _real_kill(pid, sig)


os.kill = _kill


def _popen_kill(self):
    self.send_signal(_TERM)


subprocess.Popen.kill = _popen_kill


def _socketpair(family=socket.AF_INET, type=socket.SOCK_STREAM, proto=0):
    """As Windows' socket.socketpair: two connected TCP sockets on loopback."""
    if family != socket.AF_INET:
        raise ValueError("only AF_INET is supported here (this is Windows' surface)")
    with socket.socket(family, type, proto) as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        a = socket.socket(family, type, proto)
        try:
            a.connect(lsock.getsockname())
            b, _ = lsock.accept()
        except BaseException:
            a.close()
            raise
    return a, b


socket.socketpair = _socketpair

#: POSIX-only modules, and uvloop (not built for Windows; uvicorn[standard] skips it there).
_MISSING = {"fcntl", "resource", "pwd", "grp", "termios", "uvloop"}

import fcntl as _fcntl  # noqa: E402 - kept privately, for the msvcrt stand-in below

#: Windows' msvcrt.locking, which gpumesh.oslock uses there: a stand-in over flock (a lock
#: held by the open file, dropped when it closes or the process ends, as on Windows).
msvcrt = types.ModuleType("msvcrt")
msvcrt.LK_UNLCK, msvcrt.LK_LOCK, msvcrt.LK_NBLCK, msvcrt.LK_RLCK, msvcrt.LK_NBRLCK = 0, 1, 2, 3, 4


def _locking(fd, mode, nbytes):
    if mode == msvcrt.LK_UNLCK:
        _fcntl.flock(fd, _fcntl.LOCK_UN)
        return
    flags = _fcntl.LOCK_EX | (_fcntl.LOCK_NB if mode in (msvcrt.LK_NBLCK, msvcrt.LK_NBRLCK) else 0)
    try:
        _fcntl.flock(fd, flags)
    except BlockingIOError:
        raise PermissionError(13, "Permission denied") from None  # what msvcrt raises


msvcrt.locking = _locking
sys.modules["msvcrt"] = msvcrt


class _NotOnWindows:
    """A meta path finder that makes the POSIX-only modules unimportable."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in _MISSING:
            raise ModuleNotFoundError(f"No module named {name!r} (tests/winsurface)", name=name)
        return None


sys.meta_path.insert(0, _NotOnWindows)
for _name in _MISSING:
    sys.modules.pop(_name, None)
os.environ["GPUMESH_WINSURFACE"] = "1"
