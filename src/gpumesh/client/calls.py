"""Turning user calls into task arguments and task results back into values or errors.

Pure functions, shared by every backend (the native coordinator, the engines and the inline
one that runs calls here), so a call means the same thing wherever it runs.
"""

from __future__ import annotations

import inspect
import itertools
import linecache
import platform
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import limits, wire
from ..errors import RemoteTraceback, TaskFailed, TaskTimeout
from ..namespaces import global_names
from ..protocol import FailureKind, ResultItem, failure_exception, timeout_message
from ..versions import python_minor

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


def read_input(items: Iterable[Any], who: str, what: str = "items") -> list[Any]:
    """A batch's input as a list. It is read whole before anything is submitted (as
    ``multiprocessing.Pool.imap`` and ``Executor.map`` read theirs), but never past one
    item more than a job may carry (``MAX_TASKS_PER_JOB``): an endless iterator
    (``itertools.count()``) would otherwise grow this process's memory until the machine
    gives out. ``ValueError`` then, naming ``who`` (".map()") and the limit."""
    limit = limits.MAX_TASKS_PER_JOB
    out = list(itertools.islice(items, limit + 1))
    if len(out) > limit:
        raise ValueError(
            f"{who} got more than {limit:,} {what}, the most one job may carry "
            f"(MAX_TASKS_PER_JOB); it reads its whole input before it submits anything, so it "
            f"stopped reading there (an endless iterator such as itertools.count() cannot be "
            f"mapped). Split the input into batches of at most {limit:,} (itertools.islice)")
    return out


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
    taken: set[str] = set()  # hint keys taken out of the items
    for item in items:
        hint: dict = {}
        if isinstance(item, Mapping):
            kwargs, hint = split_hints(named, item, ".map item")
            taken.update(k for k in HINT_KEYS if k in item and k not in kwargs)
            calls.append(((), kwargs))
        elif isinstance(item, tuple):
            calls.append((item, {}))
        else:
            calls.append(((item,), {}))
        hints.append(hint)
    if taken and _takes_var_keywords(fn):
        # A **kwargs function gets every other key: a data column named "cost" would go
        # missing without a word (a fresh user's did).
        from .pipeline import notice
        keys = " and ".join(repr(k) for k in sorted(taken))
        notice(f"{getattr(fn, '__qualname__', 'the function')}: the .map items' {keys} "
               f"went to the scheduler as a hint, not to its **kwargs; to get it too, name it "
               f"as a parameter (def f(..., {sorted(taken)[0]}=None, **rest))")
    return calls, hints


