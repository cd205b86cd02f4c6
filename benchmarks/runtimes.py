#!/usr/bin/env python3
"""What a task costs on each task runtime (fork, spawn): one coordinator and one 2-slot
worker on loopback per runtime, the caller in this process.

    python benchmarks/runtimes.py                  # both runtimes
    python benchmarks/runtimes.py --runtimes spawn --json out.json

Figures per runtime: no-op call latency p50 (sequential single calls), a 1,000-task
no-op map (tasks/s), and the wall time of a 20-task map whose function imports a module
that takes 1 s to import (inside the function body, as ``import torch`` usually is),
also with ``isolation="job"``. Every process started here is killed by pid at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOKEN = "bench-runtimes-token-0123456789"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(runtime: str, root: Path, moddir: Path) -> tuple[list[subprocess.Popen], str]:
    port = _port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HOME=str(root), GPUMESH_TOKEN=TOKEN, GPUMESH_DISCOVERY="0",
               GPUMESH_CONFIG=str(root / "config.json"), PYTHONPATH=str(moddir))
    env.pop("GPUMESH_RUNTIME", None)
    log = open(root / "mesh.log", "ab")
    serve = subprocess.Popen([sys.executable, "-m", "gpumesh", "serve", "--port", str(port),
                              "--data-dir", str(root / "data"), "--no-self-worker"],
                             env=env, stdout=log, stderr=log, start_new_session=True)
    join = subprocess.Popen([sys.executable, "-m", "gpumesh", "join", url, "--slots", "2",
                             "--runtime", runtime], env=env, stdout=log, stderr=log,
                            start_new_session=True)
    return [serve, join], url


def _wait_worker(mesh) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if any(w.get("alive") for w in mesh.workers()):
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    raise RuntimeError("the worker did not join")


def noop(x=None):
    return x


def slow_import(i):
    import gm_bench_slow_import  # noqa: F401 - 1 s to import (written by this script)
    return i


def measure(runtime: str) -> dict:
    from gpumesh import GPUMesh, accelerate
    root = Path(tempfile.mkdtemp(prefix=f"gpumesh-bench-{runtime}-"))
    moddir = root / "mods"
    moddir.mkdir()
    (moddir / "gm_bench_slow_import.py").write_text("import time\ntime.sleep(1.0)\n")
    procs, url = _start(runtime, root, moddir)
    try:
        mesh = GPUMesh(url, token=TOKEN, output=False)
        _wait_worker(mesh)
        f = accelerate(mesh)(noop)
        for _ in range(20):  # warm: the function is loaded, spares are up
            f(1)
        lat = []
        for _ in range(200):
            t0 = time.perf_counter()
            f(1)
            lat.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.005)
        f.map(range(50))
        t0 = time.perf_counter()
        assert f.map(range(1000)) == list(range(1000))
        rate = 1000 / (time.perf_counter() - t0)
        out = {"runtime": runtime, "noop_p50_ms": statistics.median(lat),
               "noop_p99_ms": sorted(lat)[int(len(lat) * 0.99) - 1], "map1000_tasks_s": rate}
        for iso in ("task", "job"):
            g = accelerate(mesh, isolation=iso)(slow_import)
            t0 = time.perf_counter()
            assert g.map(range(20)) == list(range(20))
            out[f"slow_import_20_{iso}_s"] = time.perf_counter() - t0
            time.sleep(3)  # spares left from the last map settle before the next
        return out
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtimes", nargs="+", default=["fork", "spawn"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [measure(r) for r in a.runtimes]
    for r in rows:
        print(f"{r['runtime']:>5}: no-op p50 {r['noop_p50_ms']:.2f} ms, p99 {r['noop_p99_ms']:.2f} ms; "
              f"1,000-task map {r['map1000_tasks_s']:.0f} tasks/s; 20 tasks importing 1 s: "
              f"{r['slow_import_20_task_s']:.1f} s (isolation=job: {r['slow_import_20_job_s']:.1f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
