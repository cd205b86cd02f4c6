"""``GET /metrics``: the coordinator's state in Prometheus text format (prometheus-client).

A leaf: it reads :class:`~.core.Coordinator` and the store at scrape time and observes two
latencies through the coordinator's ``on_grants`` / ``on_result`` hooks; nothing in the
core imports it. Who may scrape: anyone whose token may read the pool (``admin``,
``submit``, ``view``; see :mod:`.people`), or a scraper holding the separate
``serve --metrics-token``, which opens this route and nothing else.

What a scrape reports (names as Prometheus shows them; docs/monitoring.md has the list
with a scrape config and Grafana panels)::

    gpumesh_info{version}                               1
    gpumesh_tasks{state}                                tasks the store holds, by state
    gpumesh_queue_depth                                 pending tasks
    gpumesh_jobs_active                                 jobs with unfinished tasks
    gpumesh_workers{state}                              alive | dead
    gpumesh_slots{kind, state}                          cpu | gpu  x  busy | free | closed
    gpumesh_gpu_memory_total_bytes{worker,host,gpu,name}
    gpumesh_gpu_memory_free_bytes{...}                  as the worker last reported
    gpumesh_gpu_utilization_ratio{...}                  0..1, where the worker reports it
    gpumesh_gpu_temperature_celsius{...}                where the worker reports it
    gpumesh_person_running_tasks{person}
    gpumesh_person_pending_tasks{person}
    gpumesh_person_task_seconds{person, device, window} task time of finished attempts,
                                                        device cpu|gpu, window 1d|7d
    gpumesh_lease_wait_seconds                          histogram: submit -> first lease
    gpumesh_result_latency_seconds{state}               histogram: lease -> result accepted

``gpumesh_tasks`` counts rows with one ``GROUP BY`` over the tasks the store still keeps
(retention bounds it): a scrape every 15 s costs milliseconds for tens of thousands of
tasks. Per-person seconds are gauges over a rolling window, not counters: purged jobs
leave the window. They come from the app's one :class:`~.usage.UsageCache`, the one
the dashboard's People table reads: the query that reads every task finished in the
week runs at most once per ``USAGE_CACHE_S`` for both, so a figure may be that many
seconds old.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import availability
from ..limits import MiB
from .._version import __version__
from . import people
from .auth import AuthRefused
from .usage import UsageCache

#: Buckets (seconds) for the two latency histograms: from a warm lease on loopback to a
#: long queue or a long task.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                   300, 1800, 3600)


class _Pool:
    """A prometheus-client collector that reads the coordinator at each scrape."""

    def __init__(self, coord, usage: UsageCache):
        self.coord, self.usage = coord, usage

    def describe(self):
        return []  # computed per scrape; no fixed list to check at registration

    def collect(self):
        coord = self.coord
        info = GaugeMetricFamily("gpumesh_info", "gpumesh coordinator", labels=["version"])
        info.add_metric([__version__], 1)
        yield info

        tasks = GaugeMetricFamily("gpumesh_tasks", "Tasks the store holds, by state",
                                  labels=["state"])
        counts = dict.fromkeys(("pending", "leased", "done", "failed", "cancelled"), 0)
        counts.update(coord.store.task_state_counts())
        for state, n in sorted(counts.items()):
            tasks.add_metric([state], n)
        yield tasks
        yield GaugeMetricFamily("gpumesh_queue_depth", "Pending tasks waiting for a slot",
                                value=len(coord.queue))
        yield GaugeMetricFamily("gpumesh_jobs_active", "Jobs with unfinished tasks",
                                value=sum(1 for j in coord.jobs.values() if j.state == "active"))

        workers = GaugeMetricFamily("gpumesh_workers", "Workers known, by state", labels=["state"])
        alive = [w for w in coord.workers.values() if w.alive]
        workers.add_metric(["alive"], len(alive))
        workers.add_metric(["dead"], len(coord.workers) - len(alive))
        yield workers

        slots = GaugeMetricFamily("gpumesh_slots", "Slots of alive workers, by kind and state "
                                  "(closed: its owner's rules take no new task there)",
                                  labels=["kind", "state"])
        tally = {(k, s): 0 for k in ("cpu", "gpu") for s in ("busy", "free", "closed")}
        for w in alive:
            busy = {lease.slot for tid in w.leases if (lease := coord.leases.get(tid)) is not None}
            listed = w.slot_list or [{"id": i, "kind": "cpu"} for i in range(w.slots)]
            closed = availability.closed_slots(w.info, listed)
            for s in listed:
                kind = "cpu" if s.get("kind", "cpu") == "cpu" else "gpu"
                state = "busy" if s.get("id") in busy else "closed" if s.get("id") in closed else "free"
                tally[(kind, state)] += 1
        for (kind, state), n in tally.items():
            slots.add_metric([kind, state], n)
        yield slots

        labels = ["worker", "host", "gpu", "name"]
        total = GaugeMetricFamily("gpumesh_gpu_memory_total_bytes", "GPU memory", labels=labels)
        free = GaugeMetricFamily("gpumesh_gpu_memory_free_bytes", "GPU memory free, as last reported",
                                 labels=labels)
        util = GaugeMetricFamily("gpumesh_gpu_utilization_ratio", "GPU utilisation (0..1)",
                                 labels=labels)
        temp = GaugeMetricFamily("gpumesh_gpu_temperature_celsius", "GPU temperature", labels=labels)
        for w in alive:
            for g in w.info.get("gpus") or ():
                lv = [w.id, str(w.info.get("hostname", "")), str(g.get("index", "")),
                      str(g.get("name", ""))]
                for fam, key, scale in ((total, "memory_total_mb", MiB), (free, "memory_free_mb", MiB),
                                        (util, "utilization_pct", 0.01), (temp, "temperature_c", 1)):
                    v = g.get(key)
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        fam.add_metric(lv, v * scale)
        yield from (total, free, util, temp)

        running = GaugeMetricFamily("gpumesh_person_running_tasks", "Running tasks per person",
                                    labels=["person"])
        for owner, n in sorted(coord.running_by_owner().items(), key=lambda kv: str(kv[0])):
            running.add_metric([owner or people.MAIN_PERSON], n)
        yield running
        pending = GaugeMetricFamily("gpumesh_person_pending_tasks", "Pending tasks per person",
                                    labels=["person"])
        for owner, n in sorted(coord.queue.pending_by_owner().items(), key=lambda kv: str(kv[0])):
            pending.add_metric([owner or people.MAIN_PERSON], n)
        yield pending
        used = GaugeMetricFamily("gpumesh_person_task_seconds",
                                 "Task seconds of attempts finished in the window, per person",
                                 labels=["person", "device", "window"])
        for window, by_owner in self.usage.windows().items():
            for owner, u in sorted(by_owner.items(), key=lambda kv: str(kv[0])):
                for device in ("cpu", "gpu"):
                    used.add_metric([owner or people.MAIN_PERSON, device, window], u[f"{device}_s"])
        yield used


class Metrics:
    """The registry of one coordinator's metrics, hooked into ``coord``."""

    def __init__(self, coord, usage: UsageCache):
        self.coord = coord
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Pool(coord, usage))
        self.lease_wait = Histogram("gpumesh_lease_wait_seconds",
                                    "From a job's submit to each of its tasks' first lease",
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.result_latency = Histogram("gpumesh_result_latency_seconds",
                                        "From a task's lease to its result being accepted",
                                        ["state"], buckets=LATENCY_BUCKETS, registry=self.registry)
        # Each state's child, looked up at its first result (``labels()`` takes a lock;
        # made earlier, a state no result had yet would show up in scrapes as zeros).
        self._latency_of: dict[str, Any] = {}
        coord.on_grants = self._granted
        coord.on_result = self._result

    def _granted(self, grants, now: float) -> None:
        for g in grants:
            job = self.coord.jobs.get(g.job_id)
            if g.attempt == 1 and job is not None:
                self.lease_wait.observe(max(0.0, now - job.submitted))

    def _result(self, lease, state: str, now: float) -> None:
        child = self._latency_of.get(state)
        if child is None:  # ("done" or "failed": two at most)
            child = self._latency_of[state] = self.result_latency.labels(state)
        child.observe(max(0.0, now - lease.granted))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def route(coord, auth, usage: UsageCache, metrics_token: str | None = None) -> Route:
    """The ``GET /metrics`` route. ``auth``: the app's :class:`~.auth.Authenticator`;
    ``metrics_token``: a token that may read this route and nothing else (only its
    SHA-256 is kept); ``usage``: the app's :class:`~.usage.UsageCache` (the dashboard's
    too)."""
    metrics = Metrics(coord, usage)
    scrape_digest = hashlib.sha256(metrics_token.encode("utf-8")).digest() if metrics_token else None

    async def endpoint(request: Request) -> Response:
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        presented = presented.strip()
        is_scraper = bool(scrape_digest and scheme.lower() == "bearer" and presented and
                          hmac.compare_digest(hashlib.sha256(presented.encode("latin-1", "replace"))
                                              .digest(), scrape_digest))
        if not is_scraper:
            try:
                who = await auth.identity(request.client.host if request.client else None,
                                          request.headers)
            except AuthRefused as e:
                headers = {"retry-after": str(int(e.retry_after) + 1)} if e.retry_after else None
                return JSONResponse({"error": e.code, "message": e.message}, status_code=e.status,
                                    headers=headers)
            if who.role not in people.READ:
                return JSONResponse({"error": "forbidden",
                                     "message": f"the {who.role} token cannot read metrics"},
                                    status_code=403)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return Route("/metrics", endpoint, methods=["GET"])
