"""Big task arguments that arrive over HTTP go to the task process as shared memory.

Without this, a 64 MiB argument reaching a worker from another machine is copied three
times on that worker: from the socket into the agent's buffer, from there into the
socket to the task process, and from that socket into the task's own, freshly
allocated, buffer. Instead, the agent reads a big answer straight into an anonymous
memory file (``memfd_create``, Linux) and hands the task process that file's descriptor
with the byte range of its arguments; the task maps the range copy-on-write
(:func:`gpumesh.handoff.map_fd`). What is left is the one copy from the socket.

The memory is freed when the last of the agent's views of it and the task's map are
gone. A task's view holds exactly the bytes of its own arguments, and its descriptor
leads to nothing else: an answer that carries several tasks gives each big argument a
memory file of its own (one more copy, for those answers only).

Where ``memfd_create`` is missing (macOS), answers are read into a ``bytearray`` and
arguments cross the task's socket as before.
"""

from __future__ import annotations

import mmap
import os
import weakref

from .. import wire
from ..limits import HANDOFF_MIN_BYTES


def available() -> bool:
    return hasattr(os, "memfd_create")


class MemBody(mmap.mmap):
    """A writable buffer of ``size`` bytes backed by an anonymous memory file.

    ``fd`` stays open as long as this object lives (it is what a task process is given);
    raises ``OSError`` if the file cannot be made (the caller then uses a ``bytearray``)."""

    fd: int

    def __new__(cls, size: int):
        fd = os.memfd_create("gpumesh-args", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self = super().__new__(cls, fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        return self


class ArgsRange:
    """A task's arguments: ``length`` bytes at ``offset`` of ``body``'s memory file."""

    __slots__ = ("body", "offset", "length")

    def __init__(self, body: MemBody, offset: int, length: int):
        self.body, self.offset, self.length = body, offset, length

    @property
    def fd(self) -> int:
        return self.body.fd

    def view(self) -> memoryview:
        """The bytes themselves (for a script task, which reads them from stdin)."""
        return memoryview(self.body)[self.offset:self.offset + self.length]

    def __len__(self) -> int:
        return self.length


def buffer_for(size: int):
    """The buffer an answer of ``size`` bytes is read into: a :class:`MemBody` when it is
    big enough for a task to map its arguments out of it, else a ``bytearray``."""
    if size >= HANDOFF_MIN_BYTES and available():
        try:
            return MemBody(size)
        except OSError:  # out of memory or descriptors: the plain buffer still works
            pass
    return bytearray(size)


def slices(body) -> list:
    """The frames of an answer read by :func:`buffer_for`: a ``memoryview`` each, except
    that a big frame of a :class:`MemBody` is an :class:`ArgsRange` (for the task process
    to map). Raises :class:`gpumesh.errors.WireError` if the body is malformed.

    A task is handed the descriptor of its range's memory file, through which it could
    map the whole file. So when the answer carries more than one task, each big frame is
    copied into a memory file of its own, and no task can reach another's arguments."""
    view = memoryview(body)
    spans = wire.frame_spans(view)
    if not isinstance(body, MemBody):
        return [view[offset:offset + length] for offset, length in spans]
    shared = len(spans) > 2  # the meta, then one frame per task
    out: list = []
    for offset, length in spans:
        if length < HANDOFF_MIN_BYTES:
            out.append(view[offset:offset + length])
        elif not shared:
            out.append(ArgsRange(body, offset, length))
        else:
            own = MemBody(length)
            own[:] = view[offset:offset + length]
            out.append(ArgsRange(own, 0, length))
    return out
