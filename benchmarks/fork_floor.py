"""The floor that per-task isolation puts under a task, on this machine.

Every gpumesh task runs in its own process, forked from a warm function host. This
script times the part of that which no implementation can avoid. A process with the
host's imports forks a child; the child writes one byte to a pipe and exits with
``os._exit``; the parent reads the byte and reaps the child. It prints wall time and
CPU (parent and child) per fork, for a host with only cloudpickle loaded and for one
with NumPy too. There is no HTTP, no pickling and no task.

Compare the CPU column with a peer's *whole* cost per task: on 2 cores, a peer that
runs 1,500 no-op tasks/s spends at most 2 / 1,500 s = 1.33 ms of CPU per task, counting
everything. If one fork costs about that much, no forking design can match it there.

    .venv/bin/python benchmarks/fork_floor.py [--forks N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CHILD = r"""
import gc, os, sys, time
for name in sys.argv[2:]:
    __import__(name)
gc.collect(); gc.freeze()           # as the function host does before forking
n = int(sys.argv[1])
t0, c0 = time.perf_counter(), os.times()
for _ in range(n):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"x")
        os._exit(0)
    os.close(w); os.read(r, 1); os.close(r); os.waitpid(pid, 0)
t1, c1 = time.perf_counter(), os.times()
parent = (c1.user + c1.system - c0.user - c0.system) / n
child = (c1.children_user + c1.children_system - c0.children_user - c0.children_system) / n
rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
print(f"{(t1 - t0) / n * 1e3:.3f} {parent * 1e3:.3f} {child * 1e3:.3f} {rss:.0f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forks", type=int, default=2000, help="forks per row (default 2000)")
    args = ap.parse_args()
    rows = [("bare interpreter", []), ("+ cloudpickle (every host)", ["cloudpickle"]),
            ("+ cloudpickle + numpy", ["cloudpickle", "numpy"])]
    print(f"{'host has loaded':<30} {'RSS MiB':>8} {'wall ms':>8} {'parent CPU ms':>14} "
          f"{'child CPU ms':>13} {'total CPU ms':>13}")
    for label, mods in rows:
        try:
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.forks), *mods],
                                 capture_output=True, text=True, check=True, timeout=600).stdout
        except subprocess.CalledProcessError as e:
            print(f"{label:<30} failed: {e.stderr.strip().splitlines()[-1:]}")
            continue
        wall, parent, child, rss = (float(x) for x in out.split())
        print(f"{label:<30} {rss:>8.0f} {wall:>8.3f} {parent:>14.3f} {child:>13.3f} "
              f"{parent + child:>13.3f}")
    print(f"\n{os.cpu_count()} CPUs; {args.forks} forks per row")


if __name__ == "__main__":
    main()
