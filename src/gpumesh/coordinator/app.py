"""HTTP routes of the coordinator: validate at the boundary, then call :class:`Coordinator`.

Every route but ``GET /v1/health``, ``GET /v1/openapi.json`` and ``GET /v1/dist/...`` needs
``Authorization: Bearer <token>`` (see :mod:`.auth`: roles, lockout). Errors are JSON
``{"error": code, "message": text}`` with a 4xx status naming what was wrong; a malformed
request never changes state. The API is described in :mod:`.openapi`. Payload bodies are the ``frames`` layout of
:mod:`gpumesh.wire` (``application/x-gpumesh-frames``), never base64 in JSON.

    GET    /v1/health                          liveness (no auth)
    GET    /v1/openapi.json                    this API as OpenAPI 3.1 (no auth)
    GET    /v1/dist/gpumesh-<version>-py3-none-any.whl  this gpumesh's wheel (no auth)
    GET    /v1/workers                         the pool
    GET    /v1/workers/{id}/session            the worker's pulse (held open; closing = gone)
    POST   /v1/workers                         register         {hostname, ..., slots, id?}
    POST   /v1/workers/{id}/heartbeat          keep alive       {running: [task ids]}
    DELETE /v1/workers/{id}                    leave; leases are re-queued at once
    POST   /v1/workers/{id}/lease              long-poll for up to {slots} tasks
    POST   /v1/tasks/{id}/result?lease=L       a result, fenced by lease id
    POST   /v1/tasks/{id}/output?lease=L       what a running task printed
    POST   /v1/tasks/{id}/release?lease=L      hand a running task back (preempted)
    GET    /v1/handoff                         same-machine payload files (gpumesh.handoff)
    HEAD   /v1/blobs/{sha256}                  is this function blob here?
    PUT    /v1/blobs/{sha256}                  upload a function blob (hash verified)
    GET    /v1/blobs/{sha256}                  download it
    POST   /v1/jobs                            submit a job with all its arguments
    GET    /v1/jobs                            recent jobs
    GET    /v1/jobs/{id}                       status, counts and tasks
    GET    /v1/jobs/{id}/results?after=S&wait=W[&out_after=O]
                                               long-poll for results with seq > S (and
                                               task output with seq > O)
    GET    /v1/jobs/{id}/logs[?task=T]         what each task printed (kept per task)
    POST   /v1/jobs/{id}/release               the caller holds every result
    POST   /v1/jobs/release                    the same for several jobs {"jobs": [...]}
    POST   /v1/jobs/{id}/cancel                cancel what has not finished
    GET    /v1/tokens                          the people's tokens (admin; never a token)
    POST   /v1/tokens                          add one {name, role, max_running} (admin)
    DELETE /v1/tokens/{name}                   revoke it at once (admin)

Who may call what is :mod:`.people`'s: each route names the roles it admits, and the
job routes that read results or output, cancel, retry or release admit only the job's
owner (or an admin).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import struct
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import packages, tracing, versions, wire
from .._version import __version__
from . import dist
from ..limits import (HANDOFF_TTL_S, INLINE_BLOB_BYTES, LONG_POLL_MAX_S, OUTPUT_BODY_BYTES, MAX_BODY_BYTES, MAX_TASKS_PER_JOB, MiB,
                      PURGE_INTERVAL_S, RESULT_PAGE_BYTES, RESULT_PAGE_COUNT, RETENTION_S,
                      SESSION_PING_S, SWEEP_INTERVAL_S)
from ..limits import (MAX_HEARTBEAT_TASKS, MAX_JSON_BODY_BYTES, MAX_META_JSON_BYTES,
                      MAX_RELEASE_JOBS, MAX_STRING_CHARS)
from ..errors import WireError
from . import people
from .auth import Authenticator, AuthRefused
from .core import (Coordinator, NoWorkers, StaleLease, UnknownJob, UnknownWorker)
from .core import JobReleased
from .core import Unsatisfiable
from .store import Incoming
from .. import hardware, retries

log = logging.getLogger("gpumesh.coordinator")

FRAMES = "application/x-gpumesh-frames"
#: Frames bodies up to this size are built in memory and sent in one piece; larger
#: ones (big arguments and results) are streamed from their files.
SMALL_BODY_BYTES = 256 * 1024
_HEX = re.compile(r"[0-9a-f]{4,64}\Z")
_SHA = re.compile(r"[0-9a-f]{64}\Z")


class HTTPError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _err(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": code, "message": message}, status_code=status)


# ---------------------------------------------------------------- validation -------
def _field(d: dict, name: str, kind: type | tuple, default: Any = ..., *, lo=None, hi=None):
    if name not in d or d[name] is None:
        if default is ...:
            raise HTTPError(400, "bad_request", f"field {name!r} is required")
        return default
    v = d[name]
    if kind in (int, float) or kind == (int, float):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise HTTPError(400, "bad_request", f"field {name!r} must be a number, got {type(v).__name__}")
        if kind is int and not isinstance(v, int):
            raise HTTPError(400, "bad_request", f"field {name!r} must be an integer")
        if v != v or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise HTTPError(400, "bad_request", f"field {name!r} must be between {lo} and {hi}, got {v}")
        return v
    if not isinstance(v, kind):
        raise HTTPError(400, "bad_request", f"field {name!r} must be {getattr(kind, '__name__', kind)}, "
                                            f"got {type(v).__name__}")
    if kind is str:
        _check_str(v, name)
    elif kind is dict:
        _check_meta(v, name)
    return v


def _check_str(v: str, name: str) -> None:
    """A string field: at most MAX_STRING_CHARS characters, valid Unicode (no lone
    surrogates, which could never be stored or sent back)."""
    if len(v) > MAX_STRING_CHARS:
        raise HTTPError(400, "bad_request", f"field {name!r} is longer than {MAX_STRING_CHARS} characters")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise HTTPError(400, "bad_request", f"field {name!r} is not valid Unicode text") from None


def _check_meta(v: Any, name: str) -> None:
    """A nested JSON value kept by the coordinator (an error, a GPU list, caller info):
    plain JSON types, valid strings, finite numbers, at most MAX_META_JSON_BYTES."""
    try:
        size = len(json.dumps(v, allow_nan=False, ensure_ascii=False).encode("utf-8"))
    except (ValueError, UnicodeEncodeError, RecursionError, TypeError):
        raise HTTPError(400, "bad_request", f"field {name!r} holds a value that is not plain JSON "
                                            "(non-finite number or invalid text)") from None
    if size > MAX_META_JSON_BYTES:
        raise HTTPError(400, "bad_request", f"field {name!r} is over {MAX_META_JSON_BYTES // 1024} KiB")


#: What a heartbeat's ``gpu_telemetry`` may hold per GPU, with the accepted range.
_TELEMETRY = {"utilization_pct": (0.0, 100.0), "temperature_c": (-50.0, 200.0)}


def _check_telemetry(value: Any) -> dict[str, dict[str, float]]:
    """``{"<gpu index>": {"utilization_pct"?, "temperature_c"?}}``; ``ValueError`` otherwise."""
    if not isinstance(value, dict) or len(value) > 256:
        raise ValueError("field 'gpu_telemetry' must be an object of at most 256 GPUs")
    out = {}
    for k, d in value.items():
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 4) or not isinstance(d, dict) \
                or set(d) - set(_TELEMETRY):
            raise ValueError("field 'gpu_telemetry' maps a GPU index to "
                             "{utilization_pct, temperature_c}")
        for name, v in d.items():
            lo, hi = _TELEMETRY[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"gpu_telemetry.{k}.{name} must be a number from {lo:g} to {hi:g}")
        out[k] = {n: float(v) for n, v in d.items()}
    return out


def _id(value: str, what: str) -> str:
    if not isinstance(value, str) or not _HEX.match(value):
        raise HTTPError(400, "bad_request", f"{what} {str(value)[:80]!r} is not a valid id")
    return value


def _query_float(request: Request, name: str, default: float, lo: float, hi: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise HTTPError(400, "bad_request", f"query parameter {name!r} must be a number") from None
    if not lo <= v <= hi:
        raise HTTPError(400, "bad_request", f"query parameter {name!r} must be between {lo} and {hi}")
    return v


def _too_big(limit: int, setting: str) -> HTTPError:
    size = f"{limit // MiB} MiB" if limit >= MiB else f"{limit // 1024} KiB"
    return HTTPError(413, "too_large", f"request body is over the coordinator's limit of {size} "
                                       f"(set {setting} on the coordinator to raise it)")


def _content_length(request: Request, limit: int, setting: str) -> int | None:
    """The declared body size (None when chunked); 413 before reading when it is over
    ``limit``."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    try:
        n = int(declared)
    except ValueError:
        raise HTTPError(400, "bad_request", "invalid Content-Length") from None
    if n < 0:
        raise HTTPError(400, "bad_request", "invalid Content-Length")
    if n > limit:
        raise _too_big(limit, setting)
    return n


