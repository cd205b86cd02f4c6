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

Where a task process cannot be handed a descriptor (the spawn runtime: Windows, macOS,
or ``--runtime spawn`` on Linux), or there is no ``memfd_create`` (the fork runtime on
macOS), the same buffer is a file of the worker's spool
(:class:`FileBody`, mapped shared) and the task maps its range by path: one copy from the
socket there too. :func:`share_by_name` turns that on. Either way a task's arguments are
a ``shm`` :class:`~gpumesh.payloadref.PayloadRef`.
"""

from __future__ import annotations

import mmap
import os
import weakref

from .. import handoff, wire
from ..limits import HANDOFF_MIN_BYTES
from ..payloadref import PayloadRef

#: The directory of :class:`FileBody` files, once :func:`share_by_name` set it.
_named_dir: str | None = None


def available() -> bool:
    return hasattr(os, "memfd_create") or _named_dir is not None


def share_by_name(directory: str | os.PathLike) -> None:
    """Make big answers files of ``directory`` (the worker's spool, removed with the
    worker's directory even if it is killed) that task processes map by path, instead of
    memory files whose descriptor they would need to be passed."""
    global _named_dir
    _named_dir = os.fspath(directory)


class MemBody(mmap.mmap):
    """A writable buffer of ``size`` bytes backed by an anonymous memory file.

    ``fd`` stays open as long as this object lives (it is what a task process is given);
    raises ``OSError`` if the file cannot be made (the caller then uses a ``bytearray``)."""

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


class FileBody(mmap.mmap):
    """As :class:`MemBody`, backed by a new file of ``directory`` (``path``, mode 0600)
    that other processes map by name: the portable shared memory. The file is removed by
    :meth:`unlink` (a task that mapped it keeps its pages) or when this object goes.
    Raises ``OSError`` if the file cannot be made."""

    def __new__(cls, size: int, directory: str):
        path = os.path.join(directory, handoff.new_name())
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | handoff._NOINHERIT, 0o600)
        try:
            os.ftruncate(fd, size)
            self = super().__new__(cls, fd, size)
        except BaseException:
            os.close(fd)
            handoff.discard(directory, os.path.basename(path))
            raise
        os.close(fd)  # the map holds the file
        self.path = path
        self._gone = weakref.finalize(self, _remove, path)
        return self

    def unlink(self) -> None:
        """Remove the file now (its task is done with it). The map is closed first where
        nothing views it any more: Windows removes no file that is still mapped."""
        try:
            self.close()
        except BufferError:  # still viewed here: it is removed when this object goes
            pass
        self._gone()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone; or still mapped on Windows: the spool goes with the worker
        pass


def _new_body(size: int):
    return MemBody(size) if _named_dir is None else FileBody(size, _named_dir)


def buffer_for(size: int):
    """The buffer an answer of ``size`` bytes is read into: a :class:`MemBody` (or a
    :class:`FileBody`, see :func:`share_by_name`) when it is big enough for a task to map
    its arguments out of it, else a ``bytearray``."""
    if size >= HANDOFF_MIN_BYTES and available():
        try:
            return _new_body(size)
        except OSError:  # out of memory, descriptors or disk: the plain buffer still works
            pass
    return bytearray(size)


def slices(body) -> list:
    """The frames of an answer read by :func:`buffer_for`: a ``memoryview`` each, except
    that a big frame of a :class:`MemBody` or :class:`FileBody` is a ``shm``
    :class:`~gpumesh.payloadref.PayloadRef` (for the task process to map). Raises
    :class:`gpumesh.errors.WireError` if the body is malformed.

    A task is handed the descriptor (or name) of its range's file, through which it could
    map the whole file. So when the answer carries more than one task, each big frame is
    copied into a file of its own, and no task can reach another's arguments."""
    view = memoryview(body)
    spans = wire.frame_spans(view)
    if not isinstance(body, (MemBody, FileBody)):
        return [view[offset:offset + length] for offset, length in spans]
    shared = len(spans) > 2  # the meta, then one frame per task
    out: list = []
    for offset, length in spans:
        if length < HANDOFF_MIN_BYTES:
            out.append(view[offset:offset + length])
        elif not shared:
            out.append(PayloadRef.shared(body, offset, length))
        else:
            own = _new_body(length)
            own[:] = view[offset:offset + length]
            out.append(PayloadRef.shared(own, 0, length))
    return out
