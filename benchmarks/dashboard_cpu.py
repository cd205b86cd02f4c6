#!/usr/bin/env python3
"""The coordinator's CPU per dashboard poll and per ``/metrics`` scrape, after a big map.

    .venv/bin/python benchmarks/dashboard_cpu.py                 # one 5,000-task map
    .venv/bin/python benchmarks/dashboard_cpu.py --tasks 20000 --requests 20

Starts the benchmark cluster of ``run.py`` (a fresh coordinator and two one-slot workers
on 127.0.0.1, HOME in a temporary directory), runs one ``--tasks``-task no-op ``.map``
(its tasks print nothing, as in the dashboard issue's report), signs in to the
dashboard, and for each of the job page's two polls (``/ui/api/jobs/ID`` and its
``/output``) and for ``/metrics`` makes ``--requests`` requests one after the other,
reading the coordinator process's CPU time (user + system, ``/proc/PID/stat``) before
and after: the figure is that difference divided by the number of requests, with the
answer's size. ``/metrics`` is scraped with a cold and with a warm usage cache: the
first scrape after the cache's time is up pays the usage query, later ones within
``USAGE_CACHE_S`` do not (the cold figure: the mean of three such scrapes).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from systems import TOKEN, GPUMeshSystem  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def noop(i):
    return i


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def per_request(pid: int, client: httpx.Client, path: str, n: int) -> tuple[float, int]:
    size = 0
    before = cpu_s(pid)
    for _ in range(n):
        r = client.get(path)
        r.raise_for_status()
        size = len(r.content)
    return (cpu_s(pid) - before) / n, size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tasks", type=int, default=5000)
    ap.add_argument("--requests", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpumesh-dashcpu-") as tmp:
        system = GPUMeshSystem(Path(tmp))
        try:
            system.start()
            t0 = time.perf_counter()
            system.map(noop, range(args.tasks))
            print(f"{args.tasks}-task map: {time.perf_counter() - t0:.1f} s")
            (job,) = [j["id"] for j in system.mesh.jobs(limit=5) if j["n_tasks"] == args.tasks]
            pid = system.procs[0].p.pid  # gpumesh serve (uvicorn runs in that process)
            with httpx.Client(base_url=system.url, timeout=60) as ui, \
                    httpx.Client(base_url=system.url, timeout=60,
                                 headers={"authorization": f"Bearer {TOKEN}"}) as api:
                ui.post("/ui/login", json={"token": TOKEN}).raise_for_status()
                time.sleep(1)  # let the workers' heartbeats settle
                idle0 = cpu_s(pid)
                time.sleep(2)
                idle = (cpu_s(pid) - idle0) / 2
                print(f"coordinator idle: {1000 * idle:.1f} ms CPU per second (included below)")
                for path in (f"/ui/api/jobs/{job}", f"/ui/api/jobs/{job}/output"):
                    cpu, size = per_request(pid, ui, path, args.requests)
                    print(f"GET {path:<60} {1000 * cpu:8.1f} ms CPU/request  {size:>9} bytes")
                colds = []
                for _ in range(3):
                    time.sleep(5.5)  # past USAGE_CACHE_S: the next scrape recomputes usage
                    c, size = per_request(pid, api, "/metrics", 1)
                    colds.append(c)
                cold = sum(colds) / len(colds)
                warm, _ = per_request(pid, api, "/metrics", args.requests)
                print(f"GET /metrics (cold usage cache, mean of 3)              {1000 * cold:8.1f} ms CPU/request  {size:>9} bytes")
                print(f"GET /metrics (scraped again at once)                   {1000 * warm:8.1f} ms CPU/request")
        finally:
            system.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
