"""Request and response bodies of the coordinator: the asyncio side of :mod:`gpumesh.wire`.

The frames layout is read and written by :class:`~gpumesh.wire.FramesReader` and
:class:`~gpumesh.wire.FramesWriter` (no I/O); this module drives them from a Starlette
request and into a response, and enforces the body limits:

* :func:`read_body` / :func:`json_body`: a whole body in one buffer (413 over the limit,
  before reading when Content-Length says so; 400 for a short or malformed body).
* :func:`frames_streamed`: a job submission or task result read as it arrives; each
  payload frame over the store's inline limit goes straight into a temporary file that
  the store adopts (renames into place) instead of receiving bytes.
* :func:`frames_response`: a frames answer, built in memory when small and streamed
  from the store's files when not.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from .. import payloadref, wire
from ..errors import WireError
from ..limits import INLINE_BLOB_BYTES, MAX_BODY_BYTES, MAX_JSON_BODY_BYTES, MiB
from ..protocol import ErrorCode
from .model import HTTPError
from .store import Incoming

log = logging.getLogger("gpumesh.coordinator")

FRAMES = "application/x-gpumesh-frames"
#: Frames bodies up to this size are built in memory and sent in one piece; larger
#: ones (big arguments and results) are streamed from their files.
SMALL_BODY_BYTES = 256 * 1024
#: The coordinator setting that raises the payload body limit (named in a 413).
BODY_SETTING = "GPUMESH_MAX_BODY_MB"
#: Where a request's temporary payload files are registered (``request.scope``).
INCOMING = "gpumesh.incoming"


def _bad(message: str) -> HTTPError:
    return HTTPError(400, ErrorCode.BAD_REQUEST, message)


def too_big(limit: int, setting: str) -> HTTPError:
    size = f"{limit // MiB} MiB" if limit >= MiB else f"{limit // 1024} KiB"
    return HTTPError(413, ErrorCode.TOO_LARGE, f"request body is over the coordinator's limit of {size} "
                                       f"(set {setting} on the coordinator to raise it)")


def not_frames(why: str) -> HTTPError:
    return _bad(f"body is not a gpumesh frames message: {why}")


def content_length(request: Request, limit: int, setting: str) -> int | None:
    """The declared body size (None when chunked); 413 before reading when it is over
    ``limit``."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    try:
        n = int(declared)
    except ValueError:
        raise _bad("invalid Content-Length") from None
    if n < 0:
        raise _bad("invalid Content-Length")
    if n > limit:
        raise too_big(limit, setting)
    return n


# ---------------------------------------------------------------- whole bodies -----
async def read_body(request: Request, limit: int = MAX_BODY_BYTES,
                    setting: str = BODY_SETTING) -> bytearray:
    """Read the whole body into one writable buffer, refusing anything over ``limit``
    (before reading it when Content-Length already says so)."""
    return await read_all(request, content_length(request, limit, setting), limit, setting)


async def read_all(request: Request, n: int | None, limit: int, setting: str) -> bytearray:
    """The body whose Content-Length ``n`` (None: chunked) was checked against ``limit``."""
    try:
        if n is None:  # chunked: grow as it comes
            buf = bytearray()
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > limit:
                    raise too_big(limit, setting)
            return buf
        # Known size: one allocation, each piece copied once into place. Growing a bytearray
        # piece by piece would copy a large body several times over as it is reallocated.
        buf = bytearray(n)
        view, pos = memoryview(buf), 0
        async for chunk in request.stream():
            end = pos + len(chunk)
            if end > n:  # the server enforces Content-Length; never write past the buffer
                raise _bad("body is longer than its Content-Length")
            view[pos:end] = chunk
            pos = end
    except ClientDisconnect:  # the caller went away mid-body: nothing to answer, nothing kept
        raise _bad("the body ended early (the client went away)") from None
    if pos != n:
        raise _bad(f"body ended after {pos} of {n} bytes")
    return buf


async def json_body(request: Request) -> dict:
    """The body as a JSON object (``{}`` when empty); 400 otherwise."""
    body = await read_body(request, MAX_JSON_BODY_BYTES, "GPUMESH_MAX_JSON_KB")
    if not body:
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise _bad("body is not valid JSON") from None
    if not isinstance(data, dict):
        raise _bad("body must be a JSON object")
    return data