def _takes_var_keywords(fn: Callable) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def split_hints(named: set[str], kwargs: Mapping, what: str = "call") -> tuple[dict, dict]:
    """``(kwargs without the hint keys, hints)`` for one call's keyword arguments.

    A hint key the function names as a parameter stays an argument (and still counts
    as a hint when it is a number). Raises ``TypeError`` for a hint that is not a
    number, ``ValueError`` for one below 0 (or NaN). A single call ``f(x, gpu_memory_mb=6000)`` and a ``.map`` item
    ``{"x": x, "gpu_memory_mb": 6000}`` mean the same thing.
    """
    kwargs = dict(kwargs)
    hint: dict = {}
    for key in HINT_KEYS:
        if key in kwargs and key not in named:
            value = kwargs.pop(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{what} hint {key!r} must be a number >= 0, got {value!r}")
            if not value >= 0:  # (NaN too)
                raise ValueError(f"{what} hint {key!r} must be a number >= 0, got {value!r}")
            hint[key] = float(value)
        elif key in kwargs and isinstance(kwargs[key], (int, float)) and not isinstance(kwargs[key], bool):
            hint[key] = float(kwargs[key])
    return kwargs, hint


#: How much of a failed item's arguments its error quotes (characters).
ARGS_TEXT_CHARS = 160


def keep_going(via: str = ".map()", stopped: str = "the batch's other tasks were cancelled") -> str:
    """The hint on the error that stopped a batch: what happened to the other items, and
    how to keep their results instead."""
    return (f"{stopped}; pass return_exceptions=True to {via} to run every item and get each "
            "failure in its place in the results")


def describe_call(call: Call | None, limit: int = ARGS_TEXT_CHARS) -> str:
    """A call's arguments as a short text: ``lr=0.5, epochs=10`` (reprs shortened)."""
    if call is None:
        return ""
    import reprlib
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlist, r.maxdict, r.maxlevel = 40, 40, 4, 4, 2
    args, kwargs = call
    text = ", ".join([r.repr(a) for a in args] + [f"{k}={r.repr(v)}" for k, v in kwargs.items()])
    return text if len(text) <= limit else text[:limit - 3] + "..."


def where(item: ResultItem, call: Call | None = None, n: int = 1, name: str | None = None,
          hostname: str | None = None, attempt: bool = True) -> str:
    """Where a task failed, for its error: the ``.map`` item (index, the call with its
    arguments), the worker (hostname and id), the attempt and the task id, as far as
    they are known: ``.map item 7 of 20, train(lr=0.5), on worker laptop-a (0afecb2d),
    attempt 1, task 1f2be03a5020``."""
    err = item.error or {}
    index, task_id = item.index, item.task_id
    named: str | None = task_id  # the task id at the end, unless the text starts with it
    worker, host = err.get("worker") or item.worker, err.get("hostname") or hostname
    shown = f"{name or 'the function'}({describe_call(call)})" if call is not None else ""
    on = ""
    if worker:
        on = f"on worker {host} ({worker})" if host and host != worker else f"on worker {worker}"
    # Parts joined by ", " (never a doubled or trailing comma, whatever is unknown); the
    # worker follows a lone call or task with a space: "f(3) on worker w".
    if n > 1:
        parts = [f".map item {index} of {n}", shown, on]
    else:
        if call is None:
            shown, named = f"task {task_id}", None  # named once, first
        parts = [f"{shown} {on}".strip()]
    if attempt and err.get("attempt"):
        parts.append(f"attempt {err['attempt']}")
    if named:
        parts.append(f"task {named}")
    return ", ".join(p for p in parts if p)


def decode_result(item: ResultItem, payload: memoryview | None, strict: bool = False, *,
                  call: Call | None = None, n: int = 1, hint: str = "", name: str | None = None,
                  about_worker: Callable[[str], Mapping | None] | None = None) -> Any:
    """A result of a coordinator's results page and its payload frame (None: none) -> the
    value, or raise what the task raised. A value that cannot be unpickled here raises
    what unpickling raised (``ModuleNotFoundError``, ``TypeError``...), with a note that
    says where the task ran and why (``about_worker``: looks a worker up by id for that
    note; see :func:`_not_rebuilt`).

    ``strict``: the payload is JSON (see :mod:`gpumesh.strict`) and nothing is unpickled;
    a payload that is not JSON raises :class:`~gpumesh.errors.TaskFailed`. ``call``
    (the item's arguments), ``n`` (the batch size), ``hint`` and ``name`` (the
    function's) only word the error (see :func:`failure`).
    """
    __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
    if item.state == "done":
        if strict:
            from ..strict import NotJSON, decode
            try:
                return decode(payload if payload is not None else b"")
            except NotJSON as e:
                raise TaskFailed(f"{e} (task {item.task_id} on worker {item.worker})",
                                 item.task_id, item.worker) from None
        worker: Mapping = {}
        if about_worker is not None and item.worker and payload is not None and wire.holds_code(payload):
            # Bytecode of another minor version may load without a word and crash this
            # interpreter when run (3.11 and 3.12 build code objects alike): refused.
            worker = about_worker(item.worker) or {}
            theirs = python_minor(worker.get("python") or "?")
            if theirs and theirs != python_minor():
                raise TaskFailed(
                    f"{where(item, call, n, name, worker.get('hostname'))}: the task returned "
                    f"a function, lambda or class made inside it, whose bytecode is Python "
                    f"{theirs}'s; this process runs Python {platform.python_version()}, where "
                    f"it could crash the interpreter, so it is not loaded (the task is not run "
                    f"again). Return plain data, or call from Python {theirs}"
                    + (f"; {hint}" if hint else ""), item.task_id, item.worker)
        try:
            return wire.loads(payload)  # type: ignore[arg-type]  # (a done result has one)
        except Exception as e:  # noqa: BLE001 - said where and why, then raised as itself
            _not_rebuilt(e, item, call, n, name, hint, worker or about_worker)
            raise
    raise failure(item, None if strict else payload, call=call, n=n, hint=hint, name=name)


def _not_rebuilt(exc: Exception, item: ResultItem, call: Call | None, n: int, name: str | None,
                 hint: str, about_worker: Mapping | Callable[[str], Mapping | None] | None) -> None:
    """Say on ``exc`` (raised here while unpickling ``item``'s value) that the task did
    return, where it ran, and the likely reason this process cannot rebuild what it
    returned: a module missing here, another version of a package on the worker, or
    code made inside the task on a worker of another Python minor version.
    ``about_worker(worker id)``: the worker as ``GET /v1/workers`` lists it, or None (or
    that worker's entry, looked up already). The text is a note on 3.11+, the exception's
    cause before (as :func:`failure`)."""
    from .. import packages
    if isinstance(about_worker, Mapping):
        worker: Mapping = about_worker
    else:
        worker = (about_worker(item.worker) if about_worker and item.worker else None) or {}
    theirs: Mapping = worker.get("packages") or {}
    place = where(item, call, n, name, worker.get("hostname"))
    lines = [f"[gpumesh] {place}: the task returned, but this process (Python "
             f"{platform.python_version()}) could not rebuild its value; it is not run again"]
    name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    mine_py, their_py = python_minor(), python_minor(worker.get("python") or "?")
    if name:
        top = name.partition(".")[0]
        have = packages.version_of(top)
        if have is None:
            lines.append(f"[gpumesh] this machine lacks the module {name!r} that the returned "
                         f"objects need: install it here, or return plain types (numbers, "
                         f"str, lists, dicts, NumPy arrays)")
        else:
            other = theirs.get(packages.normalise(top))
            lines.append(f"[gpumesh] this machine has {top} {have} but not {name}: the worker "
                         f"made it with {top} {other or 'of another version'}; install the same "
                         f"version on both")
    elif their_py and their_py != mine_py:
        lines.append(f"[gpumesh] the worker runs Python {worker.get('python')}: a function, "
                     f"lambda or class made inside the task loads only on the Python minor "
                     f"version that made it; return plain data, or call from Python "
                     f"{their_py}")
    else:
        differ = [f"{dist} {mine} here, {theirs[dist]} on the worker"
                  for dist, mine in packages.traceback_packages(exc.__traceback__).items()
                  if theirs.get(dist) not in (None, mine)]
        if differ:
            lines.append("[gpumesh] versions differ: " + "; ".join(differ)
                         + ": install the same versions on both")
    if hint:
        lines.append(f"[gpumesh] {hint}")
    text = "\n".join(lines)
    if sys.version_info >= (3, 11):
        exc.add_note(text)
    else:
        cause = RemoteTraceback(text + "\n")
        _located(cause, cause, item, {})
        exc.__cause__ = cause



def failure(item: ResultItem, payload: memoryview | None, *, call: Call | None = None, n: int = 1,
            hint: str = "", name: str | None = None) -> BaseException:
    """The exception that stands for the failed task ``item`` at the caller (``payload``:
    the pickled exception, or None to build a :class:`RemoteError` from its ``error``).

    Its text (a note, for the function's own exception) names the ``.map`` item of
    ``n`` with its arguments (``call``), the worker, the attempt and the task, then
    ``hint``; the item's index, worker, hostname and attempt are also attributes of a
    :class:`~gpumesh.errors.TaskFailed` and of the :class:`RemoteTraceback` cause.
    """
    err = item.error or {}
    kind = err.get("kind", "")
    message = err.get("message", "the task failed")
    tb = with_source(err.get("traceback", ""))
    task_id, worker = item.task_id, err.get("worker") or item.worker
    # (a crash's message counts its attempts already: "attempt 3 of 3")
    place = where(item, call, n, name, attempt=f"attempt {err.get('attempt')} of" not in message)
    if kind == FailureKind.CANCELLED:
        # Someone cancelled the job (gpumesh cancel, .cancel()): return_exceptions would
        # not have run its items, so the hint of a batch stopped by a failure is wrong here.
        hint = ""
    if kind == FailureKind.MISSING_MODULE and isinstance(err.get("package"), str):
        # A version gap (the workers have the package, in another version): this
        # process's version is the other half of the comparison.
        from ..packages import module_distribution
        mine = module_distribution(err["package"])
        if mine is not None:
            message += f"; this caller has {mine[0]} {mine[1]}"
    elif kind == FailureKind.MISSING_MODULE and isinstance(err.get("module"), str):
        advice = _shipped_advice(err["module"])
        if advice:
            # The coordinator's "install it there ... and call again" is not the fix for
            # the caller's own code: said before the advice, it would contradict it.
            from ..packages import INSTALL_ADVICE
            message = message.replace(f"; {INSTALL_ADVICE}", "") + advice
    tail = f" ({place})" + (f"; {hint}" if hint else "")
    if err.get("stderr_tail") and kind != "raised":
        # (a progress bar's redraws as a terminal shows them: each line's last state)
        from .console import shown
        tail += "\n--- last lines the task wrote to stderr ---\n" + "\n".join(
            shown(line) for line in err["stderr_tail"].rstrip().split("\n"))
    exc = None
    if kind == "raised" and payload is not None and payload.nbytes:
        try:
            exc = wire.loads(payload)
        except BaseException:  # noqa: BLE001 - fall through to a RemoteError that keeps the text
            exc = None
        if isinstance(exc, BaseException):
            cause = RemoteTraceback(tb)
            exc.__cause__ = cause
            text = f"[gpumesh] raised by {place}; remote traceback above"
            if hint:
                text += f"\n[gpumesh] {hint}"
            if sys.version_info >= (3, 11):
                exc.add_note(text)
            else:  # no notes before 3.11: the cause, printed above the exception, says it
                cause.tb = text + "\n" + tb
            return _located(exc, cause, item, err)
        exc = None
    exc = failure_exception(kind, message + tail, remote_type=err.get("type", "Exception"),
                            remote_message=message, traceback=tb, task_id=task_id,
                            worker=worker, module=err.get("module"))
    remote = RemoteTraceback(tb) if tb else None
    if remote is not None:
        exc.__cause__ = remote
    return _located(exc, remote, item, err)


def _shipped_advice(module: str) -> str:
    """For a module the workers lack that is one of this caller's own, which it ships by
    value (:mod:`gpumesh.localcode`, or registered with cloudpickle by the user), or would
    ship once imported (the caller never imported it, but its file is the caller's own
    code: :func:`gpumesh.localcode.would_be_local`): the words that say why it did not
    travel and how to make it, else ``""``. What travels by value is what the function
    refers to; an ``import`` in its body runs on the worker, by name, so installing it
    there is not what the user needs to hear."""
    from .. import localcode
    cp = sys.modules.get("cloudpickle")  # (not imported: nothing can be registered)
    shipped = cp.list_registry_pickle_by_value() if cp is not None else ()
    parts = module.split(".")
    # (a module is shipped by value when it or a package above it is registered)
    if not any(".".join(parts[:i]) in shipped for i in range(1, len(parts) + 1)) and not (
            limits.setting("GPUMESH_SHIP_LOCAL") and localcode.would_be_local(module)):
        return ""
    return (f". But {module!r} is one of this caller's own modules, which travel with the "
            f"function by value only where it uses them from module level: an `import {module}` "
            f"inside the function's body runs on the worker, by name. Import it at the top of "
            f"your script (module level) instead, drop the import from the function's body, "
            f"and use the module-level name there: it then travels with the function")


def _located(exc: BaseException, cause: RemoteTraceback | None, item: ResultItem,
             err: dict) -> BaseException:
    """Give ``exc`` (gpumesh's own: a TaskFailed, a TaskTimeout) and its remote traceback
    where the task ran."""
    facts = {"index": item.index, "task_id": item.task_id,
             "worker": err.get("worker") or item.worker, "hostname": err.get("hostname"),
             "attempt": err.get("attempt")}
    for target in (cause, exc if isinstance(exc, (TaskFailed, TaskTimeout)) else None):
        if target is not None:
            for k, v in facts.items():
                if v is not None or not hasattr(target, k):
                    setattr(target, k, v)
    return exc


_FRAME = re.compile(r'^(\s*)File "(.+)", line (\d+), in ')


def _cells() -> dict[str, int]:
    """``{file name: execution count}`` of the cells this process's IPython ran (none
    outside IPython): the names its tracebacks show as ``Cell In[N]``."""
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
        return dict(shell.compile._filename_map) if shell is not None else {}
    except Exception:  # noqa: BLE001 - another IPython's internals: just no cell names
        return {}


def with_source(tb: str) -> str:
    """Worker traceback text with the source lines the worker could not show filled in
    from this process: a frame whose file exists here (the caller's own script or
    module) or is a notebook cell this kernel ran (IPython keeps those in
    ``linecache``) gets its line, as a local traceback would show it. A cell's frame is
    named as IPython names it in its own tracebacks: ``Cell In[2], line 4, in bad``
    (not the kernel's ``File "/tmp/ipykernel_1234/469997784.py"``)."""
    if "File " not in tb:
        return tb
    lines = tb.splitlines(keepends=True)
    out: list[str] = []
    cells = _cells() if "IPython" in sys.modules else {}
    for k, line in enumerate(lines):
        m = _FRAME.match(line)
        count = None if m is None else cells.get(m.group(2))
        if m is not None and count is not None:
            out.append(f"{m.group(1)}Cell In[{count}], line {m.group(3)}, in {line[m.end():]}")
        else:
            out.append(line)
        if m is None:
            continue
        indent, filename, lineno = m.group(1), m.group(2), int(m.group(3))
        following = lines[k + 1] if k + 1 < len(lines) else ""
        if following.startswith(indent + "  ") and not _FRAME.match(following):
            continue  # the worker had the line
        source = linecache.getline(filename, lineno).strip()
        if source:
            out.append(f"{indent}  {source}\n")
    return "".join(out)


def outcome_value(outcome: tuple, index: int, where: str, call: Call | None = None,
                  n: int = 1, hint: str = "", name: str | None = None, *,
                  local: bool = False) -> Any:
    """What a task wrapper returned (``("ok", value)``, ``("raised", exc or None, type
    name, message, traceback text)``, ``("exit", code)`` or ``("timeout", seconds)``: see
    :data:`gpumesh.client.taskwrap.run_task`; or, from the inline backend, ``("failed",
    failure kind, type name, message, traceback text)``) -> the value, or raise what the task
    raised: the function's own exception, else the class the failure-kind table
    (:data:`gpumesh.protocol.FAILURE_EXCEPTIONS`) names, as a coordinator result would
    give. Its text names the ``.map`` item of ``n``, the call of function ``name`` with
    its arguments ``call`` and ``where`` it ran, then ``hint``; ``local``: it ran in this
    process (the inline backend), which the note says instead of a remote traceback."""
    __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
    kind = outcome[0]
    if kind == "ok":
        return outcome[1]
    shown = f"{name or 'the function'}({describe_call(call)})" if call is not None else "the task"
    place = (f".map item {index} of {n}, {shown}," if n > 1 else shown) + f" on {where}"
    if kind == "failed":  # a failure of another kind, as a worker reports it
        failure_kind, type_name, message, tb = outcome[1:]
        err = failure_exception(failure_kind, f"{message} ({place})" + (f"; {hint}" if hint else ""),
                                remote_type=type_name, remote_message=message, traceback=tb,
                                task_id=str(index), worker=where)
        err.index = index  # type: ignore[attr-defined]  # (as TaskFailed's .index)
        raise err
    if kind == "raised":
        exc, type_name, message, tb = outcome[1:]
        tb = with_source(tb)
        cause = RemoteTraceback(tb)
        cause.index = index
        if isinstance(exc, BaseException):
            exc.__cause__ = cause
            if sys.version_info >= (3, 11):
                # The cause is a RemoteTraceback either way (one type to catch), but a
                # local run's note must not send the reader looking for a worker.
                said = (f"{place}, in this process (not on a worker); the function's "
                        "traceback above" if local else f"{place}; remote traceback above")
                exc.add_note(f"[gpumesh] raised by {said}" + (f"\n[gpumesh] {hint}" if hint else ""))
            raise exc
        err = failure_exception(FailureKind.RAISED, f"{message} ({place})" + (f"; {hint}" if hint else ""),
                                remote_type=type_name, remote_message=message, traceback=tb,
                                task_id=str(index), worker=where)
        err.index = index  # type: ignore[attr-defined]  # (as TaskFailed's .index)
        err.__cause__ = cause
        raise err
    if kind == "timeout":
        err = failure_exception(FailureKind.TIMEOUT, f"{timeout_message(outcome[1])} ({place})"
                                + (f"; {hint}" if hint else ""))
        err.index = index  # type: ignore[attr-defined]  # (as a mesh's TaskTimeout's .index)
        raise err
    if kind == "exit":  # as a worker of the native mesh reports it
        raise failure_exception(FailureKind.EXIT, f"the task called sys.exit({outcome[1]}) "
                                f"(task #{index} on {where})", remote_type="SystemExit",
                                task_id=str(index), worker=where)
    raise TaskFailed(f"unexpected task outcome {kind!r} (task #{index} on {where})", str(index), where)


def dump_call(fn: Callable, call: Call, i: int, n: int) -> wire.Payload:
    """One call's ``(args, kwargs)`` as a payload. If it cannot be pickled, the error
    (the pickler's own type: usually TypeError or PicklingError) names the argument."""
    try:
        return wire.dumps(call)
    except Exception as e:  # noqa: BLE001 - re-raised with the argument named
        args, kwargs = call
        where_ = "" if n == 1 else f" (item {i} of the map)"
        culprit = next((f"argument {k}" for k, a in enumerate(args) if not picklable(a)),
                       None) or next((f"keyword argument {k!r}" for k, a in kwargs.items()
                                      if not picklable(a)), "an argument")
        fname = getattr(fn, "__qualname__", "the function")
        try:
            err = type(e)(f"{culprit} of {fname}{where_} cannot be sent to a worker: {e}")
        except Exception:  # noqa: BLE001 - an exception type with another signature
            raise e from None
        raise err from e


def dump_function(fn: Callable) -> wire.Payload:
    """``fn``'s code blob, as a caller ships it. If it cannot be pickled, the error (the
    pickler's own type, as :func:`dump_call` raises for an argument) names the function
    and what of it could not be: a global it reads, a closure variable, a default, the
    object a method is bound to. The pickler's own message names only the type (``cannot
    pickle '_thread.lock' object``), not where it hides."""
    try:
        return wire.dumps(fn, code=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the culprit named
        try:
            err = type(e)(f"{_function_culprit(fn)} cannot be sent to a worker: {e}")
        except Exception:  # noqa: BLE001 - an exception type with another signature
            raise e from None
        raise err from e


def _function_culprit(fn: Any) -> str:
    """What of ``fn`` (which failed to pickle) cannot be pickled, in words; the whole
    function when no one part is found (only asked on that failure: it pickles each)."""
    import functools
    import types
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    whole = f"the function {name} (its globals, closure or bound object)"
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        if not picklable(owner):
            return f"the {type(owner).__qualname__} object that the method {name} is bound to"
        fn = fn.__func__
    if isinstance(fn, functools.partial):
        if not picklable(fn.func):
            return _function_culprit(fn.func)
        return f"an argument functools.partial gives {getattr(fn.func, '__qualname__', name)}"
    if not isinstance(fn, types.FunctionType):
        return f"the callable {type(fn).__qualname__} object {name}"
    code = fn.__code__
    for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # (an empty cell: nothing to pickle)
            continue
        if not picklable(value):
            return _in_module(value, f"closure variable {var!r} of the function {name}")
    for var in global_names(code):
        if var in fn.__globals__ and not picklable(fn.__globals__[var]):
            return _in_module(fn.__globals__[var], f"global {var!r} of the function {name}")
    if not picklable((fn.__defaults__, fn.__kwdefaults__)):
        return f"a default argument of the function {name}"
    return whole


def _in_module(value: Any, holder: str) -> str:
    """``holder`` (the words for what holds ``value``, which failed to pickle), or, for
    a module, what in it failed first: ``lockmod._lock (in global 'lockmod' of ...)``."""
    import types
    inner = _module_culprit(value) if isinstance(value, types.ModuleType) else None
    return holder if inner is None else f"{inner} (in {holder})"


def _module_culprit(mod: Any) -> str | None:
    """What of the module ``mod`` (which failed to pickle, its whole namespace with it)
    cannot be pickled: ``lockmod._lock``, or a function of it with the global it reads
    that cannot (``lockmod.locked (its global '_lock')``); None when no one name is found.
    Values that are not functions are tried first: they are what a function would fail
    on. (Not deeper: modules that read each other would send it round in circles.)"""
    import types
    values = [(k, v) for k, v in vars(mod).items() if k != "__builtins__"]
    for functions in (False, True):
        for key, value in values:
            if isinstance(value, types.FunctionType) is not functions or picklable(value):
                continue
            if functions:
                bad = next((var for var in global_names(value.__code__)
                            if var in value.__globals__ and not picklable(value.__globals__[var])),
                           None)
                if bad is not None:
                    return f"{mod.__name__}.{key} (its global {bad!r})"
            return f"{mod.__name__}.{key}"
    return None


def picklable(value: Any) -> bool:
    """Whether ``value`` survives :func:`gpumesh.wire.dumps`."""
    try:
        wire.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False
