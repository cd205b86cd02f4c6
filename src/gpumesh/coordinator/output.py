"""What tasks print: kept per task for ``gpumesh logs``, and streamed live to callers.

Workers post output in chunks while a task runs (and a last one before its result).
Each chunk is

* appended to ``<data_dir>/logs/<job>/<task>.out|.err`` (a task's second and later
  attempts, after a lost worker, a hand-back or a ``retry_on`` exception, to
  ``<task>.<attempt>.out|.err``: ``gpumesh logs`` shows each attempt apart), up to
  ``TASK_LOG_CAP_BYTES`` per stream and attempt (what comes after is counted, not kept,
  and the log says so), and
* kept in a per-job ring of recent chunks (``JOB_RING_BYTES``) with a sequence number,
  which callers read by cursor together with results (one long-poll wakes for either).
  A caller that falls behind the ring is told how many chunks it missed instead of
  stalling the tasks.

It also knows which tasks of a job printed anything (:meth:`OutputHub.printed`), so the
dashboard's output panel visits those tasks only, not every task of a big job: the ones
it saw print, and, once per job and process, those with a log on disk from before a
restart (their indexes looked up in the store). One entry per task that printed, kept
until the job's logs are deleted.
"""

from __future__ import annotations

import os
import shutil
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: Bytes of each stream of each task kept on disk for ``gpumesh logs``.
TASK_LOG_CAP_BYTES = 8 * 2**20
#: Bytes of recent output per job held in memory for live callers.
JOB_RING_BYTES = 4 * 2**20
STREAMS = ("stdout", "stderr")


@dataclass
class Chunk:
    seq: int
    task_id: str
    index: int
    stream: str
    worker: str
    data: bytes


@dataclass
class _JobOutput:
    ring: deque = field(default_factory=deque)
    ring_bytes: int = 0
    next_seq: int = 0


class OutputHub:
    """Task output of every live job. Event-loop only; no locking."""

    def __init__(self, log_dir: Path):
        self.dir = Path(log_dir)
        self._jobs: dict[str, _JobOutput] = {}
        self._sizes: dict[tuple[str, str, str], int] = {}
        self._printed: dict[str, dict[str, int]] = {}  # job -> {task id: index} that printed
        self._read_dir: set[str] = set()  # jobs whose log directory _printed includes

    def append(self, job_id: str, task_id: str, index: int, worker: str, stream: str,
               data: bytes, attempt: int = 1) -> None:
        if not data or stream not in STREAMS:
            return
        self._to_file(job_id, task_id, stream, data, attempt)
        if index >= 0:
            self._printed.setdefault(job_id, {})[task_id] = index
        else:  # (an index the caller did not know: the next read looks it up)
            self._read_dir.discard(job_id)
        out = self._jobs.setdefault(job_id, _JobOutput())
        out.ring.append(Chunk(out.next_seq, task_id, index, stream, worker, data))
        out.next_seq += 1
        out.ring_bytes += len(data)
        while out.ring_bytes > JOB_RING_BYTES and len(out.ring) > 1:
            out.ring_bytes -= len(out.ring.popleft().data)

    def _path(self, job_id: str, task_id: str, stream: str, attempt: int = 1) -> Path:
        ext = "out" if stream == "stdout" else "err"
        return self.dir / job_id / (f"{task_id}.{ext}" if attempt <= 1 else f"{task_id}.{attempt}.{ext}")

    def _to_file(self, job_id: str, task_id: str, stream: str, data: bytes, attempt: int = 1) -> None:
        key = (job_id, task_id, f"{stream}.{attempt}")
        path = self._path(job_id, task_id, stream, attempt)
        have = self._sizes.get(key)
        if have is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            have = path.stat().st_size if path.exists() else 0
        room = TASK_LOG_CAP_BYTES - have
        if room <= 0:
            return
        keep = data[:room]
        with open(path, "ab") as fh:
            fh.write(keep)
            if len(keep) < len(data):
                fh.write(f"\n[gpumesh: output beyond {TASK_LOG_CAP_BYTES // 2**20} MiB not kept]\n"
                         .encode())
        self._sizes[key] = have + len(keep)

    def last_seq(self, job_id: str) -> int:
        out = self._jobs.get(job_id)
        return -1 if out is None else out.next_seq - 1

    def since(self, job_id: str, after: int) -> tuple[list[Chunk], int]:
        """Chunks with ``seq > after`` still in the ring, and how many older ones the
        reader missed because the ring moved on."""
        out = self._jobs.get(job_id)
        if out is None:
            return [], 0
        chunks = [c for c in out.ring if c.seq > after]
        skipped = chunks[0].seq - after - 1 if chunks and chunks[0].seq > after + 1 else 0
        return chunks, skipped

    def task_log(self, job_id: str, task_id: str, stream: str, attempt: int = 1) -> bytes:
        """What attempt ``attempt`` of a task wrote to ``stream`` (kept part; b"" if none)."""
        path = self._path(job_id, task_id, stream, attempt)
        try:
            return path.read_bytes()
        except OSError:
            return b""

    def printed(self, job_id: str, indexes: Callable[[list[str]], dict[str, int]]) -> dict[str, int]:
        """``{task_id: index}`` of the job's tasks that printed anything (and have it on
        disk). The first call for a job also reads its log directory once, for output
        written before this process started; ``indexes`` maps those task ids to their
        indexes (the store's). Later calls cost nothing: :meth:`append` keeps it."""
        known = self._printed.setdefault(job_id, {})
        if job_id not in self._read_dir:
            try:
                with os.scandir(self.dir / job_id) as entries:
                    names = {e.name.split(".", 1)[0] for e in entries}
            except OSError:
                names = set()
            unknown = [t for t in names if t not in known]
            if unknown:
                known.update(indexes(unknown))
            self._read_dir.add(job_id)
        return known

    def forget(self, job_id: str, files: bool = False) -> None:
        """Drop a job's live ring (and with ``files`` its logs on disk and the record of
        which tasks printed)."""
        self._jobs.pop(job_id, None)
        if files:
            shutil.rmtree(self.dir / job_id, ignore_errors=True)
            self._printed.pop(job_id, None)
            self._read_dir.discard(job_id)
            self._sizes = {k: v for k, v in self._sizes.items() if k[0] != job_id}
