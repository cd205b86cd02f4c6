"""What every engine backend shares: routing, fallback, the task wrapper, results.

A backend (``dask.py``, ``ray.py``) subclasses :class:`EngineMesh` and implements four
methods; everything the decorators and the pool API call (``run_calls``, ``workers``,
``devices``, ``gpu_count``, ``total_score``...) is built on them here, so a call means the
same thing on every engine:

* ``_connect()`` -> an engine handle, or raise ``OSError``/``ConnectionError``/``TimeoutError``
  when the engine cannot be reached (the call then runs here, with the native mesh's notice);
* ``_resources(require)`` -> the engine's own resource request for ``gpu=``, ``cores=``,
  ``memory=``, or raise :class:`EngineCannotExpress`;
* ``_engine_workers()`` -> the engine's view of its workers, as native worker dicts
  (``id, hostname, alive, slots, slot_list, gpus, cores, ram_mb, scores...``);
* ``_run(fn, calls, resources, timeout, name)`` -> a generator of ``(index, outcome)`` in
  completion order; closing it early (a failure, Ctrl+C) cancels what is left.

Every task runs inside :data:`run_task`, which catches what the function raised and
sends it back with its formatted traceback, so exceptions arrive as themselves with a
:class:`~gpumesh.errors.RemoteTraceback` cause, whatever the engine does with errors.
"""

from __future__ import annotations

import abc
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from ... import hardware, limits
from ...errors import (MeshError, MeshUnavailable, RemoteError, RemoteTraceback, TaskFailed,
                       TaskTimeout, Unsatisfiable)
from ...limits import PROBE_DOWN_CACHE_S, PROBE_TIMEOUT_S
from .. import calls as _calls
from .. import mesh as _mesh
from ..mesh import GPUMesh, notice

_MISSING = object()


class EngineCannotExpress(MeshError, ValueError):
    """A call asks for something (a GPU model, ``gpu_memory=``, a ``gpu_memory_mb`` hint,
    a native-only feature) that this engine's resource model cannot express. Raised at
    call time, before anything is submitted."""


# The task wrapper is compiled from source into a module that cannot be imported, so
# every engine's cloudpickle ships it by value: workers need not have gpumesh installed.
_TASK_SRC = '''
def run_task(fn, args, kwargs, timeout):
    """Run fn(*args, **kwargs) on a worker -> ("ok", value) | ("raised", exc or None,
    type name, message, traceback text) | ("exit", code) | ("timeout", seconds)."""
    import os, threading, traceback
    box = {}

    def call():
        previous = os.environ.get("GPUMESH_IN_TASK")
        os.environ["GPUMESH_IN_TASK"] = "1"  # decorated calls inside the task run inline
        try:
            box["r"] = ("ok", fn(*args, **kwargs))
        except SystemExit as e:
            box["r"] = ("exit", repr(e.code))
        except BaseException as e:
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            exc = e
            try:
                try:
                    import cloudpickle as cp
                except ImportError:
                    from ray import cloudpickle as cp
                cp.loads(cp.dumps(e))
            except BaseException:
                exc = None  # cannot travel as itself: the caller gets a RemoteError
            e.__traceback__ = None
            box["r"] = ("raised", exc, type(e).__qualname__, str(e), tb)
        finally:
            if previous is None:
                os.environ.pop("GPUMESH_IN_TASK", None)
            else:
                os.environ["GPUMESH_IN_TASK"] = previous

    if timeout is None:
        call()
        return box["r"]
    t = threading.Thread(target=call, name="gpumesh-task", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return ("timeout", timeout)
    return box["r"]
'''
_ns: dict = {"__name__": "_gpumesh_engine_task"}
exec(compile(_TASK_SRC, "<gpumesh task wrapper>", "exec"), _ns)
run_task: Callable = _ns["run_task"]


