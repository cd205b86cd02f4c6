"""One coordinator per data directory: an operating-system lock held for its whole life.

Two coordinators on one store would lease the same tasks (a task run twice), recover each
other's jobs and overwrite each other's config. ``gpumesh serve`` therefore takes an
exclusive, non-blocking lock on ``<data dir>/coordinator.lock`` before it writes
anything, and keeps the file open until it exits::

    serve ─► acquire(data_dir) ─► (held) ─► job store, config.json, HTTP ... ─► exit
                 │                                                               │
                 └─ held by another process: DataDirLocked(pid) ─► exit 1        └─ the OS
                                                                                    drops it

The lock belongs to the open file, not to the path: the kernel releases it when the
process ends however it ends (``kill -9``, a crash, a power cut of a network mount
aside), so a stale lock file never blocks a restart. POSIX uses ``flock`` (advisory,
whole file); Windows uses ``msvcrt.locking`` (mandatory, on a byte range). The holder's
pid is written into the file so the refusal can say which process holds it; on Windows
the locked byte lies beyond the pid, which stays readable to the refused process.

Not covered: two machines sharing one data directory over NFS, where ``flock`` may be
local to each client. A data directory belongs on a local disk.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LOCK_NAME = "coordinator.lock"
#: Windows: offset of the one byte that is locked (the pid is written before it).
_WIN_LOCK_OFFSET = 1 << 20


class DataDirLocked(Exception):
    """Another process holds the data directory. ``pid`` is its process id (None if it
    could not be read); the message says what to do."""

    def __init__(self, data_dir: Path, pid: int | None):
        self.data_dir, self.pid = data_dir, pid
        who = f"process {pid}" if pid else "another process"
        super().__init__(
            f"the data directory {data_dir} is in use by another coordinator ({who}); "
            f"stop it first, or pass --data-dir with another directory")


class DataDirLock:
    """An exclusive lock on one data directory; :meth:`release` (or process exit) ends it."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the lock on every platform
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(data_dir: Path) -> DataDirLock:
    """Lock ``data_dir`` (which must exist) for this process.

    Raises :class:`DataDirLocked` if another process holds it, ``OSError`` if the lock
    file cannot be created or opened.
    """
    path = Path(data_dir) / LOCK_NAME
    # O_RDWR without O_TRUNC: the holder's pid must survive our opening the file.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not _try_lock(fd):
            raise DataDirLocked(Path(data_dir), _read_pid(fd))
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return DataDirLock(path, fd)


def _read_pid(fd: int) -> int | None:
    try:
        return _parse_pid(os.pread(fd, 32, 0) if hasattr(os, "pread") else _read_at_start(fd))
    except OSError:
        return None


def _read_at_start(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 32)


def _parse_pid(data: bytes) -> int | None:
    text = data.split(b"\n", 1)[0].strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


if sys.platform == "win32":
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
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
