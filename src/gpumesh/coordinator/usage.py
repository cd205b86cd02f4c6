"""Per-person task time over the last day and week, cached: the one owner of that value.

The dashboard's People table (:mod:`.ui`) and ``gpumesh_person_task_seconds`` on
``GET /metrics`` (:mod:`.metrics`) show the same figures, from the same
:class:`UsageCache`, which :func:`~.app.create_app` makes once per app and hands to
both. Each figure is :func:`task_time` over a window, a query that reads every
task of the jobs still running or finished in that window (all of a week's tasks for the
week's): milliseconds per thousand tasks, on the event loop. So it runs at most once per
:data:`USAGE_CACHE_S`, however many dashboards poll and scrapers scrape; between two
runs both read the kept answer (up to that many seconds old).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..limits import DAY_S

#: Per-person usage is recomputed at most this often (seconds), however many dashboards
#: poll and Prometheus servers scrape.
USAGE_CACHE_S = 5.0
#: The windows kept: name -> seconds back from now (the names are /metrics' ``window``).
WINDOWS = {"1d": DAY_S, "7d": 7 * DAY_S}

Usage = dict[Any, dict[str, float]]  # {owner (None: the admin's): {"gpu_s", "cpu_s", "tasks"}}
#: How much earlier than a usage window's start a job may have finished and still be
#: read for it (:func:`task_time`): a wall clock stepped back between a task's finish
#: and its job's.
USAGE_CLOCK_SLACK_S = 3600.0


def task_time(store, since: float) -> Usage:
    """Seconds of task time per person (``None``: jobs from before people) for attempts
    that finished at or after ``since`` (epoch seconds): ``{owner: {"gpu_s", "cpu_s",
    "tasks"}}``. Counts each task's last attempt (the one that produced its result).
    Meant for a metrics scrape or a dashboard refresh, not the request path.

    It reads the tasks of the jobs that were still running at ``since``: a job's
    ``finished`` is written after (in the same commit as, or later than) the last of
    its tasks', so a task finished in the window belongs to a job unfinished or
    finished in the window too. ``USAGE_CLOCK_SLACK_S`` of slack keeps that true
    across a wall clock stepped back; the tasks' own test stays exact. ``CROSS JOIN``
    keeps SQLite to that order (jobs, then each one's tasks by the ``(job_id, idx)``
    key); it could otherwise choose to scan every task."""
    out: Usage = {}
    for owner, gpu, secs, n in store.db.execute(
            "SELECT j.owner, COALESCE(t.gpu, 0), SUM(t.finished - t.started), COUNT(*)"
            " FROM jobs j CROSS JOIN tasks t ON t.job_id = j.id"
            " WHERE (j.finished IS NULL OR j.finished >= ?)"
            " AND t.finished >= ? AND t.started IS NOT NULL AND t.finished >= t.started"
            " GROUP BY j.owner, COALESCE(t.gpu, 0)", (since - USAGE_CLOCK_SLACK_S, since)):
        d = out.setdefault(owner, {"gpu_s": 0.0, "cpu_s": 0.0, "tasks": 0})
        d["gpu_s" if gpu else "cpu_s"] += float(secs or 0.0)
        d["tasks"] += n
    return out


class UsageCache:
    """:func:`task_time` for each of :data:`WINDOWS`, recomputed when the kept
    answer is older than ``max_age`` seconds (``clock``: epoch seconds)."""

    def __init__(self, store, max_age: float = USAGE_CACHE_S,
                 clock: Callable[[], float] = time.time):
        self.store, self.max_age, self.clock = store, max_age, clock
        self._at: float | None = None
        self._value: dict[str, Usage] = {}
        self.computed = 0  # how many times the windows were recomputed (tests, benchmarks)

    def windows(self) -> dict[str, Usage]:
        """``{"1d": usage, "7d": usage}``, at most ``max_age`` seconds old."""
        now = self.clock()
        if self._at is None or not 0 <= now - self._at <= self.max_age:  # (or a clock stepped back)
            self._value = {name: task_time(self.store, now - span) for name, span in WINDOWS.items()}
            self._at = now
            self.computed += 1
        return self._value
