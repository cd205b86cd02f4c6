"""The one place Python objects become bytes and bytes become Python objects.

Two layouts, both little-endian and versioned by their magic:

**Payload** - one pickled object (cloudpickle, protocol 5) with its out-of-band buffers::

    b"GMP1" | u32 nbuf | u64 pickle_len | u64 buf_len * nbuf | pad | pickle | pad | buf0 | pad | buf1 ...

  Large NumPy arrays, tensors and ``PickleBuffer``\\ s travel as raw buffers next to the
  pickle stream instead of inside it, so they are never copied into it; on the receiving
  side they are views of the (writable) receive buffer, so arrays come back writable
  without another copy. Every section starts on a 64-byte boundary.

**Frames** - several byte strings in one HTTP body (a job with its arguments, a page
of results)::

    b"GMF1" | u32 count | u64 len * count | pad | frame0 | pad | frame1 ...

  Frame 0 is JSON metadata by convention; the rest are usually payloads.
  :class:`FramesWriter` lays a body out and :class:`FramesReader` takes one apart as its
  bytes arrive, both without I/O of their own (the coordinator's HTTP bodies and
  responses drive them); :func:`unpack_frames` splits a body already in memory.

A reader that meets another magic raises :class:`~gpumesh.errors.WireError` naming both
versions, instead of a pickle traceback.
"""

from __future__ import annotations

import functools
import pickle
import re
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from . import classes
from .errors import WireError

# cloudpickle is imported where it is needed (function blobs, objects the C pickler
# cannot ship): the worker agent and the coordinator only move frames and bytes, and
# it would stay loaded in each of them for nothing. Unpickling a function made by
# cloudpickle imports it by itself; the worker's zygote imports it up front.

PAYLOAD_MAGIC = b"GMP1"
FRAMES_MAGIC = b"GMF1"
ALIGN = 64
PROTOCOL = 5

Chunk = bytes | bytearray | memoryview


def _pad(n: int) -> int:
    return (-n) % ALIGN


def _check_magic(view: memoryview, magic: bytes, what: str) -> None:
    got = bytes(view[:4])
    if got == magic:
        return
    if got[:3] == magic[:3]:
        raise WireError(
            f"{what} uses wire version {got[3:4].decode(errors='replace')}, this gpumesh reads "
            f"version {magic[3:4].decode()}: run the same gpumesh version on every machine"
        )
    raise WireError(f"not a gpumesh {what} (starts with {got!r})")


# ---------------------------------------------------------------- payloads --------
class Payload:
    """A serialized object as a list of chunks, ready to hash, send or join.

    ``chunks`` are the layout above in order; ``size`` is their total length in bytes.
    ``by_value``: the pickle carries Python bytecode (a function, lambda or class shipped
    by value), which only the Python minor version that made it can load safely.
    Nothing is copied until a caller asks for :meth:`to_bytes`.
    """

    __slots__ = ("chunks", "size", "by_value")

    def __init__(self, chunks: list[Chunk], by_value: bool = False):
        self.chunks = chunks
        self.size = sum(memoryview(c).nbytes for c in chunks)
        self.by_value = by_value

    def sha256(self) -> str:
        # Imported here: hashlib maps OpenSSL's libcrypto (~3.5 MiB resident), and the
        # worker's zygote, hosts and task processes import this module but never hash.
        import hashlib
        h = hashlib.sha256()
        for c in self.chunks:
            h.update(c)
        return h.hexdigest()

    def to_bytes(self) -> bytes:
        return b"".join(self.chunks)


def _by_value_names() -> tuple[bytes, ...]:
    """The names of the modules registered with ``cloudpickle.register_pickle_by_value``
    (by the caller, or :mod:`gpumesh.localcode`), encoded as a pickle stream writes them:
    a stream of the C pickler that mentions one may refer to such a module by reference,
    and only cloudpickle knows to send it by value."""
    cp = sys.modules.get("cloudpickle")
    if cp is None:  # not imported yet: nothing can have been registered with it
        return ()
    registry = getattr(getattr(cp, "cloudpickle", None), "_PICKLE_BY_VALUE_MODULES", None)
    return tuple(name.encode() for name in registry) if registry else ()


_CODE_PICKLER: type | None = None
#: What cloudpickle writes in place of a code object's file name.
_ANONYMOUS_FILE = "<dynamic-code>"


