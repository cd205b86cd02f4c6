"""The worker's temporary directory, and removing those of workers that died.

A worker keeps its function blobs, task output files and script working directories in
one directory of its own under the system's temporary directory
(``gpumesh-worker-`` and eight random characters, as ``mkdtemp`` names it). A worker that stops removes it; one that is killed
(``kill -9``, a power cut, a crash) cannot, so every worker that starts first removes the
directories of workers that are gone.

Inside it, ``tmp/`` holds one directory per task process (named by the agent, made by
the process before its task, :func:`gpumesh.worker.runner.use_temp_dir`): a task's
``TMPDIR`` and ``tempfile.gettempdir()``. The agent removes it as soon as the process is
done (its task ended, or for ``isolation="job"`` the job's process closed):
:func:`remove_task_dir`.

Gone is decided by a lock, not a pid: each directory holds ``.owner.lock``, locked
(:mod:`gpumesh.oslock`) by its worker for its whole life. A directory whose lock can be
taken belongs to nobody any more, even if its old pid now names another process; one
whose lock cannot be taken is a live worker's and is left alone. A directory without the
lock file (made a moment ago, not locked yet, or by another program) is never touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from .. import oslock

log = logging.getLogger("gpumesh.worker")

PREFIX = "gpumesh-worker-"
LOCK_NAME = ".owner.lock"


def create(root: Path | None = None) -> tuple[Path, oslock.FileLock]:
    """Remove dead workers' directories under ``root`` (default: the system's temporary
    directory), then make this worker's (mode 0700) and lock it. Returns the directory
    and its lock; remove the directory, then release the lock, when the worker stops."""
    sweep(root)
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
    return path, oslock.acquire(path / LOCK_NAME)


def remove_task_dir(path: str | None) -> None:
    """Remove a task process's temporary directory and all in it. Never raises."""
    if not path:
        return
    try:
        os.rmdir(path)  # (the common case: the task left nothing)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def sweep(root: Path | None = None) -> list[Path]:
    """Remove the directories of workers that are gone; returns those removed."""
    root = Path(root or tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if hasattr(os, "getuid") and entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue  # another user's worker: not ours to judge
            if not (path / LOCK_NAME).is_file():
                continue
            lock = oslock.acquire(path / LOCK_NAME)
        except oslock.Held:
            continue  # a live worker's
        except OSError:
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            lock.release()
        if not path.exists():
            removed.append(path)
    if removed:
        log.info("removed %d temporary director%s of workers that are gone",
                 len(removed), "y" if len(removed) == 1 else "ies")
    return removed


#: Variables that name the temporary directory (``tempfile`` reads the first one set).
TEMP_ENV = ("TMPDIR", "TEMP", "TMP")


def use_temp_dir(path: str | None) -> None:
    """In a task process: make ``path`` (its own, in the worker's directory) its temporary
    directory: the variables, and ``tempfile``'s choice, made maybe by its host already
    (``tempfile`` is imported here anyway). One that cannot be made leaves the worker's
    own in place."""
    if not path:
        return
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:  # (a kept process's next task: the same one)
        pass
    except OSError:
        return
    for name in TEMP_ENV:
        os.environ[name] = path
    tempfile.tempdir = path
