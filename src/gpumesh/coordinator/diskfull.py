"""A store write that fails for lack of space: told apart, answered 503, logged once.

When the coordinator's data directory fills up, every write fails the same way (SQLite's
``SQLITE_FULL``, ``ENOSPC`` or ``EDQUOT`` writing a payload or log file). That is not a
bug: the request changed nothing (each write is all or nothing, :mod:`.journal`) and the
same request succeeds once there is room. So it is answered 503 (``retry later``: a
worker posts again after a backoff) with a message naming the data directory, and logged
once per *spell*, from the first such failure until the next commit that succeeds, not
once per request with a traceback.

:class:`Spell` is the store's (``Store.full``); :func:`note` is the one place that tells
a full disk from other failures and counts it; :class:`~.model.NotStored` is the answer.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from pathlib import Path

log = logging.getLogger("gpumesh.coordinator")

#: SQLite's primary result code for "database or disk is full".
SQLITE_FULL = 13
#: errno values that mean "no room": the disk, or the user's quota on it.
NO_ROOM = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


def is_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that failed for lack of space."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)  # (Python 3.11+)
        if code is not None:
            return code & 0xFF == SQLITE_FULL
        return "disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno in NO_ROOM


def what_full(data_dir: Path) -> str:
    """The words every refusal of a full disk starts with."""
    return f"the coordinator's disk is full (no space left for its data directory {data_dir})"


class Spell:
    """Whether the data directory is full now, as far as the store's writes tell."""

    def __init__(self, data_dir: Path, clock=time.monotonic):
        self.dir = data_dir
        self._clock = clock
        #: When the first failure of this spell happened; None while writes succeed.
        self.since: float | None = None
        #: Writes refused in this spell (the first is logged, the rest only counted).
        self.refused = 0

    def hit(self, exc: BaseException) -> None:
        """A write failed for lack of space: the first of a spell is logged."""
        self.refused += 1
        if self.since is None:
            self.since = self._clock()
            log.error("%s: %s: %s. Requests that write are answered 503 (retry later) and "
                      "change nothing until there is room; this is logged once, and again "
                      "when writes succeed", what_full(self.dir), type(exc).__name__, exc)

    def cleared(self) -> None:
        """A commit succeeded: a spell, if one was on, is over."""
        if self.since is not None:
            log.warning("the coordinator's data directory %s has room again: writes succeed "
                        "(%d refused over %.0fs)", self.dir, self.refused, self._clock() - self.since)
            self.since, self.refused = None, 0


def note(spell: Spell, exc: BaseException) -> bool:
    """If ``exc`` is a full disk, count it in ``spell`` (logged once per spell) and return
    True; otherwise False (the caller logs it as it would)."""
    if not is_full(exc):
        return False
    spell.hit(exc)
    return True
