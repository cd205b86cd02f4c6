"""Keep tokens out of ``ps``, ``/proc/PID/cmdline`` and ``/proc/PID/environ``.

A token passed as ``--token=...`` or in ``$GPUMESH_TOKEN`` sits in the memory the kernel
shows other local users as this process's command line and environment. Once a command
has read its tokens, :func:`hide` overwrites every copy there with ``*`` and removes the
variables from the environment that child processes inherit:

* Linux: the regions are the kernel's own bounds, read from ``/proc/self/stat``;
* macOS: ``ps`` (``sysctl KERN_PROCARGS2``) reads the argument area ``exec`` laid out at
  the top of the stack, argv strings then environment strings; its bounds come from the C
  runtime's ``_NSGetArgv`` and ``_NSGetEnviron`` (the way PostgreSQL's ps_status clobbers
  argv there);
* elsewhere nothing is overwritten (``hide`` returns False).

The token was visible between the exec and this call, and your shell history still has a
``--token`` you typed: prefer ``$GPUMESH_TOKEN`` or the saved config. gpumesh itself never
puts a token on a command line; it hands tokens to the processes it starts through their
environment.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: Environment variables holding credentials (removed after reading).
SECRET_VARS = ("GPUMESH_TOKEN", "GPUMESH_WORKER_TOKEN", "GPUMESH_METRICS_TOKEN")
#: Largest argument area looked at (bytes); Linux's ARG_MAX is 2 MiB, macOS's 1 MiB.
MAX_REGION_BYTES = 16 * 2**20
#: Padding allowed between two strings of the macOS argument area (alignment).
_MAX_GAP_BYTES = 64


def _linux_regions() -> list[tuple[int, int]]:
    """``[(start, end)]`` of the argv and environ memory of this process (Linux)."""
    with open("/proc/self/stat", "rb") as fh:
        stat = fh.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    # after "pid (comm) ", field 3 (state) is index 0: arg_start..env_end are 48..51
    arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
    return [(arg_start, arg_end), (env_start, env_end)]


def _darwin_regions(libc=None) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the argument area (macOS): the run of argv and environment
    strings that starts at ``argv[0]`` and continues without a gap (exec lays them out
    back to back). Only strings the C runtime points at are read, and the run stops at the
    first gap, so nothing outside that mapped area is touched. A variable set after
    start-up lives on the heap, apart from the area, and ``ps`` does not show it."""
    libc = ctypes.CDLL(None) if libc is None else libc
    libc._NSGetArgc.restype = ctypes.POINTER(ctypes.c_int)
    libc._NSGetArgv.restype = ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p))
    libc._NSGetEnviron.restype = ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p))
    argc = libc._NSGetArgc().contents.value
    argv = libc._NSGetArgv().contents
    strings = [argv[i] for i in range(argc) if argv[i]]
    if not strings:
        return []
    start = strings[0]
    environ = libc._NSGetEnviron().contents
    i = 0
    while environ[i] and i < 65536:
        strings.append(environ[i])
        i += 1
    end = start
    for p in sorted(p for p in set(strings) if p >= start):
        if p > end + _MAX_GAP_BYTES or p - start > MAX_REGION_BYTES:
            break
        end = max(end, p + len(ctypes.string_at(p)) + 1)
    return [(start, end)]


def _regions() -> list[tuple[int, int]]:
    if sys.platform.startswith("linux"):
        return _linux_regions()
    if sys.platform == "darwin":
        return _darwin_regions()
    return []


def overwrite(regions: list[tuple[int, int]], needles: list[bytes]) -> bool:
    """Replace every occurrence of each of ``needles`` in the memory ``regions`` with
    ``*`` of the same length. Returns whether any region could be examined."""
    examined = False
    for start, end in regions:
        if not (0 < start < end) or end - start > MAX_REGION_BYTES:
            continue
        examined = True
        data = bytearray(ctypes.string_at(start, end - start))
        changed = False
        for needle in needles:
            pos = data.find(needle)
            while pos >= 0:
                data[pos:pos + len(needle)] = b"*" * len(needle)
                changed = True
                pos = data.find(needle, pos + len(needle))
        if changed:
            ctypes.memmove(start, bytes(data), len(data))
    return examined


def hide(*secrets: str | None) -> bool:
    """Overwrite ``secrets`` in this process's visible command line and environment and
    drop :data:`SECRET_VARS` from ``os.environ``. Best effort; returns whether the memory
    could be rewritten (Linux and macOS; False elsewhere, or without a secret)."""
    needles = [s.encode("utf-8", "surrogateescape") for s in secrets if s]
    done = False
    if needles:
        try:
            # Before the variables are unset: on macOS the area's bounds come from the
            # environment's own pointers.
            done = overwrite(_regions(), needles)
        except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no _NSGetArgv
            done = False
    for name in SECRET_VARS:
        os.environ.pop(name, None)
    return done
