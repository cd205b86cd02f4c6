"""Lease latency against a deep queue: does a lease cost the same with 100,000 tasks pending?

    .venv/bin/python benchmarks/lease_queue.py                  # ~30 s on 2 cores
    .venv/bin/python benchmarks/lease_queue.py --pending 20000 --leases 200 --json out.json

Each scenario starts a fresh ``gpumesh serve --no-self-worker`` (the ``Coordinator``
helper of ``benchmarks/scale.py``), fills its queue through the real submit API
(``POST /v1/jobs``, frames: JSON meta + one argument payload per task, as the client
sends them), registers one simulated one-slot CPU worker over HTTP (``POST /v1/workers``)
and then, ``--leases`` times in a row, one worker cycle:

* ``POST /v1/workers/{id}/lease`` ``{"slots": 1, "free": [0], "wait": 5}`` must answer
  with exactly one task (timed: **lease**);
* ``POST /v1/tasks/{id}/result?lease=L&slot=0`` with the task's argument as its value
  (timed: **result**). No ``next=1`` here, so every grant goes through the lease route.

Scenarios:

* **empty**: nothing pending; before each cycle (untimed) one job of one task is
  submitted, and after it the job is released, so the queue holds one task when leased;
* **1 job**: ``--pending`` tasks in jobs of ``--job-size`` (default 10,000) submitted first;
* **many jobs**: ``--pending`` tasks spread over ``--jobs`` jobs (default 1,000 of 100);
* **restart**: the coordinator of *many jobs* stopped and started again on the same data
  directory (it rebuilds its queue from SQLite), the worker registers again, then the
  same cycles. The start-up time (process launch -> ``/v1/health`` answers) is reported
  next to an empty coordinator's.

A simulated worker heartbeats (outside the timed calls) so it stays alive. The first
``--warmup`` cycles of each scenario are not timed. Percentiles are nearest-rank.
Everything runs on one machine: the script competes with the coordinator for CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
try:
    import gpumesh  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`: use its src/, here and in `serve`
    src = str(HERE.parent / "src")
    sys.path.insert(0, src)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
sys.path.insert(0, str(HERE))

import httpx  # noqa: E402

from gpumesh import wire  # noqa: E402
from gpumesh.limits import HEARTBEAT_INTERVAL_S  # noqa: E402
from scale import TOKEN, Coordinator, pct  # noqa: E402

FN_BLOB = b"lease_queue benchmark: a function blob no worker ever runs"
FN_HASH = hashlib.sha256(FN_BLOB).hexdigest()


def check(r: httpx.Response) -> None:
    if r.status_code >= 400:
        raise RuntimeError(f"{r.request.method} {r.request.url.path}: HTTP {r.status_code} {r.text[:300]}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Worker:
    """One simulated one-slot CPU worker and a caller, over one keep-alive connection each."""

    def __init__(self, url: str):
        headers = {"authorization": f"Bearer {TOKEN}"}
        self.caller = httpx.Client(base_url=url, headers=headers, timeout=600)
        self.http = httpx.Client(base_url=url, headers=headers, timeout=60)
        check(self.caller.put(f"/v1/blobs/{FN_HASH}", content=FN_BLOB))
        self.wid: str | None = None
        self.last_beat = 0.0
        self.n_jobs = 0
        self.run_id = os.urandom(4).hex()

    def close(self) -> None:
        self.caller.close()
        self.http.close()

    def register(self) -> None:
        body = {"slots": 1, "hostname": "lease-bench", "cpu": "simulated", "cores": 1,
                "ram_mb": 1024, "device": "cpu", "device_name": "simulated", "gpus": [],
                "slot_list": [{"id": 0, "kind": "cpu"}]}
        r = self.http.post("/v1/workers", json=body)
        check(r)
        self.wid = r.json()["id"]
        self.last_beat = time.monotonic()

    def beat(self) -> None:
        if self.wid and time.monotonic() - self.last_beat > HEARTBEAT_INTERVAL_S:
            check(self.http.post(f"/v1/workers/{self.wid}/heartbeat", json={"running": []}))
            self.last_beat = time.monotonic()

    def submit(self, values: list[int]) -> str:
        """One job with a task per value (argument ``(value,)``), as GPUMesh submits it."""
        self.n_jobs += 1
        job_id = f"{self.n_jobs:08x}{self.run_id}"
        meta = {"job_id": job_id, "kind": "function", "fn": FN_HASH, "fn_inline": False,
                "n_tasks": len(values), "timeout": None, "name": "lease-bench"}
        chunks, size = wire.pack_frames([json.dumps(meta).encode()]
                                        + [wire.dumps(((v,), {})) for v in values])
        r = self.caller.post("/v1/jobs", content=wire.iter_chunks(chunks),
                             headers={"content-type": "application/x-gpumesh-frames",
                                      "content-length": str(size)})
        check(r)
        assert r.json()["n_tasks"] == len(values), r.text
        return job_id

    def cycle(self) -> tuple[float, float, dict]:
        """Lease one task, post its result; returns (lease s, result s, the task)."""
        t0 = time.perf_counter()
        r = self.http.post(f"/v1/workers/{self.wid}/lease",
                           json={"slots": 1, "free": [0], "wait": 5})
        t1 = time.perf_counter()
        check(r)
        frames = wire.unpack_frames(bytearray(r.content))
        tasks = json.loads(bytes(frames[0]))["tasks"]
        if len(tasks) != 1:
            raise RuntimeError(f"lease answered {len(tasks)} tasks, expected 1")
        task = tasks[0]
        (value,), _ = wire.loads(frames[1])
        task["value"] = value
        chunks, size = wire.pack_frames([json.dumps({"status": "ok"}).encode(), wire.dumps(value)])
        t2 = time.perf_counter()
        r = self.http.post(f"/v1/tasks/{task['task_id']}/result",
                           params={"lease": task["lease_id"], "slot": "0"},
                           content=b"".join(bytes(c) for c in chunks),
                           headers={"content-length": str(size)})
        t3 = time.perf_counter()
        check(r)
        return t1 - t0, t3 - t2, task


def fill(w: Worker, pending: int, jobs: int) -> float:
    """Submit ``pending`` tasks as ``jobs`` equal jobs; returns seconds taken."""
    per = pending // jobs
    t0 = time.monotonic()
    for j in range(jobs):
        w.submit(list(range(j * per, (j + 1) * per)))
        w.beat()
    return time.monotonic() - t0


def measure(w: Worker, n: int, warmup: int, per_cycle_job: bool) -> dict:
    lease, result, seen = [], [], []
    for i in range(warmup + n):
        w.beat()
        job_id = w.submit([i]) if per_cycle_job else None
        dl, dr, task = w.cycle()
        if job_id is not None:
            assert task["job_id"] == job_id and task["value"] == i, task
            check(w.caller.post(f"/v1/jobs/{job_id}/release"))
        if i >= warmup:
            lease.append(dl)
            result.append(dr)
            seen.append((task["job_id"], task["index"]))
    return {"lease": lease, "result": result, "seen": seen}


def check_order(seen: list[tuple[str, int]], jobs: int) -> None:
    """Jobs take turns (any ``jobs`` consecutive leases come from different jobs, as long
    as all still have tasks) and each job's tasks leave in index order."""
    for k in range(0, len(seen) - jobs + 1):
        window = [j for j, _ in seen[k:k + jobs]]
        if len(set(window)) != len(window):
            raise AssertionError(f"jobs did not take turns around lease {k}")
    last: dict[str, int] = {}
    for j, i in seen:
        if i <= last.get(j, -1):
            raise AssertionError(f"job {j}: task {i} left after task {last[j]}")
        last[j] = i


