#!/usr/bin/env python3
"""Where one no-op call's time goes: the median time between consecutive hops; or,
with ``--cpu-per-task N``, the CPU each process spends per task of an N-task map.

Starts the benchmark cluster of ``run.py`` (``gpumesh serve --no-self-worker`` and two
``gpumesh join --slots 1`` on 127.0.0.1) with tracing on (``GPUMESH_TRACE``, see
``gpumesh/tracing.py``), makes sequential calls of a no-op function, and prints, for
each step of a call (``gpumesh.tracing.CALL_HOPS``), the median and 90th percentile
of its duration.

    .venv/bin/python benchmarks/critical_path.py [--calls 300]
    .venv/bin/python benchmarks/critical_path.py --result-bytes 4194304 --calls 20
    .venv/bin/python benchmarks/critical_path.py --idle 3 --calls 20

``--idle S``: each timed call follows S seconds of idle (the after-idle row of
``run.py``), hop by hop.

``--slowest K``: also list the K slowest calls (by the caller's wall time) hop by hop,
each mark's time since the call began, so a rare long call shows which hop took it
(the sporadic 0.1-0.5 s delays of docs/performance.md's "Open"). Wall time outside the
traced hops (pickling before the submit, decoding after the answer) shows as the gap to
``bench.end``.

``--isolation job``: the calls are ``isolation="job"`` ones, each a new job's first task
(it takes a spare as a default call does; the slot lets its last job's process go).

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

``--cpu-per-task N`` (default N: 1000) measures CPU instead of time, on the same
cluster without tracing: after an untimed warm-up map it runs one N-task no-op ``.map``
with ``isolation="task"`` and one with ``isolation="job"`` (or only the ``--isolation``
given) and prints, per mode, the map's tasks/s and the milliseconds of CPU (user +
system, from ``psutil``) per task of each process: the caller (this process), the
coordinator, each worker agent on its own, and each agent's descendants (zygote,
function hosts, task processes) apart. Descendants that ended during the map are
counted too: their CPU is in their parent's ``children_user``/``children_system`` once
the parent has reaped them, and the figures sum both. ``--json PATH`` also writes the
figures (seconds of CPU, per mode) as JSON, for scripts that compare runs.

    .venv/bin/python benchmarks/critical_path.py --cpu-per-task 1000
    .venv/bin/python benchmarks/critical_path.py --cpu-per-task 2000 --isolation job
"""

from __future__ import annotations

import argparse
import json
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


def per_call(path: Path) -> list[list[tuple[str, int]]]:
    """Every mark of each timed call, in order: [(label, ns since its bench.start)],
    one list per ``bench.start`` ... ``bench.end`` of this script."""
    calls: list[list[tuple[str, int]]] = []
    start = 0
    for line in path.read_text().splitlines():
        ns, _pid, label = line.split(" ", 2)
        if label == "bench.start":
            calls.append([])
            start = int(ns)
        if calls:
            calls[-1].append((label, int(ns) - start))
    return calls


def print_slowest(calls: list[list[tuple[str, int]]], k: int) -> None:
    """The ``k`` longest calls, hop by hop: each mark with the ms since the previous."""
    ends = [(dict(c).get("bench.end", 0), i) for i, c in enumerate(calls)]
    for end, i in sorted(ends, reverse=True)[:k]:
        print(f"\ncall {i}: {end / 1e6:.2f} ms")
        prev = 0
        for label, ns in calls[i]:
            print(f"  {label:28s} +{(ns - prev) / 1e6:8.3f} ms")
            prev = ns


# ------------------------------------------------------------ CPU per task ----------
#: The isolation modes ``--cpu-per-task`` measures, in this order.
ISOLATIONS = ("task", "job")
#: Tasks of the untimed map that warms each mode up (function shipped, hosts forked).
CPU_WARMUP_TASKS = 50


def _cpu_s(times) -> float:
    return times.user + times.system


def tree_cpu(proc) -> tuple[float, float]:
    """``(own, descendants)``: CPU seconds (user + system) of ``proc`` itself, and of
    every process below it, alive or ended. An ended child's CPU is in its parent's
    ``children_*`` times once the parent reaped it; a child that has ended but is not
    reaped yet still reads as a process (a zombie keeps its times). A process that ends
    between the listing and the read is skipped: its time reaches its parent's
    ``children_*`` later, so a delta taken at quiet moments still counts it."""
    import psutil
    t = proc.cpu_times()
    below = t.children_user + t.children_system
    for child in proc.children(recursive=True):
        try:
            ct = child.cpu_times()
        except psutil.Error:
            continue
        below += _cpu_s(ct) + ct.children_user + ct.children_system
    return _cpu_s(t), below