def _code_pickler() -> type:
    """cloudpickle's Pickler, except that code shipped by value keeps its real
    ``co_filename``. cloudpickle replaces it with ``"<dynamic-code>"`` (so that a
    notebook function pickles to the same bytes from any cell); a traceback on the
    worker would then name no file, and the caller could not show the lines of its own
    file or notebook cell (:func:`gpumesh.client.calls.with_source`). Its ``saw_code``
    says afterwards whether any code object was pickled (:attr:`Payload.by_value`)."""
    global _CODE_PICKLER
    if _CODE_PICKLER is None:
        import types
        from collections import ChainMap

        import cloudpickle

        table = cloudpickle.Pickler.dispatch_table
        anonymous = table[types.CodeType]

        def reduce_code(code: types.CodeType) -> tuple[Any, tuple[Any, ...]]:
            rebuild, args = anonymous(code)[:2]
            if _ANONYMOUS_FILE in args:
                # The first such string is co_filename (co_name comes after it).
                at = args.index(_ANONYMOUS_FILE)
                args = args[:at] + (code.co_filename,) + args[at + 1:]
            return rebuild, args

        from . import namespaces

        by_value = cloudpickle.cloudpickle._is_registered_pickle_by_value

        def reducer_override(self: Any, obj: object) -> Any:
            # Bytecode is about to travel: note it (see Payload.by_value).
            if type(obj) is types.CodeType:
                self.saw_code = True
            if type(obj) is _LRU_WRAPPER:
                got = _reduce_cached(obj, by_value)
                if got is not NotImplemented:
                    return got
            # A module shipped by value arrives as one module (gpumesh.namespaces).
            got = namespaces.reduce_override(self, obj, by_value)
            if got is not NotImplemented:
                return got
            return cloudpickle.Pickler.reducer_override(self, obj)

        _CODE_PICKLER = type("CodePickler", (cloudpickle.Pickler,),
                             {"dispatch_table": ChainMap({types.CodeType: reduce_code}, table),
                              "saw_code": False, "saw_module": False,
                              "reducer_override": reducer_override})
    return _CODE_PICKLER


#: The type of what ``functools.cache``/``lru_cache`` make (C's; None where they make
#: plain functions, which cloudpickle ships as it ships any closure).
_LRU_WRAPPER = getattr(functools, "_lru_cache_wrapper", None)
if not isinstance(_LRU_WRAPPER, type):
    _LRU_WRAPPER = None


def _reduce_cached(obj: Any, by_value: Callable[[Any], bool]) -> Any:
    """A ``functools.cache``/``lru_cache`` function made by the caller's own code (in
    ``__main__``, a notebook, a module shipped by value, a closure) as the function it
    wraps, made a cache function again where it loads: with the same ``maxsize`` and
    ``typed`` and an empty cache of its own, the process's that loads it (the cache
    holds the caller's results, which do not travel). Pickled as Python pickles it, by
    reference to its module's name, it could not load on a worker, and under ``@mesh``
    not even here ("it's not the same object as __main__.f"). One that an installed
    module defines still goes by reference (``NotImplemented``): the worker's module has
    it, with that process's cache."""
    name = getattr(obj, "__module__", None)
    module = sys.modules.get(name) if isinstance(name, str) else None
    if (module is not None and name not in ("__main__", "__mp_main__")
            and not by_value(module) and _lookup(module, obj.__qualname__) is obj):
        return NotImplemented
    params = obj.cache_parameters()
    # (its __dict__: __wrapped__, __name__, __doc__... as functools.update_wrapper set them)
    return recache, (obj.__wrapped__, params["maxsize"], params["typed"]), dict(obj.__dict__)


def recache(fn: Callable[..., Any], maxsize: int | None, typed: bool) -> Callable[..., Any]:
    """``fn`` made a ``functools.lru_cache`` function again, with an empty cache (see
    :func:`_reduce_cached`); only public ``functools`` API, whatever Python loads it."""
    return functools.lru_cache(maxsize=maxsize, typed=typed)(fn)


def _lookup(module: Any, qualname: str) -> Any:
    """What ``module``'s dotted ``qualname`` names (None when nothing does)."""
    got = module
    for part in qualname.split("."):
        got = getattr(got, part, None)
        if got is None:
            return None
    return got