async def _read_body(request: Request, limit: int = MAX_BODY_BYTES,
                     setting: str = "GPUMESH_MAX_BODY_MB") -> bytearray:
    """Read the whole body into one writable buffer, refusing anything over ``limit``
    (before reading it when Content-Length already says so)."""
    return await _read_all(request, _content_length(request, limit, setting), limit, setting)


async def _read_all(request: Request, n: int | None, limit: int, setting: str) -> bytearray:
    """The body whose Content-Length ``n`` (None: chunked) was checked against ``limit``."""
    try:
        if n is None:  # chunked: grow as it comes
            buf = bytearray()
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > limit:
                    raise _too_big(limit, setting)
            return buf
        # Known size: one allocation, each piece copied once into place. Growing a bytearray
        # piece by piece would copy a large body several times over as it is reallocated.
        buf = bytearray(n)
        view, pos = memoryview(buf), 0
        async for chunk in request.stream():
            end = pos + len(chunk)
            if end > n:  # the server enforces Content-Length; never write past the buffer
                raise HTTPError(400, "bad_request", "body is longer than its Content-Length")
            view[pos:end] = chunk
            pos = end
    except ClientDisconnect:  # the caller went away mid-body: nothing to answer, nothing kept
        raise HTTPError(400, "bad_request", "the body ended early (the client went away)") from None
    if pos != n:
        raise HTTPError(400, "bad_request", f"body ended after {pos} of {n} bytes")
    return buf


async def _json_body(request: Request) -> dict:
    body = await _read_body(request, MAX_JSON_BODY_BYTES, "GPUMESH_MAX_JSON_KB")
    if not body:
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise HTTPError(400, "bad_request", "body is not valid JSON") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "bad_request", "body must be a JSON object")
    return data


def _frames(body: bytearray) -> tuple[dict, list[memoryview]]:
    try:
        frames = wire.unpack_frames(body)
        meta = json.loads(bytes(frames[0])) if frames else None
    except (WireError, ValueError, RecursionError) as e:
        raise HTTPError(400, "bad_request", f"body is not a gpumesh frames message: {e}") from None
    if not isinstance(meta, dict):
        raise HTTPError(400, "bad_request", "frame 0 must be a JSON object")
    return meta, frames[1:]


def _not_frames(why: str) -> HTTPError:
    return HTTPError(400, "bad_request", f"body is not a gpumesh frames message: {why}")


class _Pieces:
    """A request body as it arrives, handed out ``k`` bytes at a time (views, no copies).
    Enforces the body limit and the Content-Length ``n`` (None: chunked)."""

    __slots__ = ("_stream", "_left", "got", "n", "_limit", "_setting")

    def __init__(self, request: Request, n: int | None, limit: int, setting: str):
        self._stream = request.stream().__aiter__()
        self._left = memoryview(b"")
        self.got, self.n, self._limit, self._setting = 0, n, limit, setting

    async def take(self, k: int) -> memoryview | None:
        """Up to ``k`` bytes (at least one), or None at the end of the body."""
        while not self._left:
            try:
                chunk = await self._stream.__anext__()
            except StopAsyncIteration:
                return None
            except ClientDisconnect:  # the caller went away mid-body
                raise self.short() from None
            self.got += len(chunk)
            if self.n is not None and self.got > self.n:
                raise HTTPError(400, "bad_request", "body is longer than its Content-Length")
            if self.got > self._limit:
                raise _too_big(self._limit, self._setting)
            self._left = memoryview(chunk)
        out, self._left = self._left[:k], self._left[k:]
        return out

    async def exactly(self, k: int) -> bytearray:
        """``k`` bytes in one small buffer (headers); 400 if the body ends first."""
        buf = bytearray()
        while len(buf) < k:
            piece = await self.take(k - len(buf))
            if piece is None:
                raise self.short()
            buf += piece
        return buf

    async def into(self, k: int, write) -> None:
        """Pass the next ``k`` bytes to ``write`` piece by piece; 400 if the body ends first."""
        while k > 0:
            piece = await self.take(k)
            if piece is None:
                raise self.short()
            write(piece)
            k -= len(piece)

    async def drain(self) -> None:
        """Read (and drop) what is left; 400 if it ends before its Content-Length."""
        while await self.take(1 << 30) is not None:
            pass
        if self.n is not None and self.got != self.n:
            raise self.short()

    def short(self) -> HTTPError:
        if self.n is not None:
            return HTTPError(400, "bad_request", f"body ended after {self.got} of {self.n} bytes")
        return _not_frames("frames body truncated")


class _Filling:
    """A frame kept in memory, filled piece by piece."""

    __slots__ = ("view", "at")

    def __init__(self, size: int):
        self.view, self.at = memoryview(bytearray(size)), 0

    def write(self, piece: memoryview) -> None:
        end = self.at + len(piece)
        self.view[self.at:end] = piece
        self.at = end


