"""Turning user calls into task arguments and task results back into values or errors.

Pure functions, shared by every backend and by local execution, so a call means the same
thing wherever it runs.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import wire
from ..errors import (Cancelled, RemoteError, RemoteTraceback, TaskCrashed, TaskFailed,
                      TaskTimeout, WorkerLost)

#: Keys of a ``.map`` item that are scheduling hints, not arguments (spec: "a payload's
#: gpu_memory_mb hint"; ``cost`` weighs a task for the scheduler). Removed before the
#: call unless the function's signature names them.
HINT_KEYS = ("cost", "gpu_memory_mb")

Call = tuple[tuple, dict]


def explicit_params(fn: Callable) -> set[str]:
    """Names a function takes as named parameters (not ``*args``/``**kwargs``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set()
    return {p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def map_items(fn: Callable, items: Iterable[Any]) -> tuple[list[Call], list[dict]]:
    """Normalise ``.map`` items to calls, splitting off scheduling hints.

    An item that is a mapping is keyword arguments; a tuple is positional arguments; any
    other value is the single positional argument. Returns ``(calls, hints)`` with one
    ``{"cost": float, "gpu_memory_mb": float}`` (keys present only when given) per call.
    Raises ``TypeError`` for a hint that is not a number.
    """
    named = explicit_params(fn)
    calls: list[Call] = []
    hints: list[dict] = []
    for item in items:
        hint: dict = {}
        if isinstance(item, Mapping):
            kwargs, hint = split_hints(named, item, ".map item")
            calls.append(((), kwargs))
        elif isinstance(item, tuple):
            calls.append((item, {}))
        else:
            calls.append(((item,), {}))
        hints.append(hint)
    return calls, hints


def split_hints(named: set[str], kwargs: Mapping, what: str = "call") -> tuple[dict, dict]:
    """``(kwargs without the hint keys, hints)`` for one call's keyword arguments.

    A hint key the function names as a parameter stays an argument (and still counts
    as a hint when it is a number). Raises ``TypeError`` for a hint that is not a
    number >= 0. A single call ``f(x, gpu_memory_mb=6000)`` and a ``.map`` item
    ``{"x": x, "gpu_memory_mb": 6000}`` mean the same thing.
    """
    kwargs = dict(kwargs)
    hint: dict = {}
    for key in HINT_KEYS:
        if key in kwargs and key not in named:
            value = kwargs.pop(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise TypeError(f"{what} hint {key!r} must be a number >= 0, got {value!r}")
            hint[key] = float(value)
        elif key in kwargs and isinstance(kwargs[key], (int, float)) and not isinstance(kwargs[key], bool):
            hint[key] = float(kwargs[key])
    return kwargs, hint


def decode_result(item: dict, payload: memoryview | None, strict: bool = False) -> Any:
    """A result entry from the coordinator -> the value, or raise what the task raised.

    ``strict``: the payload is JSON (see :mod:`gpumesh.strict`) and nothing is unpickled;
    a payload that is not JSON raises :class:`~gpumesh.errors.TaskFailed`.
    """
    if item["state"] == "done":
        if strict:
            from ..strict import NotJSON, decode
            try:
                return decode(payload if payload is not None else b"")
            except NotJSON as e:
                raise TaskFailed(f"{e} (task {item.get('task_id')} on worker {item.get('worker')})",
                                 item.get("task_id"), item.get("worker")) from None
        return wire.loads(payload)
    raise failure(item, None if strict else payload)


def failure(item: dict, payload: memoryview | None) -> BaseException:
    """The exception that stands for a failed task at the caller (``payload``: the
    pickled exception, or None to build a :class:`RemoteError` from its description)."""
    err = item.get("error") or {}
    kind = err.get("kind", "")
    message = err.get("message", "the task failed")
    tb = err.get("traceback", "")
    task_id, worker = item.get("task_id"), err.get("worker") or item.get("worker")
    where = f" (task {task_id} on worker {worker})" if worker else f" (task {task_id})"
    if err.get("stderr_tail") and kind != "raised":
        where += "\n--- last lines the task wrote to stderr ---\n" + err["stderr_tail"].rstrip()
    if kind == "raised" and payload is not None and payload.nbytes:
        try:
            exc = wire.loads(payload)
        except BaseException:  # noqa: BLE001 - fall through to a RemoteError that keeps the text
            exc = None
        if isinstance(exc, BaseException):
            cause = RemoteTraceback(tb)
            exc.__cause__ = cause
            if sys.version_info >= (3, 11):
                exc.add_note(f"[gpumesh] raised on the mesh{where}; remote traceback above")
            return exc
    if kind == "missing_module":  # no worker had it: raised as itself, naming them
        exc = ModuleNotFoundError(message + where, name=err.get("module"))
        if tb:
            exc.__cause__ = RemoteTraceback(tb)
        return exc
    if kind == "timeout":
        return TaskTimeout(message + where)
    if kind == "crashed":
        return TaskCrashed(message + where, task_id, worker)
    if kind == "lost":
        return WorkerLost(message + where, task_id, worker)
    if kind == "cancelled":
        return Cancelled(message + where, task_id, worker)
    if kind in ("raised", "unpickle", "result_unpicklable", "exit", "result_not_json"):
        exc = RemoteError(err.get("type", "Exception"), message, tb, task_id, worker)
        if tb:
            exc.__cause__ = RemoteTraceback(tb)
        return exc
    return TaskFailed(f"{message}{where}", task_id, worker)
