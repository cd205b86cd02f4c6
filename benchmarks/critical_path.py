#!/usr/bin/env python3
"""Where one no-op call's time goes: the median time between consecutive hops.

Starts the benchmark cluster of ``run.py`` (``gpumesh serve --no-self-worker`` and two
``gpumesh join --slots 1`` on 127.0.0.1) with tracing on (``GPUMESH_TRACE``, see
``gpumesh/tracing.py``), makes sequential calls of a no-op function, and prints, for
each step of a call (``gpumesh.tracing.CALL_HOPS``), the median and 90th percentile
of its duration.

    .venv/bin/python benchmarks/critical_path.py [--calls 300]
    .venv/bin/python benchmarks/critical_path.py --result-bytes 4194304 --calls 20

``--result-bytes N``: the function returns a float32 NumPy array of N bytes instead of
its argument, and the table lists every mark the calls share, in the order they came
(a big result takes other hops: a handoff file, a results page), so the time of a
result size can be followed hop by hop.

All processes run on this machine, so their CLOCK_MONOTONIC timestamps line up.
Tracing adds one small write per hop (a few microseconds each). The script sets
``GPUMESH_TRACE`` for the cluster it starts, in a temporary directory it removes at the
end; it needs the ``bench`` extra (``.venv/bin/pip install -e '.[bench]'``). Only
sequential single calls line up hop by hop: in a ``.map``, one lease answer or one
result answer carries tasks for several hops at once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def noop(x=None):
    return x


def ones_bytes(nbytes):
    import numpy as np
    return np.ones(nbytes // 4, np.float32)


def shared_hops(calls: list[dict[str, int]]) -> tuple[str, ...]:
    """The labels every call has, ordered by their median time from the call's start."""
    common = set.intersection(*(set(c) for c in calls)) if calls else set()
    return tuple(sorted(common, key=lambda h: statistics.median(c[h] - c["caller.submit"]
                                                                for c in calls)))


def parse(path: Path, hops) -> list[dict[str, int]]:
    """The marks of each complete call: {label: ns}, first occurrence after its
    caller.submit."""
    calls: list[dict[str, int]] = []
    for line in path.read_text().splitlines():
        ns, _pid, label = line.split(" ", 2)
        if label == "caller.submit":
            calls.append({})
        if calls and label not in calls[-1]:
            calls[-1][label] = int(ns)
    return [c for c in calls if all(h in c for h in hops)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="timed calls (default 300)")
    ap.add_argument("--warmup", type=int, default=30, help="untimed calls first (default 30)")
    ap.add_argument("--result-bytes", type=int, default=None, metavar="N",
                    help="time a call returning an N-byte float32 array instead of a no-op")
    opts = ap.parse_args()
    if opts.calls < 1 or opts.warmup < 1:
        ap.error("--calls and --warmup must be at least 1")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from systems import GPUMeshSystem  # (imports no gpumesh module)

    work = Path(tempfile.mkdtemp(prefix="gpumesh-critical-path-"))
    trace = work / "trace.log"
    # Read at import by every gpumesh process: set before this one imports gpumesh.
    os.environ["GPUMESH_TRACE"] = str(trace)
    from gpumesh.tracing import CALL_HOPS as HOPS

    system = GPUMeshSystem(work)
    walls = []
    try:
        system.start()
        n = opts.result_bytes
        for i in range(opts.warmup):
            system.call(noop, i) if n is None else system.call(ones_bytes, n)
        trace.write_text("")
        for i in range(opts.calls):
            t0 = time.perf_counter()
            if n is None:
                ok = system.call(noop, i) == i
            else:
                r = system.call(ones_bytes, n)
                ok = r.nbytes == n and float(r[-1]) == 1.0
                del r
            if not ok:
                raise SystemExit(f"call {i} returned a wrong value")
            walls.append(time.perf_counter() - t0)
        calls = parse(trace, ("caller.submit",) if n is not None else HOPS)
        if n is not None:
            HOPS = shared_hops(calls)
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    if not calls:
        raise SystemExit("no call was traced completely")
    print(f"{len(calls)} of {opts.calls} calls traced completely; wall p50 "
          f"{statistics.median(walls) * 1e3:.2f} ms")
    print(f"{'step':52s} {'p50 ms':>7s} {'p90 ms':>7s}")
    for a, b in zip(HOPS, HOPS[1:]):
        d = sorted((c[b] - c[a]) / 1e6 for c in calls)
        print(f"{a + ' -> ' + b:52s} {statistics.median(d):7.3f} {d[int(len(d) * 0.9)]:7.3f}")
    total = sorted((c[HOPS[-1]] - c[HOPS[0]]) / 1e6 for c in calls)
    print(f"{'total (caller.submit -> caller.answered)':52s} {statistics.median(total):7.3f} "
          f"{total[int(len(total) * 0.9)]:7.3f}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # what it started is stopped by main's finally
        sys.exit("interrupted")
