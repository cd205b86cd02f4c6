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

Once the coordinator has accepted a job the call never silently re-runs locally (that
would run side effects twice): losing the coordinator then means waiting for it (up to
``CALLER_RECONNECT_S``) and then :class:`~gpumesh.errors.MeshUnavailable`.
"""

from __future__ import annotations

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

from .. import config, hardware, tracing, wire
from ..handoff import Handoff, worth_it
from ..errors import MeshUnavailable, RequestRejected, Unsatisfiable
from ..limits import (CALLER_RECONNECT_S, INLINE_FUNCTION_BYTES, LONG_POLL_S, PROBE_CACHE_S,
                      PROBE_DOWN_CACHE_S, PROBE_TIMEOUT_S, RELEASE_BATCH_MAX, RELEASE_BATCH_S)
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
        self.output = output if output is not None else os.environ.get("GPUMESH_OUTPUT", "1") != "0"
        #: Strict results: JSON only, nothing from a worker is unpickled.
        self.strict = strict if strict is not None else os.environ.get("GPUMESH_STRICT_RESULTS") == "1"
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
        hostname, score, alive`` (plus ``slots``, ``running``, ``cpu``, ``gpus``...).

        Raises :class:`~gpumesh.errors.MeshUnavailable` if the coordinator does not
        answer, :class:`~gpumesh.errors.AuthError` if it refuses the token.
        """
        return self.http.request("GET", "/v1/workers", timeout=10).json()

    def jobs(self, limit: int = 20) -> list[dict]:
        """The most recent jobs, newest first: ``id, name, kind, state, n_tasks, counts``."""
        return self.http.request("GET", "/v1/jobs", params={"limit": limit}, timeout=10).json()

    def status(self, job_id: str) -> dict:
        """One job: its state, per-state task ``counts`` and ``tasks`` (index, state,
        attempts, worker, error). Raises RequestRejected (404) for an unknown job."""
        return self.http.request("GET", job_path(job_id), timeout=10).json()

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

    def submit(self, name: str | None = None, script=None, payloads=(), *,
               timeout: float | None = None) -> str:
        """Submit a script job: ``python script`` runs once per payload on the mesh, the
        payload arriving as JSON on its stdin; each task's result is the last line of its
        stdout that parses as JSON. ``script``: a path (or the source as bytes). Returns
        the job id at once (see :meth:`status`, :meth:`wait`). Raises ``ValueError`` for
        an unreadable script or a payload that is not JSON."""
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
        measured), ``slots`` and ``busy`` (slots on it, and how many run a task)."""
        return hardware.pool_devices(self.workers())

    def device_count(self) -> int:
        """How many devices the alive workers contribute (each GPU and each CPU once)."""
        return len(self.devices())

    def gpu_count(self) -> int:
        """How many GPUs (CUDA and MPS) the alive workers contribute."""
        return sum(1 for d in self.devices() if d["kind"] != "cpu")

    def total_score(self) -> float:
        """The sum of the alive devices' benchmark scores (unmeasured ones count 0)."""
        return round(sum(float(d["score"] or 0) for d in self.devices()), 3)

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
            self.http.request("GET", "/v1/health", timeout=PROBE_TIMEOUT_S)
        except Unreachable:
            notice(f"coordinator at {self.url} is unreachable; running locally")
            self._probe_down_until = time.monotonic() + PROBE_DOWN_CACHE_S
            return False
        self._probe_ok_until = now + PROBE_CACHE_S
        return True

    # ------------------------------------------------------------------ calls ------
    def run_calls(self, fn: Callable, calls: list[_calls.Call], *, hints: list[dict] | None = None,
                  timeout: float | None = None, name: str | None = None,
                  require: hardware.Requirements | None = None,
                  isolation: str | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` for each ``(args, kwargs)`` in ``calls``; values in
        order. Runs here when the mesh is unavailable (see the module docstring).
        ``isolation``: ``"task"`` (None, the default: a fresh process per task) or ``"job"``
        (each worker slot keeps one process for this job's tasks).
        ``require``: hardware every task needs; :class:`~gpumesh.errors.Unsatisfiable` if
        no alive worker (nor, when none is alive, this machine) can ever provide it."""
        if not calls:
            return []
        if os.environ.get("GPUMESH_LOCAL") == "1":
            notice("GPUMESH_LOCAL=1: running locally")
            return run_locally(fn, calls)
        if not self._mesh_reachable():
            check_local(fn, require, hints, f"the coordinator at {self.url} is unreachable")
            return run_locally(fn, calls)
        job_id = secrets.token_hex(6)
        printer = OutputPrinter(single=len(calls) == 1) if self.output else None
        bar = None
        collected = accepted = False
        try:
            first = self._submit(job_id, fn, calls, hints or [{}] * len(calls), timeout, name,
                                 printer is not None, require=require,
                                 isolation=check_isolation(isolation))
            if first is None:
                check_local(fn, require, hints, f"no worker is alive in the mesh at {self.url}")
                notice(f"no live worker in the mesh at {self.url}; running locally")
                collected = True  # nothing was stored
                return run_locally(fn, calls)
            accepted = True
            if not self._announced:  # said once the mesh took a job: token and workers are fine
                self._announced = True
                notice(f"connected to coordinator at {self.url}")
            if len(calls) > 1:  # a batch: a bar once it takes over a second (terminal/notebook)
                bar = Progress(len(calls), name or getattr(fn, "__qualname__", "tasks"))
            values = self._collect(job_id, len(calls), first, printer, bar)
            collected = True
            return values
        finally:
            if bar is not None:
                bar.close()
            if printer is not None:
                printer.flush()
            if not collected:  # Ctrl+C, a task failure, a lost coordinator: stop the rest
                self._cancel_quietly(job_id)
                if accepted:  # and free its stored arguments and results: nobody will read them
                    self._janitor.release(job_id)

    def _submit(self, job_id: str, fn: Callable, calls: list[_calls.Call], hints: list[dict],
                timeout: float | None, name: str | None, output: bool,
                require: hardware.Requirements | None = None,
                isolation: str = "task") -> bytearray | None:
        """Submit the job and wait briefly for its first results in the same round trip.
        Returns that first results page, or None if the mesh has no live worker."""
        fn_payload = wire.dumps(fn, code=True)
        fn_hash = fn_payload.sha256()
        args = [_dump_call(fn, c, i, len(calls)) for i, c in enumerate(calls)]
        inline = fn_hash not in self._known_blobs and fn_payload.size <= INLINE_FUNCTION_BYTES
        if fn_hash not in self._known_blobs and not inline:
            self._upload_blob(fn_hash, fn_payload)
        meta = {"job_id": job_id, "kind": "function", "fn": fn_hash, "fn_inline": inline,
                "n_tasks": len(calls), "timeout": timeout, "require_worker": True,
                "name": name or getattr(fn, "__qualname__", "function"),
                "costs": [h.get("cost", 1.0) for h in hints], "wait": LONG_POLL_S,
                "output": output, "caller": {"host": _HOSTNAME, "pid": os.getpid()}}
        if self.strict:
            meta["result_format"] = "json"  # the task answers in JSON; nothing is unpickled
        if isolation != "task":
            meta["isolation"] = isolation
        if require:
            meta["require"] = require.to_meta()
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

    def _collect(self, job_id: str, n: int, body: bytearray | None,
                 printer: OutputPrinter | None, bar: Progress | None = None) -> list[Any]:
        """Read result pages (the first came with the submit) until all ``n`` are in."""
        results: list[Any] = [_MISSING] * n
        got, after, out_after, attempt = 0, -1, -1, 0
        last_contact = time.monotonic()
        handoff = self.handoff
        while True:
            if body:
                page, frames = self._read_page(body)
                if page.get("workers_alive") == 0 and not page["results"]:
                    notice(f"no live worker in the mesh at {self.url}; job {job_id} is waiting "
                           "for one to (re)join")
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
                    if results[idx] is _MISSING:  # never deliver a result twice
                        results[idx] = _calls.decode_result(item, payload, self.strict)  # raises a failure
                        got += 1
                    after = max(after, item["seq"])
                if bar is not None:
                    bar.update(got)
                del frames, page
            if got >= n:
                break
            params = {"after": after, "wait": LONG_POLL_S}
            if handoff is not None:
                params["handoff"] = 1
            if printer is not None:
                params["out_after"] = out_after
            try:
                body = self.http.stream_into("GET", f"/v1/jobs/{job_id}/results", params=params,
                                             timeout=LONG_POLL_S + 15)
                last_contact, attempt = time.monotonic(), 0
            except Unreachable as e:
                if time.monotonic() - last_contact > CALLER_RECONNECT_S:
                    raise MeshUnavailable(
                        f"lost the coordinator at {self.url} for over {CALLER_RECONNECT_S:.0f}s "
                        f"while waiting for job {job_id}: {e}") from e
                time.sleep(_backoff(attempt))
                attempt += 1
                body = None
        self._janitor.release(job_id)
        return results

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
                   isolation: str | None = None) -> list[Any]:
        """Run ``function`` once per item of ``params`` (dicts are keyword arguments) across
        the mesh; returns the values in input order. ``timeout`` (seconds) applies to each
        task; ``isolation`` is ``"task"`` or ``"job"`` as for ``@accelerate`` (default: the
        decorated function's, else ``"task"``; anything else is a ``ValueError``). Raises
        what a task raised (see :mod:`gpumesh.errors`)."""
        from .remote import unwrap
        if isolation is None:
            isolation = getattr(function, "options", {}).get("isolation")
        isolation = check_isolation(isolation)
        fn = unwrap(function)
        calls, hints = _calls.map_items(fn, params)
        return self.run_calls(fn, calls, hints=hints, timeout=_check_timeout(timeout),
                              isolation=None if isolation == "task" else isolation)

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
    slots = hardware.slots_of("local", info, hardware.slot_list(info["gpus"], 1, info["mps"]))
    reasons = []
    for slot in slots:
        reason = hardware.refusal(require or hardware.Requirements(), slot, hint or None)
        if reason is None:
            return
        reasons.append(f"its {slot.device} {reason}")
    wants = (require.describe() if require else "") + (f", gpu_memory_mb={hint:g}" if hint else "")
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