def outcome_value(outcome: tuple, index: int, where: str, call: _calls.Call | None = None,
                  n: int = 1, hint: str = "", name: str | None = None) -> Any:
    """What :data:`run_task` returned -> the value, or raise what the task raised (its
    text names the ``.map`` item of ``n`` and the call of function ``name`` with its
    arguments ``call``, then ``hint``)."""
    kind = outcome[0]
    if kind == "ok":
        return outcome[1]
    if kind == "raised":
        exc, type_name, message, tb = outcome[1:]
        tb = _calls.with_source(tb)
        shown = f"{name or 'the function'}({_calls.describe_call(call)})" if call is not None else "the task"
        place = (f".map item {index} of {n}, {shown}," if n > 1 else shown) + f" on {where}"
        cause = RemoteTraceback(tb)
        cause.index = index
        if isinstance(exc, BaseException):
            exc.__cause__ = cause
            if sys.version_info >= (3, 11):
                exc.add_note(f"[gpumesh] raised by {place}; remote traceback above"
                             + (f"\n[gpumesh] {hint}" if hint else ""))
            raise exc
        err = RemoteError(type_name, f"{message} ({place})" + (f"; {hint}" if hint else ""),
                          tb, str(index), where)
        err.remote_message, err.index = message, index
        err.__cause__ = cause
        raise err
    if kind == "timeout":
        raise TaskTimeout(f"the task ran past its timeout of {outcome[1]:g} s "
                          f"(task #{index} on {where})")
    if kind == "exit":
        raise TaskFailed(f"the task called sys.exit({outcome[1]}) (task #{index} on {where})",
                         str(index), where)
    raise TaskFailed(f"unexpected task outcome {kind!r} (task #{index} on {where})", str(index), where)


