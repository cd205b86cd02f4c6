"""Per-person usage has one owner (coordinator/usage.py): the dashboard's People table and
``/metrics`` read the same cached answer, recomputed at most every ``USAGE_CACHE_S``."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gpumesh.coordinator import usage as usage_module
from gpumesh.coordinator.usage import USAGE_CACHE_S, UsageCache
from gpumesh.limits import DAY_S

from .routes_app import MAIN, api_fixture

api = api_fixture


class CountingStore:
    def __init__(self):
        self.asked: list[float] = []

    def usage(self, since: float) -> dict:
        self.asked.append(since)
        return {"alice": {"gpu_s": 7200.0, "cpu_s": 1800.0 * len(self.asked), "tasks": 1}}


def test_the_windows_are_recomputed_only_when_older_than_the_cache_age(monkeypatch):
    monkeypatch.setattr(usage_module, "task_time", lambda store, since: store.usage(since))
    store, now = CountingStore(), [1_000_000.0]
    cache = UsageCache(store, clock=lambda: now[0])
    first = cache.windows()
    assert store.asked == [1_000_000.0 - DAY_S, 1_000_000.0 - 7 * DAY_S]
    assert first["1d"]["alice"]["cpu_s"] == 1800.0 and first["7d"]["alice"]["cpu_s"] == 3600.0
    now[0] += USAGE_CACHE_S  # (exactly the age: still kept)
    assert cache.windows() is first and len(store.asked) == 2 and cache.computed == 1
    now[0] += 0.01
    assert cache.windows()["1d"]["alice"]["cpu_s"] == 5400.0 and cache.computed == 2
    now[0] -= 60  # a wall clock stepped back: not trusted to be fresh
    cache.windows()
    assert cache.computed == 3 and len(store.asked) == 6


def scrape(api) -> dict:
    r = api.call("GET", "/metrics")
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_the_dashboard_and_metrics_read_one_cached_usage(api, monkeypatch):
    asked = []

    def usage(since: float) -> dict:
        asked.append(since)
        return {"alice": {"gpu_s": 7200.0, "cpu_s": 900.0, "tasks": 2},
                None: {"gpu_s": 0.0, "cpu_s": 36.0, "tasks": 1}}
    monkeypatch.setattr(usage_module, "task_time", lambda store, since: usage(since))
    assert api.client.post("/ui/login", json={"token": MAIN}).status_code == 200
    people = {p["person"]: p for p in api.client.get("/ui/api/state").json()["people"]}
    assert len(asked) == 2  # the day's and the week's, once
    assert people["alice"]["gpu_hours_day"] == 2.0 and people["alice"]["cpu_hours_week"] == 0.25
    assert people["admin"]["cpu_hours_day"] == 0.01
    for _ in range(3):  # scrapes within the cache's age: the dashboard's answer, no query
        s = scrape(api)
        assert len(asked) == 2
    key = "gpumesh_person_task_seconds"
    assert s[(key, (("device", "gpu"), ("person", "alice"), ("window", "1d")))] == 7200.0
    assert s[(key, (("device", "cpu"), ("person", "alice"), ("window", "7d")))] == 900.0
    assert s[(key, (("device", "cpu"), ("person", "admin"), ("window", "1d")))] == 36.0
    api.client.get("/ui/api/state")
    assert len(asked) == 2
