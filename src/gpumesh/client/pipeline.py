"""The caller's pipeline: one path from a call to its values, whatever runs the tasks.

::

    GPUMesh.iter_calls(fn, calls, ...) ──► run(mesh, job)
        route: GPUMESH_LOCAL=1 ──────────────────────────────► inline backend
               backend.check(job)   refuses what it cannot express (EngineCannotExpress)
               backend.reachable()  no ─► check_local (Unsatisfiable?) ─► inline backend
        localcode.ship()   the caller's own modules (not installed, not the standard
                           library) are registered to be pickled by value
        backend.run(job)   yields STARTED once the calls are under way, then
                           (index, outcome) as each finishes; raises Fallback before
                           STARTED when nothing was stored (no live worker) ─► inline
        decode(outcome)  ─► the value, or the task's exception (raised, or in its place
                           with return_exceptions); a progress bar where the backend has one
        closing early (a failure, Ctrl+C, a closed .imap) closes the backend's run,
        which cancels what is left

A backend implements :class:`Backend`: ``run(job)`` plus, optionally, ``check`` and
``reachable``. The native coordinator (:mod:`.native`), the engines
(:mod:`.backends`) and :class:`InlineBackend` (this process) are the backends.

**Local fallback is the inline backend**: the function, each call's arguments and its
result (or exception) go through the same pickle round trip as on a worker, ``timeout=``
is enforced the same way an engine worker does it (a thread that is no longer waited for
past it: :class:`~gpumesh.errors.TaskTimeout`), and a raised exception comes back as
itself with a :class:`~gpumesh.errors.RemoteTraceback` cause and a note naming the item.
So a value computed here is a copy, exactly as a worker's would be: a function that
mutates its arguments or module globals does not change the caller's objects here either.

What **cannot be pickled** fails here exactly as on a mesh (the spec: "either path
returns the identical value"; a call must not work only while the mesh is away): a
function or argument raises the pickler's error before anything runs (naming the
argument, or what of the function cannot go: :func:`~gpumesh.client.calls.dump_function`),
a return value that cannot be pickled is a RemoteError "the return value (X)
cannot be pickled: ...", an exception travels as a worker's does (rebuilt where pickle
alone fails, :mod:`gpumesh.portable`; a RemoteError naming its type and message when its
class cannot be pickled). Strict results (JSON only) are not applied here: nothing crossed a
trust boundary (see :mod:`gpumesh.strict`). ``.local()`` is a plain call and takes no
part in any of this.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
import logging
import math
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import hardware, limits, localcode, namespaces, wire
from ..errors import Cancelled, Unsatisfiable
from . import calls as _calls
from .progress import Progress
from .taskwrap import run_task

log = logging.getLogger("gpumesh.client")

_notices: set[str] = set()
_notice_lock = threading.Lock()

#: What a backend's run yields once the calls are under way, before any outcome.
STARTED = object()


def notice(text: str, once: bool = True) -> None:
    """Print a one-line notice to stderr, once per process per distinct text (every time
    with ``once=False``: news that can recur, such as a coordinator lost and back)."""
    with _notice_lock:
        if once and text in _notices:
            return
        _notices.add(text)
    print(f"[gpumesh] {text}", file=sys.stderr, flush=True)


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0-based) of a request: full jitter,
    growing from 0.2 s to at most 5 s."""
    return random.uniform(0, min(5.0, 0.2 * 2 ** min(attempt, 10)))


#: What ``isolation=`` accepts: a fresh process per task (the default), or one process
#: per worker slot for the job's tasks.
ISOLATIONS = ("task", "job")