async def _frames_streamed(request: Request, store) -> tuple[dict, list]:
    """A frames body (job submission, task result) read as it arrives: the header is parsed
    from its first bytes, frame 0 (JSON meta) and small frames are kept in memory, and every
    payload frame over the store's inline limit is written straight into a temporary file
    (:meth:`Store.incoming`) that the store later adopts (renames into place) instead of
    receiving bytes. Returns ``(meta, frames)``: each frame a ``memoryview`` or a finished
    :class:`~.store.Incoming`.

    Every temporary file is registered with the request and deleted when its handler ends
    unless the store adopted it (see ``route`` in :func:`create_app`), whatever went wrong.
    Errors are those of :func:`_read_body` + :func:`_frames`: 413 over the limit (before
    reading when Content-Length says so), 400 for a malformed or truncated body.
    """
    setting = "GPUMESH_MAX_BODY_MB"
    n = _content_length(request, MAX_BODY_BYTES, setting)
    if n is not None and n <= INLINE_BLOB_BYTES:
        # Too small to hold a frame the store would put in a file: one buffer, as always.
        return _frames(await _read_all(request, n, MAX_BODY_BYTES, setting))
    body = _Pieces(request, n, MAX_BODY_BYTES, setting)
    head = bytearray()
    while len(head) < 8 and (piece := await body.take(8 - len(head))) is not None:
        head += piece
    if len(head) < 8:
        raise body.short() if n is not None else _not_frames(f"frames body too short ({len(head)} bytes)")
    try:
        wire._check_magic(memoryview(head), wire.FRAMES_MAGIC, "message")
    except WireError as e:
        raise _not_frames(str(e)) from None
    (count,) = struct.unpack_from("<I", head, 4)
    available = MAX_BODY_BYTES if n is None else n
    if 8 + 8 * count > available:
        raise _not_frames("frames header truncated")
    lengths = struct.unpack(f"<{count}Q", await body.exactly(8 * count))
    offsets = list(wire.frame_offsets(lengths))
    end = offsets[-1] + lengths[-1] if count else 8 + 8 * count
    if n is not None and end > n:  # refused before anything is written
        raise _not_frames("frames body truncated")
    if end > MAX_BODY_BYTES:
        raise _too_big(MAX_BODY_BYTES, setting)
    if not count:
        raise HTTPError(400, "bad_request", "frame 0 must be a JSON object")
    spool = request.scope.setdefault("gpumesh.incoming", [])
    pos = 8 + 8 * count
    frames: list = []
    meta = None
    for i, (off, size) in enumerate(zip(offsets, lengths)):
        await body.into(off - pos, lambda piece: None)  # alignment padding
        if i and size > INLINE_BLOB_BYTES:
            inc = store.incoming()
            spool.append(inc)
            await body.into(size, inc.write)
            inc.finish()
            frames.append(inc)
        else:
            buf = _Filling(size)
            await body.into(size, buf.write)
            frames.append(buf.view)
        pos = off + size
        if i == 0:  # refuse bad meta before taking in the payloads
            try:
                meta = json.loads(bytes(frames[0]))
            except (ValueError, RecursionError) as e:
                raise _not_frames(str(e)) from None
            if not isinstance(meta, dict):
                raise HTTPError(400, "bad_request", "frame 0 must be a JSON object")
    await body.drain()
    return meta, frames[1:]


def _discard_incoming(request: Request) -> None:
    """Delete the temporary files of this request's body that the store did not adopt."""
    for inc in request.scope.pop("gpumesh.incoming", ()):
        try:
            inc.discard()
        except OSError:
            log.exception("could not delete %s", inc.path)


def _take_handoffs(request: Request, meta: dict, frames: list, store) -> list:
    """Replace the frames a same-machine sender left empty by the files it wrote for them
    (``meta["handoff_files"]``: ``{"<frame number>": "<file name>"}``, frame 0 being the
    first after the meta; see :mod:`gpumesh.handoff`). Each claimed file is registered
    with the request like a streamed upload: deleted at the end unless the store adopted
    it. 400 for a malformed map, 409 ``handoff_missing`` for a file that is not there
    (the sender then sends the bytes)."""
    names = _field(meta, "handoff_files", dict, None)
    if not names:
        return frames
    frames = list(frames)
    spool = request.scope.setdefault("gpumesh.incoming", [])
    # The body limit holds for a payload however it travels: a call refused from another
    # machine is refused from this one too.
    total = sum(f.size if isinstance(f, Incoming) else f.nbytes for f in frames)
    for key, name in names.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < len(frames)):
            raise HTTPError(400, "bad_request", f"handoff_files: {key!r} is not a frame number")
        i = int(key)
        if isinstance(frames[i], Incoming) or len(frames[i]):
            raise HTTPError(400, "bad_request", f"handoff_files: frame {i} must be empty")
        try:
            inc = store.take_handoff(name)
        except ValueError as e:
            raise HTTPError(400, "bad_request", f"handoff_files: {e}") from None
        except FileNotFoundError:
            raise HTTPError(409, "handoff_missing",
                            f"handoff file {name} is not in this coordinator's handoff "
                            "directory; send the payload in the body") from None
        spool.append(inc)
        frames[i] = inc
        total += inc.size
        if total > MAX_BODY_BYTES:
            raise _too_big(MAX_BODY_BYTES, "GPUMESH_MAX_BODY_MB")
    return frames


def _sha256(frame) -> str:
    if isinstance(frame, Incoming):
        return frame.sha256()
    return hashlib.sha256(frame).hexdigest()


# ---------------------------------------------------------------- responses --------
class Part:
    """One frame of a streamed response: in-memory bytes or a file on disk."""

    __slots__ = ("data", "path", "size")

    def __init__(self, data: bytes | memoryview | None = None, path: Path | None = None, size: int = 0):
        self.data, self.path = data, path
        self.size = memoryview(data).nbytes if data is not None else size


def _read_part(part: Part) -> bytes:
    """A small file part's bytes, zero-padded to the announced size (see frames_response)."""
    with open(part.path, "rb") as fh:
        data = fh.read(part.size)
    return data + b"\0" * (part.size - len(data))


class _FramesResponse(Response):
    """A frames body held in memory; ``on_sent(ok)`` as for :func:`frames_response`."""

    media_type = FRAMES

    def __init__(self, body: bytes, on_sent=None):
        super().__init__(body)
        self.on_sent = on_sent

    async def __call__(self, scope, receive, send) -> None:
        if self.on_sent is None:
            return await super().__call__(scope, receive, send)
        sent = False
        try:
            await super().__call__(scope, receive, send)
            sent = True
        finally:
            self.on_sent(sent)


def frames_response(meta: dict, parts: list[Part], on_sent=None) -> Response:
    """Stream ``meta`` and ``parts`` as one frames body. ``on_sent(ok)`` (optional) is called
    once the last byte was handed to the connection (``True``) or sending failed
    (``False``)."""
    head = json.dumps(meta).encode()
    lengths = [len(head)] + [p.size for p in parts]
    offsets = list(wire.frame_offsets(lengths))
    total = offsets[-1] + lengths[-1]
    if total <= SMALL_BODY_BYTES:
        # Most answers (a lease of small tasks, a page of small results) are a few hundred
        # bytes: one plain response skips the streaming machinery (a task group and a
        # disconnect listener per response), which costs more than the body itself.
        body = bytearray(wire.frames_header(lengths))
        for off, part in zip(offsets, [Part(head)] + parts):
            body += b"\0" * (off - len(body))
            body += part.data if part.data is not None else _read_part(part)
        return _FramesResponse(bytes(body), on_sent)

    async def body() -> AsyncIterator[bytes]:
        if on_sent is None:
            async for chunk in chunks():
                yield chunk
            return
        sent = False
        try:
            async for chunk in chunks():
                yield chunk
            sent = True
        finally:
            on_sent(sent)

    async def chunks() -> AsyncIterator[bytes]:
        pos = 0
        header = wire.frames_header(lengths)
        yield header
        pos = len(header)
        for off, part in zip(offsets, [Part(head)] + parts):
            if off > pos:
                yield b"\0" * (off - pos)
            if part.data is not None:
                yield bytes(part.data)
            else:
                with open(part.path, "rb") as fh:
                    remaining = part.size
                    while remaining > 0:
                        chunk = fh.read(min(4 * MiB, remaining))
                        if not chunk:  # file shorter than announced: keep the framing valid
                            chunk = b"\0" * remaining
                        remaining -= len(chunk)
                        yield chunk
            pos = off + part.size

    return StreamingResponse(body(), media_type=FRAMES, headers={"content-length": str(total)})