def _cloudpickled(obj: Any, keep: Callable[[pickle.PickleBuffer], bool],
                  buffers: list[memoryview]) -> tuple[bytes, bool]:
    """``obj`` through the caller's cloudpickle pickler: ``(stream, saw_code)``. When that
    fails after a module of the caller's own code was met, it is pickled once more, with
    that module's values that cannot be pickled left behind (:class:`gpumesh.namespaces.
    LeaveBehind`): a ``_lock = threading.Lock()`` the task never reads must not stop it.
    What that second try raises is raised (it is what is left once the module's own
    names are out of the way)."""
    import io
    with io.BytesIO() as fh:
        pickler = _code_pickler()(fh, protocol=PROTOCOL, buffer_callback=keep)
        try:
            pickler.dump(obj)
            return fh.getvalue(), pickler.saw_code
        except Exception:
            if not pickler.saw_module:
                raise
    from . import namespaces
    buffers.clear()  # (the failed try's)
    with namespaces.LeaveBehind(_why_not), io.BytesIO() as fh:
        pickler = _code_pickler()(fh, protocol=PROTOCOL, buffer_callback=keep)
        pickler.dump(obj)
        return fh.getvalue(), pickler.saw_code


class _Discard:
    """A file that forgets what is written to it (:func:`_why_not` wants no bytes)."""

    @staticmethod
    def write(data: Any) -> int:
        return len(memoryview(data))


def _why_not(value: Any) -> str | None:
    """None when the caller's pickler can pickle ``value`` (on its own), else why not:
    the pickler's error, as ``TypeError: cannot pickle '_thread.lock' object``. Big
    buffers are not copied (out of band, dropped)."""
    pickler = _code_pickler()(_Discard(), protocol=PROTOCOL, buffer_callback=lambda b: False)
    try:
        pickler.dump(value)
    except Exception as e:  # noqa: BLE001 - any failure: it stays behind, and says why
        return f"{type(e).__name__}: {e}"
    return None


def dumps(obj: Any, *, code: bool = False) -> Payload:
    """Serialize ``obj`` (protocol 5, out-of-band buffers).

    Plain data goes through the C pickler (several times faster than cloudpickle). Whenever
    the result would refer to something that only exists on this side - a function,
    class or object defined in ``__main__`` or a notebook cell, a lambda, a closure, or in
    a module registered by value (the caller's own modules: :mod:`gpumesh.localcode`;
    found by its name in the stream) - it is redone with cloudpickle, which ships such
    things by value. ``code=True`` (function
    blobs) always uses cloudpickle. A module of the caller's own code travels without the
    values of its namespace that cannot be pickled (see :func:`_cloudpickled`).
    Raises whatever the pickler raises for an unpicklable object (``TypeError``,
    ``pickle.PicklingError``...).
    """
    buffers: list[memoryview] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        try:
            buffers.append(buf.raw())
        except BufferError:  # not contiguous: let pickle copy it in-band
            return True
        return False

    stream = None
    if not code:
        try:
            stream = pickle.dumps(obj, protocol=PROTOCOL, buffer_callback=keep)
        except Exception:  # noqa: BLE001 - lambdas, local classes...: cloudpickle below
            stream = None
        names = _by_value_names() if stream is not None else ()
        if stream is not None and (b"__main__" in stream
                                   or (names and any(name in stream for name in names))):
            # By reference to the caller's __main__, or (maybe: a name found anywhere in
            # the stream counts) to a module registered by value: the worker has no such
            # thing. A false alarm only costs the cloudpickle pass.
            stream = None
        if stream is None:
            buffers.clear()
    by_value = False
    if stream is None:
        stream, by_value = _cloudpickled(obj, keep, buffers)
    head = bytearray(PAYLOAD_MAGIC)
    head += struct.pack("<IQ", len(buffers), len(stream))
    for b in buffers:
        head += struct.pack("<Q", b.nbytes)
    chunks: list[Chunk] = [bytes(head)]
    off = len(head)
    parts: list[Chunk] = [stream, *buffers]
    for part in parts:
        pad = _pad(off)
        if pad:
            chunks.append(b"\0" * pad)
            off += pad
        chunks.append(part)
        off += memoryview(part).nbytes
    return Payload(chunks, by_value)


#: What a pickle that rebuilds a code object names (cloudpickle reduces one as
#: ``_builtin_type("CodeType")``): bytecode shipped by value.
_CODE_MARK = re.compile(b"CodeType")  # (a pattern searches a memoryview without a copy)


