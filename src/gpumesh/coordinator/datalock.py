"""One coordinator per data directory: an operating-system lock held for its whole life.

Two coordinators on one store would lease the same tasks (a task run twice), recover each
other's jobs and overwrite each other's config. ``gpumesh serve`` therefore takes an
exclusive, non-blocking lock on ``<data dir>/coordinator.lock`` (:mod:`gpumesh.oslock`:
``flock``, or ``msvcrt.locking`` on Windows) before it writes anything, and keeps the
file open until it exits::

    serve ─► acquire(data_dir) ─► (held) ─► job store, config.json, HTTP ... ─► exit
                 │                                                               │
                 └─ held by another process: DataDirLocked(pid) ─► exit 1        └─ the OS
                                                                                    drops it

The kernel drops the lock with the process however it ends, so a coordinator killed with
``kill -9`` never leaves a stale lock behind. A data directory belongs on a local disk:
``flock`` on a network file system may be local to each client.
"""

from __future__ import annotations

from pathlib import Path

from .. import oslock

LOCK_NAME = "coordinator.lock"


class DataDirLocked(Exception):
    """Another process holds the data directory. ``pid`` is its process id (None if it
    could not be read); the message says what to do, naming ``option``: how the one who
    started this coordinator picks another directory (``serve``'s ``--data-dir``; from
    Python, ``start_coordinator``'s ``data_dir=``)."""

    def __init__(self, data_dir: Path, pid: int | None, option: str = "--data-dir"):
        self.data_dir, self.pid = data_dir, pid
        who = f"process {pid}" if pid else "another process"
        super().__init__(
            f"the data directory {data_dir} is in use by another coordinator ({who}); "
            f"stop it first, or pass {option} with another directory")


def acquire(data_dir: Path, option: str = "--data-dir") -> oslock.FileLock:
    """Lock ``data_dir`` (which must exist) for this process; the lock lasts until it
    is released or the process ends.

    Raises :class:`DataDirLocked` (its text naming ``option``) if another process holds
    it, ``OSError`` if the lock file cannot be created or opened.
    """
    try:
        return oslock.acquire(Path(data_dir) / LOCK_NAME)
    except oslock.Held as e:
        raise DataDirLocked(Path(data_dir), e.pid, option) from None


def held_by_another(data_dir: Path, option: str = "--data-dir") -> DataDirLocked | None:
    """Whether a coordinator holds ``data_dir`` now: its :class:`DataDirLocked` (not
    raised), else None. Locks and releases at once; creates nothing where no
    coordinator ever ran (no lock file)."""
    if not (Path(data_dir) / LOCK_NAME).exists():
        return None
    try:
        acquire(data_dir, option).release()
    except DataDirLocked as e:
        return e
    except OSError:  # (unreadable: serve itself says why)
        return None
    return None
