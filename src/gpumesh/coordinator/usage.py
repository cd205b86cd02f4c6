"""Per-person task time over the last day and week, cached: the one owner of that value.

The dashboard's People table (:mod:`.ui`) and ``gpumesh_person_task_seconds`` on
``GET /metrics`` (:mod:`.metrics`) show the same figures, from the same
:class:`UsageCache`, which :func:`~.app.create_app` makes once per app and hands to
both. Each figure is :meth:`~.store.Store.usage` over a window, a query that reads every
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


class UsageCache:
    """:meth:`~.store.Store.usage` for each of :data:`WINDOWS`, recomputed when the kept
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
            self._value = {name: self.store.usage(now - span) for name, span in WINDOWS.items()}
            self._at = now
            self.computed += 1
        return self._value
