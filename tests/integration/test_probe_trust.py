"""A call the coordinator answered counts as a healthy probe: calls a little apart do
not each pay a ``GET /v1/health`` first (gpumesh.client.mesh, ``PROBE_CACHE_S``)."""

from __future__ import annotations

import time

from gpumesh import accelerate, protocol
from gpumesh.client import mesh as mesh_module


def double(x):
    return 2 * x


def test_answered_calls_keep_the_probe_fresh(make_mesh, monkeypatch):
    cache_s = 1.5
    monkeypatch.setattr(mesh_module, "PROBE_CACHE_S", cache_s)
    m = make_mesh(workers=1)
    client = m.client(output=False)
    seen: list[str] = []
    request = client.http.request

    def counting(method, path, *a, **kw):
        seen.append(path)
        return request(method, path, *a, **kw)

    monkeypatch.setattr(client.http, "request", counting)
    f = accelerate(client)(double)
    values = []
    start = time.monotonic()
    # Calls 0.3 s apart for three cache periods: with only probes refreshing the trust,
    # the probe would run again each 1.5 s (3 probes); with answers refreshing it, once.
    while time.monotonic() - start < 3 * cache_s:
        values.append(f(len(values)))
        time.sleep(0.3)
    assert values == [2 * i for i in range(len(values))]
    assert len(values) >= 5
    assert seen.count(protocol.HEALTH) == 1
    client.close()
