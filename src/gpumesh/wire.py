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

A reader that meets another magic raises :class:`~gpumesh.errors.WireError` naming both
versions, instead of a pickle traceback.
"""

from __future__ import annotations

import pickle
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

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


def _by_value_modules() -> bool:
    """Whether the caller registered modules with ``cloudpickle.register_pickle_by_value``:
    then only cloudpickle knows what must travel by value."""
    cp = sys.modules.get("cloudpickle")
    if cp is None:  # not imported yet: nothing can have been registered with it
        return False
    registry = getattr(getattr(cp, "cloudpickle", None), "_PICKLE_BY_VALUE_MODULES", None)
    return bool(registry)


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

        def reducer_override(self: Any, obj: object) -> Any:
            # Bytecode is about to travel: note it (see Payload.by_value).
            if type(obj) is types.CodeType:
                self.saw_code = True
            return cloudpickle.Pickler.reducer_override(self, obj)

        _CODE_PICKLER = type("CodePickler", (cloudpickle.Pickler,),
                             {"dispatch_table": ChainMap({types.CodeType: reduce_code}, table),
                              "saw_code": False, "reducer_override": reducer_override})
    return _CODE_PICKLER


def dumps(obj: Any, *, code: bool = False) -> Payload:
    """Serialize ``obj`` (protocol 5, out-of-band buffers).

    Plain data goes through the C pickler (several times faster than cloudpickle). Whenever
    the result would refer to something that only exists on this side - a function,
    class or object defined in ``__main__`` or a notebook cell, a lambda, a closure - it
    is redone with cloudpickle, which ships such things by value. ``code=True`` (function
    blobs) always uses cloudpickle.
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
    if not code and not _by_value_modules():
        try:
            stream = pickle.dumps(obj, protocol=PROTOCOL, buffer_callback=keep)
        except Exception:  # noqa: BLE001 - lambdas, local classes...: cloudpickle below
            stream = None
        if stream is not None and b"__main__" in stream:
            stream = None  # by-reference to the caller's __main__: the worker has no such thing
        if stream is None:
            buffers.clear()
    by_value = False
    if stream is None:
        import io
        with io.BytesIO() as fh:
            pickler = _code_pickler()(fh, protocol=PROTOCOL, buffer_callback=keep)
            pickler.dump(obj)
            stream, by_value = fh.getvalue(), pickler.saw_code
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
        return pickle.loads(stream, buffers=bufs)
    except RuntimeError as e:
        # A torch tensor saved on a device this process lacks (a CUDA tensor sent to a
        # CPU-only caller): load it again with its storages on the CPU (gpumesh.tensors).
        from .tensors import is_device_error, loads_on_cpu
        if not is_device_error(e):
            raise
        return loads_on_cpu(stream, bufs, e)


# ---------------------------------------------------------------- frames ----------
def frames_header(lengths: Sequence[int]) -> bytes:
    head = FRAMES_MAGIC + struct.pack("<I", len(lengths)) + struct.pack(f"<{len(lengths)}Q", *lengths)
    return head + b"\0" * _pad(len(head))


def pack_frames(frames: Sequence[Chunk | Payload]) -> tuple[list[Chunk], int]:
    """Lay out ``frames`` as one body. Returns (chunks, total bytes); nothing is copied."""
    lengths = [f.size if isinstance(f, Payload) else memoryview(f).nbytes for f in frames]
    chunks: list[Chunk] = [frames_header(lengths)]
    off = len(chunks[0])
    for f, n in zip(frames, lengths):
        pad = _pad(off)
        if pad:
            chunks.append(b"\0" * pad)
            off += pad
        if isinstance(f, Payload):
            chunks.extend(f.chunks)
        else:
            chunks.append(f)
        off += n
    return chunks, off


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
