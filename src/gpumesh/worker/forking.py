"""A function host's fork: libc's ``fork`` plus only the at-fork hooks a process with one
thread needs, for about half of what ``os.fork()`` costs the child.

``os.fork()`` runs CPython's after-fork procedure in the child, and with it every hook
registered with ``os.register_at_fork``. Those of ``threading`` and ``logging`` rebuild
the state of the parent's *other* threads and of locks they might have held. Every
function host imports both (cloudpickle imports logging, which imports threading), and
their Python code writes to pages of the host that each child then copies: ~180 page
faults, ~0.5 ms of CPU per task on a 2-core VM, close to half of a fork's cost in the
child (docs/performance.md, "Twelfth session: a cheaper fork"). A function host runs one
thread (it must: forking a process with several is unsafe), and for it their work is
void.

:func:`fork` calls libc's ``fork`` with the GIL held (``ctypes.PyDLL``) and runs the
hooks registered since :func:`record_hooks` except those of ``threading`` and
``logging``, in CPython's order (before-hooks last registered first, the others first
registered first; one that raises is reported and skipped, as CPython does). Python's
``random`` registers one of them when it is imported: each task process still gets
its own seed. Where the premise or the interpreter internals it rests on are not known
to hold, :func:`fork` is ``os.fork()``: another Python thread running when
:func:`prepare` last looked, not CPython with a GIL on Linux, a version outside
3.10-3.13 (each checked by the test suite), or :func:`record_hooks` never called in this
process or an ancestor.

What :func:`fork` does is worked out by :func:`prepare`, not at each fork: between two
forks every object the forking process touches costs it a copy-on-write fault (its last
child shares its pages), so the fork itself touches as few as it can.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

#: Modules whose at-fork hooks only serve threads other than the forking one.
THREAD_ONLY = frozenset({"threading", "logging"})

#: ``(before, after_in_parent, after_in_child)`` of each ``os.register_at_fork`` call
#: made since :func:`record_hooks` (None where that call gave none).
_hooks: list[tuple[Callable | None, Callable | None, Callable | None]] = []
_libc_fork: Any = None
#: What :func:`fork` runs, from :func:`prepare`: ``(libc fork, before-hooks in the order
#: to call them, after-in-parent hooks, after-in-child hooks)``; None: ``os.fork()``.
_plan: tuple[Any, tuple, tuple, tuple] | None = None


def supported() -> bool:
    """Whether this interpreter is one :func:`fork` may bypass ``os.fork()`` on."""
    return (sys.platform == "linux" and sys.implementation.name == "cpython"
            and (3, 10) <= sys.version_info[:2] <= (3, 13)
            and getattr(sys, "_is_gil_enabled", lambda: True)())


def record_hooks() -> None:
    """Note every ``os.register_at_fork`` call from now on (each still registers as
    before, for code that calls ``os.fork()`` itself), and get libc's ``fork`` ready.
    Call once, early, in the process that forks (the zygote: hosts inherit both). Hooks
    registered before the call are not run by :func:`fork`: call it before importing
    anything but the standard library's ``threading`` and ``logging``."""
    global _libc_fork
    if _libc_fork is not None or not supported():
        return
    try:
        import ctypes
        libc_fork = ctypes.PyDLL(None, use_errno=True).fork
    except (OSError, AttributeError):
        return
    libc_fork.restype = ctypes.c_int
    libc_fork.argtypes = []
    register = os.register_at_fork

    def register_at_fork(**hooks: Callable) -> None:
        register(**hooks)  # (raises for what the real one refuses; nothing noted then)
        _hooks.append((hooks.get("before"), hooks.get("after_in_parent"),
                       hooks.get("after_in_child")))

    register_at_fork.__doc__ = register.__doc__
    os.register_at_fork = register_at_fork  # type: ignore[assignment]
    _libc_fork = libc_fork


def prepare() -> None:
    """Work out what :func:`fork` does until the next call: call it after anything that
    may register hooks or start threads (loading the function, each preload)."""
    global _plan
    threading = sys.modules.get("threading")
    if _libc_fork is None or (threading is not None and threading.active_count() > 1):
        _plan = None
        return
    hooks = [h for h in _hooks if not any(_thread_only(f) for f in h)]
    _plan = (_libc_fork, tuple(b for b, _, _ in reversed(hooks) if b is not None),
             tuple(p for _, p, _ in hooks if p is not None),
             tuple(c for _, _, c in hooks if c is not None))


def fork() -> int:
    """Fork this process (see the module's docstring): 0 in the child, the child's pid
    in the parent, as ``os.fork()``. Raises ``OSError`` when the fork fails."""
    plan = _plan
    if plan is None:
        return os.fork()
    libc_fork, befores, parents, children = plan
    for hook in befores:
        _run(hook)
    pid = libc_fork()
    if pid < 0:
        import ctypes
        err = ctypes.get_errno()
        for hook in parents:
            _run(hook)
        raise OSError(err, os.strerror(err))
    for hook in children if pid == 0 else parents:
        _run(hook)
    return pid


def _thread_only(hook: Callable | None) -> bool:
    return hook is not None and getattr(hook, "__module__", None) in THREAD_ONLY


def _run(hook: Callable) -> None:
    try:
        hook()
    except Exception:  # noqa: BLE001 - as CPython's own at-fork calls: report, go on
        traceback.print_exc()
