"""An exclusive, non-blocking lock on a file, held by an open file and named by a pid.

The lock belongs to the open file, not to the path: the kernel releases it when the
process ends however it ends (``kill -9``, a crash), so a lock file left behind never
blocks anyone. POSIX uses ``flock`` (advisory, whole file; note that a second open of
the same file *in the same process* is refused too); Windows uses ``msvcrt.locking``
(mandatory, on a byte range). The holder writes its pid into the file so that a refused
process can say who holds it; on Windows the locked byte lies far beyond the pid, which
stays readable.

Used for one coordinator per data directory (:mod:`gpumesh.coordinator.datalock`) and
for telling a dead worker's temporary directory from a live one's
(:mod:`gpumesh.worker.tempdirs`). Not reliable on network file systems, where ``flock``
may be local to each client.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Windows: offset of the one byte that is locked (the pid is written before it).
_WIN_LOCK_OFFSET = 1 << 20


class FileLock:
    """A held lock; :meth:`release` (or the end of the process) drops it."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the lock on every platform
            self._fd = None

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Held(Exception):
    """Another process holds the lock; ``pid`` is its process id (None if unreadable)."""

    def __init__(self, path: Path, pid: int | None):
        super().__init__(f"{path} is locked by {f'process {pid}' if pid else 'another process'}")
        self.path, self.pid = path, pid


def acquire(path: Path) -> FileLock:
    """Lock ``path`` (created if missing, mode 0600) and write this process's pid into it.

    Raises :class:`Held` if another open file holds it, ``OSError`` if it cannot be
    created or opened.
    """
    path = Path(path)
    # O_RDWR without O_TRUNC: the holder's pid must survive our opening the file.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not _try_lock(fd):
            raise Held(path, _read_pid(fd))
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
    except BaseException:
        os.close(fd)
        raise
    return FileLock(path, fd)


def _read_pid(fd: int) -> int | None:
    try:
        if hasattr(os, "pread"):
            data = os.pread(fd, 32, 0)
        else:
            os.lseek(fd, 0, os.SEEK_SET)
            data = os.read(fd, 32)
    except OSError:
        return None
    text = data.split(b"\n", 1)[0].strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


try:  # by what the platform has, not its name (tests/winsurface has no fcntl either)
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]  # the None that selects msvcrt below

if fcntl is None:
    import msvcrt

    def _try_lock(fd: int) -> bool:
        os.lseek(fd, _WIN_LOCK_OFFSET, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        finally:
            os.lseek(fd, 0, os.SEEK_SET)
        return True
else:
    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