# ---------------------------------------------------------------- the app ----------
def create_app(coord: Coordinator, token: str, *, worker_token: str | None = None,
               safe_mode: bool = False, loopback_bound: bool = False,
               authenticator: Authenticator | None = None,
               metrics_token: str | None = None) -> Starlette:
    """Build the ASGI app around ``coord``.

    ``token``: the main bearer token (everything allowed); ``worker_token``: an optional
    token that may only act as a worker. ``safe_mode``: refuse function (pickle) jobs.
    ``loopback_bound``: the server listens on loopback only (see :mod:`.auth` for what
    that exempts). ``metrics_token``: a token that may read ``GET /metrics`` only (see
    :mod:`.metrics`). Only hashes of the tokens are kept.
    """
    auth = authenticator or Authenticator(token, worker_token, loopback_bound=loopback_bound)
    del token, worker_token

    def caps_changed(reg: people.People) -> None:
        coord.max_running.clear()
        coord.max_running.update(reg.caps())
        coord._wake_idle()  # a raised cap may let a waiting person start now
    if auth.people is None:
        auth.people = people.People(coord.store, on_change=caps_changed)
    caps_changed(auth.people)
    registry = auth.people

    def route(path: str, methods: list[str], auth_required: bool = True, worker: bool = False,
              action: str = "", roles: frozenset[str] | None = None):
        """Register ``fn`` at ``path``. ``roles``: who may call it (:mod:`.people`);
        default: callers who may submit, or with ``worker`` the worker token (and admins).
        ``action`` names what a refused role may not do, for its 403. Routes that need
        no token answer every gpumesh version (a caller learns ours from health, and the
        wheel is how another version gets this one); the others refuse other versions."""
        allowed = roles or (people.WORKER if worker else people.SUBMIT)

        def deco(fn):
            async def endpoint(request: Request) -> Response:
                try:
                    if auth_required:
                        _check_version(request, worker)
                        client = request.client.host if request.client else None
                        who = await auth.identity(client, request.headers)
                        if who.role not in allowed:
                            if who.role == people.ROLE_WORKER:
                                raise HTTPError(403, "forbidden",
                                                f"the worker token cannot {action or 'do this'}; "
                                                "this needs the main token")
                            raise HTTPError(403, "forbidden",
                                            f"{who.name}'s token ({who.role}) cannot "
                                            f"{action or 'do this'}")
                        request.scope["gpumesh.who"] = who
                    return await fn(request)
                except AuthRefused as e:
                    headers = {"retry-after": str(int(e.retry_after) + 1)} if e.retry_after else None
                    return JSONResponse({"error": e.code, "message": e.message}, status_code=e.status,
                                        headers=headers)
                except HTTPError as e:
                    return _err(e.status, e.code, e.message)
                except UnknownWorker:
                    return _err(404, "unknown_worker", "worker is not registered (register again)")
                except UnknownJob as e:
                    return _err(404, "unknown_job", f"no such job {e}")
                except Exception:  # a bug must not take the coordinator down
                    log.exception("error handling %s %s", request.method, request.url.path)
                    return _err(500, "internal", "internal error; see the coordinator log")
                finally:  # payload files of the body that were not stored: gone
                    if "gpumesh.incoming" in request.scope:
                        _discard_incoming(request)
            routes.append(Route(path, endpoint, methods=methods))
            return fn
        return deco

    routes: list[Route] = []

    def who_of(request: Request) -> people.Identity:
        return request.scope.get("gpumesh.who", people.MAIN)

    def owned(request: Request, jid: str, action: str) -> None:
        """Refuse (403 ``not_yours``) unless the caller may ``action`` job ``jid``;
        404 for an unknown job."""
        who = who_of(request)
        job = coord.jobs.get(jid)
        if job is not None:
            owner = job.owner
        else:
            found = coord.store.job_owners([jid])
            if jid not in found:
                raise UnknownJob(jid)
            owner = found[jid]
        if not who.may_touch(owner):
            raise HTTPError(403, "not_yours", f"job {jid} belongs to {owner or 'admin'}: "
                                              f"{who.name} cannot {action} it")

    async def until_disconnect(request: Request, work: Awaitable):
        """Run ``work``; cancel it if the client goes away first (then return None)."""
        task = asyncio.ensure_future(work)

        async def watch():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return None

    # -- health & pool ---------------------------------------------------------------
    @route("/v1/health", ["GET"], auth_required=False)
    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True, "version": __version__})

    @route("/v1/openapi.json", ["GET"], auth_required=False)
    async def openapi(request: Request) -> Response:
        from .openapi import spec
        return JSONResponse(spec())

    # The wheel of this gpumesh, for other machines to install (no token: public code).
    wheels = dist.WheelCache(coord.store.dir / "dist")

    @route(dist.DIST_PATH + "/{name}", ["GET"], auth_required=False)
    async def wheel(request: Request) -> Response:
        name = request.path_params["name"]
        if name != dist.wheel_name():
            raise HTTPError(404, "not_found", f"no file {name[:100]!r} here: this coordinator "
                                              f"serves {dist.wheel_name()} (the gpumesh it runs)")
        try:
            data = await asyncio.to_thread(wheels.get)
        except (dist.DistUnavailable, OSError) as e:
            log.warning("cannot serve the wheel: %s", e)
            raise HTTPError(503, "dist_unavailable", f"cannot make the wheel: {e}") from None
        return Response(data, media_type="application/zip",
                        headers={"content-disposition": f'attachment; filename="{name}"'})

    @route("/v1/workers", ["GET"], action="list the workers", roles=people.READ)
    async def list_workers(request: Request) -> Response:
        return JSONResponse([coord.worker_view(w) for w in coord.workers.values()])

    @route("/v1/workers", ["POST"], worker=True)
    async def register(request: Request) -> Response:
        data = await _json_body(request)
        wid = _field(data, "id", str, None)
        if wid is not None:
            _id(wid, "worker id")
        slots = _field(data, "slots", int, 1, lo=1, hi=1024)
        info = {}
        for key in ("hostname", "user", "device", "device_name", "platform", "python", "version",
                    "cpu", "gpus"):
            if key in data:
                info[key] = data[key]
        for key in ("cores", "ram_mb", "score"):
            if key in data:
                info[key] = _field(data, key, (int, float), lo=0, hi=1e12)
        info.setdefault("score", 0.0)
        for key in ("hostname", "user", "device", "device_name", "platform", "python", "version", "cpu"):
            if key in info and not isinstance(info[key], str):
                raise HTTPError(400, "bad_request", f"field {key!r} must be a string")
            if key in info:
                _check_str(info[key], key)
        if "gpus" in info:
            gpus = info["gpus"]
            if not isinstance(gpus, list) or len(gpus) > 256 or not all(isinstance(g, dict) for g in gpus):
                raise HTTPError(400, "bad_request", "field 'gpus' must be a list of objects (at most 256)")
            _check_meta(gpus, "gpus")
        try:  # the slots it offers (one per GPU, then CPU slots) and its device scores
            info["slot_list"] = hardware.check_slot_list(data.get("slot_list"), slots, info.get("gpus"))
            if data.get("scores") is not None:
                info["scores"] = hardware.check_scores(data["scores"])
            if data.get("packages") is not None:  # its Python distributions (gpumesh.packages)
                info["packages"] = packages.check(data["packages"])
            if data.get("allow_installs") is not None:  # join --allow-installs
                info["allow_installs"] = _field(data, "allow_installs", bool)
            _owner_fields(data, info)
        except ValueError as e:
            raise HTTPError(400, "bad_request", str(e)) from None
        w = coord.register(info, wid, slots)
        from ..limits import HEARTBEAT_INTERVAL_S, WORKER_TTL_S
        return JSONResponse({"id": w.id, "heartbeat_s": HEARTBEAT_INTERVAL_S, "ttl_s": WORKER_TTL_S,
                             "version": __version__})

    @route("/v1/workers/{wid}/heartbeat", ["POST"], worker=True)
    async def heartbeat(request: Request) -> Response:
        wid = _id(request.path_params["wid"], "worker id")
        data = await _json_body(request)
        running = _field(data, "running", list, None)
        if running is not None and (len(running) > MAX_HEARTBEAT_TASKS or not all(
                isinstance(t, str) and _HEX.match(t) for t in running)):
            raise HTTPError(400, "bad_request", "field 'running' must be a list of task ids "
                                                f"(at most {MAX_HEARTBEAT_TASKS})")
        info = {}
        if "score" in data:
            info["score"] = _field(data, "score", (int, float), lo=0, hi=1e12)
        try:  # device scores once measured; free GPU memory as last seen
            if data.get("scores") is not None:
                info["scores"] = hardware.check_scores(data["scores"])
            if data.get("gpu_free_mb") is not None:
                info["gpu_free_mb"] = hardware.check_gpu_free(data["gpu_free_mb"])
            if data.get("gpu_telemetry") is not None:
                info["gpu_telemetry"] = _check_telemetry(data["gpu_telemetry"])
            if data.get("packages") is not None:  # something was installed or removed
                info["packages"] = packages.check(data["packages"])
            _owner_fields(data, info)
        except ValueError as e:
            raise HTTPError(400, "bad_request", str(e)) from None
        return JSONResponse(coord.heartbeat(wid, running, info))

    @route("/v1/workers/{wid}/session", ["GET"], worker=True)
    async def session(request: Request) -> Response:
        """The worker's pulse: an open response that only ends when either side goes.
        A worker process that dies closes its sockets at once, so its tasks are re-queued
        in milliseconds instead of after the heartbeat TTL."""
        wid = _id(request.path_params["wid"], "worker id")
        sid = coord.session_opened(wid)

        worker = coord.workers[wid]
        wake = worker.wake = asyncio.Event()

        async def pulse() -> AsyncIterator[bytes]:
            try:
                yield b"open\n"
                while not coord.closing:
                    try:
                        await asyncio.wait_for(wake.wait(), SESSION_PING_S)
                    except asyncio.TimeoutError:
                        yield b"ping\n"
                        continue
                    wake.clear()
                    lines, worker.outbox = worker.outbox, []
                    if lines:
                        yield ("\n".join(lines) + "\n").encode()
            finally:
                coord.session_closed(wid, sid)
        return StreamingResponse(pulse(), media_type="text/plain")

    @route("/v1/workers/{wid}", ["DELETE"], worker=True)
    async def deregister(request: Request) -> Response:
        wid = _id(request.path_params["wid"], "worker id")
        return JSONResponse({"requeued": coord.deregister(wid)})

    @route("/v1/workers/{wid}/lease", ["POST"], worker=True)
    async def lease(request: Request) -> Response:
        wid = _id(request.path_params["wid"], "worker id")
        data = await _json_body(request)
        slots = _field(data, "slots", int, 1, lo=1, hi=1024)
        wait = _field(data, "wait", (int, float), 0, lo=0, hi=LONG_POLL_MAX_S)
        try:
            free = hardware.check_free_slots(data.get("free"))
        except ValueError as e:
            raise HTTPError(400, "bad_request", str(e)) from None
        by_path = _field(data, "handoff", bool, False)
        grants = await until_disconnect(request, coord.lease(wid, slots, wait, free))
        return lease_response(grants or [], by_path)

    def lease_response(grants, by_path: bool = False) -> Response:
        """Frames: JSON ``{"tasks": [...]}`` then each task's argument payload.
        ``by_path`` (the worker shares this machine): arguments the store keeps as files
        travel as ``args_file`` (relative to the blob directory) and an empty frame."""
        if grants:
            tracing.mark("coordinator.grant")
        tasks, parts, files = [], [], {}
        for g in grants:
            job = coord.jobs[g.job_id]
            inline, fname = coord.store.task_args(g.task_id)
            if fname is None:
                parts.append(Part(inline))
            elif by_path:  # same machine: the worker maps the file itself
                files[g.task_id] = fname
                parts.append(Part(b""))
            else:
                path = coord.store.file_path(fname)
                parts.append(Part(path=path, size=path.stat().st_size))
            tasks.append({"task_id": g.task_id, "job_id": g.job_id, "index": g.index,
                          "lease_id": g.lease_id, "attempt": g.attempt, "kind": job.kind,
                          "fn": job.fn_hash, "timeout": job.meta.get("timeout"),
                          "name": job.meta.get("name", ""), "slot": g.slot,
                          "result_format": job.meta.get("result_format", "pickle"),
                          "isolation": job.meta.get("isolation", "task")})
            if job.require.requires:  # built into a task environment if the worker lacks them
                tasks[-1]["requires"] = list(job.require.requires)
            if g.task_id in files:
                tasks[-1]["args_file"] = files[g.task_id]
        if not grants:
            return frames_response({"tasks": tasks}, parts)
        leases = [(g.task_id, g.lease_id) for g in grants]
        # A lease counts as delivered only once its whole answer has left; one whose answer
        # broke off goes back to the queue at once (see Coordinator.lease_delivered).
        return frames_response({"tasks": tasks}, parts,
                               on_sent=lambda ok: coord.lease_delivered(leases, ok))

    @route("/v1/tasks/{tid}/result", ["POST"], worker=True)
    async def result(request: Request) -> Response:
        tracing.mark("coordinator.result")
        tid = _id(request.path_params["tid"], "task id")
        lease_id = request.query_params.get("lease", "")
        _id(lease_id or "-", "lease id")
        meta, frames = await _frames_streamed(request, coord.store)
        status = _field(meta, "status", str)
        if status not in ("ok", "error", "retry"):
            raise HTTPError(400, "bad_request", "field 'status' must be ok, error or retry")
        error = _field(meta, "error", dict, None)
        if status == "ok" and not frames:
            raise HTTPError(400, "bad_request", "an ok result needs a payload frame")
        frames = _take_handoffs(request, meta, frames, coord.store)
        payload = frames[0] if frames else None
        try:
            wid = coord.post_result(tid, lease_id, status, error, payload)
            tracing.mark("coordinator.result_stored")
        except StaleLease:
            return _err(409, "stale_lease",
                        "this lease is no longer current (the task was re-queued or already has a result)")
        # ?next=1: the worker's slot is free again; hand it the next task in the same
        # round trip instead of making it come back with a lease request.
        if request.query_params.get("next") == "1" and wid is not None:
            slot = request.query_params.get("slot")
            if slot is not None and not (re.fullmatch(r"[0-9]{1,4}", slot) and int(slot) < 1024):
                raise HTTPError(400, "bad_request", "query parameter 'slot' must be a slot id")
            return lease_response(coord.grant_now(wid, 1, None if slot is None else int(slot)),
                                  request.query_params.get("handoff") == "1")
        return lease_response([])

    @route("/v1/tasks/{tid}/release", ["POST"], worker=True)
    async def hand_back(request: Request) -> Response:
        """The worker hands a running task back (its owner's rules): re-queued as
        preempted, the attempt not counted; fenced by the lease like a result."""
        tid = _id(request.path_params["tid"], "task id")
        lease_id = request.query_params.get("lease", "")
        _id(lease_id or "-", "lease id")
        data = await _json_body(request)
        reason = _field(data, "reason", str, "handed back by its worker")
        _check_str(reason, "reason")
        if len(reason) > 200 or not reason.isprintable():
            raise HTTPError(400, "bad_request",
                            "field 'reason' must be a printable line of at most 200 characters")
        try:
            coord.hand_back(tid, lease_id, reason)
        except StaleLease:
            return _err(409, "stale_lease", "this lease is no longer current")
        return JSONResponse({"requeued": True})

    @route("/v1/tasks/{tid}/output", ["POST"], worker=True)
    async def task_output(request: Request) -> Response:
        tid = _id(request.path_params["tid"], "task id")
        lease_id = request.query_params.get("lease", "")
        _id(lease_id or "-", "lease id")
        _meta, frames = _frames(await _read_body(request, OUTPUT_BODY_BYTES))
        if len(frames) != 2:
            raise HTTPError(400, "bad_request", "output needs two frames: stdout, stderr")
        try:
            coord.post_output(tid, lease_id, bytes(frames[0]), bytes(frames[1]))
        except StaleLease:
            return _err(409, "stale_lease", "this lease is no longer current")
        return JSONResponse({"accepted": True})

    @route("/v1/handoff", ["GET"], roles=people.CALLER_AND_WORKER)
    async def handoff_dirs(request: Request) -> Response:
        """Where a sender on this machine may leave payload files, and where the store's
        payload files are (see :mod:`gpumesh.handoff`)."""
        store = coord.store
        return JSONResponse({"blob_dir": str(store.blob_dir.resolve()),
                             "handoff_dir": str(store.handoff_dir.resolve()),
                             "nonce": store.handoff_nonce})

    # -- blobs -----------------------------------------------------------------------
    @route("/v1/blobs/{h}", ["HEAD", "GET"], roles=people.CALLER_AND_WORKER)
    async def get_blob(request: Request) -> Response:
        h = request.path_params["h"]
        if not _SHA.match(h):
            raise HTTPError(400, "bad_request", "blob name must be a sha256 hex digest")
        path = coord.store.blob_file(h)
        if path is None:
            return _err(404, "unknown_blob", f"no blob {h}")
        size = path.stat().st_size
        if request.method == "HEAD":
            return Response(status_code=200, headers={"content-length": str(size)})

        async def body() -> AsyncIterator[bytes]:
            with open(path, "rb") as fh:
                while chunk := fh.read(4 * MiB):
                    yield chunk
        return StreamingResponse(body(), media_type="application/octet-stream",
                                 headers={"content-length": str(size)})

    @route("/v1/blobs/{h}", ["PUT"], action="upload function blobs")
    async def put_blob(request: Request) -> Response:
        h = request.path_params["h"]
        if not _SHA.match(h):
            raise HTTPError(400, "bad_request", "blob name must be a sha256 hex digest")
        body = await _read_body(request)
        if hashlib.sha256(body).hexdigest() != h:
            raise HTTPError(400, "bad_request", "blob content does not match its sha256 name")
        coord.store.put_blob(h, [body])
        return JSONResponse({"stored": True})

    # -- jobs ------------------------------------------------------------------------
    @route("/v1/jobs", ["POST"], action="submit jobs")
    async def submit(request: Request) -> Response:
        tracing.mark("coordinator.submit")
        meta, frames = await _frames_streamed(request, coord.store)
        job_id = _id(_field(meta, "job_id", str), "job id")
        kind = _field(meta, "kind", str, "function")
        if kind not in ("function", "script"):
            raise HTTPError(400, "bad_request", "field 'kind' must be 'function' or 'script'")
        if safe_mode and kind == "function":
            raise HTTPError(403, "safe_mode",
                            "this coordinator runs in safe mode (serve --safe-mode): it refuses "
                            "function jobs, whose pickled code and arguments run on the workers; "
                            "submit a script job instead")
        result_format = _field(meta, "result_format", str, "pickle")
        if result_format not in ("pickle", "json"):
            raise HTTPError(400, "bad_request", "field 'result_format' must be 'pickle' or 'json'")
        isolation = _field(meta, "isolation", str, "task")
        if isolation not in ("task", "job"):
            raise HTTPError(400, "bad_request", "field 'isolation' must be 'task' or 'job'")
        if isolation == "job" and kind == "script":
            raise HTTPError(400, "bad_request", "script jobs always run one process per task: "
                            "isolation='job' is for function jobs")
        name = _field(meta, "name", str, "")[:200]
        fn = _field(meta, "fn", str)
        if not _SHA.match(fn):
            raise HTTPError(400, "bad_request", "field 'fn' must be a sha256 hex digest")
        inline_fn = _field(meta, "fn_inline", bool, False)
        n = _field(meta, "n_tasks", int, lo=0, hi=MAX_TASKS_PER_JOB)
        if len(frames) != n + (1 if inline_fn else 0):
            raise HTTPError(400, "bad_request",
                            f"n_tasks is {n} but the body carries {len(frames)} payload frames")
        timeout = _field(meta, "timeout", (int, float), None, lo=0.001, hi=365 * 86400)
        costs = _field(meta, "costs", list, None)
        if costs is None:
            costs = [1.0] * n
        elif len(costs) != n or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                        and 0 <= c < 1e9 for c in costs):
            raise HTTPError(400, "bad_request", "field 'costs' must hold one number >= 0 per task")
        try:  # hardware the tasks need, and their GPU memory hints (MiB)
            require = hardware.Requirements.from_meta(_field(meta, "require", dict, None))
            vram = hardware.check_vram_hints(meta.get("gpu_memory_mb"), n)
        except ValueError as e:
            raise HTTPError(400, "bad_request", str(e)) from None
        try:  # re-runs of items whose function raised one of these types (gpumesh.retries)
            retry = retries.check_meta(meta.get("retries"), meta.get("retry_on"))
        except ValueError as e:
            raise HTTPError(400, "bad_request", str(e)) from None
        require_worker = _field(meta, "require_worker", bool, False)
        caller = _field(meta, "caller", dict, {})
        wait = _field(meta, "wait", (int, float), 0, lo=0, hi=LONG_POLL_MAX_S)
        want_output = _field(meta, "output", bool, False)
        by_path = _field(meta, "handoff", bool, False)
        if not (job_id in coord.jobs or coord.store.job_exists(job_id)):
            # (a resent submit of a stored job: its files were claimed the first time)
            frames = _take_handoffs(request, meta, frames, coord.store)
        args = frames
        if inline_fn:
            blob, args = frames[0], frames[1:]
            if _sha256(blob) != fn:
                raise HTTPError(400, "bad_request", "inline function blob does not match 'fn'")
            coord.store.put_blob(fn, blob if isinstance(blob, Incoming) else [blob])
        elif not coord.store.has_blob(fn):
            raise HTTPError(409, "missing_blob", f"upload blob {fn} first (PUT /v1/blobs/{fn})")
        job_meta = {"timeout": timeout, "name": name, "caller": caller}
        if require:
            job_meta["require"] = require.to_meta()
        if vram:
            job_meta["gpu_memory_mb"] = {str(i): v for i, v in vram.items()}
        if result_format != "pickle":
            job_meta["result_format"] = result_format
        if isolation != "task":
            job_meta["isolation"] = isolation
        if retry is not None:
            job_meta["retries"], job_meta["retry_on"] = retry
        try:
            job, created = coord.submit(job_id, name, kind, fn, job_meta, list(args),
                                        [float(c) for c in costs], require_worker,
                                        owner=who_of(request).name)
        except NoWorkers:
            return _err(409, "no_workers", "no worker is alive in the mesh")
        except Unsatisfiable as e:
            return _err(409, "unsatisfiable", str(e))
        tracing.mark("coordinator.stored")
        info = {"job_id": job.id, "n_tasks": job.n_tasks, "created": created}
        if not wait or job.id not in coord.jobs:
            return JSONResponse(info)
        # Submit-and-wait: a short call's result comes back in the submit's own answer,
        # saving the caller a round trip (the answer is a results page, cursor -1).
        out_after = -1 if want_output else None
        waited = await until_disconnect(request, coord.wait_results(job.id, -1, wait, out_after))
        if waited is None:
            return Response(status_code=204)
        tracing.mark("coordinator.answer")
        return results_page(waited, -1, out_after, info, by_path)

    @route("/v1/jobs", ["GET"], action="list jobs", roles=people.READ)
    async def list_jobs(request: Request) -> Response:
        limit = int(_query_float(request, "limit", 20, 1, 1000))
        rows = coord.store.db.execute(
            "SELECT id FROM jobs ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        return JSONResponse([_job_view(coord, r[0], with_tasks=False) for r in rows])

    @route("/v1/jobs/{jid}", ["GET"], action="read job status", roles=people.READ)
    async def job_status(request: Request) -> Response:
        jid = _id(request.path_params["jid"], "job id")
        view = _job_view(coord, jid, with_tasks=True)
        if view is None:
            raise UnknownJob(jid)
        if not who_of(request).may_touch(view["owner"]):
            # Someone else's job: its shape and states, not its error texts (they may
            # quote the arguments).
            for t in view["tasks"]:
                if t["error"]:
                    t["error"] = {k: t["error"][k] for k in ("kind", "type") if k in t["error"]}
        return JSONResponse(view)

    @route("/v1/jobs/{jid}/results", ["GET"], action="read results", roles=people.READ)
    async def results(request: Request) -> Response:
        jid = _id(request.path_params["jid"], "job id")
        after = int(_query_float(request, "after", -1, -1, 1e15))
        wait = _query_float(request, "wait", 0, 0, LONG_POLL_MAX_S)
        out_after = request.query_params.get("out_after")
        out_after = None if out_after is None else int(_query_float(request, "out_after", -1, -1, 1e15))
        owned(request, jid, "read the results of")
        if jid not in coord.jobs:
            if coord.store.job_exists(jid):
                return _err(410, "released", f"job {jid}'s results were already collected")
            raise UnknownJob(jid)
        job = await until_disconnect(request, coord.wait_results(jid, after, wait, out_after))
        if job is None:
            return Response(status_code=204)
        return results_page(job, after, out_after, {}, request.query_params.get("handoff") == "1")

    def results_page(job, after: int, out_after: int | None, extra: dict,
                     by_path: bool = False) -> Response:
        """Frames: JSON (results, counts, output chunks) + result payloads + output bytes.
        ``by_path`` (the caller shares this machine): a result the store keeps as a file is
        named by ``file`` (relative to the blob directory) instead of sent."""
        items, parts, budget = [], [], RESULT_PAGE_BYTES
        for t in coord.store.results_after(job.id, after, RESULT_PAGE_COUNT):
            size = 0 if by_path and t.result_file is not None else t.result_size
            if parts and size > budget:
                break
            budget -= size
            items.append({"index": t.idx, "task_id": t.id, "state": t.state, "seq": t.seq,
                          "worker": t.worker_id, "error": t.error,
                          "has_payload": t.result is not None or t.result_file is not None})
            if t.result is not None:
                parts.append(Part(t.result))
            elif t.result_file is not None and by_path:
                items[-1]["has_payload"] = False
                items[-1]["file"] = t.result_file
            elif t.result_file is not None:
                parts.append(Part(path=coord.store.file_path(t.result_file), size=t.result_size))
        meta = dict(extra, results=items, n_tasks=job.n_tasks, n_final=job.n_final,
                    state=job.state, workers_alive=len(coord.alive_workers()),
                    workers_able=coord.able_workers(job))
        if out_after is not None:  # the caller also wants what tasks printed
            chunks, skipped = coord.output.since(job.id, out_after)
            meta["output"] = [{"seq": c.seq, "task_id": c.task_id, "index": c.index,
                               "stream": c.stream, "worker": c.worker} for c in chunks]
            meta["output_skipped"] = skipped
            parts += [Part(c.data) for c in chunks]
        return frames_response(meta, parts)

    @route("/v1/jobs/{jid}/logs", ["GET"], action="read logs", roles=people.READ)
    async def job_logs(request: Request) -> Response:
        """Each task's kept stdout and stderr (text, invalid UTF-8 replaced)."""
        jid = _id(request.path_params["jid"], "job id")
        task = request.query_params.get("task")
        if task is not None:
            _id(task, "task id")
        owned(request, jid, "read the output of")
        rows = coord.store.task_rows(jid)
        if not rows and not coord.store.job_exists(jid):
            raise UnknownJob(jid)
        out = []
        for t in rows:
            if task is not None and t["id"] != task:
                continue
            attempts = _attempt_logs(coord, jid, t)
            out.append({"id": t["id"], "index": t["index"], "state": t["state"],
                        "stdout": "".join(a["stdout"] for a in attempts),
                        "stderr": "".join(a["stderr"] for a in attempts),
                        "attempts": attempts})
        if task is not None and not out:
            raise HTTPError(404, "unknown_task", f"job {jid} has no task {task}")
        return JSONResponse({"job_id": jid, "tasks": out})

    @route("/v1/jobs/release", ["POST"], action="release jobs")
    async def release_many(request: Request) -> Response:
        """Release several collected jobs in one request (the caller batches them)."""
        data = await _json_body(request)
        jobs = _field(data, "jobs", list)
        if not 1 <= len(jobs) <= MAX_RELEASE_JOBS or not all(
                isinstance(j, str) and _HEX.match(j) for j in jobs):
            raise HTTPError(400, "bad_request", "field 'jobs' must be a list of 1 to "
                                                f"{MAX_RELEASE_JOBS} job ids")
        released = 0
        who = who_of(request)
        owners = coord.store.job_owners(list(dict.fromkeys(jobs)))
        for jid, owner in owners.items():
            if not who.may_touch(owner):
                raise HTTPError(403, "not_yours", f"job {jid} belongs to {owner or 'admin'}: "
                                                  f"{who.name} cannot release it")
        for jid in dict.fromkeys(jobs):  # unknown ids are skipped: retention got there first
            if jid in coord.jobs or coord.store.job_exists(jid):
                coord.release(jid)
                released += 1
        return JSONResponse({"released": released})

    @route("/v1/jobs/{jid}/release", ["POST"], action="release jobs")
    async def release(request: Request) -> Response:
        jid = _id(request.path_params["jid"], "job id")
        owned(request, jid, "release")
        coord.release(jid)
        return JSONResponse({"released": True})

    @route("/v1/jobs/{jid}/cancel", ["POST"], action="cancel jobs")
    async def cancel(request: Request) -> Response:
        jid = _id(request.path_params["jid"], "job id")
        owned(request, jid, "cancel")
        if jid not in coord.jobs:  # finished a while ago: only the store still has it
            row = coord.store.job_row(jid)
            if row is None:
                raise UnknownJob(jid)
            return JSONResponse({"cancelled": 0, "state": row["state"]})
        n = coord.cancel(jid)
        return JSONResponse({"cancelled": n, "state": coord.jobs[jid].state})

    @route("/v1/jobs/{jid}/retry", ["POST"], action="retry jobs")
    async def retry(request: Request) -> Response:
        jid = _id(request.path_params["jid"], "job id")
        owned(request, jid, "retry")
        try:
            return JSONResponse({"retried": coord.retry(jid)})
        except JobReleased:
            return _err(410, "released", f"job {jid} cannot be retried: its results belong to "
                                         "the caller that submitted it (a function call or .map) "
                                         "or were already collected; call or submit it again")

    # -- people --------------------------------------------------------------------
    @route("/v1/tokens", ["GET"], action="list tokens", roles=people.ADMIN)
    async def list_tokens(request: Request) -> Response:
        return JSONResponse(registry.list())

    @route("/v1/tokens", ["POST"], action="add tokens", roles=people.ADMIN)
    async def add_token(request: Request) -> Response:
        """A new person's token, drawn here and answered once (only its digest is kept)."""
        from ..config import generate_token
        data = await _json_body(request)
        name = _field(data, "name", str)
        role = _field(data, "role", str, people.ROLE_SUBMIT)
        cap = _field(data, "max_running", int, None, lo=1, hi=people.MAX_RUNNING_CAP)
        token = generate_token()
        try:
            row = registry.add(name, role, cap, token)
        except ValueError as e:
            code = "exists" if "already has a token" in str(e) else "bad_request"
            raise HTTPError(409 if code == "exists" else 400, code, str(e)) from None
        return JSONResponse(dict(row, token=token))

    @route("/v1/tokens/{name}", ["DELETE"], action="revoke tokens", roles=people.ADMIN)
    async def revoke_token(request: Request) -> Response:
        name = request.path_params["name"]
        if not registry.revoke(name):
            raise HTTPError(404, "unknown_token", f"nobody is called {name[:80]!r} here")
        return JSONResponse({"revoked": name})

    from . import metrics, ui  # leaves: GET /metrics, the dashboard at /ui
    routes.append(metrics.route(coord, auth, metrics_token))
    routes.extend(ui.routes(coord, auth))
    del metrics_token

    async def sweeper() -> None:
        last_purge = 0.0
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                coord.sweep()
                now = time.time()
                if now - last_purge > PURGE_INTERVAL_S:
                    last_purge = now
                    coord.purge(now - RETENTION_S)
                    coord.store.sweep_handoff(now - HANDOFF_TTL_S)
            except Exception:
                log.exception("sweep failed")

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.ensure_future(sweeper())
        try:
            yield
        finally:
            task.cancel()

    async def not_found(request: Request, exc: Exception) -> Response:
        if request.url.path.startswith("/api/"):  # PyPI's other gpumesh (3.x) speaks /api/...
            return _other_project(request)
        return _err(404, "not_found", f"no route {request.method} {request.url.path}")

    async def bad_method(request: Request, exc: Exception) -> Response:
        return _err(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}")

    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={404: not_found, 405: bad_method})


