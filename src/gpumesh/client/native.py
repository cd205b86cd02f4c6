"""The native backend: a job on a gpumesh coordinator over its HTTP API.

::

    pickle the function once (content-addressed: sha256); upload it only if the
    coordinator lacks it (small ones ride inside the submit)
      ▼
    POST /v1/jobs  one request for the whole batch, idempotent on the job id
      │   409 no_workers, or nothing reached it ──► Fallback (nothing was stored)
      ▼
    GET /v1/jobs/{id}/results?after=seq  long-poll; pages of results stream in
      ▼
    (index, ("result", ResultItem, payload, strict)) as they come; the pipeline decodes them

Once the coordinator has accepted a job the calls never silently re-run locally (that
would run side effects twice): losing the coordinator then means waiting for it (up to
``CALLER_RECONNECT_S``) and then :class:`~gpumesh.errors.MeshUnavailable`. Losing every
worker means waiting for one to (re)join, for the call's ``timeout=`` or, without one,
``NO_WORKER_WAIT_S``, and then :class:`~gpumesh.errors.WorkerLost`. Workers closed by
their owners' rules (paused, outside their hours) are not lost: a job only they could run
waits for them, for the call's ``timeout=`` (without one, for as long as it takes), and
then :class:`~gpumesh.errors.TaskTimeout`.

Script jobs (:mod:`.scripts`) are submitted and collected through the same
:meth:`NativeBackend.send_job` (retries, backoff, blob upload) and :func:`poll_results`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from .. import availability, hardware, protocol, retries, tracing, versions, wire
from ..errors import (MeshError, MeshUnavailable, RequestRejected, TaskTimeout, Unsatisfiable,
                      WireError, WorkerLost)
from ..handoff import Handoff, worth_it
from ..limits import (CALLER_RECONNECT_S, INLINE_FUNCTION_BYTES, LONG_POLL_S, NO_WORKER_WAIT_S,
                      RELEASE_ATTEMPTS, RELEASE_BATCH_MAX, RELEASE_BATCH_S)
from ..payloadref import handoff_meta
from ..protocol import ErrorCode
from ..transport import Unreachable
from . import calls as _calls
from .progress import DELAY_S as BAR_DELAY_S
from .console import OutputPrinter
from .pipeline import STARTED, Backend, Fallback, Job, backoff, notice
from .stopsignals import answer_count, cancelled_text, outstanding

log = logging.getLogger("gpumesh.client")

_HOSTNAME = socket.gethostname()


#: How long what GET /v1/workers said is used for about_worker (s).
WORKERS_FRESH_S = 30.0


class NativeBackend(Backend):
    """Runs jobs on ``mesh``'s coordinator. The mesh keeps what outlives one job (its
    transport, the probe cache, the blobs the coordinator has, the handoff directories)."""

    progress = True

    def __init__(self, mesh: Any):
        self.mesh = mesh
        self.where = f"the mesh at {mesh.url}"
        #: Jobs whose arguments or results went as files (gpumesh.handoff): released at
        #: once, not in the next batch, so that those files are back in the handoff pool
        #: for the next call's big payloads to be written over (fresh pages cost ~1 ms
        #: per MiB on the build VM, ~7x a write over pages in memory).
        self._moved_files: set[str] = set()
        #: (when, {worker id: the worker as GET /v1/workers lists it}) for about_worker.
        self._pool_seen: tuple[float, dict[str, dict]] = (-1e9, {})

    def reachable(self) -> bool:
        return self.mesh._mesh_reachable()

    def unreachable_why(self) -> str:
        return f"the coordinator at {self.mesh.url} is unreachable"

    def about_worker(self, worker_id: str) -> dict | None:
        # Asked only for a value that holds code or could not be rebuilt; a .map of 1,000
        # such values asks once (a worker's Python does not change while it runs).
        now = time.monotonic()
        if now - self._pool_seen[0] > WORKERS_FRESH_S:
            try:
                self._pool_seen = (now, {str(w.get("id")): w for w in self.mesh.workers()})
            except MeshError:
                return self._pool_seen[1].get(worker_id)
        return self._pool_seen[1].get(worker_id)

    def run(self, job: Job) -> Iterator[Any]:
        mesh = self.mesh
        job.job_id = job_id = secrets.token_hex(6)
        printer = OutputPrinter(single=job.n == 1) if mesh.output else None
        collected = accepted = interrupted = False
        try:
            mesh._start_keepalive()  # the coordinator cancels a job whose caller goes quiet
            with outstanding(mesh, job_id, job.n):  # SIGTERM/SIGHUP now cancel it too (.stopsignals)
                # Decided once: another thread may announce the mesh meanwhile.
                waits = self._waits(job)
                try:
                    first = self._submit(job, printer is not None, waits)
                except Fallback:
                    collected = True  # nothing was stored
                    raise
                accepted = True
                if not waits:
                    first = bytearray()  # (a submit that did not wait answers JSON, not a page)
                if not mesh._announced:  # said once the mesh took a job: token and workers are fine
                    mesh._announced = True
                    notice(f"connected to coordinator at {mesh.url}")
                yield STARTED
                yield from self._collect(job, first, printer)
                collected = True
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            if printer is not None:
                printer.flush()
            if not collected:  # Ctrl+C, a task failure, a lost coordinator, a closed iterator
                cancelled, stopped = self._cancel(job_id)
                # A cancel the coordinator answered means it had the job, even when the
                # interrupt came during a submit still waiting for first results.
                accepted = accepted or cancelled
                if interrupted and accepted:  # (the traceback says only where the caller was)
                    notice("interrupted: " + (
                        cancelled_text(job_id, stopped, job.n) if cancelled else
                        f"job {job_id} could not be cancelled (the coordinator did not "
                        f"answer): `gpumesh cancel {job_id}`"), once=False)
                if accepted:  # and free its stored arguments and results: nobody will read them
                    self._release(job_id)

    # ------------------------------------------------------------------ submit -----
    def _waits(self, job: Job) -> bool:
        """Whether the submit also waits (up to LONG_POLL_S) for the first results. Not for
        ``.imap``, and not for the mesh's first job: its "connected" line is said when the
        job is accepted, not seconds later with the first result."""
        return not job.streaming and self.mesh._announced

    @staticmethod
    def _first_wait(job: Job) -> float:
        """How long a waiting submit waits for first results: a batch no longer than its
        progress bar's delay (the bar is drawn once the submit returns, so a longer wait
        hid it for up to LONG_POLL_S), a single call (no bar) the whole long poll."""
        return min(LONG_POLL_S, BAR_DELAY_S) if job.n > 1 else LONG_POLL_S

    def _submit(self, job: Job, output: bool, waits: bool) -> bytearray:
        """Submit the job and, if ``waits``, wait briefly for its first results in the same
        round trip. Returns that first results page (JSON without ``waits``); raises
        Fallback if the mesh has no live worker or the submit reached nobody."""
        mesh, fn, calls, hints = self.mesh, job.fn, job.calls, job.hints
        fn_payload = _calls.dump_function(fn)  # (an error names what of fn cannot go)
        fn_hash = fn_payload.sha256()
        args = [_calls.dump_call(fn, c, i, len(calls)) for i, c in enumerate(calls)]
        require = job.require
        if fn_payload.by_value or any(a.by_value for a in args):
            # Bytecode travels: only workers of this Python minor version can load it safely.
            require = dataclasses.replace(require or hardware.Requirements(),
                                          python=versions.python_minor())
        job.sent_require = require
        inline = fn_hash not in mesh._known_blobs and fn_payload.size <= INLINE_FUNCTION_BYTES
        if fn_hash not in mesh._known_blobs and not inline:
            self.upload_blob(fn_hash, fn_payload)
        assert job.job_id is not None  # (run gave the job its id)
        handoff = mesh.handoff
        submit = protocol.JobSubmit(
            job_id=job.job_id, kind="function", fn=fn_hash, fn_inline=inline,
            n_tasks=len(calls), timeout=job.timeout, require_worker=True,
            name=job.name or job.qualname or "function",
            costs=[h.get("cost", 1.0) for h in hints],
            wait=self._first_wait(job) if waits else 0,
            output=output, caller={"host": _HOSTNAME, "pid": os.getpid()},
            # strict: the task answers in JSON; nothing is unpickled
            result_format="json" if mesh.strict else None,
            isolation=None if job.isolation == "task" else job.isolation,
            require=require.to_meta() if require else None,
            gpu_memory_mb=([h.get("gpu_memory_mb") for h in hints]
                           if any(h.get("gpu_memory_mb") for h in hints) else None),
            handoff=True if handoff is not None else None,  # big results come as paths to map
            **(retries.to_meta(*job.retry) if job.retry else {}))
        written: list[str] = []  # handoff files: claimed by the coordinator, or deleted below
        try:
            return self.send_job(submit, fn_payload, args, handoff, written)
        finally:
            if written:
                self._moved_files.add(submit.job_id)
            for name in written:
                handoff.discard(name)

    def send_job(self, submit: protocol.JobSubmit, fn_payload: wire.Payload, args: list,
                 handoff: Handoff | None = None, written: list[str] | None = None,
                 fallback: bool = True) -> bytearray:
        """POST a job: ``submit`` (the JSON head, ``submit.as_dict()``), the function or
        script blob ``fn_payload`` (sha256 ``submit.fn``) inside it when ``submit.fn_inline``,
        one frame per task in ``args``; with ``handoff``, big arguments go as its files
        (named under the head's ``refs``; ``written`` collects the names). Resent (idempotent on
        the job id) with backoff until it is stored or refused, for up to
        ``CALLER_RECONNECT_S``; a ``missing_blob`` refusal uploads the blob and resends.
        Returns the coordinator's answer (the first results page for a function job that
        waits). Raises :class:`Fallback` (``fallback``: a function job) when the mesh has
        no live worker or the first attempt reached nobody, :class:`Unsatisfiable`,
        :class:`MeshUnavailable` after the retries, and RequestRejected as refused."""
        mesh, fn_hash = self.mesh, submit.fn
        written = [] if written is None else written
        meta = submit.as_dict()
        frames: list = [json.dumps(meta).encode()]
        if submit.fn_inline:
            frames.append(fn_payload)
        handed = None
        if handoff is not None and any(worth_it(a.size) for a in args):
            # Same machine: big arguments go as files the coordinator renames into its
            # store (gpumesh.handoff) and their frames stay empty.
            handed, files, sizes = list(frames), {}, {}
            try:
                for a in args:
                    if worth_it(a.size):
                        written.append(handoff.write(a.chunks))
                        files[str(len(handed) - 1)] = written[-1]
                        sizes[str(len(handed) - 1)] = a.size
                        a = b""
                    handed.append(a)
            except OSError as e:
                # Its directory is full (or not writable now): this call's bytes go over
                # HTTP instead, as when the coordinator cannot find a handoff file.
                log.warning("could not write a handoff file (%s); sending the arguments over HTTP", e)
                for name in written:
                    handoff.discard(name)
                written.clear()
                handed = None
            else:
                handed[0] = json.dumps(handoff_meta(meta, files, sizes)).encode()
        frames = handed if handed is not None else frames + list(args)
        chunks, size = wire.pack_frames(frames)
        deadline = time.monotonic() + CALLER_RECONNECT_S
        attempt = 0
        while True:
            try:
                tracing.mark("caller.submit")
                page = mesh.http.stream_into(
                    "POST", protocol.JOBS, content=wire.iter_chunks(chunks),
                    headers={"content-type": "application/x-gpumesh-frames",
                             "content-length": str(size)}, timeout=LONG_POLL_S + 600)
                tracing.mark("caller.answered")
                mesh._heard_from()
                if attempt:
                    _back(mesh, submit.job_id)
                mesh._known_blobs.add(fn_hash)
                return page if page is not None else bytearray()
            except RequestRejected as e:
                code = getattr(e, "code", "")
                if code == ErrorCode.NO_WORKERS and fallback:
                    raise Fallback(f"no worker is alive in the mesh at {mesh.url}",
                                   f"no live worker in the mesh at {mesh.url}; running locally") from None
                if code == ErrorCode.UNSATISFIABLE:  # nothing was stored; the message lists the pool
                    raise Unsatisfiable(str(e).rsplit(" (HTTP", 1)[0]) from None
                if code == ErrorCode.MISSING_BLOB:  # coordinator lost it (fresh data dir): upload
                    mesh._known_blobs.discard(fn_hash)
                    self.upload_blob(fn_hash, fn_payload)
                    continue
                if code == ErrorCode.HANDOFF_MISSING and handoff is not None:
                    # Its handoff directory is not the one we wrote to (restarted, or a
                    # look-alike path): send the bytes, and stop handing off to it.
                    mesh._handoff = None
                    return self.send_job(dataclasses.replace(submit, handoff=False), fn_payload,
                                         args, None, written, fallback)
                raise
            except Unreachable as e:
                # Idempotent on job_id: resending is safe whether or not it arrived.
                if not e.sent and attempt == 0:
                    if not fallback:  # nothing to run here instead: say so at once
                        raise
                    notice(f"coordinator at {mesh.url} is unreachable; running locally")
                    mesh._probe_ok_until = 0.0
                    raise Fallback(self.unreachable_why()) from None
                if time.monotonic() > deadline:
                    raise MeshUnavailable(f"could not submit to {mesh.url} for "
                                          f"{CALLER_RECONNECT_S:.0f}s: {e}") from e
                if attempt == 0:
                    _lost(mesh, submit.job_id)
                time.sleep(backoff(attempt))
                attempt += 1

    def upload_blob(self, h: str, payload: wire.Payload) -> None:
        """Store a function or script blob on the coordinator unless it has it."""
        mesh = self.mesh
        try:
            mesh.http.request("HEAD", protocol.blob(h), timeout=10)
            mesh._known_blobs.add(h)
            return
        except RequestRejected as e:
            if e.status != 404:
                raise
        mesh.http.request("PUT", protocol.blob(h), content=wire.iter_chunks(payload.chunks),
                          headers={"content-length": str(payload.size)}, timeout=600)
        mesh._known_blobs.add(h)

    # ------------------------------------------------------------------ collect ----
    def _collect(self, job: Job, body: bytearray | None,
                 printer: OutputPrinter | None) -> Iterator[tuple[int, tuple]]:
        """Read result pages (the first came with the submit) until all calls' results are
        in; yields ``(index, outcome)`` as they come. Once pages have said "no worker can
        run it" for the job's timeout (None: NO_WORKER_WAIT_S), WorkerLost is raised
        (the job is then cancelled), or with ``return_exceptions`` the job is cancelled
        here and each unfinished call's outcome is that WorkerLost. Once they have said
        "only workers closed by their owners could run it" for the job's timeout (None: no
        limit), the same happens with a TaskTimeout that says why."""
        mesh, job_id, n, timeout = self.mesh, job.job_id, job.n, job.timeout
        assert job_id is not None  # (run gave the job its id)
        seen = bytearray(n)  # 1 once an index's result was delivered: never twice
        got, after, out_after = 0, -1, -1
        handoff = mesh.handoff
        # Nothing runs the job's tasks while the pool is empty: a task's timeout never
        # starts, so the wait for a worker to (re)join is bounded here instead.
        alone_limit = NO_WORKER_WAIT_S if timeout is None else timeout
        alone_since: float | None = None
        nobody = "no worker"  # or, with workers alive that cannot run the tasks, which one
        # Workers paused by their owners (or outside their hours) are alive but lend
        # nothing: the call waits for them as long as its own timeout= allows (no limit
        # without one), saying why.
        closed: dict[str, int] | None = None
        closed_since: float | None = None
        reconnect: dict = {}
        while True:
            if body:
                page, frames = read_page(body, f"the coordinator at {mesh.url} (job {job_id})")
                if page.workers_able == 0:
                    alone_since = alone_since or time.monotonic()
                    if page.workers_alive:  # e.g. the only GPU box went, CPUs remain
                        needs = job.sent_require.describe() if job.sent_require else ""
                        nobody = "no worker that can run its tasks" + (f" [{needs}]" if needs else "")
                        notice(f"no live worker in the mesh at {mesh.url} can run job {job_id}'s "
                               f"tasks" + (f" (they need {needs})" if needs else "")
                               + f"; waiting for one to (re)join (for up to {alone_limit:g}s)")
                    elif not page.results:
                        nobody = "no worker"
                        notice(f"no live worker in the mesh at {mesh.url}; job {job_id} is "
                               f"waiting for one to (re)join (for up to {alone_limit:g}s)")
                else:
                    alone_since = None
                if page.workers_able and page.workers_closed:
                    if closed_since is None or page.workers_closed != closed:
                        what = availability.describe_closed(page.workers_closed)
                        notice(f"job {job_id} is waiting: {what} (no other worker in the mesh at "
                               f"{mesh.url} can run its tasks); "
                               + (f"waiting for up to {timeout:g}s (the call's timeout=)" if timeout
                                  is not None else "waiting until one takes tasks again"))
                    closed, closed_since = page.workers_closed, closed_since or time.monotonic()
                else:
                    closed_since = None
                k = 1 + sum(1 for item in page.results if item.has_payload)
                if printer is not None:
                    # Output first: a task's prints come before its result (and its error).
                    printer.skipped(page.output_skipped or 0)
                    for chunk, data in zip(page.output or [], frames[k:]):
                        printer.write(chunk, data)
                        out_after = max(out_after, chunk["seq"])
                k = 1
                for item in page.results:
                    payload = None
                    if item.has_payload:
                        payload, k = frames[k], k + 1
                    elif item.refs is not None or item.file is not None:  # same machine: map the store's file
                        self._moved_files.add(job_id)
                        try:
                            payload = handoff.open_result(item)
                        except (OSError, AttributeError):  # gone (or not ours): ask over HTTP
                            handoff = None
                            break  # re-read from this result on
                    idx = item.index
                    after = max(after, item.seq)
                    if seen[idx]:  # never deliver a result twice
                        continue
                    seen[idx] = 1
                    got += 1
                    yield idx, ("result", item, payload, mesh.strict)
                del frames, page
            if got >= n:
                break
            wait = LONG_POLL_S
            lost: Exception | None = None  # a bounded wait that ran out
            if closed_since is not None and timeout is not None and closed:
                held = time.monotonic() - closed_since
                if held >= timeout:
                    lost = TaskTimeout(f"{n - got} of {n} task(s) of job {job_id} could not start "
                                       f"for {held:.0f}s (the call's timeout={timeout:g}s): "
                                       f"{availability.describe_closed(closed)}, and no other "
                                       f"worker in the mesh at {mesh.url} can run them; they "
                                       f"were cancelled")
                wait = min(wait, max(0.05, timeout - held))
            if alone_since is not None:
                alone = time.monotonic() - alone_since
                if alone >= alone_limit:
                    why = (f"the call's timeout={timeout:g}s" if timeout is not None else
                           f"the wait without a timeout=, GPUMESH_NO_WORKER_TIMEOUT="
                           f"{alone_limit:g}s")
                    lost = WorkerLost(f"{nobody} has been alive in the mesh at {mesh.url} for "
                                      f"{alone:.0f}s ({why}); {n - got} of {n} task(s) of job "
                                      f"{job_id} did not finish and were cancelled")
                wait = min(wait, max(0.05, alone_limit - alone))  # wake up when the time is up
            if lost is not None:
                if not job.return_exceptions:
                    raise lost
                self.cancel_quietly(job_id)  # no task of it may run later
                for idx in range(n):
                    if not seen[idx]:
                        seen[idx] = 1
                        yield idx, ("error", lost)
                break
            # caller=1: the waiting call polls (the coordinator hears it, .keepalive),
            # unlike a status read by anyone else
            params: dict = {"after": after, "wait": wait, "caller": 1}
            if handoff is not None:
                params["handoff"] = 1
            if printer is not None:
                params["out_after"] = out_after
            if closed_since is None:  # not known to wait on closed workers: hear it at once
                params["closed"] = 1
            try:
                body = poll_results(mesh, job_id, params, wait, reconnect)
            except Retrying:
                # the pool is unknown until the coordinator answers again
                alone_since = closed_since = None
                body = None
        self._release(job_id)

    def _release(self, job_id: str) -> None:
        self.mesh._janitor.release(job_id, at_once=job_id in self._moved_files)
        self._moved_files.discard(job_id)

    def cancel_quietly(self, job_id: str) -> bool:
        """Cancel ``job_id``; False (logged at debug level) if that failed: the error that
        ended the call matters more."""
        return self._cancel(job_id)[0]

    def _cancel(self, job_id: str) -> tuple[bool, int | None]:
        """:meth:`cancel_quietly`, and how many tasks the coordinator says it stopped
        (None: it did not say)."""
        try:
            resp = self.mesh.http.request("POST", protocol.job_cancel(job_id), timeout=5)
        except Exception as e:  # noqa: BLE001 - the original error matters more
            log.debug("cancel of %s failed: %s", job_id, e)
            return False, None
        return True, answer_count(resp)


class Retrying(Exception):
    """:func:`poll_results` got no answer, waited its backoff, and wants to be called again."""


def poll_results(mesh: Any, job_id: str, params: dict, wait: float,
                 state: dict) -> bytearray | None:
    """One long-poll of ``job_id``'s results page (``params``: ``after``, ``wait``...):
    the body, or None when nothing came within ``wait``. An unreachable coordinator is
    retried with backoff: after each backoff sleep this raises :class:`Retrying` (so
    that the caller re-checks its own deadlines before calling again with the same
    ``state``, an empty dict at first); after ``CALLER_RECONNECT_S`` without an answer it
    raises :class:`MeshUnavailable`."""
    try:
        body = mesh.http.stream_into("GET", protocol.job_results(job_id), params=params,
                                     timeout=wait + 15)
    except Unreachable as e:
        if "since" not in state:
            _lost(mesh, job_id)
        since = state.setdefault("since", time.monotonic())
        if time.monotonic() - since > CALLER_RECONNECT_S:
            raise MeshUnavailable(
                f"lost the coordinator at {mesh.url} for over {CALLER_RECONNECT_S:.0f}s "
                f"while waiting for job {job_id}: {e}. The coordinator cancels the job once "
                f"it has not heard from this caller for its GPUMESH_CALLER_TIMEOUT; "
                f"whatever of it ran before that is not undone") from e
        attempt = state.get("attempt", 0)
        state["attempt"] = attempt + 1
        time.sleep(backoff(attempt))
        raise Retrying() from e
    if state:
        _back(mesh, job_id)
        state.clear()
    return body


# The two ends of an outage, said each time (a waiting caller is otherwise silent for up to
# CALLER_RECONNECT_S, then fails): the user learns why it waits, for how long, and where.
def _lost(mesh: Any, job_id: str) -> None:
    notice(f"lost the coordinator at {mesh.url} while waiting for job {job_id}; retrying for "
           f"up to {CALLER_RECONNECT_S:g}s (GPUMESH_RECONNECT_TIMEOUT)", once=False)


def _back(mesh: Any, job_id: str) -> None:
    notice(f"the coordinator at {mesh.url} answers again; job {job_id} goes on", once=False)


def read_page(body: bytearray, source: str = "the coordinator") -> tuple[protocol.ResultPage,
                                                                          list[memoryview]]:
    """A results page body -> ``(its head, its frames)`` (frame 0 is the head). Raises
    :class:`~gpumesh.errors.WireError` for a body that is not a results page: its text
    names ``source`` (who sent it) and the field that is wrong. Not retried: a coordinator
    of this version never sends one, so asking again would get the same."""
    frames = wire.unpack_frames(body)
    try:
        return protocol.ResultPage.from_dict(json.loads(bytes(frames[0]))), frames
    except (ValueError, WireError) as e:  # (a head that is not JSON, or not UTF-8)
        raise WireError(f"{source} sent a malformed results page: {e}") from None


class Janitor:
    """Releases collected jobs off the call's critical path, on a background thread, in
    batches: the jobs collected within ``RELEASE_BATCH_S`` of each other go in one request
    (a loop of single calls would otherwise add a request per call). A job whose payloads
    went as files goes at once (with whatever is pending): its files then return to the
    handoff pool before the next call's big payloads are written.

    A release frees the coordinator's copy of a job's arguments and results. What is still
    pending when the interpreter exits is sent then (a script that ends right after its
    last call must not leave that call's payloads on the coordinator's disk until
    retention), and so is what is pending when the mesh is closed. A batch whose request
    fails goes back in the queue, up to ``RELEASE_ATTEMPTS`` sends in all; only then, or
    when the process dies without exiting, are the payloads left to retention.
    """

    def __init__(self, mesh: Any):
        import atexit
        self._mesh = mesh
        self._pending: list[tuple[str, int]] = []  # (job id, sends already tried)
        self._sending = 0  # batches taken but not yet answered
        self._at_once = False  # a pending release asked not to wait for a batch
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="gpumesh-release", daemon=True).start()
        atexit.register(self.flush)

    def release(self, job_id: str, at_once: bool = False) -> None:
        """Queue ``job_id``'s release; ``at_once``: send the batch now, without waiting
        ``RELEASE_BATCH_S`` for more (a job whose payloads went as files)."""
        with self._cv:
            self._pending.append((job_id, 0))
            self._at_once = self._at_once or at_once
            self._cv.notify_all()

    def _take(self) -> list[tuple[str, int]]:
        with self._cv:
            batch = self._pending[:RELEASE_BATCH_MAX]
            del self._pending[:len(batch)]
            self._at_once = False
            self._sending += bool(batch)
            return batch

    def _send(self, batch: list[tuple[str, int]], timeout: float) -> bool:
        """One release request for ``batch``; True when the coordinator answered. A failed
        batch is queued again while its jobs have sends left."""
        ok = True
        try:
            if batch:
                self._mesh.http.request("POST", protocol.JOBS_RELEASE,
                                        json={"jobs": [job for job, _ in batch]}, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - best effort (see the class docstring)
            ok = False
            log.debug("release of %d job(s) failed: %s", len(batch), e)
        with self._cv:
            if not ok:
                self._pending.extend((job, n + 1) for job, n in batch if n + 1 < RELEASE_ATTEMPTS)
            self._sending -= bool(batch)
            self._cv.notify_all()
        return ok

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
                # let the calls that follow join this batch, unless one is in a hurry
                self._cv.wait_for(lambda: self._at_once, RELEASE_BATCH_S)
            if not self._send(self._take(), timeout=10):
                time.sleep(RELEASE_BATCH_S * 5)  # a busy or restarting coordinator: back off

    def flush(self, timeout: float = 3.0) -> None:
        """Send every pending release now and wait (up to ``timeout`` seconds) for those the
        thread is sending. Called at interpreter exit."""
        deadline = time.monotonic() + timeout
        while batch := self._take():
            self._send(batch, timeout=max(0.1, deadline - time.monotonic()))
        with self._cv:
            while self._sending and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
