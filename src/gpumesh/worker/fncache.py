"""The worker's cache of function blobs (``<worker dir>/fn/<sha256>``), bounded.

A task names its function by the sha256 of its pickled bytes; the agent fetches a blob
from the coordinator once and keeps it here for the function's later tasks. Bounded two
ways:

* **size**: beyond ``cap_bytes`` (``GPUMESH_FN_CACHE_MB``) the least recently used blobs
  are deleted, down to the cap;
* **time**: a blob no task used for ``idle_s`` (``GPUMESH_WARM_IDLE``: when its function's
  warm host exits too) is deleted.

Never deleted: a blob a task holds (:meth:`FunctionCache.acquire` until
:meth:`~FunctionCache.release`: the fetch, the host's load, the run), nor one whose
function the executor still keeps processes of (``in_use``: a spawn runtime's spares load
it from here when they start). A fork host reads its blob once, while its first task holds
it, so a blob deleted later is fetched again from the coordinator when a new host needs it.
So the cap may be exceeded while held blobs alone exceed it. Thread-safe.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gpumesh.worker")


@dataclass
class _Blob:
    size: int
    used: float
    holds: int = 0


class FunctionCache:
    """Blobs under ``root``; ``fetch(h)`` returns blob ``h``'s bytes (or None) from the
    coordinator. ``in_use()``: the hashes the executor still keeps processes of."""

    def __init__(self, root: Path, fetch: Callable[[str], bytes | bytearray | memoryview | None],
                 cap_bytes: int, idle_s: float, in_use: Callable[[], Iterable[str]] = tuple,
                 clock: Callable[[], float] = time.monotonic):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fetch, self.cap_bytes, self.idle_s = fetch, cap_bytes, idle_s
        self.in_use, self.clock = in_use, clock
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}
        self._blobs: dict[str, _Blob] = {}
        for p in self.root.iterdir():  # (a cache directory given again)
            if p.is_file() and len(p.name) == 64:
                self._blobs[p.name] = _Blob(p.stat().st_size, clock())
            elif p.suffix == ".tmp":
                p.unlink(missing_ok=True)

    @property
    def size(self) -> int:
        with self._lock:
            return sum(b.size for b in self._blobs.values())

    def acquire(self, h: str) -> Path:
        """The path of blob ``h``, fetched if it is not here, held until :meth:`release`.
        Raises (``RuntimeError`` for a corrupted blob, the transport's errors) when it
        cannot be fetched."""
        path = self.root / h
        while True:
            with self._lock:
                b = self._blobs.get(h)
                if b is not None:
                    b.holds += 1
                    b.used = self.clock()
                    return path
                lock = self._fetching.setdefault(h, threading.Lock())
            with lock:
                with self._lock:
                    if h in self._blobs:
                        continue  # another thread fetched it meanwhile
                data = self.fetch(h)
                if data is None or hashlib.sha256(data).hexdigest() != h:
                    raise RuntimeError(f"function blob {h[:12]} arrived corrupted")
                tmp = path.with_name(h + ".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, path)
                with self._lock:
                    self._blobs[h] = _Blob(len(data), self.clock(), holds=1)
                    self._fetching.pop(h, None)
                    self._trim()
                return path

    def release(self, h: str) -> None:
        """A holder of ``h`` is done with it (it stays cached while the cap allows)."""
        with self._lock:
            b = self._blobs.get(h)
            if b is not None:
                b.holds = max(0, b.holds - 1)
                b.used = self.clock()
            self._trim()

    def sweep(self) -> None:
        """Delete the blobs idle for ``idle_s`` (and any beyond the cap)."""
        with self._lock:
            self._trim(idle=True)

    def _trim(self, idle: bool = False) -> None:
        """Called with the lock held."""
        total = sum(b.size for b in self._blobs.values())
        now = self.clock()
        stale = idle and any(not b.holds and now - b.used > self.idle_s for b in self._blobs.values())
        if total <= self.cap_bytes and not stale:
            return
        busy = {h.split("|")[0] for h in self.in_use()}
        for h, b in sorted(self._blobs.items(), key=lambda kv: kv[1].used):  # oldest first
            if b.holds or h in busy:
                continue
            if total <= self.cap_bytes and not (idle and now - b.used > self.idle_s):
                continue
            try:
                (self.root / h).unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("could not delete function blob %s: %s", h[:12], e)
                continue
            del self._blobs[h]
            total -= b.size
