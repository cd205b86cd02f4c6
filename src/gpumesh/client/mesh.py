"""``GPUMesh``: a caller's handle on one coordinator.

The life of a call (``f(x)`` or ``f.map(items)``)::

    route ── GPUMESH_LOCAL=1, coordinator down, or no live worker ──► run here, in-process
      │ (probe GET /v1/health, cached PROBE_CACHE_S)
      ▼
    pickle the function once (content-addressed: sha256); upload it only if the
    coordinator lacks it (small ones ride inside the submit)
      ▼
    POST /v1/jobs  one request for the whole batch, idempotent on the job id
      │   409 no_workers ──► run here (nothing was stored)
      ▼
    GET /v1/jobs/{id}/results?after=seq  long-poll; pages of results stream in
      ▼
    values in input order; the first failure cancels the rest and is raised as itself
    (return_exceptions=True: every call runs, failures stand in their place; iter_calls
    and .imap(): (index, value) as they finish, closing early cancels the rest)

Once the coordinator has accepted a job the call never silently re-runs locally (that
would run side effects twice): losing the coordinator then means waiting for it (up to
``CALLER_RECONNECT_S``) and then :class:`~gpumesh.errors.MeshUnavailable`. Losing every
worker means waiting for one to (re)join, for the call's ``timeout=`` or, without one,
``NO_WORKER_WAIT_S``, and then :class:`~gpumesh.errors.WorkerLost`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .. import config, hardware, limits, retries, tracing, versions, wire
from ..handoff import Handoff, worth_it
from ..errors import MeshUnavailable, RequestRejected, Unsatisfiable, WorkerLost
from ..limits import (CALLER_RECONNECT_S, INLINE_FUNCTION_BYTES, LONG_POLL_S, NO_WORKER_WAIT_S,
                      PROBE_CACHE_S, PROBE_DOWN_CACHE_S, PROBE_TIMEOUT_S, RELEASE_BATCH_MAX,
                      RELEASE_BATCH_S)
from ..transport import Transport, Unreachable
from . import calls as _calls
from .console import OutputPrinter
from .paths import job_path
from .progress import Progress

log = logging.getLogger("gpumesh.client")

_MISSING = object()
_UNPROBED = object()
_HOSTNAME = socket.gethostname()
_notices: set[str] = set()
_notice_lock = threading.Lock()


def notice(text: str) -> None:
    """Print a one-line notice to stderr, once per process per distinct text."""
    with _notice_lock:
        if text in _notices:
            return
        _notices.add(text)
    print(f"[gpumesh] {text}", file=sys.stderr, flush=True)


def _backoff(attempt: int) -> float:
    import random
    return random.uniform(0, min(5.0, 0.2 * 2 ** min(attempt, 10)))


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
        self.__janitor: _Janitor | None = None

    def __repr__(self) -> str:
        return f"GPUMesh({self.url!r})"

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
            except Unreachable:  # the call itself will say so; asked again next time
                return None
        return self._handoff

    def close(self) -> None:
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
        return self.http.request("GET", "/v1/workers", timeout=10).json()

    def jobs(self, limit: int = 20) -> list[dict]:
        """The most recent jobs, newest first: ``id, name, kind, state, n_tasks, counts``."""
        return self.http.request("GET", "/v1/jobs", params={"limit": limit}, timeout=10).json()

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
        params = {"task": task_id} if task_id else None
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
        return self.http.request("POST", "/v1/tokens", json=body, timeout=10).json()

    def tokens(self) -> list[dict]:
        """The people's tokens (admin only): ``[{"name", "role", "max_running", "created"}]``."""
        return self.http.request("GET", "/v1/tokens", timeout=10).json()

    def revoke_token(self, name: str) -> None:
        """Revoke ``name``'s token at once (admin only). Raises RequestRejected (404) for
        an unknown name."""
        from urllib.parse import quote
        self.http.request("DELETE", f"/v1/tokens/{quote(name, safe='')}", timeout=10)

    def submit(self, name: str | None = None, script=None, payloads=(), *,
               timeout: float | None = None) -> str:
        """Submit a script job: ``python script`` runs once per payload on the mesh, the
        payload arriving as JSON on its stdin; each task's result is the last line of its
        stdout that parses as JSON. ``script``: a path (or the source as bytes). A payload
        that is a JSON object may carry the ``.map`` hints ``cost`` and ``gpu_memory_mb``
        (it still reaches the script whole). Returns the job id at once (see
        :meth:`status`, :meth:`wait`). Raises ``ValueError`` for an unreadable script, a
        payload that is not JSON or a hint that is not a number, and
        :class:`~gpumesh.errors.Unsatisfiable` for a ``gpu_memory_mb`` hint no alive
        worker's GPU could ever meet."""
        from . import scripts
        if script is None:
            raise ValueError("submit() needs script= (the path of a Python script)")
        return scripts.submit(self, script, list(payloads), name=name, timeout=_check_timeout(timeout))

    def wait(self, job_id: str, timeout: float | None = None) -> list[dict]:
        """Wait for a script job to finish; one dict per task in payload order:
        ``{"task_id", "index", "state", "worker", "error", "result"}`` (``result`` is the
        JSON value the script printed, None if the task failed)."""
        from . import scripts
        got = scripts.wait(self, job_id, timeout=timeout)
        return [dict(v, task_id=k) for k, v in sorted(got.items(), key=lambda kv: kv[1]["index"])]

    @staticmethod
    def results_to_dataframe(results):
        """A ``pandas.DataFrame`` from results: dicts become columns (one row each), other
        values a single ``result`` column. Requires pandas (``pip install pandas``)."""
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

    def device_count(self) -> int:
        """How many machines contribute compute: alive workers counted once per host
        (a PC with a GPU and a CPU is one; two workers started on one host are one)."""
        return len({w.get("hostname") or w.get("id") for w in self.workers()
                    if w.get("alive", True)})

    def gpu_count(self) -> int:
        """How many GPUs (CUDA and MPS) the alive workers contribute; a GPU that two
        workers of one host both offer counts once."""
        return len({(d["hostname"] or d["worker"], d["kind"], d["index"], d["name"])
                    for d in self.devices() if d["kind"] != "cpu"})

    def total_score(self) -> float:
        """The sum of the alive devices' measured benchmark scores, as a float; devices
        still pending (score None) add nothing, and an empty pool gives 0.0."""
        return float(round(sum(float(d["score"]) for d in self.devices()
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
            health = self.http.request("GET", "/v1/health", timeout=PROBE_TIMEOUT_S)
        except Unreachable:
            notice(f"coordinator at {self.url} is unreachable; running locally")
            self._probe_down_until = time.monotonic() + PROBE_DOWN_CACHE_S
            return False
        try:
            theirs = health.json().get("version")
        except (ValueError, AttributeError):
            theirs = None
        # Another version is a refusal, never a silent local run (like a refused token).
        versions.check_coordinator(theirs, self.url, "caller")
        self._probe_ok_until = now + PROBE_CACHE_S
        return True

    # ------------------------------------------------------------------ calls ------
    def run_calls(self, fn: Callable, calls: list[_calls.Call], *, hints: list[dict] | None = None,
                  timeout: float | None = None, name: str | None = None,
                  require: hardware.Requirements | None = None, return_exceptions: bool = False,
                  retry: tuple[int, tuple] | None = None,
                  isolation: str | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` for each ``(args, kwargs)`` in ``calls``; values in
        order. Runs here when the mesh is unavailable (see the module docstring).
        ``isolation``: ``"task"`` (None, the default: a fresh process per task) or ``"job"``
        (each worker slot keeps one process for this job's tasks).
        ``require``: hardware every task needs; :class:`~gpumesh.errors.Unsatisfiable` if
        no alive worker (nor, when none is alive, this machine) can ever provide it.
        ``return_exceptions``: every call runs, and a failed one's exception takes its
        place in the list (default: the first failure is raised and the rest cancelled).
        ``retry``: ``(retries, exception types)`` (see :mod:`gpumesh.retries`).
        :class:`~gpumesh.errors.WorkerLost` once no worker that can run the calls has been
        alive for ``timeout`` seconds (without one, ``NO_WORKER_WAIT_S``:
        ``$GPUMESH_NO_WORKER_TIMEOUT``); the job is cancelled (with ``return_exceptions``,
        each unfinished call's place holds that WorkerLost).
        """
        values: list[Any] = [_MISSING] * len(calls)
        for index, value in self.iter_calls(fn, calls, hints=hints, timeout=timeout, name=name,
                                            require=require, return_exceptions=return_exceptions,
                                            retry=retry, isolation=isolation):
            values[index] = value
        return values

    def iter_calls(self, fn: Callable, calls: list[_calls.Call], *, hints: list[dict] | None = None,
                   timeout: float | None = None, name: str | None = None,
                   require: hardware.Requirements | None = None, return_exceptions: bool = False,
                   retry: tuple[int, tuple] | None = None, handle: Any = None,
                   isolation: str | None = None):
        """As :meth:`run_calls`, yielding ``(index, value)`` as each call finishes. Closing
        the generator before the end cancels the calls still running. With ``handle``
        (a dict, see :class:`~gpumesh.client.sweep.Results`), the job is submitted
        without waiting for a first result, ``handle["job_id"]`` is set, and the generator
        yields ``None`` once the calls are under way (before any result)."""
        if not calls:
            if handle is not None:
                yield None
            return
        if limits.setting("GPUMESH_LOCAL"):
            notice("GPUMESH_LOCAL=1: running locally")
            yield from _started(handle, iter_locally(fn, calls, return_exceptions, retry))
            return
        if not self._mesh_reachable():
            check_local(fn, require, hints, f"the coordinator at {self.url} is unreachable")
            yield from _started(handle, iter_locally(fn, calls, return_exceptions, retry))
            return
        job_id = secrets.token_hex(6)
        printer = OutputPrinter(single=len(calls) == 1) if self.output else None
        bar = None
        collected = accepted = False
        started = time.monotonic()  # the batch's start: the bar's delay, rate and ETA count from here
        try:
            first = self._submit(job_id, fn, calls, hints or [{}] * len(calls), timeout, name,
                                 printer is not None, require=require, retry=retry,
                                 wait=0 if handle is not None else LONG_POLL_S,
                                 isolation=check_isolation(isolation))
            if first is None:
                check_local(fn, require, hints, f"no worker is alive in the mesh at {self.url}")
                notice(f"no live worker in the mesh at {self.url}; running locally")
                collected = True  # nothing was stored
                yield from _started(handle, iter_locally(fn, calls, return_exceptions, retry))
                return
            accepted = True
            if handle is not None:
                first = bytearray()  # (a submit that did not wait answers JSON, not a page)
            if not self._announced:  # said once the mesh took a job: token and workers are fine
                self._announced = True
                notice(f"connected to coordinator at {self.url}")
            if handle is not None:
                handle["job_id"] = job_id
                yield None
            if len(calls) > 1:  # a batch: a bar once it takes over a second (terminal/notebook)
                bar = Progress(len(calls), name or getattr(fn, "__qualname__", "tasks"),
                               started=started)
            yield from self._collect(job_id, calls, first, printer, bar, return_exceptions,
                                     ".imap()" if handle is not None else ".map()",
                                     getattr(fn, "__qualname__", None), timeout=timeout)
            collected = True
        finally:
            if bar is not None:
                bar.close()
            if printer is not None:
                printer.flush()
            if not collected:  # Ctrl+C, a task failure, a lost coordinator, a closed iterator
                self._cancel_quietly(job_id)
                if accepted:  # and free its stored arguments and results: nobody will read them
                    self._janitor.release(job_id)

    def _submit(self, job_id: str, fn: Callable, calls: list[_calls.Call], hints: list[dict],
                timeout: float | None, name: str | None, output: bool,
                require: hardware.Requirements | None = None, retry: tuple[int, tuple] | None = None,
                wait: float = LONG_POLL_S, isolation: str = "task") -> bytearray | None:
        """Submit the job and wait briefly (up to ``wait`` s) for its first results in the
        same round trip. Returns that first results page, or None if the mesh has no live
        worker."""
        fn_payload = wire.dumps(fn, code=True)
        fn_hash = fn_payload.sha256()
        args = [_dump_call(fn, c, i, len(calls)) for i, c in enumerate(calls)]
        if fn_payload.by_value or any(a.by_value for a in args):
            # Bytecode travels: only workers of this Python minor version can load it safely.
            require = dataclasses.replace(require or hardware.Requirements(),
                                          python=versions.python_minor())
        inline = fn_hash not in self._known_blobs and fn_payload.size <= INLINE_FUNCTION_BYTES
        if fn_hash not in self._known_blobs and not inline:
            self._upload_blob(fn_hash, fn_payload)
        meta = {"job_id": job_id, "kind": "function", "fn": fn_hash, "fn_inline": inline,
                "n_tasks": len(calls), "timeout": timeout, "require_worker": True,
                "name": name or getattr(fn, "__qualname__", "function"),
                "costs": [h.get("cost", 1.0) for h in hints], "wait": wait,
                "output": output, "caller": {"host": _HOSTNAME, "pid": os.getpid()}}
        if self.strict:
            meta["result_format"] = "json"  # the task answers in JSON; nothing is unpickled
        if isolation != "task":
            meta["isolation"] = isolation
        if require:
            meta["require"] = require.to_meta()
        if retry:
            meta.update(retries.to_meta(*retry))
        if any(h.get("gpu_memory_mb") for h in hints):
            meta["gpu_memory_mb"] = [h.get("gpu_memory_mb") for h in hints]
        handoff = self.handoff
        if handoff is not None:
            meta["handoff"] = True  # big results come back as paths to map
        written: list[str] = []  # handoff files: claimed by the coordinator, or deleted below
        try:
            return self._send_job(meta, fn_hash, fn_payload, inline, args, handoff, written)
        finally:
            for name in written:
                handoff.discard(name)

    def _send_job(self, meta: dict, fn_hash: str, fn_payload: wire.Payload, inline: bool,
                  args: list[wire.Payload], handoff: Handoff | None,
                  written: list[str]) -> bytearray | None:
        """POST the job (see _submit); resent until it is stored or refused."""
        frames: list = [json.dumps(meta).encode()]
        if inline:
            frames.append(fn_payload)
        if handoff is not None and any(worth_it(a.size) for a in args):
            # Same machine: big arguments go as files the coordinator renames into its
            # store (gpumesh.handoff) and their frames stay empty.
            files = {}
            for a in args:
                if worth_it(a.size):
                    written.append(handoff.write(a.chunks))
                    files[str(len(frames) - 1)] = written[-1]
                    a = b""
                frames.append(a)
            frames[0] = json.dumps(dict(meta, handoff_files=files)).encode()
        else:
            frames.extend(args)
        chunks, size = wire.pack_frames(frames)
        deadline = time.monotonic() + CALLER_RECONNECT_S
        attempt = 0
        while True:
            try:
                tracing.mark("caller.submit")
                page = self.http.stream_into(
                    "POST", "/v1/jobs", content=wire.iter_chunks(chunks),
                    headers={"content-type": "application/x-gpumesh-frames",
                             "content-length": str(size)}, timeout=LONG_POLL_S + 600)
                tracing.mark("caller.answered")
                self._known_blobs.add(fn_hash)
                return page if page is not None else bytearray()
            except RequestRejected as e:
                code = getattr(e, "code", "")
                if code == "no_workers":
                    return None
                if code == "unsatisfiable":  # nothing was stored; the message lists the pool
                    raise Unsatisfiable(str(e).rsplit(" (HTTP", 1)[0]) from None
                if code == "missing_blob":  # coordinator lost it (fresh data dir): upload
                    self._known_blobs.discard(fn_hash)
                    self._upload_blob(fn_hash, fn_payload)
                    continue
                if code == "handoff_missing" and handoff is not None:
                    # Its handoff directory is not the one we wrote to (restarted, or a
                    # look-alike path): send the bytes, and stop handing off to it.
                    self._handoff = None
                    return self._send_job(dict(meta, handoff=False), fn_hash, fn_payload,
                                          inline, args, None, written)
                raise
            except Unreachable as e:
                # Idempotent on job_id: resending is safe whether or not it arrived.
                if not e.sent and attempt == 0:
                    notice(f"coordinator at {self.url} is unreachable; running locally")
                    self._probe_ok_until = 0.0
                    return None
                if time.monotonic() > deadline:
                    raise MeshUnavailable(f"could not submit to {self.url} for "
                                          f"{CALLER_RECONNECT_S:.0f}s: {e}") from e
                time.sleep(_backoff(attempt))
                attempt += 1

    def _upload_blob(self, h: str, payload: wire.Payload) -> None:
        try:
            self.http.request("HEAD", f"/v1/blobs/{h}", timeout=10)
            self._known_blobs.add(h)
            return
        except RequestRejected as e:
            if e.status != 404:
                raise
        self.http.request("PUT", f"/v1/blobs/{h}", content=wire.iter_chunks(payload.chunks),
                          headers={"content-length": str(payload.size)}, timeout=600)
        self._known_blobs.add(h)

    def _collect(self, job_id: str, calls: list[_calls.Call], body: bytearray | None,
                 printer: OutputPrinter | None, bar: Progress | None = None,
                 return_exceptions: bool = False, via: str = ".map()", name: str | None = None,
                 timeout: float | None = None):
        """Read result pages (the first came with the submit) until all calls' results are
        in; yields ``(index, value)`` as they come. A failure is yielded as its exception
        with ``return_exceptions``, else raised (its text says how to keep going).
        Once pages have said "no worker can run it" for ``timeout`` seconds (None:
        NO_WORKER_WAIT_S), WorkerLost is raised (the caller then cancels the job), or with
        ``return_exceptions`` the job is cancelled here and each unfinished call gets it."""
        n = len(calls)
        seen = bytearray(n)  # 1 once an index's result was delivered: never twice
        hint = _calls.keep_going(via) if n > 1 and not return_exceptions else ""
        tally = {"done": 0, "failed": 0, "cancelled": 0}
        got, after, out_after, attempt = 0, -1, -1, 0
        last_contact = time.monotonic()
        handoff = self.handoff
        # Nothing runs the job's tasks while the pool is empty: a task's timeout never
        # starts, so the wait for a worker to (re)join is bounded here instead.
        alone_limit = NO_WORKER_WAIT_S if timeout is None else timeout
        alone_since: float | None = None
        nobody = "no worker"  # or, with workers alive that cannot run the tasks, which one
        while True:
            if body:
                page, frames = self._read_page(body)
                able = page.get("workers_able", page.get("workers_alive"))
                if able == 0:
                    alone_since = alone_since or time.monotonic()
                    if page.get("workers_alive"):  # e.g. the only GPU box went, CPUs remain
                        nobody = "no worker that can run its tasks"
                        notice(f"no live worker in the mesh at {self.url} can run job {job_id}'s "
                               f"tasks; waiting for one to (re)join (for up to {alone_limit:g}s)")
                    elif not page["results"]:
                        nobody = "no worker"
                        notice(f"no live worker in the mesh at {self.url}; job {job_id} is "
                               f"waiting for one to (re)join (for up to {alone_limit:g}s)")
                elif able is not None:
                    alone_since = None
                k = 1 + sum(1 for item in page["results"] if item["has_payload"])
                if printer is not None:
                    # Output first: a task's prints come before its result (and its error).
                    printer.skipped(page.get("output_skipped", 0))
                    for chunk, data in zip(page.get("output", []), frames[k:]):
                        printer.write(chunk, data)
                        out_after = max(out_after, chunk["seq"])
                k = 1
                for item in page["results"]:
                    payload = None
                    if item["has_payload"]:
                        payload, k = frames[k], k + 1
                    elif "file" in item:  # same machine: map the store's file (gpumesh.handoff)
                        try:
                            payload = handoff.open(item["file"])
                        except (OSError, AttributeError):  # gone (or not ours): ask over HTTP
                            handoff = None
                            break  # re-read from this result on
                    idx = item["index"]
                    after = max(after, item["seq"])
                    if seen[idx]:  # never deliver a result twice
                        continue
                    seen[idx] = 1
                    got += 1
                    tally[item["state"] if item["state"] in tally else "failed"] += 1
                    try:
                        value = _calls.decode_result(item, payload, self.strict, call=calls[idx],
                                                     n=n, hint=hint, name=name)
                    except Exception as e:  # noqa: BLE001 - what the task raised
                        if not return_exceptions:
                            raise
                        value = e
                    if bar is not None:
                        bar.update(got, failed=tally["failed"], cancelled=tally["cancelled"])
                    yield idx, value
                del frames, page
            if got >= n:
                break
            wait = LONG_POLL_S
            if alone_since is not None:
                alone = time.monotonic() - alone_since
                if alone >= alone_limit:
                    why = (f"the call's timeout={timeout:g}s" if timeout is not None else
                           f"the wait without a timeout=, GPUMESH_NO_WORKER_TIMEOUT="
                           f"{alone_limit:g}s")
                    lost = WorkerLost(f"{nobody} has been alive in the mesh at {self.url} for "
                                      f"{alone:.0f}s ({why}); {n - got} of {n} task(s) of job "
                                      f"{job_id} did not finish and were cancelled")
                    if not return_exceptions:
                        raise lost
                    self._cancel_quietly(job_id)  # no task of it may run later
                    for idx in range(n):
                        if not seen[idx]:
                            seen[idx] = 1
                            yield idx, lost
                    break
                wait = min(wait, max(0.05, alone_limit - alone))  # wake up when the time is up
            params = {"after": after, "wait": wait}
            if handoff is not None:
                params["handoff"] = 1
            if printer is not None:
                params["out_after"] = out_after
            try:
                body = self.http.stream_into("GET", f"/v1/jobs/{job_id}/results", params=params,
                                             timeout=wait + 15)
                last_contact, attempt = time.monotonic(), 0
            except Unreachable as e:
                alone_since = None  # the pool is unknown until the coordinator answers again
                if time.monotonic() - last_contact > CALLER_RECONNECT_S:
                    raise MeshUnavailable(
                        f"lost the coordinator at {self.url} for over {CALLER_RECONNECT_S:.0f}s "
                        f"while waiting for job {job_id}: {e}") from e
                time.sleep(_backoff(attempt))
                attempt += 1
                body = None
        self._janitor.release(job_id)

    @staticmethod
    def _read_page(body: bytearray) -> tuple[dict, list[memoryview]]:
        frames = wire.unpack_frames(body)
        return json.loads(bytes(frames[0])), frames

    def _cancel_quietly(self, job_id: str) -> None:
        try:
            self.http.request("POST", f"/v1/jobs/{job_id}/cancel", timeout=5)
        except Exception as e:  # noqa: BLE001 - the original error matters more
            log.debug("cancel of %s failed: %s", job_id, e)

    @property
    def _janitor(self) -> _Janitor:
        with self._lock:
            if self.__janitor is None:
                self.__janitor = _Janitor(self)
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
        is a ``ValueError``)."""
        from .remote import unwrap
        if isolation is None:
            isolation = getattr(function, "options", {}).get("isolation")
        isolation = check_isolation(isolation)
        fn = unwrap(function)
        calls, hints = _calls.map_items(fn, params)
        extra = {} if isolation == "task" else {"isolation": isolation}
        return self.run_calls(fn, calls, hints=hints, timeout=_check_timeout(timeout),
                              return_exceptions=bool(return_exceptions), **extra)

    @staticmethod
    def start_coordinator(port: int = 8000, token: str | None = None, host: str = "127.0.0.1",
                          data_dir: str | None = None, self_worker: bool = True):
        """Start ``gpumesh serve`` in a background process and return once it answers.

        Returns a :class:`~gpumesh.client.processes.CoordinatorHandle` (``.url``,
        ``.token``, ``.stop()``; also a context manager). Raises ``RuntimeError`` with
        the server's own message if it fails to start.
        """
        from .processes import start_coordinator
        return start_coordinator(port=port, token=token, host=host, data_dir=data_dir,
                                 self_worker=self_worker)

    @staticmethod
    def add_worker(url: str, token: str | None = None, slots: int = 1):
        """Start ``gpumesh join url`` in a background process; returns the new worker's
        description (a dict as in :meth:`workers`, with ``.stop()``) once registered."""
        from .processes import add_worker
        return add_worker(url, token=token, slots=slots)


class _Janitor:
    """Releases collected jobs off the call's critical path, on a background thread, in
    batches: the jobs collected within ``RELEASE_BATCH_S`` of each other go in one request
    (a loop of single calls would otherwise add a request per call).

    A release frees the coordinator's copy of a job's arguments and results. What is still
    pending when the interpreter exits is sent then (a script that ends right after its
    last call must not leave that call's payloads on the coordinator's disk until
    retention); only a process that dies without exiting leaves them to retention.
    """

    def __init__(self, mesh: GPUMesh):
        import atexit
        self._mesh = mesh
        self._pending: list[str] = []
        self._sending = 0  # batches taken but not yet answered
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="gpumesh-release", daemon=True).start()
        atexit.register(self.flush)

    def release(self, job_id: str) -> None:
        with self._cv:
            self._pending.append(job_id)
            self._cv.notify_all()

    def _take(self) -> list[str]:
        with self._cv:
            batch = self._pending[:RELEASE_BATCH_MAX]
            del self._pending[:len(batch)]
            self._sending += bool(batch)
            return batch

    def _send(self, batch: list[str], timeout: float) -> None:
        try:
            if batch:
                self._mesh.http.request("POST", "/v1/jobs/release", json={"jobs": batch}, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - best effort (see the class docstring)
            log.debug("release of %d job(s) failed: %s", len(batch), e)
        finally:
            with self._cv:
                self._sending -= bool(batch)
                self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
            time.sleep(RELEASE_BATCH_S)  # let the calls that follow join this batch
            self._send(self._take(), timeout=10)

    def flush(self, timeout: float = 3.0) -> None:
        """Send every pending release now and wait (up to ``timeout`` seconds) for those the
        thread is sending. Called at interpreter exit."""
        deadline = time.monotonic() + timeout
        while batch := self._take():
            self._send(batch, timeout=max(0.1, deadline - time.monotonic()))
        with self._cv:
            while self._sending and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())


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


def _dump_call(fn: Callable, call: _calls.Call, i: int, n: int) -> wire.Payload:
    """One call's ``(args, kwargs)`` as a payload. If it cannot be pickled, the error
    (the pickler's own type: usually TypeError or PicklingError) names the argument."""
    try:
        return wire.dumps(call)
    except Exception as e:  # noqa: BLE001 - re-raised with the argument named
        args, kwargs = call
        where = "" if n == 1 else f" (item {i} of the map)"
        culprit = next((f"argument {k}" for k, a in enumerate(args) if not _picklable(a)),
                       None) or next((f"keyword argument {k!r}" for k, a in kwargs.items()
                                      if not _picklable(a)), "an argument")
        name = getattr(fn, "__qualname__", "the function")
        try:
            err = type(e)(f"{culprit} of {name}{where} cannot be sent to a worker: {e}")
        except Exception:  # noqa: BLE001 - an exception type with another signature
            raise e from None
        raise err from e


def _picklable(value: Any) -> bool:
    try:
        wire.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False


def run_locally(fn: Callable, calls: list[_calls.Call]) -> list[Any]:
    """The fallback path: the same calls, in this process, in order."""
    return [fn(*a, **kw) for a, kw in calls]


def iter_locally(fn: Callable, calls: list[_calls.Call], return_exceptions: bool = False,
                 retry: tuple[int, tuple] | None = None):
    """The fallback path, item by item: yields ``(index, value)`` in order, with the mesh's
    semantics (``return_exceptions``: a raised exception is yielded in its item's place;
    ``retry``: re-runs as :func:`gpumesh.retries.call_with_retries`)."""
    n = len(calls)
    for i, (a, kw) in enumerate(calls):
        try:
            value = retries.call_with_retries(fn, a, kw, *retry) if retry else fn(*a, **kw)
        except Exception as e:  # noqa: BLE001 - the function's own exception
            if not return_exceptions:
                if n > 1 and sys.version_info >= (3, 11):
                    e.add_note(f"[gpumesh] raised by .map item {i} of {n}, "
                               f"{getattr(fn, '__qualname__', 'the function')}"
                               f"({_calls.describe_call((a, kw))}), on this machine; "
                               + _calls.keep_going(stopped="the items after it did not run"))
                raise
            value = e
        yield i, value


def _started(handle: Any, results):
    """``results``, preceded by the one ``None`` an iterator with a handle waits for."""
    if handle is not None:
        yield None
    yield from results


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


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)
