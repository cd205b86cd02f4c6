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

**The pool: released payload files written over.** Writing a payload into a new file
costs the machine fresh pages: ~0.9 ms per MiB on the build VM, against ~0.13 ms to
write over a file whose pages are still in memory (docs/performance.md, "Tenth
session"). So the store does not always delete a released payload file (a job's
arguments or its result): it renames it into the drop directory as ``<24 hex>.free``
(:func:`pool_file`), and the next sender writes its payload over it
(:func:`write_file` claims one by renaming it to its own name). That is safe only when
nobody maps the file any more, since a copy-on-write map still shows the file's pages
it has not copied. Hence a protocol of ``flock`` locks:

* a reader maps a store file only under a shared lock, which it holds as long as the map
  lives, and only after checking, lock held, that the store still names that very file
  (:func:`lock_shared`; :meth:`gpumesh.payloadref.PayloadRef.open`). A worker's agent
  opens a task's arguments' file under that lock (:meth:`~gpumesh.payloadref.PayloadRef.pin`)
  and passes the descriptor to the task process: ``flock`` belongs to the open file
  description, so every copy of the descriptor shares the lock, which lasts while any
  copy is open; the task process maps from a copy it keeps open as long as its map
  (:func:`map_locked`), so a kept ``isolation="job"`` process that holds on to its
  argument array keeps the file out of the pool. A spawned task process maps by path,
  under a lock of its own;
* the store first renames the file out of its place (to ``<24 hex>.held``, which no
  sender takes), then tries the exclusive lock without waiting, and only if that
  succeeds renames it to ``.free``; while anyone holds the shared lock it tries again
  now and then, and deletes the file after ``HANDOFF_POOL_IDLE_S``.

A reader that locked before the rename keeps the file out of the pool; one that opened
it before the rename but locks after finds that the store no longer names it, and
treats it as gone (a caller then asks over HTTP; an agent hands the task back, as for a
file that is not there). A process says that it maps under locks with the request
header :data:`MAP_LOCKS_HEADER` (a caller on its results requests, a worker's agent on
its leases and result posts); a job's result files that went by path to any request
without it, or over HTTP, are never pooled, nor are its argument files that did (a
worker that gets the bytes over HTTP: the coordinator streams them from the file). Only
a job's release pools its files (a retry reads the same arguments' file again). The
pool is bounded (``HANDOFF_POOL_BYTES``) and emptied after ``HANDOFF_POOL_IDLE_S``
without use.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from . import limits
from .limits import HANDOFF_MIN_BYTES, HANDOFF_POOL_BYTES

try:  # the pool needs flock; where there is none (Windows) there is no handoff either
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]  # (tested as None below)

if TYPE_CHECKING:  # (protocol imports payloadref, which imports this module)
    from .protocol import ResultItem

#: The name a sender gives a file it writes into the handoff directory.
NAME = re.compile(r"[0-9a-f]{24}\.part")
#: A released payload file in the pool, for a sender to write over (see the docstring).
FREE = re.compile(r"[0-9a-f]{24}\.free")
#: A released payload file set aside for the pool while a reader still maps it.
HELD = re.compile(r"[0-9a-f]{24}\.held")
#: The probe file the coordinator writes (holds the nonce).
PROBE = ".probe"
#: The request header by which a process says it maps store files under shared locks.
MAP_LOCKS_HEADER = "x-gpumesh-map-locks"
#: Maps a process holds locked at once; beyond that a payload is read into memory instead
#: (each locked map keeps a descriptor open: they must not crowd out the process's sockets).
MAX_LOCKED_MAPS = 256
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
    chunks = [memoryview(c).cast("B") for c in chunks]
    size = sum(c.nbytes for c in chunks)
    path = os.path.join(drop_dir, name)
    fd = _claim_free(drop_dir, name, size)
    if fd is None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOINHERIT, 0o600)
    try:
        _write_all(fd, chunks)
        if os.fstat(fd).st_size != size:  # a pooled file that was bigger
            os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        discard(drop_dir, name)
        raise
    os.close(fd)
    return name


