"""``GPUMesh``: a caller's handle on one coordinator: the pool views, the people, script
jobs, and the entry of every call (``f(x)``, ``f.map(items)``, ``f.imap``, ``distribute``).

A call goes through the caller's one pipeline (:mod:`gpumesh.client.pipeline`): routing
(``GPUMESH_LOCAL=1``, an unreachable coordinator - probed with ``GET /v1/health``, cached
``PROBE_CACHE_S`` - or no live worker: the calls run here, on the inline backend, with a
remote call's semantics), decoding, the progress bar. This mesh's backend is the native
coordinator (:mod:`gpumesh.client.native`); ``dask://`` and ``ray://`` URLs are engine
backends (:mod:`gpumesh.client.backends`).

Values come in input order; the first failure cancels the rest and is raised as itself
(return_exceptions=True: every call runs, failures stand in their place; iter_calls
and .imap(): (index, value) as they finish, closing early cancels the rest).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

from .. import config, hardware, limits, protocol, versions
from ..errors import AuthError
from ..handoff import Handoff
from ..limits import PROBE_CACHE_S, PROBE_DOWN_CACHE_S, PROBE_TIMEOUT_S
from ..transport import Transport, Unreachable
from . import calls as _calls
from . import pipeline
from .paths import check_id, job_path
# Re-exported: what the rest of the client (and its users' tests) import from here.
from .pipeline import ISOLATIONS, check_isolation, check_local, notice  # noqa: F401
from .pipeline import check_timeout as _check_timeout

log = logging.getLogger("gpumesh.client")

_MISSING = object()
_UNPROBED = object()


def _machines_devices(devices: list[dict]) -> list[dict]:
    """The pool's physical devices among ``devices`` (as :meth:`GPUMesh.devices` lists
    them, one per worker): one per (host, kind, index, model), the best measured of the
    workers that share it."""
    best: dict[tuple, dict] = {}
    for d in devices:
        key = (d["hostname"] or d["worker"], d["kind"], d["index"], d["name"])
        seen = best.get(key)
        if seen is None or (d["score"] is not None
                            and (seen["score"] is None or d["score"] > seen["score"])):
            best[key] = d
    return list(best.values())


class GPUMesh:
    """A connection to a gpumesh coordinator.

    ``url``: ``http(s)://host:port``; ``None`` reads ``$GPUMESH_URL`` then the saved config.
    ``token``: the coordinator's token; ``None`` reads ``$GPUMESH_TOKEN`` then the config.
    ``output``: print what tasks print on this console, prefixed with the worker's name
    (default: on, unless ``$GPUMESH_OUTPUT=0``).
    ``fingerprint``: ``SHA256:<hex>`` of the coordinator's TLS certificate to pin (what
    ``gpumesh serve --tls`` printed); ``None`` reads ``$GPUMESH_FINGERPRINT``, then the
    saved config (for the saved URL only).
    ``strict``: accept only JSON results and never unpickle what workers send (see
    :mod:`gpumesh.strict`); default ``$GPUMESH_STRICT_RESULTS=1``.
    Raises ``ValueError`` for a URL that is not http(s). Creating one sends nothing.
    ``dask://host:8786`` (or ``tcp://``) and ``ray://host:10001`` / ``ray://auto`` URLs give
    the same API on a Dask or Ray cluster (:mod:`gpumesh.client.backends`).
    """

    def __new__(cls, url: str | None = None, *args: Any, **kwargs: Any):
        # dask://, tcp:// and ray:// URLs are served by an engine backend (client/backends/).
        if cls is GPUMesh:
            from .backends import backend_class
            cls = backend_class(url) or cls
        return super().__new__(cls)

    def __init__(self, url: str | None = None, token: str | None = None, *,
                 output: bool | None = None, fingerprint: str | None = None,
                 strict: bool | None = None):
        ep = config.resolve(url, token, fingerprint)
        #: Print what remote tasks print (default on; ``GPUMESH_OUTPUT=0`` turns it off).
        self.output = output if output is not None else limits.setting("GPUMESH_OUTPUT")
        #: Strict results: JSON only, nothing from a worker is unpickled.
        self.strict = strict if strict is not None else limits.setting("GPUMESH_STRICT_RESULTS")
        self.url, self.token, self.fingerprint = ep.url, ep.token, ep.fingerprint
        if self.fingerprint:
            from ..tls import normalise_fingerprint
            self.fingerprint = normalise_fingerprint(self.fingerprint)
            if not self.url.startswith("https://"):
                raise ValueError(f"a TLS fingerprint was given but {self.url} is not an https:// URL")
        self._http: Transport | None = None
        self._lock = threading.Lock()
        self._probe_ok_until = 0.0
        self._probe_down_until = 0.0
        self._known_blobs: set[str] = set()
        self._handoff: Handoff | None | object = _UNPROBED  # see the handoff property
        self._announced = False
        self.__janitor: Any = None
        self.__keepalive: Any = None
        #: The coordinator's GPUMESH_CALLER_TIMEOUT (s), from its health answer: the
        #: keepalive's pace (None until known).
        self._caller_timeout: float | None = None
        self.__native: Any = None

    def __repr__(self) -> str:
        return f"GPUMesh({self.url!r})"

    def __call__(self, fn: Any = None, **options: Any) -> Any:
        """``@m`` and ``@m(timeout=60, ...)``: the same as ``@accelerate(m, ...)``, so a
        mesh a program names ``mesh`` decorates as the default ``@mesh`` does. Raises
        ``TypeError`` for something that is not a function (as ``@accelerate`` does)."""
        from .remote import RemoteFunction
        if fn is None:
            return lambda f: RemoteFunction(f, self, options)
        return RemoteFunction(fn, self, options)

    def __reduce__(self):
        # A mesh captured by a shipped function travels without its token; inside a
        # task, mesh calls run inline anyway (see RemoteFunction.__call__).
        return (GPUMesh, (self.url, None))  # output= is a console choice of the caller

    @property
    def http(self) -> Transport:
        with self._lock:
            if self._http is None:
                self._http = Transport(self.url, self.token, fingerprint=self.fingerprint)
            return self._http

    @property
    def handoff(self) -> Handoff | None:
        """The coordinator's payload directories if this process shares its machine and
        user (big arguments and results then change hands as files; see
        :mod:`gpumesh.handoff`), else None. Asked once per mesh, on its first call."""
        if self._handoff is _UNPROBED:
            try:
                self._handoff = Handoff.probe(self.http)
            except (Unreachable, AuthError):  # the call itself will say so (what it was
                return None                     # refused: "submit jobs"); asked again next time
        return cast("Handoff | None", self._handoff)  # (probed by now)

    def close(self) -> None:
        """Send the releases still pending (so the coordinator frees the payloads of the
        calls already collected), then close the connection pool. A later call reopens it."""
        if self.__janitor is not None:
            self.__janitor.flush()
        if self._http is not None:
            self._http.close()
            self._http = None

    # ------------------------------------------------------------------ pool -------
    def workers(self) -> list[dict]:
        """Every worker the coordinator knows: dicts with ``id, device, device_name,
        hostname, score, alive`` (plus ``slots``, ``running``, ``cpu``, ``gpus``...), and
        what its owner's rules close: ``owner`` (``{"state", "label", "until"?}`` or None)
        and ``gpu_states`` (``{"0": {"state", "label"}}``; see docs/owner.md).
        ``score`` is the worker's best device score, None while its benchmark is pending
        (as in :meth:`devices`); ``scores`` has one per device once measured.

        Raises :class:`~gpumesh.errors.MeshUnavailable` if the coordinator does not
        answer, :class:`~gpumesh.errors.AuthError` if it refuses the token.
        """
        return self.http.request("GET", protocol.WORKERS, timeout=10).json()

    def jobs(self, limit: int = 20, before: str | None = None, owner: str | None = None,
             state: str | None = None) -> list[dict]:
        """The most recent jobs, newest first: ``id, name, kind, state, n_tasks, counts``.
        ``before``: a job id, for the jobs older than it (the next page: pass the last id
        of a page; a page shorter than ``limit`` is the last); ``owner``: one person's
        jobs only; ``state``: ``active``, ``finished`` or ``cancelled`` only."""
        params: dict = {"limit": limit}
        if isinstance(before, str):  # (the coordinator spells ids in lower case)
            before = before.lower()
        params.update({k: v for k, v in (("before", before), ("owner", owner), ("state", state))
                       if v is not None})
        return self.http.request("GET", protocol.JOBS, params=params, timeout=10).json()

    def status(self, job_id: str) -> dict:
        """One job: ``id, name, kind, state, n_tasks, counts`` (tasks per state),
        ``released`` and ``tasks``, one dict per task in index order: ``id, index, state,
        attempts, worker_id, cost, error`` and, for a done task, ``result``: the JSON
        value a script printed, or the value a function returned, decoded as the call
        would (unpickled; JSON when ``strict``). ``result_error`` says why a result could
        not be decoded here. ``released: True``: the job's results were collected by its
        caller (or let go) and deleted, so no task has ``result``. Works after a
        coordinator restart (results are stored). Raises RequestRejected (404) for an
        unknown job."""
        from .jobview import job_status
        return job_status(self, job_id)

    def logs(self, job_id: str, task_id: str | None = None) -> list[dict]:
        """What each task of a job printed: ``[{"id", "index", "state", "stdout", "stderr"}]``."""
        params = {"task": check_id(task_id, "task id", "`gpumesh status JOB`")} if task_id else None
        return self.http.request("GET", job_path(job_id, "logs"), params=params, timeout=30).json()["tasks"]

    def cancel(self, job_id: str) -> int:
        """Cancel every unfinished task of a job; running ones are killed on their workers.
        Returns how many tasks were cancelled (0 for a job that had already ended).
        Raises RequestRejected (404) for an unknown job."""
        return self.cancel_job(job_id)["cancelled"]

    def cancel_job(self, job_id: str) -> dict:
        """As :meth:`cancel`, returning the coordinator's answer: ``{"cancelled": n,
        "state": the job's state afterwards}``."""
        return self.http.request("POST", job_path(job_id, "cancel"), timeout=10).json()

    def retry(self, job_id: str) -> int:
        """Re-queue the failed tasks of a job (fresh attempts). Returns how many.
        Raises RequestRejected (404 unknown job, 410 arguments already released)."""
        return self.http.request("POST", job_path(job_id, "retry"), timeout=10).json()["retried"]

    # ------------------------------------------------------------------ people -----
    def add_token(self, name: str, role: str = "submit", max_running: int | None = None) -> dict:
        """Give the person ``name`` their own token (admin only). ``role``: ``admin``,
        ``submit``, ``view`` or ``worker``; ``max_running``: their cap on running tasks.
        Returns ``{"name", "role", "max_running", "created", "token"}``; the token is
        shown this once (the coordinator keeps only its SHA-256). Raises RequestRejected
        (400 bad name/role, 403 not an admin, 409 name taken)."""
        body = {"name": name, "role": role, "max_running": max_running}
        return self.http.request("POST", protocol.TOKENS, json=body, timeout=10).json()

    def tokens(self) -> list[dict]:
        """The people's tokens (admin only): ``[{"name", "role", "max_running", "created"}]``."""
        return self.http.request("GET", protocol.TOKENS, timeout=10).json()

    def revoke_token(self, name: str) -> str:
        """Revoke ``name``'s token at once (admin only); names are compared without case.
        Returns the name revoked (as it was added). Raises RequestRejected (404) for an
        unknown name."""
        return self.http.request("DELETE", protocol.token(name), timeout=10).json()["revoked"]

    def submit(self, name: str | None = None, script=None, payloads=(), *,
               timeout: float | None = None) -> str:
        """Submit a script job: ``python script`` runs once per payload on the mesh, the
        payload arriving as JSON on its stdin; each task's result is the last line of its
        stdout that parses as JSON. ``script``: a path (or the source as bytes). A payload
        that is a JSON object may carry the ``.map`` hints ``cost`` and ``gpu_memory_mb``
        (it still reaches the script whole). Returns the job id at once (see
        :meth:`status`, :meth:`wait`). Raises ``ValueError`` for an unreadable script, a
        payload that is not JSON or a hint that is not a number, or more payloads than
        ``MAX_TASKS_PER_JOB`` (read, like a map's items, before anything is sent; never
        more than one past it), and :class:`~gpumesh.errors.Unsatisfiable` for a ``gpu_memory_mb`` hint no alive
        worker's GPU could ever meet."""
        from . import scripts
        if script is None:
            raise ValueError("submit() needs script= (the path of a Python script)")
        return scripts.submit(self, script, _calls.read_input(payloads, "submit()", "payloads"),
                              name=name, timeout=_check_timeout(timeout))

    def wait(self, job_id: str, timeout: float | None = None) -> list[dict]:
        """Wait for a job to finish; one dict per task in payload (item) order:
        ``{"task_id", "index", "state", "worker", "error", "result"}``. ``result`` is
        decoded as :meth:`status` decodes it: for a script job the JSON value the script
        printed, for a function call or ``.map`` (made by another caller) the value the
        function returned, unpickled (never when ``strict``). It is None for a task that
        did not finish ``done``, and for one whose result cannot be decoded here, which
        has ``result_error`` (why) instead. Waiting reads the results without releasing
        them. ``timeout`` (seconds): ``TimeoutError`` if the job is not finished by then.
        Raises RequestRejected (404 unknown job; 410 a function job whose caller already
        collected its results, which deletes them)."""
        from . import scripts
        got = scripts.wait(self, job_id, timeout=timeout)
        return [dict(v, task_id=k) for k, v in sorted(got.items(), key=lambda kv: kv[1]["index"])]

    @staticmethod
    def results_to_dataframe(results):
        """A ``pandas.DataFrame`` from results, one row per item in item order: dicts
        become columns, other values a single ``result`` column. An exception in the list
        (``return_exceptions=True``), or a ``wait`` record of a task that failed, leaves its
        row's values missing and adds an ``error`` column (``"ValueError: diverged"``, None
        for the rows that did not fail) when some item failed. Requires pandas
        (``pip install pandas``)."""
        from .frames import results_to_dataframe
        return results_to_dataframe(results)

    def devices(self) -> list[dict]:
        """The pool as devices, strongest first: every GPU of every alive worker and each
        alive worker's CPU. Dicts with ``worker, hostname, kind`` (``"cuda"``, ``"mps"``,
        ``"cpu"``), ``device`` (``"cuda:0"``...), ``index, name, memory_total_mb,
        memory_free_mb`` (GPU memory; RAM for a CPU), ``cores, score`` (None until
        measured), ``slots`` and ``busy`` (slots on it, and how many run a task), ``state``
        (``{"state", "label"}`` while its owner's rules close it, else None)."""
        return hardware.pool_devices(self.workers())

    # The pool's size counts hardware, not workers (the spec: device_count is "alive
    # machines"): two workers started on one host share its CPU, and may both be given
    # its GPU, so device_count, gpu_count and total_score count such a device once.
    # devices() still lists each worker's, with its slots and busy count.

    def device_count(self) -> int:
        """How many machines contribute compute: alive workers counted once per host
        (a PC with a GPU and a CPU is one; two workers started on one host are one)."""
        return len({w.get("hostname") or w.get("id") for w in self.workers()
                    if w.get("alive", True)})

    def gpu_count(self) -> int:
        """How many GPUs (CUDA and MPS) the alive machines contribute; a GPU that two
        workers of one host both offer counts once."""
        return sum(1 for d in _machines_devices(self.devices()) if d["kind"] != "cpu")

    def total_score(self) -> float:
        """The combined benchmark score of the alive machines' devices, as a float: each
        device once (a host's CPU that two of its workers measured counts once, at its
        best score); devices still pending (score None) add nothing, and an empty pool
        gives 0.0."""
        return float(round(sum(float(d["score"]) for d in _machines_devices(self.devices())
                               if d["score"] is not None), 3))

    def auto_device(self) -> dict | None:
        """The alive device with the highest score (as in :meth:`devices`); None if the
        pool is empty."""
        devices = self.devices()
        return devices[0] if devices else None

    # ------------------------------------------------------------------ routing ----
    def _mesh_reachable(self) -> bool:
        now = time.monotonic()
        if now < self._probe_ok_until:
            return True
        if now < self._probe_down_until:  # a frozen coordinator costs one probe timeout, not one per call
            return False
        try:
            health = self.http.request("GET", protocol.HEALTH, timeout=PROBE_TIMEOUT_S)
        except Unreachable:
            notice(f"coordinator at {self.url} is unreachable; running locally")
            self._probe_down_until = time.monotonic() + PROBE_DOWN_CACHE_S
            return False
        try:
            answer = health.json()
            theirs = answer.get("version")
            timeout = answer.get("caller_timeout")
            if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
                self._caller_timeout = float(timeout)
        except (ValueError, AttributeError):
            theirs = None
        # Another version is a refusal, never a silent local run (like a refused token).
        versions.check_coordinator(theirs, self.url, "caller")
        self._probe_ok_until = now + PROBE_CACHE_S
        return True

    def _heard_from(self) -> None:
        """The coordinator just answered a call: as good as a healthy probe, so the next
        ``PROBE_CACHE_S`` of calls need none (a call after a short pause would otherwise
        pay a ``GET /v1/health`` round trip first). Should it go away meanwhile, a submit
        that could not be sent still runs the call here."""
        self._probe_ok_until = time.monotonic() + PROBE_CACHE_S

    # ------------------------------------------------------------------ calls ------
    def run_calls(self, fn: Callable, calls: list[_calls.Call], *, hints: list[dict] | None = None,
                  timeout: float | None = None, name: str | None = None,
                  require: hardware.Requirements | None = None, return_exceptions: bool = False,
                  retry: tuple[int, tuple] | None = None,
                  isolation: str | None = None, entry: str | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` for each ``(args, kwargs)`` in ``calls``; values in
        order. Runs here when the mesh is unavailable (see the module docstring).
        ``isolation``: ``"task"`` (None, the default: a fresh process per task) or ``"job"``
        (each worker slot keeps one process for this job's tasks).
        ``require``: hardware every task needs; :class:`~gpumesh.errors.Unsatisfiable` if
        no alive worker (nor, when none is alive, this machine) can ever provide it.
        ``return_exceptions``: every call runs, and a failed one's exception takes its
        place in the list (default: the first failure is raised and the rest cancelled).
        ``retry``: ``(retries, exception types)`` (see :mod:`gpumesh.retries`). ``entry``:
        the call a failure's advice names (default ``.map()``).
        :class:`~gpumesh.errors.WorkerLost` once no worker that can run the calls has been
        alive for ``timeout`` seconds (without one, ``NO_WORKER_WAIT_S``:
        ``$GPUMESH_NO_WORKER_TIMEOUT``); the job is cancelled (with ``return_exceptions``,
        each unfinished call's place holds that WorkerLost).
        """
        __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
        values: list[Any] = [_MISSING] * len(calls)
        # (drained: a task's StopIteration is raised as itself, not as PEP 479's RuntimeError)
        for index, value in pipeline.drained(self.iter_calls(
                fn, calls, hints=hints, timeout=timeout, name=name, require=require,
                return_exceptions=return_exceptions, retry=retry, isolation=isolation,
                entry=entry)):
            values[index] = value
        return values

    def iter_calls(self, fn: Callable, calls: list[_calls.Call], *, hints: list[dict] | None = None,
                   timeout: float | None = None, name: str | None = None,
                   require: hardware.Requirements | None = None, return_exceptions: bool = False,
                   retry: tuple[int, tuple] | None = None, handle: Any = None,
                   isolation: str | None = None, entry: str | None = None):
        """As :meth:`run_calls`, yielding ``(index, value)`` as each call finishes. Closing
        the generator before the end cancels the calls still running. With ``handle``
        (a dict, see :class:`~gpumesh.client.sweep.Results`), the job is submitted
        without waiting for a first result, ``handle["job_id"]`` is set, and the generator
        yields ``None`` once the calls are under way (before any result)."""
        __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
        pipeline.check_function(fn, "run_calls()/iter_calls()")
        job = pipeline.Job(fn, calls, hints or [{}] * len(calls), timeout=timeout, name=name,
                           require=require, retry=retry, isolation=check_isolation(isolation),
                           return_exceptions=return_exceptions, streaming=handle is not None,
                           entry=entry)
        return pipeline.run(self, job, handle)

    def _backend(self) -> pipeline.Backend:
        """What runs this mesh's calls when it is reachable (see :mod:`.pipeline`)."""
        with self._lock:
            if self.__native is None:
                from .native import NativeBackend
                self.__native = NativeBackend(self)
            return self.__native

    def _start_keepalive(self) -> None:
        """Start this mesh's keepalive thread, once (see :mod:`.keepalive`)."""
        with self._lock:
            if self.__keepalive is None:
                from .keepalive import Keepalive
                self.__keepalive = Keepalive(self)

    @property
    def _janitor(self):
        with self._lock:
            if self.__janitor is None:
                from .native import Janitor
                self.__janitor = Janitor(self)
            return self.__janitor

    # ------------------------------------------------------------------ API --------
    def distribute(self, function: Callable, params: Iterable[Any], timeout: float | None = None,
                   return_exceptions: bool = False, isolation: str | None = None) -> list[Any]:
        """Run ``function`` once per item of ``params`` (dicts are keyword arguments) across
        the mesh; returns the values in input order. ``timeout`` (seconds) applies to each
        task. Raises what a task raised (see :mod:`gpumesh.errors`), and cancels the rest;
        with ``return_exceptions=True`` every item runs and a failed item's exception
        stands in its place in the list. ``isolation``: ``"task"`` or ``"job"`` as for
        ``@accelerate`` (default: the decorated function's, else ``"task"``; anything else
        is a ``ValueError``). A generator function or an ``async def`` is a ``TypeError``
        before anything runs, as for ``@accelerate``. ``params`` is read whole before
        anything is submitted, as ``.map`` reads its items."""
        from .remote import unwrap
        if isolation is None:
            isolation = getattr(function, "options", {}).get("isolation")
        isolation = check_isolation(isolation)
        fn = unwrap(function)
        pipeline.check_function(fn, "distribute()")
        calls, hints = _calls.map_items(fn, _calls.read_input(params, "distribute()"))
        extra: dict[str, Any] = {} if isolation == "task" else {"isolation": isolation}
        return self.run_calls(fn, calls, hints=hints, timeout=_check_timeout(timeout),
                              return_exceptions=bool(return_exceptions), entry="distribute()",
                              **extra)

    @staticmethod
    def start_coordinator(port: int = 8000, token: str | None = None, host: str = "127.0.0.1",
                          data_dir: str | None = None, self_worker: bool = True,
                          detach: bool = False):
        """Start ``gpumesh serve`` in a background process and return once it answers.

        Returns a :class:`~gpumesh.client.processes.CoordinatorHandle` (``.url``,
        ``.token``, ``.stop()``, ``.process``, ``.log_path``; also a context manager that
        stops it). Without ``token``: the one this process gave the coordinator at this
        URL before, else the one the saved config holds for it (as ``gpumesh serve``
        does), else a new one. The saved config is never written (``serve
        --no-save-config``): callers of it pass its ``.url`` and ``.token``. Raises
        :class:`~gpumesh.errors.StartFailed` (a ``MeshError`` and a ``RuntimeError``) with
        the server's own message and its log file's path if it fails to start, and,
        naming the port and starting nothing, when something already listens on it.

        The coordinator (with its self-worker) is this program's: ``stop()``, the end of
        a ``with`` block, or else this program's exit stops it. ``detach=True`` leaves it
        running after the program ends (stop it by its PID, ``.process.pid``). Its output
        goes to ``gpumesh-coordinator-*.log`` in the temporary directory (``$TMPDIR``,
        else ``/tmp``; ``.log_path``), removed once it stopped cleanly and kept when it
        failed, exited with an error or is detached.
        """
        from .processes import start_coordinator
        return start_coordinator(port=port, token=token, host=host, data_dir=data_dir,
                                 self_worker=self_worker, detach=detach)

    @staticmethod
    def add_worker(url: str, token: str | None = None, slots: int = 1, detach: bool = False):
        """Start ``gpumesh join url`` in a background process; returns the new worker's
        description (a dict as in :meth:`workers`, with ``.stop()``, ``.process`` and
        ``.log_path``; also a context manager that stops it) once registered. Raises
        :class:`~gpumesh.errors.StartFailed` with the worker's own message and its log
        file's path if it exits or does not register in time.

        As for :meth:`start_coordinator`: stopped by ``stop()``, a ``with`` block's end or
        this program's exit unless ``detach=True``; its output goes to
        ``gpumesh-worker-*.log`` in the temporary directory, removed once it stopped
        cleanly."""
        from .processes import add_worker
        return add_worker(url, token=token, slots=slots, detach=detach)
