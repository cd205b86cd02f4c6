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
socket there too. A worker's :class:`Bodies` says which of the two it uses. Either way a task's arguments are
a ``shm`` :class:`~gpumesh.payloadref.PayloadRef`.
"""

from __future__ import annotations

import mmap
import os
import weakref

from .. import handoff, wire
from ..limits import HANDOFF_MIN_BYTES
from ..payloadref import PayloadRef

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


class Bodies:
    """Where one worker reads its big answers: memory files (``named_dir`` None, Linux's
    fork runtime), or files of ``named_dir`` (the worker's spool, removed with the
    worker's directory even if it is killed) that task processes map by path.

    One per executor (:func:`gpumesh.worker.executor.make_executor` makes it), not a
    process-wide switch: a process that holds executors of both runtimes (the tests, an
    embedding program) gives each the kind its task processes can open."""

    def __init__(self, named_dir: str | os.PathLike | None = None):
        self.named_dir = None if named_dir is None else os.fspath(named_dir)

    def available(self) -> bool:
        return hasattr(os, "memfd_create") or self.named_dir is not None

    def _new_body(self, size: int):
        return MemBody(size) if self.named_dir is None else FileBody(size, self.named_dir)

    def buffer_for(self, size: int):
        """The buffer an answer of ``size`` bytes is read into: a :class:`MemBody` (or a
        :class:`FileBody` with ``named_dir``) when it is big enough for a task to map its
        arguments out of it, else a ``bytearray``."""
        if size >= HANDOFF_MIN_BYTES and self.available():
            try:
                return self._new_body(size)
            except OSError:  # out of memory, descriptors or disk: the plain buffer still works
                pass
        return bytearray(size)

    def slices(self, body) -> list:
        """The frames of an answer read by :meth:`buffer_for`: a ``memoryview`` each,
        except that a big frame of a :class:`MemBody` or :class:`FileBody` is a ``shm``
        :class:`~gpumesh.payloadref.PayloadRef` (for the task process to map). Raises
        :class:`gpumesh.errors.WireError` if the body is malformed.

        A task is handed the descriptor (or name) of its range's file, through which it
        could map the whole file. So when the answer carries more than one task, each big
        frame is copied into a file of its own, and no task can reach another's
        arguments."""
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
                own = self._new_body(length)
                own[:] = view[offset:offset + length]
                out.append(PayloadRef.shared(own, 0, length))
        return out


#: Memory files: what a worker uses unless its executor says otherwise (and the tests).
MEMORY = Bodies()
available = MEMORY.available
buffer_for = MEMORY.buffer_for
slices = MEMORY.slices