def holds_code(data: Chunk) -> bool:
    """Whether the payload ``data`` may rebuild bytecode (a function, lambda or class
    shipped by value), from a search of its pickle stream alone (big buffers travel out
    of band, so the search is short). It can say True of data that only contains the word;
    False means no code object is rebuilt. Raises :class:`WireError` for bytes that are
    not a payload."""
    view = memoryview(data).cast("B")
    if view.nbytes < 16:
        raise WireError(f"payload too short ({view.nbytes} bytes)")
    _check_magic(view, PAYLOAD_MAGIC, "payload")
    nbuf, stream_len = struct.unpack_from("<IQ", view, 4)
    off = 16 + 8 * nbuf
    off += _pad(off)
    return _CODE_MARK.search(view[off:off + stream_len]) is not None


def loads(data: Chunk) -> Any:
    """Inverse of :func:`dumps`. Pass a ``bytearray`` to get writable arrays back.

    Raises :class:`WireError` for bytes that are not a payload; whatever unpickling
    raises (``ModuleNotFoundError`` for a module the receiver lacks, ...) otherwise.
    torch tensors saved on a device this process lacks arrive on the CPU.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < 16:
        raise WireError(f"payload too short ({view.nbytes} bytes)")
    _check_magic(view, PAYLOAD_MAGIC, "payload")
    nbuf, stream_len = struct.unpack_from("<IQ", view, 4)
    lens = struct.unpack_from(f"<{nbuf}Q", view, 16)
    off = 16 + 8 * nbuf
    off += _pad(off)
    stream = view[off:off + stream_len]
    off += stream_len
    bufs = []
    for n in lens:
        off += _pad(off)
        bufs.append(view[off:off + n])
        off += n
    if off > view.nbytes:
        raise WireError("payload truncated")
    try:
        # (a class sent by value never rewrites one this process has: gpumesh.classes)
        return classes.load(stream, bufs)
    except RuntimeError as e:
        # A torch tensor saved on a device this process lacks (a CUDA tensor sent to a
        # CPU-only caller): load it again with its storages on the CPU (gpumesh.tensors).
        from .tensors import is_device_error, loads_on_cpu
        if not is_device_error(e):
            raise
        return loads_on_cpu(stream, bufs, e)


def dumps_exception(exc: BaseException) -> Payload | None:
    """``exc`` as a payload that loads as an exception of its class, with its ``args``
    and attributes: itself when pickle carries it, else a stand-in that rebuilds it
    without calling its ``__init__`` (:mod:`gpumesh.portable`). None when it cannot travel
    at all (its class cannot be pickled). Never raises."""
    from .portable import portable_exception
    travelling = portable_exception(exc, dumps, lambda p: loads(p.to_bytes()))
    if travelling is None:
        return None
    try:
        return dumps(travelling)
    except Exception:  # noqa: BLE001 - it pickled a moment ago; the caller gets its type and text
        return None


# ---------------------------------------------------------------- frames ----------
def frames_header(lengths: Sequence[int]) -> bytes:
    head = FRAMES_MAGIC + struct.pack("<I", len(lengths)) + struct.pack(f"<{len(lengths)}Q", *lengths)
    return head + b"\0" * _pad(len(head))


def pack_frames(frames: Sequence[Chunk | Payload]) -> tuple[list[Chunk], int]:
    """Lay out ``frames`` as one body. Returns (chunks, total bytes); nothing is copied."""
    writer = FramesWriter([f.size if isinstance(f, Payload) else memoryview(f).nbytes for f in frames])
    chunks: list[Chunk] = []
    for piece in writer.pieces(frames):
        if isinstance(piece, Payload):
            chunks.extend(piece.chunks)
        else:
            chunks.append(piece)
    return chunks, writer.size


def frame_offsets(lengths: Sequence[int]) -> Iterator[int]:
    """Byte offset of each frame in a body whose header names ``lengths``."""
    off = len(frames_header(lengths))
    for n in lengths:
        off += _pad(off)
        yield off
        off += n


def frame_spans(data: Chunk) -> list[tuple[int, int]]:
    """``(offset, length)`` in bytes of each frame of a frames body. Raises
    :class:`WireError` if the body is malformed."""
    view = memoryview(data).cast("B")
    if view.nbytes < 8:
        raise WireError(f"frames body too short ({view.nbytes} bytes)")
    _check_magic(view, FRAMES_MAGIC, "message")
    (count,) = struct.unpack_from("<I", view, 4)
    if 8 + 8 * count > view.nbytes:
        raise WireError("frames header truncated")
    lengths = struct.unpack_from(f"<{count}Q", view, 8)
    spans = list(zip(frame_offsets(lengths), lengths))
    for off, n in spans:
        if off + n > view.nbytes:
            raise WireError("frames body truncated")
    return spans


def unpack_frames(data: Chunk) -> list[memoryview]:
    """Split a frames body into views (no copies). Raises :class:`WireError` if malformed."""
    view = memoryview(data).cast("B")
    return [view[off:off + n] for off, n in frame_spans(view)]


def iter_chunks(chunks: Iterable[Chunk], size: int = 1 << 20) -> Iterator[bytes | memoryview]:
    """Re-chunk a body for sending: small pieces are coalesced into ``bytes`` of about
    ``size`` (few syscalls), and each piece of ``size`` or more is passed on as it is, a
    ``memoryview`` that the socket sends without a copy (a 64 MiB array is never copied
    on its way out)."""
    pending = bytearray()
    for c in chunks:
        mv = memoryview(c).cast("B")
        if pending and len(pending) + mv.nbytes > size:
            yield bytes(pending)
            pending.clear()
        if mv.nbytes < size:
            pending += mv
            continue
        yield mv
    if pending:
        yield bytes(pending)


# ---------------------------------------------------------------- incremental frames --
_F = TypeVar("_F")


class FramesWriter:
    """The layout of a frames body whose frames are ``lengths`` bytes long, for a sender
    that produces the frames itself (from memory, from files).

    ``header`` is the header with its padding, ``offsets`` each frame's byte offset,
    ``size`` the whole body's length. No I/O: :meth:`pieces` says what to send in order.
    """

    __slots__ = ("lengths", "header", "offsets", "size")

    def __init__(self, lengths: Sequence[int]):
        self.lengths = list(lengths)
        self.header = frames_header(self.lengths)
        self.offsets = list(frame_offsets(self.lengths))
        self.size = self.offsets[-1] + self.lengths[-1] if self.lengths else len(self.header)

    def pieces(self, frames: Sequence[_F]) -> Iterator[bytes | _F]:
        """The body in order: ``bytes`` (the header, the zero padding before a frame) and,
        in their places, the items of ``frames`` (one per length, passed through as they
        are: the caller turns each into its bytes)."""
        if len(frames) != len(self.lengths):
            raise ValueError(f"{len(frames)} frames for a layout of {len(self.lengths)}")
        yield self.header
        pos = len(self.header)
        for off, n, frame in zip(self.offsets, self.lengths, frames):
            if off > pos:
                yield b"\0" * (off - pos)
            yield frame
            pos = off + n


class FramesTooLarge(WireError):
    """A frames header announces a body longer than the reader's ``limit``."""


