#!/usr/bin/env python3
"""Two checkouts of gpumesh, call by call in lockstep: before/after figures that hold up
on a shared machine.

Run one after the other, two benchmark runs on a busy 2-core machine differ by more than
most changes (the load moves by 2x within minutes). Here each checkout gets its own
cluster (``run.py``'s shape: a coordinator and two one-slot workers on 127.0.0.1, from a
child process whose ``PYTHONPATH`` is that checkout's ``src``), and the parent has them
make their calls in turns: round r, A calls then B (B then A in odd rounds), so both meet
the same load at nearly the same moment. It prints each side's p50, the median of the
per-round ratios B/A, in how many rounds B was faster, and each side's CPU per call by
process (``psutil``: the caller; the coordinator; the agents; the agents' descendants,
i.e. zygote, function hosts and task processes).

    .venv-bench/bin/python benchmarks/lockstep.py BEFORE/src AFTER/src [--calls 300]
    .venv-bench/bin/python benchmarks/lockstep.py BEFORE/src AFTER/src --idle 3 --calls 24
    .venv-bench/bin/python benchmarks/lockstep.py BEFORE/src AFTER/src --isolation job
    .venv-bench/bin/python benchmarks/lockstep.py BEFORE/src AFTER/src --result-bytes 262144
    .venv-bench/bin/python benchmarks/lockstep.py BEFORE/src AFTER/src --in-bytes 67108864 --calls 20

``--idle S`` sleeps S seconds before each round (the first call after an idle spell);
``--result-bytes N``: the function returns a float32 NumPy array of N bytes;
``--in-bytes N``: the function gets a float32 array of N bytes and returns it plus one
(``run.py``'s "in and out" row). Both
checkouts need the interpreter's packages (the ``bench`` extra); ``--json PATH`` writes
every call's time. The same checkout twice shows the harness's own spread (A/A).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP_CALLS = 30


def noop(x=None):
    return x


def ones_bytes(nbytes):
    import numpy as np
    return np.ones(nbytes // 4, np.float32)


def inc(a):
    return a + 1


def child(isolation: str, nbytes: int, in_bytes: int = 0) -> None:
    """One side: start a cluster, warm it, then make one call per ``go`` line on stdin,
    answering each with its time, and at the end its CPU per call. The answers go to the
    original stdout; everything else this process prints goes to stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")
    sys.path.insert(0, str(HERE))
    import psutil
    from critical_path import tree_cpu
    from systems import GPUMeshSystem
    work = Path(tempfile.mkdtemp(prefix="gpumesh-lockstep-"))
    system = GPUMeshSystem(work)
    try:
        system.start()
        import gpumesh
        from gpumesh import accelerate
        fn = accelerate(system.mesh, isolation=isolation)(
            inc if in_bytes else ones_bytes if nbytes else noop)
        if in_bytes:
            import numpy as np
            arg, nbytes = np.zeros(in_bytes // 4, np.float32), in_bytes
        else:
            arg = nbytes or 7
        for _ in range(WARMUP_CALLS):
            fn(arg)
        procs = {("coordinator" if p.args[0] == "serve" else f"agent {i}"): psutil.Process(p.p.pid)
                 for i, p in enumerate(system.procs)}
        me = psutil.Process()
        before = {k: tree_cpu(p) for k, p in procs.items()}
        mine = me.cpu_times()
        answer({"ready": str(Path(gpumesh.__file__).parents[1])})
        n = 0
        for line in sys.stdin:
            if line.strip() != "go":
                break
            t0 = time.perf_counter()
            out = fn(arg)
            ms = (time.perf_counter() - t0) * 1e3
            if (out.nbytes != nbytes) if nbytes else (out != arg):
                raise SystemExit("a call returned a wrong value")
            del out  # as run.py does: a result is not held while the next call runs
            n += 1
            answer({"ms": ms})
        after = {k: tree_cpu(p) for k, p in procs.items()}
        end = me.cpu_times()
        cpu = {"caller": end.user + end.system - mine.user - mine.system,
               "coordinator": sum(after["coordinator"]) - sum(before["coordinator"]),
               "agents": sum(after[k][0] - before[k][0] for k in after if k != "coordinator"),
               "task processes": sum(after[k][1] - before[k][1] for k in after if k != "coordinator")}
        answer({"cpu_ms_per_call": {k: 1e3 * v / max(n, 1) for k, v in cpu.items()}})
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="the first checkout's src directory (before)")
    ap.add_argument("b", help="the second checkout's src directory (after)")
    ap.add_argument("--calls", type=int, default=300, help="rounds (default 300)")
    ap.add_argument("--idle", type=float, default=0.0, metavar="S", help="sleep S s before each round")
    ap.add_argument("--isolation", choices=("task", "job"), default="task")
    ap.add_argument("--result-bytes", type=int, default=0, metavar="N")
    ap.add_argument("--in-bytes", type=int, default=0, metavar="N")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every call's time here")
    opts = ap.parse_args()
    sides = {}
    try:
        for name, src in (("A", opts.a), ("B", opts.b)):
            env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
            sides[name] = subprocess.Popen(
                [sys.executable, __file__, "--child", opts.isolation, str(opts.result_bytes),
                 str(opts.in_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for name, p in sides.items():
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"side {name} ended before it was ready")
            print(f"{name}: gpumesh from {json.loads(line)['ready']}")
        ms: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(opts.calls):
            if opts.idle:
                time.sleep(opts.idle)
            for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
                p = sides[name]
                p.stdin.write("go\n")
                p.stdin.flush()
                ms[name].append(json.loads(p.stdout.readline())["ms"])
        cpu = {}
        for name, p in sides.items():
            p.stdin.write("stop\n")
            p.stdin.flush()
            cpu[name] = json.loads(p.stdout.readline())["cpu_ms_per_call"]
    finally:
        for p in sides.values():
            if p.poll() is None:
                p.stdin.close()
                p.wait(60)
    a, b = ms["A"], ms["B"]
    print(f"{opts.calls} rounds, idle {opts.idle:g} s, isolation={opts.isolation}, result "
          f"{opts.result_bytes} bytes, in and out {opts.in_bytes} bytes, load average now {os.getloadavg()[0]:.1f}")
    print(f"p50: A {statistics.median(a):.2f} ms, B {statistics.median(b):.2f} ms; median of "
          f"the rounds' B/A {statistics.median(y / x for x, y in zip(a, b)):.3f}; B faster in "
          f"{sum(y < x for x, y in zip(a, b))} of {len(a)}")
    for name in ("A", "B"):
        print(f"CPU per call, {name}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in cpu[name].items()))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"ms": ms, "cpu_ms_per_call": cpu}) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    else:
        sys.exit(main())
