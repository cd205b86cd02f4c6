"""The decorators: ``@accelerate(mesh, ...)``, bare ``@accelerate``, and ``@mesh``.

A decorated function becomes a :class:`RemoteFunction`; calling it, or its ``.map``,
goes through :meth:`GPUMesh.run_calls` (mesh when available, else locally on the inline
backend), so the value is the same either way. Inside a task (``GPUMESH_IN_TASK`` is set
by the runner) decorated functions run inline, on the same inline backend: a task
waiting for a child task that can never get a slot would deadlock a small mesh. Their
requirements are checked against the task's worker, as against this machine for a fallback.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .. import retries as _retries
from ..hardware import Requirements
from . import calls as _calls
from . import pipeline
from .mesh import GPUMesh, _check_timeout, check_isolation
from .sweep import Results

#: Options ``@accelerate`` accepts. ``gpu`` (a kind: "cuda", "mps", "gpu", "cpu", or a
#: model such as "A100"), ``cores``, ``memory`` (host RAM) and ``gpu_memory`` (the GPU's
#: memory) describe the hardware every task of the function needs: only slots that meet
#: them run it (see :mod:`gpumesh.hardware` for the exact rules). ``retries`` and
#: ``retry_on`` re-run an item whose function raised one of those exception types
#: (see :mod:`gpumesh.retries`); by default a raised exception is the item's answer.
#: ``isolation``: ``"task"`` (default, a fresh process per task) or ``"job"`` (each worker
#: slot keeps one process for the job's tasks; see docs/architecture.md).
OPTIONS = ("timeout", "gpu", "cores", "memory", "gpu_memory", "retries", "retry_on", "requires",
           "isolation")


def unwrap(fn: Callable) -> Callable:
    """The plain function behind a :class:`RemoteFunction` (or ``fn`` itself)."""
    return getattr(fn, "__gpumesh_wrapped__", fn)


def _shortened(exc: BaseException) -> BaseException:
    """``exc``, raised by a call or ``.map``, with gpumesh's own frames below the call
    taken off its traceback when they say nothing the user needs: a task's exception
    (its worker-side traceback is the cause, and its note says where it ran), gpumesh's
    failure of a task, or a Ctrl+C that landed while the call waited on the network. Any
    other exception (gpumesh's own error, or a bad argument) keeps every frame."""
    from ..errors import RemoteTraceback, TaskFailed, TaskTimeout
    if isinstance(exc, (KeyboardInterrupt, TaskFailed, TaskTimeout)) \
            or isinstance(exc.__cause__, RemoteTraceback):
        return exc.with_traceback(None)
    return exc


class RemoteFunction:
    """What ``@accelerate``/``@mesh`` return. Call it like the function, or use
    ``.map(items)``, ``.local(...)`` and ``.to(device)``.

    The function must return its value: a generator function (``yield``), an ``async
    def`` or an async generator function is refused with a ``TypeError`` at decoration
    (its calls would only make a generator or coroutine, which cannot be sent back).

    Over ``@functools.cache``/``@lru_cache``, ``.cache_info()``, ``.cache_clear()`` and
    ``.cache_parameters()`` are those of this process's own cache, the one :meth:`local`
    uses: a task runs with a cache of its own process, which they neither count nor
    clear. A function without a cache has none of them (``AttributeError``)."""

    def __init__(self, fn: Callable, mesh: GPUMesh | _DefaultMesh | None, options: dict):
        # Not callable, or a generator or coroutine function: every call would fail, here
        # and on the mesh.
        pipeline.check_function(unwrap(fn), "@accelerate/@mesh")
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise TypeError(f"unknown @accelerate option(s) {sorted(unknown)}; "
                            f"expected some of {list(OPTIONS)}")
        self.__gpumesh_wrapped__ = unwrap(fn)
        self._mesh = mesh
        self.options = dict(options)
        self.options["timeout"] = _check_timeout(options.get("timeout"))
        self.options["isolation"] = check_isolation(options.get("isolation"))
        #: What the function's tasks need; bad values raise ValueError here, at decoration.
        self.require = Requirements.from_options(
            **{k: options[k] for k in ("gpu", "cores", "memory", "gpu_memory", "requires")
               if options.get(k) is not None})
        #: ``(retries, exception types)``, or None; bad values raise here, at decoration.
        retries, types = _retries.check(options.get("retries"), options.get("retry_on"))
        self.retry = (retries, types) if types else None
        functools.update_wrapper(self, self.__gpumesh_wrapped__)

    def __reduce__(self):
        # Ship the function and its options but not the mesh client (nor its token).
        # Inside a task the rebuilt RemoteFunction runs inline, .map included.
        return (_rebuild, (self.__gpumesh_wrapped__, self.options))

    def __repr__(self) -> str:
        return f"<RemoteFunction {getattr(self, '__qualname__', '?')}>"

    def _cache_method(self, name: str) -> Callable[..., Any]:
        """The wrapped cache function's method ``name``, else the ``AttributeError`` of a
        missing attribute (so ``hasattr(f, "cache_info")`` says whether it has one), saying
        why it is missing."""
        fn = self.__gpumesh_wrapped__
        method = getattr(fn, name, None)
        if method is None:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}: "
                f"{getattr(fn, '__qualname__', 'the function')} is not a functools.cache/"
                f"lru_cache function", name=name, obj=self)
        return method

    # Properties, not methods: functools.update_wrapper copies the wrapped function's
    # __dict__, but these are methods of its type, which it does not copy.
    @property
    def cache_info(self) -> Callable[[], Any]:
        """The caller's own cache's ``cache_info`` (see the class docstring)."""
        return self._cache_method("cache_info")

    @property
    def cache_clear(self) -> Callable[[], None]:
        """The caller's own cache's ``cache_clear`` (see the class docstring)."""
        return self._cache_method("cache_clear")

    @property
    def cache_parameters(self) -> Callable[[], dict]:
        """The caller's own cache's ``cache_parameters`` (see the class docstring)."""
        return self._cache_method("cache_parameters")

    def __get__(self, obj, objtype=None):
        # Decorating a method: bind like a function would.
        if obj is None:
            return self
        return functools.partial(self.__call__, obj)

    @property
    def mesh(self) -> GPUMesh:
        m = self._mesh if self._mesh is not None else accelerate.installed()
        return m.resolve() if isinstance(m, _DefaultMesh) else m

    def _inline(self) -> bool:
        return bool(os.environ.get("GPUMESH_IN_TASK"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
        fn = self.__gpumesh_wrapped__
        hints = None
        if any(k in kwargs for k in _calls.HINT_KEYS):  # f(x, gpu_memory_mb=...) as in .map
            kwargs, hint = _calls.split_hints(_calls.explicit_params(fn), kwargs)
            hints = [hint]
        try:
            if self._inline():
                return self._run_inline([(args, kwargs)], hints)[0][1]
            return self.mesh.run_calls(fn, [(args, kwargs)], hints=hints, **self._call_options())[0]
        except BaseException as failure:  # (raised on, without gpumesh's own frames)
            raise _shortened(failure)

    def _run_inline(self, calls: list[_calls.Call], hints: list[dict] | None = None,
                    return_exceptions: bool = False, handle: dict | None = None,
                    timeout: float | None = None, entry: str | None = None):
        """Inside a task: the calls on the inline backend, with this function's options
        (``timeout``, checked, replaces the decorator's); a list of ``(index, value)`` (an
        iterator with ``handle``). ``entry``: the call its errors name (as
        :class:`~gpumesh.client.pipeline.Job`'s)."""
        __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
        # The hardware and packages it asks for are this worker's to meet, as this
        # machine's are when the mesh is away: a GPU function does not run on a CPU.
        # (A call's scheduling hints are dropped here: there is nothing to schedule.)
        pipeline.check_local(self.__gpumesh_wrapped__, self.require, None,
                             "a decorated call inside a task runs inline, on the task's worker")
        options = self._call_options(timeout=timeout)
        job = pipeline.Job(self.__gpumesh_wrapped__, calls, hints or [{}] * len(calls),
                           timeout=options["timeout"], name=options["name"],
                           retry=self.retry, return_exceptions=return_exceptions,
                           streaming=handle is not None, entry=entry, nested=True)
        run = pipeline.run(None, job, handle, backend=pipeline.INLINE)
        return run if handle is not None else pipeline.drained(run)

    def _call_options(self, isolation: str | None = None, timeout: float | None = None) -> dict:
        """The options of this function's calls; ``isolation`` and ``timeout`` (checked)
        replace the decorator's for one ``.map``/``.imap``."""
        fn = self.__gpumesh_wrapped__
        timeout = self.options["timeout"] if timeout is None else timeout
        options = {"timeout": timeout, "name": getattr(fn, "__qualname__", None),
                   "require": self.require}
        if self.retry is not None:  # (an engine refuses what it cannot express)
            options["retry"] = self.retry
        isolation = self.options["isolation"] if isolation is None else isolation
        if isolation != "task":  # (likewise; "task" is what engines do)
            options["isolation"] = isolation
        return options

    def map(self, items: Iterable[Any], *, return_exceptions: bool = False,
            ordered: bool = True, isolation: str | None = None,
            timeout: float | None = None) -> list[Any] | Results:
        """One task per item (a dict is keyword arguments, a tuple positional arguments,
        anything else the single argument), spread over the mesh; values in input order.
        ``[]`` for no items. The items are read whole before anything is submitted (as
        ``multiprocessing.Pool.imap`` and ``Executor.map`` do); more than
        ``MAX_TASKS_PER_JOB`` (a million) is a ``ValueError``, raised once the input has
        given one item more, so an endless iterator fails at once instead of filling
        this process's memory.

        By default the first failure is raised (as the function's own exception, its
        remote traceback attached, its text naming the item, worker and attempt) and the
        other tasks are cancelled. ``return_exceptions=True``: every item runs, and a
        failed item's exception stands in its place in the list. ``ordered=False``: the
        same as :meth:`imap` (an iterator of ``(index, value)`` as tasks finish).
        ``isolation``: ``"task"`` or ``"job"`` for this map's tasks, as for
        ``@accelerate`` (default: the decorator's); anything else is a ``ValueError``.
        ``timeout``: seconds each of this map's tasks may run, as the decorator's
        ``timeout=`` (which it replaces for this map; default: the decorator's), also
        when the items run here; a number > 0, else a ``ValueError`` before anything
        is submitted. A task past it raises :class:`~gpumesh.errors.TaskTimeout`."""
        __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
        isolation = None if isolation is None else check_isolation(isolation)
        timeout = _check_timeout(timeout)
        if not ordered:
            # (its errors name what the user called, not the .imap() it goes through)
            return self._imap(items, bool(return_exceptions), isolation, timeout,
                              ".map(ordered=False)")
        fn = self.__gpumesh_wrapped__
        calls, hints = _calls.map_items(fn, _calls.read_input(items, ".map()"))
        try:
            if self._inline():
                return [v for _, v in self._run_inline(calls, hints, bool(return_exceptions),
                                                       timeout=timeout)]
            return self.mesh.run_calls(fn, calls, hints=hints,
                                       return_exceptions=bool(return_exceptions),
                                       **self._call_options(isolation, timeout))
        except BaseException as failure:  # (raised on, without gpumesh's own frames)
            raise _shortened(failure)

    def imap(self, items: Iterable[Any], *, return_exceptions: bool = False,
             isolation: str | None = None, timeout: float | None = None) -> Results:
        """One task per item (as :meth:`map`, which also says how its input is read:
        whole, before anything is submitted), submitted at once; returns an iterator of
        ``(index, value)`` pairs in the order the tasks finish, each index once.

        Stop early with ``break`` inside ``with f.imap(items) as it:``, ``it.close()``, or
        by dropping the iterator: the tasks not finished yet are cancelled. A failure is
        raised from ``next()`` (and the rest cancelled) unless ``return_exceptions=True``,
        which yields ``(index, exception)`` instead. Without a mesh the items run here,
        one per ``next()``, in input order. ``isolation`` and ``timeout``: as for :meth:`map`."""
        isolation = None if isolation is None else check_isolation(isolation)
        return self._imap(items, bool(return_exceptions), isolation, _check_timeout(timeout),
                          ".imap()")

    def _imap(self, items: Iterable[Any], flag: bool, isolation: str | None,
              timeout: float | None, via: str) -> Results:
        """:meth:`imap` with its options checked; ``via``: the call its errors name (the
        input limit's ValueError, a task's StopIteration, the return_exceptions hint)."""
        fn = self.__gpumesh_wrapped__
        calls, hints = _calls.map_items(fn, _calls.read_input(items, via))
        if self._inline():
            return Results(lambda h: self._run_inline(calls, hints, flag, h, timeout, via),
                           len(calls))
        mesh = self.mesh
        options = self._call_options(isolation, timeout)
        return Results(lambda h: mesh.iter_calls(fn, calls, hints=hints, return_exceptions=flag,
                                                 handle=h, entry=via, **options), len(calls))

    def to(self, device: str) -> RemoteFunction:
        """The same function bound to a device kind or model (``"cuda"``, ``"mps"``,
        ``"gpu"``, ``"cpu"``, ``"A100"``): a new RemoteFunction whose ``gpu`` option is
        ``device``, so its tasks run only on such slots. Raises ``ValueError`` for
        anything else (e.g. ``"cuda:1"``: a task cannot choose a GPU by index)."""
        if not isinstance(device, str) or not device.strip():
            raise ValueError(f".to() needs a device name such as 'cuda', 'cpu' or 'A100', got {device!r}")
        from ..hardware import normalise_gpu
        gpu = normalise_gpu(device, "device")
        return RemoteFunction(self.__gpumesh_wrapped__, self._mesh, dict(self.options, gpu=gpu))

    def local(self, *args: Any, **kwargs: Any) -> Any:
        """Run in this process, never on the mesh."""
        return self.__gpumesh_wrapped__(*args, **kwargs)


def _rebuild(fn: Callable, options: dict) -> RemoteFunction:
    return RemoteFunction(fn, None, options)


class _DefaultMesh:
    """``from gpumesh import mesh``: a bare decorator and a lazily connected GPUMesh.

    Once the program set a mesh with ``accelerate.install(m)``, that is ``m`` (as for a
    bare ``@accelerate``), looked up at each call, so functions decorated before the
    install use it too. Else it connects on first use from ``$GPUMESH_URL``/
    ``$GPUMESH_TOKEN``, else the saved config. Attribute access (``mesh.workers()``) goes
    to that GPUMesh.
    """

    def __init__(self) -> None:
        self._mesh: GPUMesh | None = None
        self._lock = threading.Lock()

    def resolve(self) -> GPUMesh:
        installed = accelerate._installed
        if isinstance(installed, GPUMesh):
            return installed
        with self._lock:
            if self._mesh is None:
                self._mesh = GPUMesh()
            return self._mesh

    def __call__(self, fn: Callable | None = None, **options: Any):
        if fn is None:
            return lambda f: RemoteFunction(f, self, options)
        return RemoteFunction(fn, self, options)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __repr__(self) -> str:
        return ("<gpumesh default mesh (accelerate.install()'s, else from $GPUMESH_URL or "
                "~/.gpumesh/config.json)>")

    def __reduce__(self):
        return (_default_mesh, ())


def _default_mesh() -> _DefaultMesh:
    return mesh


mesh = _DefaultMesh()


class _Accelerate:
    """``accelerate``: ``@accelerate(mesh, timeout=..)``, ``@accelerate`` and
    ``accelerate.install(mesh)`` (after which bare ``@accelerate``, bare ``@mesh`` and
    ``from gpumesh import mesh`` use that mesh)."""

    def __init__(self) -> None:
        self._installed: GPUMesh | _DefaultMesh | None = None

    def install(self, target: GPUMesh) -> None:
        """Make ``target`` this program's mesh: bare ``@accelerate``, bare ``@mesh`` and
        ``from gpumesh import mesh`` use it from now on, functions decorated earlier
        included (``@accelerate(m)`` keeps its own ``m``)."""
        if not isinstance(target, (GPUMesh, _DefaultMesh)):
            raise TypeError(f"accelerate.install() needs a GPUMesh, got {type(target).__name__}")
        self._installed = target

    def installed(self) -> GPUMesh | _DefaultMesh:
        return self._installed if self._installed is not None else mesh

    def __call__(self, target: Any = None, **options: Any):
        if isinstance(target, (GPUMesh, _DefaultMesh)):
            return lambda fn: RemoteFunction(fn, target, options)
        if target is None:
            return lambda fn: RemoteFunction(fn, None, options)
        if callable(target):
            return RemoteFunction(target, None, options)
        raise TypeError(f"@accelerate takes a GPUMesh or a function, got {type(target).__name__}")


accelerate = _Accelerate()