def _base_url(request: Request) -> str:
    """The coordinator's URL as this client reached it (what it can reach again)."""
    return str(request.base_url).rstrip("/")


def _check_version(request: Request, worker_route: bool) -> None:
    """Refuse (409 ``version_mismatch``) a gpumesh caller or worker of another version."""
    agent = versions.parse_agent(request.headers.get("user-agent"))
    if agent is None or agent[0] == __version__:
        return  # not gpumesh's own client (curl, a test, a proxy's probe), or ours
    role = "worker" if worker_route and request.url.path.startswith(("/v1/workers", "/v1/tasks")) \
        else "caller"
    raise HTTPError(409, "version_mismatch",
                    versions.refusal(role, agent[0][:40], __version__, _base_url(request)))


def _other_project(request: Request) -> Response:
    """An answer for the unrelated gpumesh 3.x on PyPI, in the shape its workers relay.

    Its worker first probes ``GET /api/workers`` and gives up with a network-sounding
    error on anything but a 200, then registers, and prints the ``error`` of a 426 answer
    as the reason. So the probe gets an empty list (no data of ours) and every other
    request the 426 with our one line."""
    line = (f"this is not the gpumesh this coordinator runs: PyPI's 'gpumesh' is another "
            f"project (with another protocol), and the coordinator at {_base_url(request)} "
            f"runs gpumesh {__version__}; install it on this machine with: "
            f"{dist.install_command(_base_url(request))}")
    if request.method == "GET" and request.url.path == "/api/workers":
        return JSONResponse({"workers": [], "error": line})
    return JSONResponse({"error": line, "message": line}, status_code=426)