def measure_map(system, isolation: str, n: int) -> dict:
    """Run an ``n``-task no-op map with ``isolation`` on ``system``'s cluster; returns
    ``{"tasks_per_s", "wall_s", "cpu_s": {process label: CPU seconds during the map}}``
    (labels: ``caller``, ``coordinator``, ``agent K``, ``agent K's descendants``)."""
    import psutil

    from gpumesh import accelerate
    fn = accelerate(system.mesh, isolation=isolation)(noop)
    warm = fn.map(range(CPU_WARMUP_TASKS))
    if warm != list(range(CPU_WARMUP_TASKS)):
        raise SystemExit(f"the warm-up map ({isolation=}) returned wrong values")
    system.check()
    procs: dict[str, psutil.Process] = {}
    agents = 0
    for p in system.procs:
        if p.args[0] == "serve":
            procs["coordinator"] = psutil.Process(p.p.pid)
        else:
            agents += 1
            procs[f"agent {agents}"] = psutil.Process(p.p.pid)
    me = psutil.Process()
    before = {k: tree_cpu(p) for k, p in procs.items()}
    me0 = _cpu_s(me.cpu_times())
    t0 = time.perf_counter()
    out = fn.map(range(n))
    wall = time.perf_counter() - t0
    me1 = _cpu_s(me.cpu_times())
    after = {k: tree_cpu(p) for k, p in procs.items()}
    if out != list(range(n)):
        raise SystemExit(f"the {n}-task map ({isolation=}) returned wrong values")
    cpu = {"caller": me1 - me0}
    for k in procs:
        cpu[k] = after[k][0] - before[k][0]
        if k != "coordinator":
            cpu[f"{k}'s descendants"] = after[k][1] - before[k][1]
        else:  # it starts none with --no-self-worker; whatever it did start counts as its own
            cpu[k] += after[k][1] - before[k][1]
    return {"tasks_per_s": n / wall, "wall_s": wall, "cpu_s": cpu}


def cpu_per_task(opts) -> int:
    """The ``--cpu-per-task`` mode: print (and with ``--json`` write) per-process CPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from systems import GPUMeshSystem  # (imports no gpumesh module)

    os.environ.pop("GPUMESH_TRACE", None)  # tracing's writes would be counted as CPU
    n = opts.cpu_per_task
    modes = ISOLATIONS if opts.isolation == "both" else (opts.isolation,)
    work = Path(tempfile.mkdtemp(prefix="gpumesh-cpu-per-task-"))
    system = GPUMeshSystem(work)
    runs = {}
    try:
        system.start()
        for mode in modes:
            runs[mode] = measure_map(system, mode, n)
        system.check()
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    labels = list(next(iter(runs.values()))["cpu_s"])
    print(f"CPU per task (ms, user + system) of a {n}-task no-op map, per process")
    width = max(len(x) for x in labels + ["total"])
    print(f"{'':{width}s} " + " ".join(f"{'isolation=' + m:>16s}" for m in modes))
    print(f"{'tasks/s':{width}s} " + " ".join(f"{runs[m]['tasks_per_s']:16.0f}" for m in modes))
    for label in labels:
        print(f"{label:{width}s} " + " ".join(f"{1e3 * runs[m]['cpu_s'][label] / n:16.3f}"
                                              for m in modes))
    print(f"{'total':{width}s} " + " ".join(f"{1e3 * sum(runs[m]['cpu_s'].values()) / n:16.3f}"
                                            for m in modes))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"n_tasks": n, "load": os.getloadavg(),
                                               "runs": runs}, indent=2) + "\n")
    return 0


# ------------------------------------------------------------ hop table -------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="timed calls (default 300)")
    ap.add_argument("--warmup", type=int, default=30, help="untimed calls first (default 30)")
    ap.add_argument("--idle", type=float, default=0.0, metavar="S",
                    help="sleep S seconds before each timed call: where the first call "
                    "after an idle spell spends its time (e.g. --idle 3 --calls 20)")
    ap.add_argument("--result-bytes", type=int, default=None, metavar="N",
                    help="time a call returning an N-byte float32 array instead of a no-op")
    ap.add_argument("--cpu-per-task", type=int, nargs="?", const=1000, default=None,
                    metavar="N", help="instead of the hop table: CPU per task of each "
                    "process on an N-task no-op map (N default 1000)")
    ap.add_argument("--isolation", choices=(*ISOLATIONS, "both"), default="both",
                    help="with --cpu-per-task: the isolation mode(s) to measure (default "
                    "both); for the hop table, the calls' mode (default: task)")
    ap.add_argument("--slowest", type=int, default=0, metavar="K",
                    help="also list the K slowest calls hop by hop")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="with --cpu-per-task: also write the figures to PATH as JSON")
    opts = ap.parse_args()
    if opts.calls < 1 or opts.warmup < 1:
        ap.error("--calls and --warmup must be at least 1")
    if opts.cpu_per_task is not None:
        if opts.cpu_per_task < 1:
            ap.error("--cpu-per-task must be at least 1")
        if opts.result_bytes is not None:
            ap.error("--cpu-per-task measures no-op tasks: it takes no --result-bytes")
        return cpu_per_task(opts)
    if opts.json is not None:
        ap.error("--json goes with --cpu-per-task")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from systems import GPUMeshSystem  # (imports no gpumesh module)

    work = Path(tempfile.mkdtemp(prefix="gpumesh-critical-path-"))
    trace = work / "trace.log"
    # Read at import by every gpumesh process: set before this one imports gpumesh.
    os.environ["GPUMESH_TRACE"] = str(trace)
    from gpumesh.tracing import CALL_HOPS as HOPS
    from gpumesh.tracing import mark

    system = GPUMeshSystem(work)
    if opts.isolation != "both":  # (each call of isolation="job" is a new job's first task)
        system.isolation = opts.isolation
    walls = []
    try:
        system.start()
        n = opts.result_bytes
        for i in range(opts.warmup):
            system.call(noop, i) if n is None else system.call(ones_bytes, n)
        trace.write_text("")
        for i in range(opts.calls):
            if opts.idle:
                time.sleep(opts.idle)
            mark("bench.start")
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
            mark("bench.end")
        timeline = per_call(trace) if opts.slowest else []
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
    if opts.slowest:
        print_slowest(timeline, opts.slowest)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # what it started is stopped by main's finally
        sys.exit("interrupted")