def summary(name: str, m: dict, extra: dict) -> dict:
    row = {"scenario": name, **extra}
    for key in ("lease", "result"):
        row[f"{key}_p50_ms"] = 1000 * pct(m[key], 0.5)
        row[f"{key}_p99_ms"] = 1000 * pct(m[key], 0.99)
    cycle = [a + b for a, b in zip(m["lease"], m["result"])]
    row["cycle_p50_ms"] = 1000 * pct(cycle, 0.5)
    row["cycle_p99_ms"] = 1000 * pct(cycle, 0.99)
    return row


def start(root: Path) -> tuple[Coordinator, float]:
    t0 = time.monotonic()
    c = Coordinator(root)
    return c, time.monotonic() - t0


def run(args, tmp: Path) -> list[dict]:
    rows = []
    # (a) empty queue
    coord, up = start(tmp / "empty")
    try:
        w = Worker(coord.url)
        w.register()
        m = measure(w, args.leases, args.warmup, per_cycle_job=True)
        rows.append(summary("empty", m, {"pending": 0, "jobs": 0, "startup_s": up}))
        w.close()
    finally:
        coord.stop()
    log(f"empty: {json.dumps(rows[-1])}")

    # (b) pending tasks in few big jobs
    coord, up = start(tmp / "one")
    try:
        w = Worker(coord.url)
        jobs = max(1, args.pending // args.job_size)
        fill_s = fill(w, args.pending, jobs)
        w.register()
        m = measure(w, args.leases, args.warmup, per_cycle_job=False)
        check_order(m["seen"], jobs)
        rows.append(summary(f"{args.pending:,} pending, {jobs:,} job(s)", m,
                            {"pending": args.pending, "jobs": jobs, "startup_s": up, "submit_s": fill_s}))
        w.close()
    finally:
        coord.stop()
    log(f"one: {json.dumps(rows[-1])}")

    # (c) pending tasks over many jobs, then (d) the same after a restart
    root = tmp / "many"
    coord, up = start(root)
    try:
        w = Worker(coord.url)
        fill_s = fill(w, args.pending, args.jobs)
        w.register()
        m = measure(w, args.leases, args.warmup, per_cycle_job=False)
        check_order(m["seen"], args.jobs)
        rows.append(summary(f"{args.pending:,} pending, {args.jobs:,} jobs", m,
                            {"pending": args.pending, "jobs": args.jobs, "startup_s": up, "submit_s": fill_s}))
        w.close()
    finally:
        coord.stop()
    log(f"many: {json.dumps(rows[-1])}")

    coord, up = start(root)
    try:
        w = Worker(coord.url)
        w.n_jobs = 10**5  # fresh job ids, should it submit
        w.register()
        m = measure(w, args.leases, args.warmup, per_cycle_job=False)
        left = args.pending - (args.warmup + args.leases)
        rows.append(summary(f"same, after a restart ({left:,} pending)", m,
                            {"pending": left, "jobs": args.jobs, "startup_s": up}))
        w.close()
    finally:
        coord.stop()
    log(f"restart: {json.dumps(rows[-1])}")
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]
    cols = ["scenario", "lease p50 ms", "lease p99 ms", "result p50 ms", "result p99 ms",
            "p50 / empty", "p99 / empty", "start-up s"]
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in rows:
        cells = [r["scenario"], f"{r['lease_p50_ms']:.2f}", f"{r['lease_p99_ms']:.2f}",
                 f"{r['result_p50_ms']:.2f}", f"{r['result_p99_ms']:.2f}",
                 f"{r['lease_p50_ms'] / base['lease_p50_ms']:.2f}",
                 f"{r['lease_p99_ms'] / base['lease_p99_ms']:.2f}", f"{r['startup_s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--pending", type=int, default=100_000, help="tasks pending in the deep scenarios")
    ap.add_argument("--job-size", type=int, default=10_000, help="tasks per job in the '1 job' scenario's fill")
    ap.add_argument("--jobs", type=int, default=1_000, help="jobs in the 'many jobs' scenario")
    ap.add_argument("--leases", type=int, default=500, help="timed lease cycles per scenario")
    ap.add_argument("--warmup", type=int, default=20, help="untimed cycles first")
    ap.add_argument("--json", type=Path, help="also write the rows (with raw figures) here")
    args = ap.parse_args(argv)
    if args.pending < 2 * (args.warmup + args.leases) or args.pending % args.jobs:
        ap.error("--pending must be a multiple of --jobs and cover two rounds of --warmup + --leases")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpumesh-lease-queue-") as tmp:
        rows = run(args, Path(tmp))
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; "
          f"{args.leases} timed lease cycles per scenario; {time.monotonic() - t0:.0f} s in all")
    print(table(rows))
    for r in rows:
        if "submit_s" in r:
            print(f"submit of {r['pending']:,} tasks in {r['jobs']:,} job(s): {r['submit_s']:.1f} s "
                  f"({r['pending'] / r['submit_s']:,.0f} tasks/s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