class FrameStart:
    """Frame ``index`` (``size`` bytes) begins; its bytes follow as :class:`FrameData`."""

    __slots__ = ("index", "size")

    def __init__(self, index: int, size: int):
        self.index, self.size = index, size


class FrameData:
    """The next ``data`` bytes of frame ``index``: a view of the bytes fed (no copy)."""

    __slots__ = ("index", "data")

    def __init__(self, index: int, data: memoryview):
        self.index, self.data = index, data


class FrameEnd:
    """Frame ``index`` is complete."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class FramesHead:
    """The header was read: the frames' ``lengths`` and the body's ``size`` (bytes)."""

    __slots__ = ("lengths", "size")

    def __init__(self, lengths: tuple[int, ...], size: int):
        self.lengths, self.size = lengths, size


FramesEvent = FramesHead | FrameStart | FrameData | FrameEnd


class FramesReader:
    """Takes a frames body apart as its bytes arrive, without I/O of its own.

    :meth:`feed` takes the next bytes (any split: one byte at a time, the whole body)
    and returns what they completed, in order: one :class:`FramesHead`, then per frame a
    :class:`FrameStart`, its :class:`FrameData` pieces (views of the bytes fed; a
    consumer that keeps them must copy) and a :class:`FrameEnd`. Padding is skipped, and
    bytes after the last frame are ignored. :meth:`close` at the end of the body raises
    unless the body was complete.

    ``size``: the body's length when known in advance (an HTTP Content-Length); a header
    that announces more is refused at once. ``limit``: the most bytes a body may hold;
    a header announcing more raises :class:`FramesTooLarge`. Raises :class:`WireError`
    (another magic, a truncated header or body) naming what is wrong.
    """

    __slots__ = ("size", "limit", "_head", "_lengths", "_offsets", "_pos", "_frame", "_in_frame",
                 "body_size")

    def __init__(self, size: int | None = None, limit: int | None = None):
        self.size, self.limit = size, limit
        self._head = bytearray()
        self._lengths: tuple[int, ...] | None = None
        self._offsets: list[int] = []
        self._pos = 0  # bytes of the body consumed so far
        self._frame = 0  # the frame being read (== count once all are)
        self._in_frame = False
        #: The whole body's length as the header announces it (None until it is read).
        self.body_size: int | None = None

    @property
    def done(self) -> bool:
        """Every frame was read."""
        return self._lengths is not None and self._frame == len(self._lengths)

    def feed(self, data: Chunk) -> list[FramesEvent]:
        view = memoryview(data).cast("B")
        events: list[FramesEvent] = []
        if self._lengths is None:
            view = self._read_head(view, events)
            if self._lengths is None:
                return events
        lengths, offsets = self._lengths, self._offsets
        while view.nbytes and self._frame < len(lengths):
            i = self._frame
            start = offsets[i]
            if self._pos < start:  # padding before frame i
                skip = min(start - self._pos, view.nbytes)
                view, self._pos = view[skip:], self._pos + skip
                if self._pos < start:
                    break
            if not self._in_frame:
                self._in_frame = True
                events.append(FrameStart(i, lengths[i]))
            take = min(start + lengths[i] - self._pos, view.nbytes)
            if take:
                events.append(FrameData(i, view[:take]))
                view, self._pos = view[take:], self._pos + take
            if self._pos == start + lengths[i]:
                self._end_frame(events)
        self._empty_frames(events)
        return events

    def close(self) -> None:
        """The body ended: raise :class:`WireError` unless every frame was read."""
        if self._lengths is None and len(self._head) < 8:
            raise WireError(f"frames body too short ({len(self._head)} bytes)")
        if not self.done:
            raise WireError("frames body truncated")

    def _end_frame(self, events: list[FramesEvent]) -> None:
        events.append(FrameEnd(self._frame))
        self._frame += 1
        self._in_frame = False

    def _empty_frames(self, events: list[FramesEvent]) -> None:
        """Frames of no bytes right where the body stands end without waiting for data."""
        lengths = self._lengths
        while (lengths is not None and self._frame < len(lengths) and lengths[self._frame] == 0
               and self._offsets[self._frame] <= self._pos):
            if not self._in_frame:
                events.append(FrameStart(self._frame, 0))
            self._in_frame = True
            self._end_frame(events)

    def _read_head(self, view: memoryview, events: list[FramesEvent]) -> memoryview:
        head = self._head
        if len(head) < 8:
            take = min(8 - len(head), view.nbytes)
            head += view[:take]
            view = view[take:]
            if len(head) < 8:
                return view
            _check_magic(memoryview(bytes(head)), FRAMES_MAGIC, "message")
            (count,) = struct.unpack_from("<I", head, 4)
            most = self.size if self.size is not None else self.limit
            if most is not None and 8 + 8 * count > most:
                raise WireError("frames header truncated")
        (count,) = struct.unpack_from("<I", head, 4)
        need = 8 + 8 * count - len(head)
        take = min(need, view.nbytes)
        head += view[:take]
        view = view[take:]
        if take < need:
            return view
        lengths = struct.unpack_from(f"<{count}Q", head, 8)
        self._offsets = list(frame_offsets(lengths))
        end = self._offsets[-1] + lengths[-1] if count else 8 + 8 * count
        if self.size is not None and end > self.size:
            raise WireError("frames body truncated")
        if self.limit is not None and end > self.limit:
            raise FramesTooLarge(f"frames body of {end} bytes is over the limit of {self.limit}")
        self._lengths, self._pos, self.body_size = lengths, len(head), end
        self._head = bytearray()
        events.append(FramesHead(lengths, end))
        self._empty_frames(events)
        return view
