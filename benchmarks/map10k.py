"""A 10,000-task ``.map`` on the native mesh while ``workers()`` is asked all along.

    .venv/bin/python benchmarks/map10k.py              # 10,000 tasks (~30-60 s here)
    .venv/bin/python benchmarks/map10k.py --tasks 2000

The performance issue's bar for a big map: every result right and in order, the
coordinator answering ``GPUMesh.workers()`` within 100 ms throughout, and the caller's
memory growing by less than 200 MiB. Same cluster as ``run.py`` (a fresh coordinator and
two one-slot workers on 127.0.0.1). Prints tasks/s, the ``workers()`` round trips
(p50/p99/max, one every 0.1 s from a second thread of the caller) and the caller's peak
RSS growth (``ru_maxrss``: the most resident memory the process ever had).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from systems import GPUMeshSystem  # noqa: E402


def square(i):
    return i * i


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpumesh-map10k-") as tmp:
        system = GPUMeshSystem(Path(tmp))
        try:
            system.start()
            system.map(square, range(100))  # warm: hosts forked, imports paid
            mesh = system.mesh
            probes: list[float] = []
            done = threading.Event()

            def probe() -> None:
                while not done.wait(0.1):
                    t0 = time.perf_counter()
                    mesh.workers()
                    probes.append(time.perf_counter() - t0)

            rss0 = peak_rss_mib()
            prober = threading.Thread(target=probe, daemon=True)
            prober.start()
            t0 = time.perf_counter()
            values = system.map(square, range(args.tasks))
            elapsed = time.perf_counter() - t0
            done.set()
            prober.join()
            grew = peak_rss_mib() - rss0
        finally:
            system.stop()
    right = values == [i * i for i in range(args.tasks)]
    probes.sort()
    fig = {"tasks": args.tasks, "right": right, "seconds": round(elapsed, 2),
           "tasks_per_s": round(args.tasks / elapsed, 1),
           "workers_p50_ms": round(1000 * probes[len(probes) // 2], 1),
           "workers_p99_ms": round(1000 * probes[min(len(probes) - 1, int(len(probes) * 0.99))], 1),
           "workers_max_ms": round(1000 * probes[-1], 1), "workers_calls": len(probes),
           "caller_peak_rss_growth_MiB": round(grew, 1)}
    print(f"{args.tasks} tasks, results right and in order: {right}")
    print(f"  {fig['seconds']} s, {fig['tasks_per_s']} tasks/s")
    print(f"  workers() during the map: p50 {fig['workers_p50_ms']} ms, p99 {fig['workers_p99_ms']} ms, "
          f"max {fig['workers_max_ms']} ms over {len(probes)} calls (bar: 100 ms)")
    print(f"  caller peak RSS grew by {fig['caller_peak_rss_growth_MiB']} MiB (bar: 200 MiB)")
    if args.json:
        args.json.write_text(json.dumps(fig, indent=2))
    return 0 if right else 1


if __name__ == "__main__":
    sys.exit(main())
