"""What a running task printed, on the lending machine's disk and on its way out: how far
each of its output files was read and forwarded, and keeping those files small.

A task's stdout and stderr go to files of its slot in the worker's spool (see
gpumesh.worker.executor.Executor.output_paths); the agent forwards them every
``OUTPUT_FLUSH_S`` (gpumesh.worker.agent) through an :class:`OutputCursor`.
"""

from __future__ import annotations

import os
import threading

from .. import protocol
from ..limits import ERROR_TAIL_BYTES, SPOOL_CAP_BYTES

#: Bytes of each stream of one task forwarded to the coordinator; the rest is dropped
#: with a note (the task still runs to the end and its result still arrives).
FORWARD_CAP_BYTES = 16 * 2**20


class OutputCursor:
    """How far a running task's output files have been read and forwarded.

    The files are the lender's disk: once one is past ``SPOOL_CAP_BYTES`` and all of it
    was read, it is emptied (:meth:`trim`; the task appends, ``O_APPEND``, so it goes on
    writing from the start). Only output past the forwarding cap can be emptied away: up
    to the cap, a file over ``SPOOL_CAP_BYTES`` is forwarded first (:meth:`behind`), and
    the cap is no larger than it. What a trim could lose is what the task writes in the
    microseconds between the size check and the truncation, all of it past the cap: the
    end of the stream is kept in memory for a failure's ``stderr_tail`` (:meth:`tail`).
    A script task's stdout is never emptied: its result is the last JSON line of it, read
    from the file once the script has ended (gpumesh.worker.scripts)."""

    def __init__(self, task: protocol.TaskGrant, out: str, err: str):
        self.task_id, self.lease_id = task.task_id, task.lease_id
        self.paths = (out, err)
        self.offsets = [0, 0]  # read up to here in the file as it is now
        self.sent = [0, 0]  # bytes of each stream forwarded (at most FORWARD_CAP_BYTES)
        self.tails = [b"", b""]  # the last bytes of each stream before it was emptied
        self.trimmed = (1,) if task.kind == "script" else (0, 1)  # the streams trim may empty
        self.lock = threading.Lock()

    def read(self, limit: int) -> tuple[bytes, bytes]:
        got = []
        for i, path in enumerate(self.paths):
            data = b""
            try:
                size = os.stat(path).st_size
            except OSError:
                size = 0
            if size > self.offsets[i] and self.sent[i] < FORWARD_CAP_BYTES:
                try:
                    with open(path, "rb") as fh:
                        fh.seek(self.offsets[i])
                        data = fh.read(min(limit, FORWARD_CAP_BYTES - self.sent[i]))
                except OSError:
                    data = b""
                self.offsets[i] += len(data)
                self.sent[i] += len(data)
                if self.sent[i] >= FORWARD_CAP_BYTES:
                    data += (f"\n[gpumesh: output beyond {FORWARD_CAP_BYTES // 2**20} MiB "
                             "not forwarded]\n").encode()
            elif size > self.offsets[i]:  # past the cap: read (nothing more is forwarded)
                self.offsets[i] = size
            got.append(data)
        return got[0], got[1]

    def behind(self) -> bool:
        """Whether a file is past ``SPOOL_CAP_BYTES`` with output still to forward: the
        next reads must not wait for the next flush."""
        for i, path in enumerate(self.paths):
            try:
                if self.sent[i] < FORWARD_CAP_BYTES and os.stat(path).st_size > SPOOL_CAP_BYTES:
                    return True
            except OSError:
                pass
        return False

    def trim(self) -> None:
        """Empty each file that is past ``SPOOL_CAP_BYTES`` and whose stream is past the
        forwarding cap (see the class's docstring); its last ``ERROR_TAIL_BYTES`` are kept
        here."""
        for i in self.trimmed:
            path = self.paths[i]
            if self.sent[i] < FORWARD_CAP_BYTES:  # (past the cap, nothing is left to read)
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue
            try:
                end = os.fstat(fd).st_size
                if end <= SPOOL_CAP_BYTES:
                    continue
                keep = os.pread(fd, ERROR_TAIL_BYTES, max(0, end - ERROR_TAIL_BYTES))
                if os.fstat(fd).st_size == end:  # (what came meanwhile is read next time)
                    os.ftruncate(fd, 0)
                    self.tails[i], self.offsets[i] = keep, 0
            except OSError:
                pass
            finally:
                os.close(fd)

    def tail(self, i: int, n: int = ERROR_TAIL_BYTES) -> bytes:
        """The last ``n`` bytes of stream ``i`` (0 stdout, 1 stderr), emptied or not."""
        try:
            with open(self.paths[i], "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(0, size - n))
                now = fh.read()
        except OSError:
            now = b""
        return (self.tails[i] + now)[-n:]

    def emptied(self, i: int) -> bool:
        return bool(self.tails[i])

    def remove(self) -> None:
        """The task's output was delivered: its files are emptied (they are the slot's,
        made again for its next task, and removed with the worker's directory)."""
        for path in self.paths:
            try:
                os.truncate(path, 0)
            except OSError:
                pass