def check_isolation(isolation: Any) -> str:
    """``isolation`` checked (None is ``"task"``); ``ValueError`` for anything else."""
    if isolation is None:
        return "task"
    if not isinstance(isolation, str) or isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be 'task' or 'job', got {isolation!r}")
    return isolation


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` in seconds as a float (None: none); ``ValueError`` unless a finite
    number > 0 (an infinite one is no timeout: say None)."""
    if timeout is None:
        return None
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not 0 < timeout < math.inf):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def unsupported_function(fn: Any) -> str | None:
    """Why ``fn`` cannot be the function of a task, or None when it can: a task calls it
    and sends back what it returned, so a function whose call only makes a generator or
    a coroutine (``yield`` in its body, ``async def``) would send back an object that
    cannot be pickled, on every call. A callable object is judged by its ``__call__``."""
    target = fn
    if not (inspect.isroutine(fn) or inspect.isclass(fn) or isinstance(fn, functools.partial)):
        target = inspect.getattr_static(type(fn), "__call__", fn)
    if inspect.isasyncgenfunction(target):
        return ("it is an async generator function (async def with yield): a task returns one "
                "value, and a worker cannot send back an async generator. Collect its items in a "
                "plain def instead (e.g. asyncio.run of a coroutine that gathers them into a list) "
                "and return that list")
    if inspect.iscoroutinefunction(target):
        return ("it is an async def function: calling it only makes a coroutine, which a task "
                "cannot send back. Decorate a plain def that runs it instead: "
                "def f(x): return asyncio.run(your_coroutine(x))")
    if inspect.isgeneratorfunction(target):
        return ("it is a generator function (it yields): calling it only makes a generator, "
                "which a task cannot send back. Return a list instead (return list(...)), or "
                "make each item its own task with .map()")
    return None


def _short_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        return f"<{type(obj).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def check_function(fn: Any, who: str) -> None:
    """``TypeError`` naming ``who`` (the decorator or call given ``fn``) when ``fn`` is a
    function a task cannot run (see :func:`unsupported_function`), or is no callable at
    all (else the job was submitted and failed on a worker)."""
    if not callable(fn):
        raise TypeError(f"{who} needs a function (or another callable), got "
                        f"{type(fn).__name__}: {_short_repr(fn)}")
    why = unsupported_function(fn)
    if why is not None:
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise TypeError(f"{who} cannot run {name}: {why}")


@dataclasses.dataclass
class Job:
    """One batch of calls of one function, as every backend receives it."""

    fn: Callable
    calls: list[_calls.Call]
    #: One ``{"cost", "gpu_memory_mb"}`` dict per call (keys present only when given).
    hints: list[dict]
    timeout: float | None = None
    name: str | None = None
    require: hardware.Requirements | None = None
    #: ``(retries, exception types)`` (see :mod:`gpumesh.retries`), or None.
    retry: tuple[int, tuple] | None = None
    isolation: str = "task"
    return_exceptions: bool = False
    #: True for ``.imap()``: submit without waiting for a first result.
    streaming: bool = False
    #: Set by a backend that stores the job somewhere (the native coordinator's job id).
    job_id: str | None = None
    #: What the native backend asked of workers: ``require`` plus, when code travels by
    #: value, the caller's Python (its notices say it when no alive worker can run the job).
    sent_require: hardware.Requirements | None = None
    #: The call that made this batch, as its errors' advice names it ("distribute()");
    #: None: ".map()", or ".imap()" when streaming.
    entry: str | None = None
    #: A decorated call inside a task (run inline, in that task's process): the function
    #: runs as itself, not a copy, so what it keeps (a functools.cache) is that process's.
    nested: bool = False

    @property
    def n(self) -> int:
        return len(self.calls)

    @property
    def qualname(self) -> str | None:
        return getattr(self.fn, "__qualname__", None)

    @property
    def via(self) -> str:
        return self.entry or (".imap()" if self.streaming else ".map()")


class TaskStopIteration(RuntimeError):
    """A task raised ``StopIteration`` (``.stop``), which cannot leave an iterator as
    itself: raised inside the pipeline's generator, Python turns it into a bare
    ``RuntimeError: generator raised StopIteration`` (PEP 479), and raised from an
    iterator's ``next()`` it would end the caller's ``for`` loop as if every result had
    come. So it travels out of :func:`run` as this error (its cause the StopIteration);
    what returns whole values (:func:`drained`: a call, ``.map``) raises ``.stop`` itself,
    and ``.imap`` raises this one, naming why."""

    def __init__(self, stop: StopIteration, via: str):
        super().__init__(
            f"a task of {via} raised {stop!r}, which an iterator's next() cannot raise (it "
            f"would end your for loop as if every result had come); it is this error's "
            f"cause. Pass return_exceptions=True to get it as the item's value")
        self.stop = stop


def drained(run: Iterator[Any]) -> list[Any]:
    """Every ``(index, value)`` of :func:`run`, in the order they came; a task's
    ``StopIteration`` is raised as itself (see :class:`TaskStopIteration`)."""
    __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
    try:
        return list(run)
    except TaskStopIteration as e:
        stop = e.stop
    raise stop  # (outside the except block: its context stays the task's, not ours)


class Fallback(Exception):
    """Raised by a backend's run before it yields STARTED: nothing was stored, the calls
    may run here. ``why`` words an Unsatisfiable from :func:`check_local`; ``notice``
    (if any) is told before they run."""

    def __init__(self, why: str, notice: str | None = None):
        super().__init__(why)
        self.why, self.notice = why, notice


class Backend(abc.ABC):
    """What runs a :class:`Job`'s calls (see the module docstring)."""

    #: Where the tasks run, for messages ("this machine", "Dask at dask://host:8786").
    where = "the mesh"
    #: What happened to the other items when one failed (the error's hint says it).
    stopped = "the batch's other tasks were cancelled"
    #: Whether a batch shows a progress bar (the native mesh's does).
    progress = False

    def check(self, job: Job, local: bool = False) -> None:
        """Raise if this backend cannot express ``job`` (before anything is sent);
        ``local``: the job is about to run inline anyway (GPUMESH_LOCAL=1)."""

    def reachable(self) -> bool:
        """Whether the backend answers (if not, the calls run here)."""
        return True

    def unreachable_why(self) -> str:
        return f"{self.where} is unreachable"

    def about_worker(self, worker_id: str) -> dict | None:
        """The worker ``worker_id`` as ``GET /v1/workers`` lists it (``python``,
        ``packages``...), for an error's words; None when unknown or not asked."""
        return None

    @abc.abstractmethod
    def run(self, job: Job) -> Iterator[Any]:
        """Yield :data:`STARTED` once the calls are under way, then ``(index, outcome)``
        as each finishes, every index once. ``outcome`` is a :data:`run_task` tuple,
        ``("result", item, payload, strict)`` (a :class:`~gpumesh.protocol.ResultItem` of a
        coordinator's results page and its payload frame or None, see
        :func:`~gpumesh.client.calls.decode_result`) or ``("error", exception)``.
        Closing it early cancels what is left. Raise :class:`Fallback` before STARTED
        when the calls were stored nowhere and may run here."""


def decode(outcome: tuple, index: int, job: Job, backend: Backend, hint: str) -> Any:
    """An outcome of ``backend`` -> its value, or raise the exception that stands for it."""
    __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
    kind = outcome[0]
    if kind == "result":
        _, item, payload, strict = outcome
        return _calls.decode_result(item, payload, strict, call=job.calls[index], n=job.n,
                                    hint=hint, name=job.qualname, about_worker=backend.about_worker)
    if kind == "error":
        raise outcome[1]
    return _calls.outcome_value(outcome, index, backend.where, job.calls[index], job.n, hint,
                                job.qualname, local=backend is INLINE)


def route(mesh: Any, job: Job) -> Backend:
    """The backend that runs ``job``: ``mesh``'s own, or the inline one (GPUMESH_LOCAL=1,
    or the mesh unreachable and this machine able to run it)."""
    backend = mesh._backend()
    local = limits.setting("GPUMESH_LOCAL")
    backend.check(job, local)
    if local:
        notice("GPUMESH_LOCAL=1: running locally")
        return INLINE
    if not backend.reachable():
        check_local(job.fn, job.require, job.hints, backend.unreachable_why())
        return INLINE
    return backend


def run(mesh: Any, job: Job, handle: dict | None = None,
        backend: Backend | None = None) -> Iterator[Any]:
    """The pipeline: ``(index, value)`` as each call of ``job`` finishes (see the module
    docstring). ``backend``: skip routing (None: :func:`route` on ``mesh``). With
    ``handle`` (a dict, see :class:`~gpumesh.client.sweep.Results`) it yields ``None``
    once the calls are under way (``handle["job_id"]`` set where the backend stored the
    job), before any value."""
    __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
    if not job.calls:
        if handle is not None:
            yield None
        return
    started = time.monotonic()  # the batch's start: the bar's delay, rate and ETA count from here
    if backend is None:
        backend = route(mesh, job)
    localcode.ship()  # the caller's own modules travel by value in what backend.run pickles
    runner = backend.run(job)
    try:
        first = next(runner)
    except Fallback as e:
        check_local(job.fn, job.require, job.hints, e.why)
        if e.notice:
            notice(e.notice)
        backend = INLINE
        runner = backend.run(job)
        first = next(runner)
    if first is not STARTED:
        raise RuntimeError(f"{type(backend).__name__}.run yielded {first!r} before STARTED")
    bar = None
    try:
        if handle is not None:
            if job.job_id is not None:
                handle["job_id"] = job.job_id
            yield None
        if backend.progress and job.n > 1:  # a bar once a batch takes over a second
            bar = Progress(job.n, job.name or job.qualname or "tasks", started=started)
        hint = (_calls.keep_going(job.via, stopped=backend.stopped)
                if job.n > 1 and not job.return_exceptions else "")
        failed = cancelled = got = 0
        for index, outcome in runner:
            try:
                value = decode(outcome, index, job, backend, hint)
            except Exception as e:  # noqa: BLE001 - what the task raised
                if isinstance(e, StopIteration) and not job.return_exceptions:
                    # Raised as itself here it would become a bare RuntimeError (PEP 479).
                    raise TaskStopIteration(e, job.via) from e
                if not job.return_exceptions:
                    raise
                value = e
                cancelled += isinstance(e, Cancelled)
                failed += not isinstance(e, Cancelled)
            got += 1
            if bar is not None:
                bar.update(got, failed=failed, cancelled=cancelled)
            yield index, value
    finally:
        if bar is not None:
            bar.close()
        runner.close()  # type: ignore[attr-defined]  # (each backend's run is a generator) a failure, Ctrl+C, a closed iterator: the backend cancels what is left


# ------------------------------------------------------------------ inline -----------

class InlineBackend(Backend):
    """Runs the calls in this process, one by one in input order, with a remote call's
    semantics (see the module docstring): a pickle round trip of the function, the
    arguments and the outcome, ``timeout=`` (:class:`~gpumesh.errors.TaskTimeout`) and
    ``retries=``/``retry_on=`` as the coordinator applies them (each attempt gets fresh
    copies of the arguments)."""

    where = "this machine"
    stopped = "the items after it did not run"
    #: A batch run here (the mesh unreachable, GPUMESH_LOCAL=1) shows its bar as on the
    #: mesh; inside a task (nested calls) stderr is a file, so none is drawn.
    progress = True

    def run(self, job: Job) -> Iterator[Any]:
        name = job.qualname or "the function"
        # As the native backend's submit: the function and every call's arguments are
        # pickled before anything runs, and what cannot be raises the same error.
        # Loaded in a scope of its own: the caller's modules and classes it uses are
        # copies (gpumesh.namespaces, gpumesh.classes), as in a worker's process. A job's
        # tasks share them (isolation="job": a process kept for the job); with the
        # default isolation each task loads its own, as in a process of its own (the
        # pickle stream is parsed again; big arrays stay views of the one blob). A nested
        # call (inside a task) runs the function itself, in the task's process: what it
        # keeps, a functools.cache, is that process's, as README says; arguments are
        # still copies.
        blob = None if job.nested else _joined(_calls.dump_function(job.fn))
        scope = namespaces.Scope()
        with scope:
            fn = job.fn if blob is None else wire.loads(blob)
        fresh = False  # (the first task takes the load above)
        payloads: list[wire.Payload | None] = [
            _calls.dump_call(job.fn, call, i, job.n) for i, call in enumerate(job.calls)]
        yield STARTED
        retries, types = job.retry or (0, ())
        for i in range(job.n):
            payload, payloads[i] = payloads[i], None  # (freed as it goes, as a worker's)
            assert payload is not None
            for attempt in range(retries + 1):
                if fresh and job.isolation == "task" and blob is not None:
                    scope = namespaces.Scope()
                    with scope:
                        fn = wire.loads(blob)
                fresh = True
                with scope:
                    args, kwargs = wire.loads(_joined(payload))
                outcome = run_task(fn, args, kwargs, job.timeout, True)
                if not (outcome[0] == "raised" and attempt < retries
                        and isinstance(outcome[1], types)):
                    break
                log.info("%s raised %s (item %d, attempt %d); running it again", name,
                         outcome[2], i, attempt + 1)
            yield i, _copied(outcome)


INLINE = InlineBackend()


def _joined(payload: wire.Payload) -> bytearray:
    """The payload's bytes in one writable buffer: arrays loaded from it are writable, as
    a worker's and a remote call's are (``wire.loads`` of ``bytes`` gives read-only ones)."""
    out = bytearray()
    for c in payload.chunks:
        out += c
    return out


def _copied(outcome: tuple) -> tuple:
    """A run_task outcome as it would reach the caller from a worker: the value or the
    exception through one pickle round trip (one ``dumps``, one ``loads``: what the trip
    costs anyway, so checking that the value survives it costs nothing more). A value
    that cannot be pickled is the worker's ``result_unpicklable`` failure, with its
    message; an exception travels as :func:`gpumesh.wire.dumps_exception` sends it, or,
    when it cannot travel, arrives as a RemoteError naming its type (``("raised", None,
    ...)``); a value that cannot be unpickled raises what
    ``loads`` raised, as decoding a worker's result would."""
    from ..protocol import FailureKind
    from ..retries import type_name
    if outcome[0] == "ok":
        value = outcome[1]
        try:
            payload = wire.dumps(value)
        except Exception as e:  # noqa: BLE001 - the pickler's own error, as a worker reports it
            import traceback
            return ("failed", FailureKind.RESULT_UNPICKLABLE, type_name(type(e)),
                    f"the return value ({type(value).__qualname__}) cannot be pickled: {e}",
                    "".join(traceback.format_exception(type(e), e, e.__traceback__)))
        try:
            return ("ok", wire.loads(_joined(payload)))
        except Exception as e:  # noqa: BLE001 - raised in the item's place, as decode would
            return ("error", e)
    if outcome[0] == "raised" and outcome[1] is not None:
        exc = outcome[1]
        sent = wire.dumps_exception(exc)  # (as a worker sends it)
        try:
            copy = wire.loads(_joined(sent)) if sent is not None else None
        except Exception:  # noqa: BLE001 - as a worker's: cannot travel, a RemoteError says it
            copy = None
        if copy is None:
            return ("raised", None, type_name(type(exc)), *outcome[3:])
        return ("raised", copy, *outcome[2:])
    return outcome


# ------------------------------------------------------------------ local check ------

_this_machine: dict | None = None


def check_local(fn: Callable, require: hardware.Requirements | None, hints: list[dict] | None,
                why: str) -> None:
    """Before a call with hardware requirements runs here instead of on the mesh: raise
    :class:`~gpumesh.errors.Unsatisfiable` unless this machine meets them."""
    hint = max((h.get("gpu_memory_mb") or 0 for h in hints or ()), default=0)
    if not require and not hint:
        return
    global _this_machine
    if _this_machine is None:
        from ..worker.device import detect  # NVML or nvidia-smi; never a CUDA context
        _this_machine = detect()
    info = _this_machine
    if require is not None and require.requires:  # this process runs it: its own packages
        from ..packages import installed
        info = dict(info, packages=installed())
    slots = hardware.slots_of("local", info, hardware.slot_list(info["gpus"], 1, info["mps"]))
    reasons = []
    for slot in slots:
        reason = hardware.refusal(require or hardware.Requirements(), slot, hint or None)
        if reason is None:
            return
        reasons.append(f"its {slot.device} {reason}")
    wants = (require.describe() if require else "") + (f", gpu_memory_mb={hardware.format_mib(hint)}" if hint else "")
    raise Unsatisfiable(f"{why}, and this machine cannot run {getattr(fn, '__qualname__', 'the function')} "
                        f"({wants.strip(', ')}): " + "; ".join(reasons))