def frames(body: bytearray) -> tuple[dict, list[memoryview]]:
    """A frames body in memory: ``(frame 0 as a JSON object, the other frames as views)``."""
    try:
        parts = wire.unpack_frames(body)
        meta = json.loads(bytes(parts[0])) if parts else None
    except (WireError, ValueError, RecursionError) as e:
        raise not_frames(str(e)) from None
    if not isinstance(meta, dict):
        raise _bad("frame 0 must be a JSON object")
    return meta, parts[1:]


# ---------------------------------------------------------------- streamed bodies --
class _Filling:
    """A frame kept in memory, filled piece by piece."""

    __slots__ = ("view", "at")

    def __init__(self, size: int):
        self.view, self.at = memoryview(bytearray(size)), 0

    def write(self, piece: memoryview) -> None:
        end = self.at + len(piece)
        self.view[self.at:end] = piece
        self.at = end

    def finish(self) -> memoryview:
        return self.view


async def frames_streamed(request: Request, store) -> tuple[dict, list]:
    """A frames body (job submission, task result) read as it arrives: frame 0 (JSON meta)
    and small frames are kept in memory, and every payload frame over the store's inline
    limit is written straight into a temporary file (:meth:`Store.incoming`) that the
    store later adopts. Returns ``(meta, frames)``: each frame a ``memoryview`` or a
    finished :class:`~.store.Incoming`.

    Every temporary file is registered with the request (:data:`INCOMING`) and deleted by
    :func:`discard_incoming` when its handler ends unless the store adopted it. Errors are
    those of :func:`read_body` + :func:`frames`: 413 over the limit (before reading when
    Content-Length or the frames header says so), 400 for a malformed or truncated body;
    frame 0 is refused before any payload is taken in.
    """
    n = content_length(request, MAX_BODY_BYTES, BODY_SETTING)
    if n is not None and n <= INLINE_BLOB_BYTES:
        # Too small to hold a frame the store would put in a file: one buffer, as always.
        return frames(await read_all(request, n, MAX_BODY_BYTES, BODY_SETTING))
    reader = wire.FramesReader(size=n, limit=MAX_BODY_BYTES)
    spool = request.scope.setdefault(INCOMING, [])
    got = 0
    sink: _Filling | Incoming | None = None
    kept: list = []
    meta: dict | None = None
    try:
        async for chunk in request.stream():
            got += len(chunk)
            if n is not None and got > n:
                raise _bad("body is longer than its Content-Length")
            if got > MAX_BODY_BYTES:
                raise too_big(MAX_BODY_BYTES, BODY_SETTING)
            try:
                events = reader.feed(chunk)
            except wire.FramesTooLarge:
                raise too_big(MAX_BODY_BYTES, BODY_SETTING) from None
            except WireError as e:
                raise not_frames(str(e)) from None
            for ev in events:
                if isinstance(ev, wire.FrameData):
                    assert sink is not None  # (a frame's bytes come after its start)
                    sink.write(ev.data)
                elif isinstance(ev, wire.FrameStart):
                    if ev.index and ev.size > INLINE_BLOB_BYTES:
                        sink = store.incoming()
                        spool.append(sink)
                    else:
                        sink = _Filling(ev.size)
                elif isinstance(ev, wire.FrameEnd):
                    assert sink is not None
                    kept.append(sink.finish() if isinstance(sink, _Filling) else _finished(sink))
                    if ev.index == 0:  # refuse bad meta before taking in the payloads
                        meta = _meta(kept[0])
                elif not ev.lengths:  # FramesHead of no frames
                    raise _bad("frame 0 must be a JSON object")
    except ClientDisconnect:  # the caller went away mid-body
        raise _short(got, n) from None
    if n is not None and got != n:
        raise _short(got, n)
    try:
        reader.close()
    except WireError as e:
        raise not_frames(str(e)) from None
    assert meta is not None  # (the reader ended cleanly, so frame 0 did)
    return meta, kept[1:]


def _finished(inc: Incoming) -> Incoming:
    inc.finish()
    return inc


def _meta(frame: memoryview) -> dict:
    try:
        meta = json.loads(bytes(frame))
    except (ValueError, RecursionError) as e:
        raise not_frames(str(e)) from None
    if not isinstance(meta, dict):
        raise _bad("frame 0 must be a JSON object")
    return meta


def _short(got: int, n: int | None) -> HTTPError:
    if n is not None:
        return _bad(f"body ended after {got} of {n} bytes")
    return not_frames("frames body truncated")


