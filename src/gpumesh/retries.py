"""``@accelerate(m, retries=N, retry_on=(OSError, ...))``: re-run an item whose function
raised one of the named exception types.

By default a raised exception is the task's answer: only lost workers and crashed task
processes are retried, by the coordinator, up to ``MAX_ATTEMPTS``. With ``retry_on``
the caller says which of its own exceptions are worth another attempt (a flaky file
system, a network blip): an item whose function raised such an exception, or one of
its subclasses, runs again, at most ``retries`` times, and on the mesh on another worker
when one can run it. A result that was delivered is never re-run: only a failure that is
about to be retried is held back from the caller.

Types travel by name (``module.Qualname``, builtins bare, as
:func:`type_name` writes them); the task reports the names of its
exception's classes and the coordinator matches them, so nothing is unpickled there.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .errors import MeshError, TaskCrashed
from .limits import MAX_RETRIES, MAX_RETRY_TYPES

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_<>][A-Za-z0-9_<>]*)*\Z")


def type_name(t: type) -> str:
    """``module.Qualname`` of a type (builtins without the module)."""
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def check(retries: Any, retry_on: Any) -> tuple[int, tuple[type, ...]]:
    """Validate the decorator's ``retries`` and ``retry_on``; returns ``(retries, types)``
    (``(0, ())`` when neither is given).

    Raises ``TypeError`` for a ``retries`` that is not an int or a ``retry_on`` that is not
    an exception class or a tuple/list of them (subclasses of ``Exception``: a
    ``KeyboardInterrupt`` or ``SystemExit`` in a task is never retried), and
    ``ValueError`` for ``retries`` outside 1..MAX_RETRIES, too many types, a type that
    would never match (gpumesh's own errors but TaskCrashed), or one of the two without
    the other.
    """
    if retries is None and retry_on is None:
        return 0, ()
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)):
        raise TypeError(f"retries must be a whole number of re-runs, got {retries!r}")
    if retries is not None and not 1 <= retries <= MAX_RETRIES:
        # (0 re-runs is no retry_on at all: leave both out)
        raise ValueError(f"retries must be between 1 and {MAX_RETRIES} (re-runs of an item), "
                         f"got {retries}")
    if isinstance(retry_on, type):
        retry_on = (retry_on,)
    if retry_on is not None:
        if not isinstance(retry_on, (tuple, list)):
            raise TypeError(f"retry_on must be an exception class or a tuple of them, got {retry_on!r}")
        bad = [t for t in retry_on if not (isinstance(t, type) and issubclass(t, Exception))]
        if bad:
            raise TypeError(f"retry_on must name exception classes (subclasses of Exception), "
                            f"got {bad[0]!r}")
        if len(retry_on) > MAX_RETRY_TYPES:
            raise ValueError(f"retry_on names {len(retry_on)} types; at most {MAX_RETRY_TYPES}")
        never = [t for t in retry_on if _never_matches(t)]
        if never:
            raise ValueError(
                f"retry_on=({never[0].__name__},) would never match: gpumesh raises it at the "
                "caller, the function never does (only TaskCrashed, a task process that died, is "
                "retried so); to retry a task that hangs, let the function raise its own "
                "exception on a deadline (e.g. a socket timeout) and name that")
    if not retry_on:
        raise ValueError(f"retries={retries} needs retry_on=(ExceptionType, ...): the exceptions "
                         "worth another attempt (a raised exception is otherwise the answer; "
                         "retry_on=(Exception,) retries any)")
    if not retries:
        raise ValueError("retry_on= needs retries=N (1 or more): how many times to re-run an item")
    return retries, tuple(retry_on)


def _never_matches(t: type) -> bool:
    """gpumesh's own errors, which only the caller sees (TaskTimeout, WorkerLost, their
    bases...), but TaskCrashed itself, which the coordinator matches by its name when a
    task process dies."""
    return issubclass(t, MeshError) and t is not TaskCrashed


def to_meta(retries: int, types: tuple[type, ...]) -> dict:
    """What a job's submit carries: ``{"retries": N, "retry_on": [type names]}``."""
    return {"retries": retries, "retry_on": [type_name(t) for t in types]}


def check_meta(retries: Any, retry_on: Any) -> tuple[int, list[str]] | None:
    """The coordinator's check of a submit's ``retries`` and ``retry_on`` fields; None
    when neither is given. Raises ``ValueError`` naming what is wrong."""
    if retries is None and retry_on is None:
        return None
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 < retries <= MAX_RETRIES:
        raise ValueError(f"field 'retries' must be a whole number from 1 to {MAX_RETRIES}")
    if (not isinstance(retry_on, list) or not 0 < len(retry_on) <= MAX_RETRY_TYPES
            or not all(isinstance(n, str) and len(n) <= 200 and _NAME.match(n) for n in retry_on)):
        raise ValueError(f"field 'retry_on' must be a list of 1 to {MAX_RETRY_TYPES} exception "
                         "type names")
    return retries, list(dict.fromkeys(retry_on))


def call_with_retries(fn: Callable, args: tuple, kwargs: dict, retries: int,
                      types: tuple[type[BaseException], ...]) -> Any:
    """``fn(*args, **kwargs)`` here, re-run up to ``retries`` times while it raises one of
    ``types`` (the local fallback's version of what the coordinator does)."""
    for attempt in range(retries + 1):
        try:
            return fn(*args, **kwargs)
        except types:
            if attempt == retries:
                raise