def _claim_free(drop_dir: str | Path, name: str, size: int) -> int | None:
    """Take a pooled file to write ``size`` bytes over, renamed to ``drop_dir/name``: its
    descriptor, open for writing; None when the pool has none that fits. Fits: the
    smallest of at least ``size`` bytes, up to twice that (cutting a bigger one down
    would free more pages than writing over it saves), else the biggest smaller one."""
    if fcntl is None:
        return None
    try:
        with os.scandir(drop_dir) as it:
            free = [(e.stat(follow_symlinks=False).st_size, e.path) for e in it
                    if FREE.fullmatch(e.name)]
    except OSError:
        return None
    big = sorted(f for f in free if size <= f[0] <= 2 * size)
    small = sorted((f for f in free if f[0] < size), reverse=True)
    dest = os.path.join(drop_dir, name)
    for _, path in big + small:
        try:
            os.rename(path, dest)  # atomic: of two senders, one gets it
        except OSError:
            continue
        try:
            fd = os.open(dest, os.O_WRONLY | _NOINHERIT | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            discard(drop_dir, name)
            continue
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            discard(drop_dir, name)
            continue
        os.utime(fd)  # a fresh file to the handoff sweep's age test, as a new one would be
        return fd
    return None


def pool_bytes(ram: int | None = None) -> int:
    """How many bytes of released payload files the pool may keep: ``HANDOFF_POOL_BYTES``,
    at most 1/16 of the machine's memory (``ram``, bytes; read when None)."""
    if ram is None:
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            ram = 0
    return min(HANDOFF_POOL_BYTES, ram // 16)


def pool_file(drop_dir: str | Path, path: str | Path, budget: int) -> bool:
    """Give the released store file ``path`` to the pool in ``drop_dir`` if nobody maps
    it and the pool stays within ``budget`` bytes; else delete it. True if pooled.
    Raises nothing for a file that is gone. (:func:`take_out` and :func:`try_pool` in
    two steps: the store's reaper retries a file that is still mapped.)"""
    waiting = take_out(drop_dir, path, budget)
    if waiting is None:
        return False
    if try_pool(waiting):
        return True
    _unlink(waiting)
    return False


def take_out(drop_dir: str | Path, path: str | Path, budget: int) -> str | None:
    """Rename the released store file ``path`` out of the store, to ``<24 hex>.held`` in
    ``drop_dir`` (where no sender takes it), if the pool stays within ``budget`` bytes
    with it; else delete it. Returns the new path, or None. Once renamed, no reader can
    lock the file anew (:func:`lock_shared` finds the store's name gone)."""
    if fcntl is None:
        _unlink(path)
        return None
    try:
        size = os.stat(path).st_size
    except OSError:
        _unlink(path)
        return None
    if size < HANDOFF_MIN_BYTES or pool_held(drop_dir) + size > budget:
        _unlink(path)
        return None
    waiting = os.path.join(drop_dir, os.urandom(12).hex() + ".held")
    try:
        os.rename(path, waiting)
    except OSError:
        _unlink(path)
        return None
    return waiting


def try_pool(waiting: str) -> bool | None:
    """Pool the file :func:`take_out` set aside if nobody maps it now (its exclusive lock
    is free): renamed to ``<24 hex>.free``, True. False while a reader still holds its
    shared lock (the file must not change: try again later, or delete it); None if it
    is gone."""
    assert fcntl is not None  # (take_out sets nothing aside without flock)
    try:
        fd = os.open(waiting, os.O_RDONLY | _NOINHERIT)
    except OSError:
        _unlink(waiting)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # anyone mapping it holds LOCK_SH
    except OSError:
        return False
    finally:
        os.close(fd)  # (closing drops our lock too; no reader can take one any more)
    free = waiting[:-len(".held")] + ".free"
    try:
        os.rename(waiting, free)  # only now may a sender claim it
    except OSError:
        _unlink(waiting)
        return None
    return True


def pool_held(drop_dir: str | Path) -> int:
    """Bytes of pooled files in ``drop_dir`` now, and of files set aside for it."""
    held = 0
    try:
        with os.scandir(drop_dir) as it:
            for e in it:
                if FREE.fullmatch(e.name) or HELD.fullmatch(e.name):
                    try:
                        held += e.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:  # (taken meanwhile)
                        pass
    except OSError:
        pass
    return held


def sweep_pool(drop_dir: str | Path, older_than: float | None = None) -> int:
    """Delete pooled files put there before ``older_than`` (epoch seconds; None: all,
    and the files set aside for the pool too). Returns how many."""
    n = 0
    try:
        with os.scandir(drop_dir) as it:
            for e in it:
                try:
                    if (FREE.fullmatch(e.name) and (
                            older_than is None or e.stat(follow_symlinks=False).st_ctime < older_than)
                            or older_than is None and HELD.fullmatch(e.name)):
                        os.unlink(e.path)
                        n += 1
                except FileNotFoundError:
                    pass
    except OSError:
        pass
    return n


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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


def lock_shared(fd: int, path: str | Path) -> bool:
    """Take a shared ``flock`` on ``fd``, opened from ``path`` (a store file), and check,
    lock held, that ``path`` still names that file: True if so (the store will not pool
    the file while the lock is held); False if the store has moved it since (the lock is
    dropped again: the caller treats the file as gone). No-op True without flock."""
    if fcntl is None:
        return True
    fcntl.flock(fd, fcntl.LOCK_SH)  # (the store holds LOCK_EX for microseconds at most)
    try:
        here, st = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        here = None
    if here is None or (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    return True


_held_lock = threading.Lock()
_held = 0  # locked maps this process holds


def map_locked(fd: int, offset: int = 0, length: int | None = None) -> memoryview:
    """As :func:`map_fd` for a descriptor :func:`lock_shared` locked, which this takes
    over: it stays open (and its lock held) until the map is gone, then is closed. Past
    :data:`MAX_LOCKED_MAPS` held maps, the bytes are read into memory instead and the
    descriptor is closed at once. Raises like :func:`map_fd`."""
    global _held
    with _held_lock:
        room = _held < MAX_LOCKED_MAPS
        if room:
            _held += 1
    try:
        if not room:
            size = os.fstat(fd).st_size
            n = size - offset if length is None else length
            if offset < 0 or n < 0 or offset + n > size:
                raise ValueError(f"bytes {offset}..{offset + n} are not in a file of {size}")
            buf = bytearray(n)
            got = 0
            while got < n:  # os.preadv may return less than asked
                k = os.preadv(fd, [memoryview(buf)[got:]], offset + got)
                if k == 0:
                    raise ValueError(f"the file ended at {offset + got} of {offset + n} bytes")
                got += k
            os.close(fd)
            return memoryview(buf)
        view = map_fd(fd, offset, length)
    except BaseException:
        if room:
            _unhold(None)
        try:
            os.close(fd)
        except OSError:  # (closed already, after a copy)
            pass
        raise
    if not isinstance(view.obj, mmap.mmap):  # an empty range: nothing mapped
        _unhold(fd)
    else:
        weakref.finalize(view.obj, _unhold, fd)
    return view


def _unhold(fd: int | None) -> None:
    global _held
    with _held_lock:
        _held -= 1
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
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

