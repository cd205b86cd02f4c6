"""Deleting released payload files on a thread of their own, off the event loop.

Unlinking a file frees its page-cache pages there and then: a 64 MiB payload file took
5-50 ms to unlink on the shared build VM (docs/performance.md, "Tenth session"), and a
released call has two (its arguments and its result). The coordinator released jobs
inside the release request, on its event loop, so the next call's submit, lease and
result post waited for those unlinks. The rows stop naming the files first (in the
store's transaction), so nothing can reach a file once it is queued here; a file left
by a coordinator killed before its turn came lies in a released job's folder, which
:meth:`~gpumesh.coordinator.store.Store.purge_before` removes with the job.

The reaper also keeps the handoff pool (:mod:`gpumesh.handoff`): a released payload file
it is asked to pool is set aside in the drop directory if the pool has room (else
deleted), and pooled for a sender to write over once nobody maps it. A file still mapped
is tried again, soon at first (``RETRY_FIRST_S``: a caller's ``r = f(a)`` loop drops the
previous result as the next call starts, whose own result should find it pooled), then
less often, every ``RETRY_S`` at most, and deleted after ``HANDOFF_POOL_IDLE_S``; the pool is
emptied after ``HANDOFF_POOL_IDLE_S`` in which nothing was pooled.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from .. import handoff
from ..limits import HANDOFF_POOL_IDLE_S

log = logging.getLogger("gpumesh.coordinator")

#: Seconds :meth:`Reaper.close` waits for what is queued (a stop never hangs on a disk).
CLOSE_WAIT_S = 10.0
#: Seconds between tries to pool a file a reader still maps (one flock try per file):
#: RETRY_FIRST_S after a file is set aside, doubling up to RETRY_S.
RETRY_FIRST_S = 0.005
RETRY_S = 0.05


class Reaper:
    """Removes files, then empty folders, then whole trees, in the order asked; one
    daemon thread, started with the first request. Where no thread can be started the
    removal happens in the caller, as before."""

    def __init__(self, pool_dir: Path | None = None, pool_budget: int = 0) -> None:
        """``pool_dir``: the handoff drop directory, where pooled files go, at most
        ``pool_budget`` bytes of them (0: none are pooled)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pool_dir, self._pool_budget = pool_dir, pool_budget if pool_dir is not None else 0
        self._pooled = False  # files may be in the pool (the idle sweep has work)
        self._waiting: list[tuple[str, float]] = []  # set aside, still mapped: (path, since)
        self._retry_s = RETRY_FIRST_S  # the wait before the next try of _waiting

    def remove(self, files: Iterable[Path] = (), dirs: Iterable[Path] = (),
               trees: Iterable[Path] = (), pool: Iterable[Path] = ()) -> None:
        """Queue ``files`` to unlink and ``pool`` to give to the pool (or unlink), then
        the folders ``dirs`` to remove if empty, then ``trees`` to remove with everything
        in them. Missing ones are skipped. Never raises."""
        item = (tuple(files), tuple(dirs), tuple(trees), tuple(pool))
        if not any(item):
            return
        if self._start():
            self._queue.put(item)
        else:
            self._do(item)

    def flush(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """Wait until everything queued before this call is removed; False on timeout."""
        if self._thread is None:
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        """Finish what is queued (at most :data:`CLOSE_WAIT_S`), then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(CLOSE_WAIT_S)

    def _start(self) -> bool:
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="payload-reaper", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # (interpreter shutting down, no threads left)
                    return False
                self._thread = thread
            return True

    def _run(self) -> None:
        while True:
            timeout = self._retry_s if self._waiting else HANDOFF_POOL_IDLE_S if self._pooled else None
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                assert self._pool_dir is not None  # (only a pool sets _pooled, _waiting)
                if self._waiting:
                    self._retry()
                    self._retry_s = min(RETRY_S, 2 * self._retry_s)
                else:  # nothing pooled for that long: give the memory back
                    handoff.sweep_pool(self._pool_dir, time.time() - HANDOFF_POOL_IDLE_S)
                    self._pooled = handoff.pool_held(self._pool_dir) > 0
                continue
            if item is None:
                if self._pool_dir is not None:
                    handoff.sweep_pool(self._pool_dir)
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._do(item)
            except Exception:  # noqa: BLE001 - a removal must never end the thread
                log.exception("removing released payload files failed")

    def _do(self, item: tuple) -> None:
        files, dirs, trees, pool = item
        if pool and self._pool_budget > 0:
            assert self._pool_dir is not None  # (a budget comes with a pool directory)
            for path in pool:
                waiting = handoff.take_out(self._pool_dir, path, self._pool_budget)
                if waiting is not None:
                    self._waiting.append((waiting, time.monotonic()))
                    self._retry_s = RETRY_FIRST_S
            pool = ()
            self._retry()
        _remove(files + pool, dirs, trees)

    def _retry(self) -> None:
        """Pool the files set aside that nobody maps now; delete those mapped too long."""
        now, still = time.monotonic(), []
        for path, since in self._waiting:
            pooled = handoff.try_pool(path)
            if pooled:
                self._pooled = True
            elif pooled is False:
                if now - since < HANDOFF_POOL_IDLE_S:
                    still.append((path, since))
                else:
                    _remove((Path(path),), (), ())
        self._waiting = still


def _remove(files: tuple[Path, ...], dirs: tuple[Path, ...], trees: tuple[Path, ...]) -> None:
    for path in files:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove payload file %s: %s", path, e)
    for path in dirs:
        try:
            os.rmdir(path)
        except OSError:  # absent, or a file in it we did not know of (purge removes it)
            pass
    for path in trees:
        shutil.rmtree(path, ignore_errors=True)
