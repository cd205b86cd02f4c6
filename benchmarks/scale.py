"""How far one native coordinator goes: N simulated workers + a stream of submitted tasks.

    .venv/bin/python benchmarks/scale.py                     # N = 10, 50, 200, 500; ~2 min
    .venv/bin/python benchmarks/scale.py --workers 10,50 --seconds 5 --json out.json

For each N a fresh ``gpumesh serve --no-self-worker`` is started, then:

* **N simulated workers** (one asyncio loop, ``httpx.AsyncClient``, in this process) speak
  the real protocol without running anything: ``POST /v1/workers`` (register), a pulse
  (``GET /v1/workers/{id}/session``, held open; ``--no-pulse`` drops it), a heartbeat every
  ``HEARTBEAT_INTERVAL_S`` listing the tasks they hold, the lease long-poll
  (``POST /v1/workers/{id}/lease``), and for each granted task an immediate
  ``POST /v1/tasks/{id}/result?next=1`` (the value is the task's own argument), taking
  the next task from that answer exactly like ``worker/agent.py``.
* **callers** (``--callers`` threads in a child process, the real ``GPUMesh`` client) submit
  ``.map`` jobs of ``--batch`` tasks back to back for ``--seconds``. Each task's argument
  is the monotonic time at submit, so a simulated worker knows how long the task took to
  reach it.

Figures, per N: the coordinator's CPU (percent of one core, from its process tree's CPU
time: idle with N workers polling, then under load), its RSS after the run, **lease
latency** p50/p99 (submit -> task in a worker's hands), the result round trip p50/p99
(``POST result?next=1``: the coordinator's per-task cost seen by a worker) and tasks/s
completed. Everything runs on one machine: the generator competes with the coordinator
for CPU, so these are lower bounds for a coordinator with a machine of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from gpumesh import wire
from gpumesh.limits import HEARTBEAT_INTERVAL_S

TOKEN = "scale-bench-token-0123456789abcdefghijklmnop"


def free_port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * len(values) + 0.5)) - 1))]


# ------------------------------------------------------------------ coordinator ----------
class Coordinator:
    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, GPUMESH_TOKEN=TOKEN, HOME=str(root), GPUMESH_CONFIG=str(root / "config.json"))
        env.pop("GPUMESH_URL", None)
        self.log = open(root / "coordinator.log", "wb")
        self.p = subprocess.Popen([sys.executable, "-m", "gpumesh", "serve", "--port", str(self.port),
                                   "--data-dir", str(root / "data"), "--no-self-worker"],
                                  env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        else:
            raise RuntimeError("coordinator did not start")
        self.proc = psutil.Process(self.p.pid)

    def procs(self) -> list[psutil.Process]:
        try:
            return [self.proc, *self.proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_seconds(self) -> float:
        total = 0.0
        for p in self.procs():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def rss_mib(self) -> float:
        total = 0
        for p in self.procs():
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(15)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.log.close()


# ------------------------------------------------------------------ simulated workers ----
class Stats:
    def __init__(self) -> None:
        self.lease_latency: list[float] = []
        self.result_rtt: list[float] = []
        self.done = 0
        self.errors: list[str] = []
        self.recording = False


async def sim_worker(i: int, client: httpx.AsyncClient, stats: Stats, stop: asyncio.Event,
                     registered: list, pulse: bool, lease_wait: float) -> None:
    body = {"slots": 1, "hostname": f"sim{i}", "cpu": "simulated", "cores": 1, "ram_mb": 1024,
            "device": "cpu", "device_name": "simulated", "gpus": [],
            "slot_list": [{"id": 0, "kind": "cpu"}]}
    r = await client.post("/v1/workers", json=body)
    r.raise_for_status()
    wid = r.json()["id"]
    held: set[str] = set()
    registered.append(wid)
    bg = []

    async def heartbeat() -> None:
        while not stop.is_set():
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            try:
                await client.post(f"/v1/workers/{wid}/heartbeat", json={"running": sorted(held)})
            except httpx.HTTPError as e:
                stats.errors.append(f"heartbeat: {e!r}")

    async def session() -> None:
        try:
            async with client.stream("GET", f"/v1/workers/{wid}/session", timeout=None) as resp:
                async for _ in resp.aiter_lines():
                    if stop.is_set():
                        return
        except (httpx.HTTPError, asyncio.CancelledError):
            pass

    bg.append(asyncio.create_task(heartbeat()))
    if pulse:
        bg.append(asyncio.create_task(session()))
    try:
        while not stop.is_set():
            try:
                r = await client.post(f"/v1/workers/{wid}/lease",
                                      json={"slots": 1, "free": [0], "wait": lease_wait},
                                      timeout=lease_wait + 30)
                r.raise_for_status()
            except httpx.HTTPError as e:
                if not stop.is_set():
                    stats.errors.append(f"lease: {e!r}")
                    await asyncio.sleep(0.5)
                continue
            frames = wire.unpack_frames(bytearray(r.content))
            tasks = json.loads(bytes(frames[0]))["tasks"]
            args = frames[1:]
            while tasks:
                task, arg = tasks[0], args[0]
                got = time.monotonic()
                (t_submit,), _ = wire.loads(arg)
                held.add(task["task_id"])
                chunks, size = wire.pack_frames([json.dumps({"status": "ok"}).encode(), wire.dumps(t_submit)])
                content = b"".join(bytes(c) for c in chunks)
                params = {"lease": task["lease_id"], "next": "1", "slot": str(task.get("slot", 0))}
                t0 = time.monotonic()
                try:
                    r = await client.post(f"/v1/tasks/{task['task_id']}/result", params=params,
                                          content=content, headers={"content-length": str(size)})
                    r.raise_for_status()
                except httpx.HTTPError as e:
                    stats.errors.append(f"result: {e!r}")
                    held.discard(task["task_id"])
                    break
                if stats.recording:
                    stats.lease_latency.append(got - t_submit)
                    stats.result_rtt.append(time.monotonic() - t0)
                    stats.done += 1
                held.discard(task["task_id"])
                frames = wire.unpack_frames(bytearray(r.content))
                tasks = json.loads(bytes(frames[0]))["tasks"]
                args = frames[1:]
    finally:
        for t in bg:
            t.cancel()


# ------------------------------------------------------------------ callers -------------
def callers_main(url: str, n_callers: int, batch: int, seconds: float, out) -> None:
    """In a child process: ``n_callers`` threads submitting ``.map`` jobs for ``seconds``."""
    from gpumesh import GPUMesh, accelerate
    from gpumesh.client import mesh as mesh_mod

    def refuse(fn, calls):
        raise RuntimeError("the load generator's job ran locally: the coordinator saw no worker")
    mesh_mod.run_locally = refuse
    m = GPUMesh(url, token=TOKEN, output=False)

    @accelerate(m)
    def echo(t):
        return t

    done = [0]
    errors: list[str] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def loop() -> None:
        while time.monotonic() < end:
            try:
                values = echo.map([time.monotonic()] * batch)
                assert len(values) == batch
                with lock:
                    done[0] += batch
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(repr(e))
                time.sleep(0.2)

    threads = [threading.Thread(target=loop) for _ in range(n_callers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.send({"done": done[0], "elapsed": time.monotonic() - t0, "errors": errors[:5]})


# ------------------------------------------------------------------ one N ---------------
async def run_n(n: int, args, root: Path) -> dict:
    coord = Coordinator(root / f"n{n}")
    stats, stop, registered = Stats(), asyncio.Event(), []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    row: dict = {"workers": n}
    async with httpx.AsyncClient(base_url=coord.url, limits=limits, timeout=60,
                                 headers={"authorization": f"Bearer {TOKEN}"}) as client:
        workers = [asyncio.create_task(sim_worker(i, client, stats, stop, registered, args.pulse,
                                                  args.lease_wait)) for i in range(n)]
        deadline = time.monotonic() + 60
        while len(registered) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        row["registered"] = len(registered)
        await asyncio.sleep(1.0)  # every lease long-poll open
        # idle: N workers heartbeating and long-polling, nothing submitted
        c0, t0 = coord.cpu_seconds(), time.monotonic()
        await asyncio.sleep(args.idle)
        row["cpu_idle_pct"] = round(100 * (coord.cpu_seconds() - c0) / (time.monotonic() - t0), 1)
        # load: callers in a child process, measured while they run
        batch = args.batch or max(25, n // 2)
        row["batch"], row["callers"] = batch, args.callers
        parent, child = mp.Pipe()
        p = mp.get_context("fork").Process(target=callers_main,
                                           args=(coord.url, args.callers, batch, args.seconds, child))
        stats.recording = True
        me = psutil.Process()
        g0 = sum(me.cpu_times()[:2])
        c0, t0 = coord.cpu_seconds(), time.monotonic()
        p.start()
        loop = asyncio.get_running_loop()
        res = await loop.run_in_executor(None, parent.recv)
        elapsed = time.monotonic() - t0
        row["cpu_load_pct"] = round(100 * (coord.cpu_seconds() - c0) / elapsed, 1)
        # the simulated workers' own CPU: near 100 % means the generator, not the coordinator, is the limit
        row["generator_cpu_pct"] = round(100 * (sum(me.cpu_times()[:2]) - g0) / elapsed, 1)
        stats.recording = False
        await loop.run_in_executor(None, p.join)
        row["rss_mib"] = round(coord.rss_mib(), 1)
        row["tasks_per_s"] = round(res["done"] / res["elapsed"], 1)
        row["tasks"] = res["done"]
        row["lease_p50_ms"] = round(1000 * (pct(stats.lease_latency, 0.5) or float("nan")), 1)
        row["lease_p99_ms"] = round(1000 * (pct(stats.lease_latency, 0.99) or float("nan")), 1)
        row["result_rtt_p50_ms"] = round(1000 * (pct(stats.result_rtt, 0.5) or float("nan")), 1)
        row["result_rtt_p99_ms"] = round(1000 * (pct(stats.result_rtt, 0.99) or float("nan")), 1)
        row["caller_errors"] = res["errors"]
        row["worker_errors"] = stats.errors[:5]
        row["n_worker_errors"] = len(stats.errors)
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    coord.stop()
    return row


COLUMNS = [("workers", "N"), ("cpu_idle_pct", "CPU idle %"), ("cpu_load_pct", "CPU load %"),
           ("rss_mib", "RSS MiB"), ("lease_p50_ms", "lease p50 ms"), ("lease_p99_ms", "lease p99 ms"),
           ("result_rtt_p50_ms", "result RTT p50 ms"), ("result_rtt_p99_ms", "result RTT p99 ms"),
           ("tasks_per_s", "tasks/s"), ("generator_cpu_pct", "generator CPU %")]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "n/a")) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--workers", default="10,50,200,500", help="comma-separated N values")
    ap.add_argument("--seconds", type=float, default=10.0, help="load duration per N")
    ap.add_argument("--idle", type=float, default=4.0, help="idle measurement per N (s)")
    ap.add_argument("--callers", type=int, default=4, help="caller threads submitting .map jobs")
    ap.add_argument("--batch", type=int, default=0, help="tasks per job (default max(25, N/2))")
    ap.add_argument("--lease-wait", type=float, default=20.0, help="lease long-poll wait (s)")
    ap.add_argument("--no-pulse", dest="pulse", action="store_false", help="workers hold no pulse")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    except (ImportError, ValueError, OSError):
        pass
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpumesh-scale-") as tmp:
        for n in [int(x) for x in args.workers.split(",") if x.strip()]:
            row = asyncio.run(run_n(n, args, Path(tmp)))
            rows.append(row)
            print(f"N={n}: " + json.dumps(row), file=sys.stderr, flush=True)
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; "
          f"{args.callers} callers, {args.seconds:g} s of load per N")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