def discard_incoming(request: Request) -> None:
    """Delete the temporary files of this request's body that the store did not adopt."""
    for inc in request.scope.pop(INCOMING, ()):
        try:
            inc.discard()
        except OSError:
            log.exception("could not delete %s", inc.path)


def take_handoffs(request: Request, names: dict | None, frames: list, store,
                  refs: dict | None = None) -> list:
    """Replace the frames a same-machine sender left empty by the files it wrote for them:
    ``refs``, the meta's ``refs`` (``{"<frame number>": {"kind": "handoff", "name",
    "size"}}``, frame 0 being the first after the meta; see :mod:`gpumesh.payloadref`),
    or from a sender before refs ``names``, the meta's ``handoff_files`` (``{"<frame
    number>": "<file name>"}``; see :mod:`gpumesh.handoff`). Each claimed file is
    registered with the request like a streamed upload: deleted at the end unless the
    store adopted it. 400 naming the field for a malformed map or a file of another
    size than its reference says, 409 ``handoff_missing`` for a file that is not there
    (the sender then sends the bytes)."""
    if not names and not refs:
        return frames
    frames = list(frames)
    spool = request.scope.setdefault(INCOMING, [])
    # The body limit holds for a payload however it travels: a call refused from another
    # machine is refused from this one too.
    total = sum(f.size if isinstance(f, Incoming) else f.nbytes for f in frames)
    key = payloadref.REFS if refs else "handoff_files"
    try:  # the whole map is checked before any file is claimed
        claimed = payloadref.handoff_refs({key: refs or names}, len(frames))
    except payloadref.BadRef as e:
        raise _bad(str(e)) from None
    for i, ref in claimed.items():
        name = ref["name"]
        if isinstance(frames[i], Incoming) or len(frames[i]):
            raise _bad(f"{key}: frame {i} must be empty")
        try:
            inc = store.take_handoff(name)
        except ValueError as e:
            raise _bad(f"{key}: {e}") from None
        except FileNotFoundError:
            raise HTTPError(409, ErrorCode.HANDOFF_MISSING,
                            f"handoff file {name} is not in this coordinator's handoff "
                            "directory; send the payload in the body") from None
        spool.append(inc)
        frames[i] = inc
        if ref.get("size", inc.size) != inc.size:  # the file is not the one it names
            raise _bad(f"{key}.{i}: 'size' is {ref['size']} but the handoff file holds "
                       f"{inc.size} bytes")
        total += inc.size
        if total > MAX_BODY_BYTES:
            raise too_big(MAX_BODY_BYTES, BODY_SETTING)
    return frames


def sha256(frame) -> str:
    """The hex SHA-256 of a frame in memory or of a streamed one."""
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
    assert part.path is not None  # (a part without data is a file)
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


def frames_response(meta: dict, parts: list[Part],
                    on_sent: Callable[[bool], None] | None = None) -> Response:
    """Stream ``meta`` and ``parts`` as one frames body. ``on_sent(ok)`` (optional) is called
    once the last byte was handed to the connection (``True``) or sending failed
    (``False``)."""
    parts = [Part(json.dumps(meta).encode()), *parts]
    layout = wire.FramesWriter([p.size for p in parts])
    if layout.size <= SMALL_BODY_BYTES:
        # Most answers (a lease of small tasks, a page of small results) are a few hundred
        # bytes: one plain response skips the streaming machinery (a task group and a
        # disconnect listener per response), which costs more than the body itself.
        small = bytearray()
        for piece in layout.pieces(parts):
            if not isinstance(piece, Part):
                small += piece
            else:
                small += piece.data if piece.data is not None else _read_part(piece)
        return _FramesResponse(bytes(small), on_sent)

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
        for piece in layout.pieces(parts):
            if not isinstance(piece, Part):
                yield piece
            elif piece.data is not None:
                yield bytes(piece.data)
            else:
                assert piece.path is not None
                with open(piece.path, "rb") as fh:
                    remaining = piece.size
                    while remaining > 0:
                        chunk = fh.read(min(4 * MiB, remaining))
                        if not chunk:  # file shorter than announced: keep the framing valid
                            chunk = b"\0" * remaining
                        remaining -= len(chunk)
                        yield chunk

    return StreamingResponse(body(), media_type=FRAMES, headers={"content-length": str(layout.size)})
