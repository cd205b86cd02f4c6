"""Same-machine payload handoff: big payloads change hands as files, not HTTP bodies.

When a caller or a worker runs on the coordinator's own machine, as the coordinator's
user, a 64 MiB array need not cross the loopback as an HTTP body (copied by the kernel
and by Python at every hop). Instead:

* **Upload.** The sender writes the payload into the coordinator's *handoff directory*
  (``<data>/blobs/handoff``) and names the file in its request (``handoff_files``); the
  coordinator renames it into its store. One copy, into the page cache.
* **Download.** A requester that says ``handoff`` gets, for each payload the store keeps
  as a file, that file's path (relative to ``<data>/blobs``) instead of its bytes, and maps
  it (``mmap``, copy-on-write): arrays come back as writable views of the page cache,
  copied only where the program writes.

Ray does the same on one machine with its shared-memory object store; here the store's
own files are the shared memory.

Mapping is safe because a named file never changes. The store writes every payload file
under another name and renames it into place, and deletes it only when the job is
released or purged; a map outlives the deletion. Never reuse or rewrite such a file in
place: a private map still sees the file's pages it has not copied.

**Who may use it.** :meth:`Handoff.probe` asks the coordinator (``GET /v1/handoff``) where
its directories are and for a nonce it wrote to a probe file there, then checks that this
process reads the same nonce from that file (same machine, or the same shared file
system) and owns the handoff directory (same user). Nothing is granted that the user did
not have: whoever can write there can already rewrite the coordinator's database. The
coordinator only ever adopts files by a plain name inside that one directory.

``GPUMESH_HANDOFF=0`` turns it off for a process (everything then travels over HTTP).
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from . import limits
from .limits import HANDOFF_MIN_BYTES

if TYPE_CHECKING:  # (protocol imports payloadref, which imports this module)
    from .protocol import ResultItem

#: The name a sender gives a file it writes into the handoff directory.
NAME = re.compile(r"[0-9a-f]{24}\.part")
#: The probe file the coordinator writes (holds the nonce).
PROBE = ".probe"
#: Open flags: not inherited by child processes, and binary (Windows opens text otherwise).
_NOINHERIT = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_NOINHERIT", 0)


def enabled() -> bool:
    return limits.setting("GPUMESH_HANDOFF")


class Handoff:
    """A coordinator's directories, as reachable from this process.

    ``blob_dir``: where the store keeps payload files (answers name paths relative to it);
    ``drop_dir``: where senders write payloads for the coordinator to adopt.
    """

    __slots__ = ("blob_dir", "drop_dir")

    def __init__(self, blob_dir: str | Path, drop_dir: str | Path):
        self.blob_dir, self.drop_dir = Path(blob_dir), Path(drop_dir)

    @classmethod
    def from_answer(cls, answer: dict) -> Handoff | None:
        """Check a ``GET /v1/handoff`` answer against this process's view of the disk.
        Returns None if the handoff cannot be used here (another machine, another user,
        a malformed answer)."""
        if not hasattr(os, "getuid"):  # no POSIX owners to compare (Windows): HTTP only
            return None
        try:
            blob_dir, drop_dir = Path(answer["blob_dir"]), Path(answer["handoff_dir"])
            nonce = answer["nonce"]
            if not (blob_dir.is_absolute() and drop_dir.is_absolute() and isinstance(nonce, str)
                    and len(nonce) >= 16):
                return None
            with open(drop_dir / PROBE, encoding="ascii") as fh:
                if fh.read(256) != nonce:
                    return None
            st = os.stat(drop_dir)
            if st.st_uid != os.getuid() or not os.access(drop_dir, os.W_OK):
                return None
        except (KeyError, TypeError, ValueError, OSError):
            return None
        return cls(blob_dir, drop_dir)

    @classmethod
    def probe(cls, http) -> Handoff | None:
        """Ask the coordinator behind ``http`` (a :class:`~gpumesh.transport.Transport`).
        None when disabled, refused, unknown to an older coordinator, or unusable here.
        Raises :class:`~gpumesh.transport.Unreachable` like any request."""
        from . import protocol
        from .errors import RequestRejected
        if not enabled():
            return None
        try:
            answer = http.request("GET", protocol.HANDOFF, timeout=10).json()
        except RequestRejected:
            return None
        return cls.from_answer(answer) if isinstance(answer, dict) else None

    # ----------------------------------------------------------------- sending ------
    def write(self, chunks: Iterable) -> str:
        """Write a payload's chunks to a new file in the handoff directory; returns its
        name (for ``handoff_files``). Raises ``OSError`` (disk full...; nothing is left)."""
        return write_file(self.drop_dir, chunks)

    def discard(self, name: str) -> None:
        """Delete a file this process wrote, if the coordinator did not adopt it."""
        discard(self.drop_dir, name)

    # ----------------------------------------------------------------- receiving ----
    def open_result(self, item: ResultItem) -> memoryview:
        """Map the store's file of a result that a results page names (its ``refs``'
        ``"result"``, or from a coordinator before refs its ``file``), as :meth:`open`.
        Raises ``FileNotFoundError`` if it is gone or not a store file (the caller then
        asks over HTTP)."""
        from .payloadref import from_wire
        wire = (item.refs or {}).get("result")
        if wire is None:  # the key before refs: drop it in the next release
            if item.file is None:
                raise FileNotFoundError("the result names no store file")
            return self.open(item.file)
        return _open_ref(lambda: from_wire(wire, self.blob_dir, "refs.result"))

    def open(self, rel: str) -> memoryview:
        """Map the store's payload file ``rel`` (a path relative to ``blob_dir``, as an
        answer names it). Returns a writable copy-on-write view. Raises
        ``FileNotFoundError`` if the file is gone (the caller then asks over HTTP)."""
        from .payloadref import store_file
        return _open_ref(lambda: store_file(self.blob_dir, rel))


def worth_it(size: int) -> bool:
    """Whether a payload of ``size`` bytes should change hands as a file."""
    return size >= HANDOFF_MIN_BYTES


def new_name() -> str:
    """A fresh handoff file name (96 random bits)."""
    return os.urandom(12).hex() + ".part"


def _open_ref(make) -> memoryview:
    """Open and release the reference ``make()`` returns; one that names no store file
    is ``FileNotFoundError`` like a file that is gone."""
    from .payloadref import BadRef
    try:
        ref = make()
    except BadRef as e:
        raise FileNotFoundError(str(e)) from None
    try:
        return ref.open()
    finally:
        ref.release()


def write_file(drop_dir: str | Path, chunks: Iterable, name: str | None = None) -> str:
    """Write ``chunks`` to ``drop_dir/<name>`` (default: :func:`new_name`; mode 0600,
    created exclusively). Returns the name. On failure the partial file is removed and
    ``OSError`` raised (``ValueError`` for a name that is not a handoff name)."""
    if name is None:
        name = new_name()
    elif not NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a handoff file name")
    path = os.path.join(drop_dir, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOINHERIT, 0o600)
    try:
        _write_all(fd, chunks)
    except BaseException:
        os.close(fd)
        discard(drop_dir, name)
        raise
    os.close(fd)
    return name


def memory_file(chunks: Iterable) -> int | None:
    """A new anonymous memory file (Linux ``memfd_create``) holding ``chunks``: its open
    descriptor, which the caller closes. None where there is no ``memfd_create`` or it
    fails (out of memory...): the caller then sends the bytes instead."""
    if not hasattr(os, "memfd_create"):
        return None
    try:
        fd = os.memfd_create("gpumesh-result", os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        _write_all(fd, chunks)
    except OSError:
        os.close(fd)
        return None
    return fd


def _write_all(fd: int, chunks: Iterable) -> None:
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view.nbytes:  # os.write may write less than asked (signals, big pieces)
            view = view[os.write(fd, view[:1 << 30]):]


def discard(drop_dir: str | Path, name: str) -> None:
    try:
        os.unlink(os.path.join(drop_dir, name))
    except FileNotFoundError:
        pass


def map_file(path: str | Path) -> memoryview:
    """A writable copy-on-write view of a whole file (an empty view for an empty file).
    Raises ``FileNotFoundError``/``OSError``."""
    fd = os.open(path, os.O_RDONLY | _NOINHERIT)
    try:
        return map_fd(fd)
    finally:
        os.close(fd)


def map_fd(fd: int, offset: int = 0, length: int | None = None) -> memoryview:
    """As :func:`map_file`, for an open file descriptor (left open); with ``offset`` and
    ``length`` (bytes), a view of just that part of the file, of which only the pages
    holding it are mapped. Raises ``ValueError`` for a range outside the file."""
    size = os.fstat(fd).st_size
    if length is None:
        length = size - offset
    if offset < 0 or length < 0 or offset + length > size:
        raise ValueError(f"bytes {offset}..{offset + length} are not in a file of {size}")
    if length == 0:
        return memoryview(bytearray())
    start = offset - offset % mmap.ALLOCATIONGRANULARITY  # maps begin on a page boundary
    # ACCESS_COPY: pages are shared with the page cache until written, so the arrays a
    # payload holds are writable without touching the file.
    mapped = mmap.mmap(fd, offset - start + length, offset=start, access=mmap.ACCESS_COPY)
    return memoryview(mapped)[offset - start:]