def tcp_reachable(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class EngineMesh(GPUMesh, metaclass=abc.ABCMeta):
    """A :class:`GPUMesh` whose tasks run on an existing engine (see the module docstring)."""

    #: The engine's name in messages ("Dask", "Ray").
    engine = "engine"
    #: Exceptions of ``_connect`` that mean "not reachable": the call then runs here.
    unreachable: tuple[type[BaseException], ...] = (OSError, ConnectionError, TimeoutError)

    def __init__(self, url: str | None = None, token: str | None = None, *,
                 output: bool | None = None, fingerprint: str | None = None,
                 strict: bool | None = None, **_native_only: Any):
        from . import resolve_url
        url = resolve_url(url)
        if not isinstance(url, str) or not url.strip():
            raise ValueError("an engine URL is empty; expected e.g. dask://host:8786 or ray://host:10001")
        self.url = url.strip().rstrip("/")
        parts = urlsplit(self.url)
        if not parts.hostname:
            raise ValueError(f"engine URL {self.url!r} names no host, e.g. dask://host:8786")
        try:
            self.host, self.port = parts.hostname, parts.port
        except ValueError:
            raise ValueError(f"engine URL {self.url!r} has an invalid port") from None
        self.token = token  # engines have their own security (TLS configs); kept for repr/pickle only
        self.fingerprint = None
        if fingerprint:
            raise EngineCannotExpress(f"fingerprint= pins a native coordinator's certificate; "
                                      f"{self.engine} uses its own TLS configuration")
        self.output = output if output is not None else limits.setting("GPUMESH_OUTPUT")
        self.strict = strict if strict is not None else limits.setting("GPUMESH_STRICT_RESULTS")
        if self.strict:
            raise EngineCannotExpress(f"strict results (JSON only) are a native-mesh feature; "
                                      f"{self.engine} unpickles results")
        self._lock = threading.RLock()
        self._engine: Any = None
        self._down_until = 0.0
        self._announced = False

    def __repr__(self) -> str:
        return f"GPUMesh({self.url!r})"

    def __reduce__(self):
        return (GPUMesh, (self.url, None))

    # ------------------------------------------------------------ native-only ---------
    @property
    def http(self):
        raise EngineCannotExpress(f"{self.url} is a {self.engine} cluster: there is no gpumesh "
                                  f"coordinator HTTP API to talk to")

    def _native_only(self, what: str):
        raise EngineCannotExpress(f"{what}() is a native-mesh feature; on {self.engine} use the "
                                  f"engine's own dashboard")

    def jobs(self, limit: int = 20):
        self._native_only("jobs")

    def status(self, job_id: str):
        self._native_only("status")

    def logs(self, job_id: str, task_id: str | None = None):
        self._native_only("logs")

    def cancel(self, job_id: str):
        self._native_only("cancel")

    def close(self) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            self._disconnect(engine)

    # ------------------------------------------------------------ the interface -------
    @abc.abstractmethod
    def _connect(self) -> Any:
        """Connect to the engine; returns its client object. Raises on failure."""

    def _disconnect(self, engine: Any) -> None:
        pass

    @abc.abstractmethod
    def _resources(self, require: hardware.Requirements | None) -> dict:
        """The engine's resource request for ``require``; raises EngineCannotExpress."""

    @abc.abstractmethod
    def _unsatisfiable(self, resources: dict, workers: list[dict]) -> str | None:
        """Why no worker can ever run a call needing ``resources`` (None if one can)."""

    @abc.abstractmethod
    def _engine_workers(self) -> list[dict]:
        """The engine's own view of its workers, as ``GPUMesh.workers()`` dicts."""

    def _run(self, fn: Callable, calls: list[_calls.Call], resources: dict, timeout: float | None,
             name: str) -> Iterator[tuple[int, tuple]]:
        """Run the calls; yields ``(index, outcome)`` as each finishes."""

    # ------------------------------------------------------------ connection ----------
    def _reachable(self) -> bool:
        with self._lock:
            if self._engine is not None:
                return True
            if time.monotonic() < self._down_until:
                return False
            try:
                self._engine = self._connect()
            except self.unreachable:
                notice(f"coordinator at {self.url} is unreachable; running locally")
                self._down_until = time.monotonic() + PROBE_DOWN_CACHE_S
                return False
            if not self._announced:
                self._announced = True
                notice(f"connected to {self.engine} at {self.url}")
            return True

    # ------------------------------------------------------------ pool ----------------
    def workers(self) -> list[dict]:
        """The engine's workers as gpumesh worker dicts (``id, hostname, alive, slots,
        slot_list, gpus, cores, ram_mb, running, engine``, plus ``resources``). Scores are
        not measured on engines (``score`` None). Raises MeshUnavailable if unreachable."""
        if not self._reachable():
            raise MeshUnavailable(f"the {self.engine} cluster at {self.url} is unreachable")
        return self._engine_workers()

    # ------------------------------------------------------------ calls ---------------
    def iter_calls(self, fn: Callable, calls: list[_calls.Call], *, hints: list[dict] | None = None,
                   timeout: float | None = None, name: str | None = None,
                   require: hardware.Requirements | None = None, return_exceptions: bool = False,
                   handle: Any = None, **options: Any):
        """As :meth:`GPUMesh.iter_calls`, on the engine (``run_calls`` collects it)."""
        if not calls:
            if handle is not None:
                yield None
            return
        unknown = sorted(k for k, v in options.items() if v is not None)
        if "retry" in unknown:
            raise EngineCannotExpress(f"retries=/retry_on= are a native-mesh feature; {self.engine} "
                                      f"retries lost tasks on its own, never raised exceptions")
        if unknown:
            raise EngineCannotExpress(f"the option(s) {unknown} have no {self.engine} equivalent")
        if limits.setting("GPUMESH_LOCAL"):
            notice("GPUMESH_LOCAL=1: running locally")
            yield from _mesh._started(handle, _mesh.iter_locally(fn, calls, return_exceptions))
            return
        if any(h.get("gpu_memory_mb") for h in hints or ()):
            raise EngineCannotExpress(f"{self.engine} cannot reserve GPU memory per task: drop the "
                                      f"gpu_memory_mb hint, or use the native mesh")
        resources = self._resources(require)
        if not self._reachable():
            _mesh.check_local(fn, require, hints, f"the {self.engine} cluster at {self.url} is unreachable")
            yield from _mesh._started(handle, _mesh.iter_locally(fn, calls, return_exceptions))
            return
        workers = self._engine_workers()
        if not any(w.get("alive", True) for w in workers):
            _mesh.check_local(fn, require, hints, f"no worker is alive in the {self.engine} cluster at {self.url}")
            notice(f"no live worker in the mesh at {self.url}; running locally")
            yield from _mesh._started(handle, _mesh.iter_locally(fn, calls, return_exceptions))
            return
        why = self._unsatisfiable(resources, workers)
        if why:
            raise Unsatisfiable(f"no {self.engine} worker at {self.url} can run "
                                f"{getattr(fn, '__qualname__', 'the function')} "
                                f"({require.describe() if require else resources}): {why}")
        label = f"{name or getattr(fn, '__qualname__', 'function')}-{secrets.token_hex(4)}"
        where = f"{self.engine} at {self.url}"
        n = len(calls)
        hint = _calls.keep_going(".imap()" if handle is not None else ".map()") \
            if n > 1 and not return_exceptions else ""
        run = self._run(fn, calls, resources, timeout, label)
        try:
            if handle is not None:
                yield None
            while True:
                try:
                    index, outcome = next(run)
                except StopIteration:
                    break
                except MeshError:
                    raise
                except Exception as e:  # the engine's own failure (worker died, result unpicklable...)
                    raise TaskFailed(f"{self.engine} could not run the task: {type(e).__name__}: {e}") from e
                try:
                    value = outcome_value(outcome, index, where, calls[index], n, hint,
                                          getattr(fn, "__qualname__", None))
                except Exception as e:  # noqa: BLE001 - what the task raised
                    if not return_exceptions:
                        raise
                    value = e
                yield index, value
        finally:
            run.close()  # a failure, Ctrl+C or a closed iterator: the generator cancels what is left