def _attempt_logs(coord: Coordinator, job_id: str, task: dict) -> list[dict]:
    """A task's output attempt by attempt: ``[{"attempt", "worker", "hostname", "ended",
    "stdout", "stderr"}]``; ``ended`` says why an earlier attempt ended without a result
    (from the task's history), and is the task's state for its last attempt."""
    history = {h.get("attempt"): h for h in task.get("history") or ()}
    out = []
    def text(stream: str, k: int) -> str:
        return coord.output.task_log(job_id, task["id"], stream, k).decode("utf-8", "replace")

    for k in range(1, max(int(task["attempts"] or 0), 1) + 1):
        h = history.get(k)
        last = h is None and k == task["attempts"]
        worker = h.get("worker") if h else (task["worker_id"] if last else None)
        if h:
            hostname = h.get("hostname")
        else:  # the current attempt has no history entry: name its worker as history would
            w = coord.workers.get(worker) if worker else None
            hostname = str(w.info["hostname"])[:200] if w is not None and w.info.get("hostname") else None
        out.append({"attempt": k, "worker": worker, "hostname": hostname,
                    "ended": h.get("ended") if h else task["state"],
                    "stdout": text("stdout", k), "stderr": text("stderr", k)})
    return out


def _job_view(coord: Coordinator, job_id: str, with_tasks: bool) -> dict | None:
    row = coord.store.job_row(job_id)
    if row is None:
        return None
    counts = coord.store.task_counts(job_id)
    view = {"id": row["id"], "name": row["name"], "kind": row["kind"], "state": row["state"],
            "n_tasks": row["n_tasks"], "counts": counts, "created": row["created"],
            # released: the results were collected (or let go) and their payloads deleted
            "released": bool(row["released"]),
            "owner": row.get("owner") or people.MAIN_PERSON,
            "result_format": (row["meta"] or {}).get("result_format", "pickle")}
    if with_tasks:
        view["tasks"] = coord.store.task_rows(job_id)
    job = coord.jobs.get(job_id)
    if job is not None and job.preempted:
        view["preempted"] = job.preempted
    waiting = coord.waiting_reason(job_id)
    if waiting:
        view["waiting"] = waiting
    return view


def _owner_fields(data: dict, info: dict) -> None:
    """The owner's rules as a worker reports them (gpumesh.availability): ``owner`` and
    ``gpu_states``, each replaced whole when present. ValueError names the field."""
    from .. import availability
    if "owner" in data:
        info["owner"] = availability.check_owner(data["owner"])
    if "gpu_states" in data:
        info["gpu_states"] = availability.check_gpu_states(data["gpu_states"])
