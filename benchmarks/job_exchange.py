#!/usr/bin/env python3
"""The agent's exchange with a job's kept process alone (``isolation="job"``, fork
runtime): no coordinator, no HTTP. One slot thread runs N no-op tasks of one job through
``Executor.run`` one after another, as the agent's slot thread does with a queue of
grants, with the next grant offered as ``ahead`` (sent to the kept process behind the
running task) or not (``--no-ahead``: each task sent after the last one's reply was
read). Prints tasks/s and the CPU per task (ms, user + system) of this process and of
its descendants (zygote, function host, the kept process).

    .venv/bin/python benchmarks/job_exchange.py [--tasks 5000] [--no-ahead]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import psutil


def noop(x=None):
    return x


def cpu(proc: psutil.Process) -> tuple[float, float]:
    """(this process's CPU, its descendants' CPU) in seconds, reaped ones included."""
    t = proc.cpu_times()
    own = t.user + t.system
    kids = t.children_user + t.children_system
    for c in proc.children(recursive=True):
        try:
            ct = c.cpu_times()
            kids += ct.user + ct.system + ct.children_user + ct.children_system
        except psutil.NoSuchProcess:
            pass
    return own, kids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=5000)
    ap.add_argument("--no-ahead", action="store_true")
    opts = ap.parse_args()
    from gpumesh import wire
    from gpumesh.protocol import TaskGrant
    from gpumesh.worker.executor import Executor

    work = tempfile.mkdtemp(prefix="gpumesh-job-exchange-")
    blob = wire.dumps(noop)
    path = os.path.join(work, "fn")
    with open(path, "wb") as fh:
        for c in blob.chunks:
            fh.write(c)
    ex = Executor(spool=os.path.join(work, "spool"))
    body = b"".join(bytes(c) for c in wire.dumps(((1,), {})).chunks)
    grants = [(TaskGrant(f"t{i}", "-", "h", timeout=60, isolation="job", job_id="j"), body)
              for i in range(opts.tasks + 50)]
    queue = list(grants)
    ahead = None if opts.no_ahead else (lambda: queue[0] if queue else None)

    def run_one():
        g, b = queue.pop(0)
        ex.new_output(g.task_id)
        out = ex.run(g, path, b, slot=0, ahead=ahead)
        if out.status != "ok":
            raise SystemExit(f"task {g.task_id}: {out.error}")

    try:
        for _ in range(50):  # the host, its kept process, warm
            run_one()
        me = psutil.Process()
        c0, t0 = cpu(me), time.perf_counter()
        for _ in range(opts.tasks):
            run_one()
        c1, t1 = cpu(me), time.perf_counter()
    finally:
        ex.close()
    n = opts.tasks
    print(f"{'no ahead' if opts.no_ahead else 'ahead'}: {n / (t1 - t0):.0f} tasks/s; CPU per task "
          f"(ms): slot thread's process {1e3 * (c1[0] - c0[0]) / n:.3f}, its descendants "
          f"{1e3 * (c1[1] - c0[1]) / n:.3f}; load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
