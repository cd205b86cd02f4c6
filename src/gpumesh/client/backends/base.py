"""What every engine backend shares: the connection, the pool views, the checks.

A backend (``dask.py``, ``ray.py``) subclasses :class:`EngineMesh` and implements the
methods below; everything the decorators and the pool API call (``run_calls``,
``workers``, ``devices``, ``gpu_count``, ``total_score``...) is built on them, and calls
go through the caller's one pipeline (:mod:`gpumesh.client.pipeline`: routing, local
fallback on the inline backend, decoding) through :class:`EngineBackend`, so a call
means the same thing on every engine:

* ``_connect()`` -> an engine handle, or raise ``OSError``/``ConnectionError``/``TimeoutError``
  when the engine cannot be reached (the call then runs here, with the native mesh's notice);
* ``_resources(require)`` -> the engine's own resource request for ``gpu=``, ``cores=``,
  ``memory=``, or raise :class:`EngineCannotExpress`;
* ``_engine_workers()`` -> the engine's view of its workers, as native worker dicts
  (``id, hostname, alive, slots, slot_list, gpus, cores, ram_mb, scores...``);
* ``_run(fn, calls, resources, timeout, name)`` -> a generator of ``(index, outcome)`` in
  completion order; closing it early (a failure, Ctrl+C) cancels what is left.

Every task runs inside :data:`~gpumesh.client.taskwrap.run_task`, which catches what the
function raised and sends it back with its formatted traceback, so exceptions arrive as
themselves with a :class:`~gpumesh.errors.RemoteTraceback` cause, whatever the engine
does with errors (the inline backend runs calls inside the same wrapper).
"""

from __future__ import annotations

import abc
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from ... import hardware, limits
# EngineCannotExpress lives in errors.py (public, cheap to import); named here too, where
# it was defined before, for code that imports it from this module.
from ...errors import EngineCannotExpress, MeshError, MeshUnavailable, TaskFailed, Unsatisfiable
from ...limits import PROBE_DOWN_CACHE_S, PROBE_TIMEOUT_S
from .. import calls as _calls
from ..calls import outcome_value  # noqa: F401 - re-exported (it lived here)
from ..mesh import GPUMesh, notice
from ..pipeline import STARTED, Backend, Fallback, Job
from ..taskwrap import run_task  # noqa: F401 - re-exported for dask.py and ray.py


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
        self._lock = threading.RLock()  # type: ignore[assignment]  # (GPUMesh's, re-entrant here)
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

    def jobs(self, limit: int = 20, before: str | None = None, owner: str | None = None,
             state: str | None = None):
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

    def _run(self, fn: Callable, calls: list[_calls.Call], resources: dict,  # type: ignore[empty-body]
             timeout: float | None, name: str) -> Iterator[tuple[int, tuple]]:  # (each engine's)
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
    def _backend(self) -> EngineBackend:
        return EngineBackend(self)


class EngineBackend(Backend):
    """The pipeline's view of an :class:`EngineMesh` (see :mod:`gpumesh.client.pipeline`)."""

    def __init__(self, mesh: EngineMesh):
        self.mesh = mesh
        self.where = f"{mesh.engine} at {mesh.url}"
        self._resources: dict = {}

    def check(self, job: Job, local: bool = False) -> None:
        mesh = self.mesh
        if job.retry is not None:
            raise EngineCannotExpress(f"retries=/retry_on= are a native-mesh feature; {mesh.engine} "
                                      f"retries lost tasks on its own, never raised exceptions")
        if job.isolation != "task":
            raise EngineCannotExpress(f"the option(s) ['isolation'] have no {mesh.engine} equivalent")
        if local:
            return
        if any(h.get("gpu_memory_mb") for h in job.hints):
            raise EngineCannotExpress(f"{mesh.engine} cannot reserve GPU memory per task: drop the "
                                      f"gpu_memory_mb hint, or use the native mesh")
        self._resources = mesh._resources(job.require)

    def reachable(self) -> bool:
        return self.mesh._reachable()

    def unreachable_why(self) -> str:
        return f"the {self.mesh.engine} cluster at {self.mesh.url} is unreachable"

    def run(self, job: Job):
        mesh, resources, require = self.mesh, self._resources, job.require
        workers = mesh._engine_workers()
        if not any(w.get("alive", True) for w in workers):
            raise Fallback(f"no worker is alive in the {mesh.engine} cluster at {mesh.url}",
                           f"no live worker in the mesh at {mesh.url}; running locally")
        why = mesh._unsatisfiable(resources, workers)
        if why:
            raise Unsatisfiable(f"no {mesh.engine} worker at {mesh.url} can run "
                                f"{job.qualname or 'the function'} "
                                f"({require.describe() if require else resources}): {why}")
        label = f"{job.name or job.qualname or 'function'}-{secrets.token_hex(4)}"
        run = mesh._run(job.fn, job.calls, resources, job.timeout, label)
        try:
            yield STARTED
            while True:
                try:
                    index, outcome = next(run)
                except StopIteration:
                    break
                except MeshError:
                    raise
                except Exception as e:  # the engine's own failure (worker died, result unpicklable...)
                    raise TaskFailed(f"{mesh.engine} could not run the task: {type(e).__name__}: {e}") from e
                yield index, outcome
        finally:
            run.close()  # type: ignore[attr-defined]  # (a generator) a failure, Ctrl+C or a closed iterator: the generator cancels what is left
