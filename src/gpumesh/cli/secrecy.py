"""Keep tokens out of ``ps``, ``/proc/PID/cmdline`` and ``/proc/PID/environ``.

A token passed as ``--token=...`` or in ``$GPUMESH_TOKEN`` sits in the memory the kernel
shows other local users as this process's command line and environment. Once a command
has read its tokens, :func:`hide` overwrites every copy there with ``*`` (Linux: the
regions are found through ``/proc/self/stat``) and removes the variables from the
environment that child processes inherit. The token was visible between the exec and
this call, and your shell history still has a ``--token`` you typed: prefer
``$GPUMESH_TOKEN`` or the saved config. gpumesh itself never puts a token on a command
line; it hands tokens to the processes it starts through their environment.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: Environment variables holding credentials (removed after reading).
SECRET_VARS = ("GPUMESH_TOKEN", "GPUMESH_WORKER_TOKEN", "GPUMESH_METRICS_TOKEN")


def _regions() -> list[tuple[int, int]]:
    """``[(start, end)]`` of the argv and environ memory of this process (Linux)."""
    with open("/proc/self/stat", "rb") as fh:
        stat = fh.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    # after "pid (comm) ", field 3 (state) is index 0: arg_start..env_end are 48..51
    arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
    return [(arg_start, arg_end), (env_start, env_end)]


def hide(*secrets: str | None) -> bool:
    """Overwrite ``secrets`` in this process's visible command line and environment and
    drop :data:`SECRET_VARS` from ``os.environ``. Best effort; returns whether the
    memory could be rewritten (False off Linux)."""
    for name in SECRET_VARS:
        os.environ.pop(name, None)
    needles = [s.encode("utf-8", "surrogateescape") for s in secrets if s]
    if not needles or not sys.platform.startswith("linux"):
        return False
    try:
        regions = _regions()
        for start, end in regions:
            if not (0 < start < end) or end - start > 16 * 2**20:
                continue
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
    except (OSError, ValueError, IndexError):
        return False
    return True
