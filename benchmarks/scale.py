"""How far one native coordinator goes: N simulated workers + a stream of submitted tasks.

    .venv/bin/python benchmarks/scale.py                     # N = 10, 50, 200, 500; ~3 min
    .venv/bin/python benchmarks/scale.py --workers 10,50 --seconds 5 --json out.json

For each N a fresh ``gpumesh serve --no-self-worker`` is started, then:

* **N simulated workers** speak the real protocol without running anything:
  ``POST /v1/workers`` (register), a pulse (``GET /v1/workers/{id}/session``, held open;
  ``--no-pulse`` drops it), a heartbeat every ``HEARTBEAT_INTERVAL_S`` listing the tasks
  they hold, the lease long-poll (``POST /v1/workers/{id}/lease``), and for each granted
  task an immediate ``POST /v1/tasks/{id}/result?next=1`` (the value is the task's own
  argument), taking the next task from that answer exactly like ``worker/agent.py``.
  They are spread over ``--procs`` processes, each one asyncio loop speaking HTTP/1.1 over
  raw keep-alive sockets (three per worker, like the real agent: lease, heartbeat,
  pulse). A general-purpose HTTP client costs far more CPU per request than the
  coordinator spends answering it, and would measure itself instead.
* **callers** (``--callers`` threads in a child process, the real ``GPUMesh`` client)
  submit ``.map`` jobs of ``--batch`` tasks for ``--seconds``: back to back (saturation:
  what one coordinator core can do), or paced to ``--rate`` tasks/s in all (latency
  at a given load). Each task's
  argument is the monotonic time at submit (CLOCK_MONOTONIC is one clock for every
  process on the machine), so a simulated worker knows how long the task took to reach it.
* **a probe** asks ``GET /v1/workers`` every 0.25 s, as ``gpumesh workers`` would.

With ``--pin`` (the default when the machine has 2 or more CPUs) the coordinator is
pinned to CPU 0 and everything else to the other CPUs, so every figure is that of a
coordinator with exactly one core of its own; the generator's CPU is printed next to it so
a reader can tell which side was the limit.

Figures, per N: the coordinator's CPU (percent of one core: idle with N workers polling
and heartbeating, then under load), its RSS after the run, **lease latency** p50/p99
(submit -> task in a worker's hands, including the wait in the queue), the result round
trip p50/p99 (``POST result?next=1``: the coordinator's per-task work seen by a worker),
heartbeat round trip p99, ``GET /v1/workers`` p99, tasks/s completed, and the workers
still registered at the end (a worker the coordinator declared dead is re-registered
and counted as lost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

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
    """Nearest-rank percentile ``q`` (0..1) of ``values``; None when empty."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * len(values) + 0.5)) - 1))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 1)


# ------------------------------------------------------------------ raw HTTP/1.1 --------
class Conn:
    """One keep-alive HTTP/1.1 connection, requests one at a time. Just enough HTTP for
    this benchmark: Content-Length and chunked bodies, no redirects, no TLS."""

    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port,
                                                                 limit=1 << 20)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    def _head(self, method: str, path: str, length: int, ctype: str) -> bytes:
        return (f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                f"authorization: Bearer {TOKEN}\r\ncontent-type: {ctype}\r\n"
                f"content-length: {length}\r\n\r\n").encode()

    async def request(self, method: str, path: str, body: bytes = b"",
                      ctype: str = "application/json") -> tuple[int, bytes]:
        """Send one request, return (status, body). Raises OSError/IncompleteReadError
        when the connection breaks (the next call reconnects)."""
        if self.writer is None:
            await self._open()
        try:
            self.writer.write(self._head(method, path, len(body), ctype) + body)
            status, headers = await self._read_head()
            if headers.get("transfer-encoding") == "chunked":
                data = await self._read_chunked()
            else:
                data = await self.reader.readexactly(int(headers.get("content-length", "0")))
            if headers.get("connection") == "close":
                self.close()
            return status, data
        except BaseException:
            self.close()
            raise

    async def stream(self, path: str) -> None:
        """GET ``path`` and read its body until the server ends it (the pulse)."""
        if self.writer is None:
            await self._open()
        try:
            self.writer.write(self._head("GET", path, 0, "text/plain"))
            await self._read_head()
            while await self.reader.read(65536):
                pass
        finally:
            self.close()

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip().lower()
        return status, headers

    async def _read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return bytes(out)
            out += await self.reader.readexactly(size)
            await self.reader.readexactly(2)


# ------------------------------------------------------------------ simulated workers ----
class Stats:
    def __init__(self) -> None:
        self.lease_latency: list[float] = []
        self.result_rtt: list[float] = []
        self.heartbeat_rtt: list[float] = []
        self.done = 0
        self.lost = 0          # times the coordinator no longer knew one of our workers
        self.errors: list[str] = []
        self.recording = False

    def error(self, what: str) -> None:
        if len(self.errors) < 1000:
            self.errors.append(what)


REGISTER = {"slots": 1, "cpu": "simulated", "cores": 1, "ram_mb": 1024, "device": "cpu",
            "device_name": "simulated", "gpus": [], "slot_list": [{"id": 0, "kind": "cpu"}]}
RESULT_HEAD = json.dumps({"status": "ok"}).encode()
FRAMES = "application/x-gpumesh-frames"


class SimWorker:
    """One simulated one-slot worker: register, pulse, heartbeat, lease, post results."""

    def __init__(self, i: int, port: int, stats: Stats, args):
        self.name, self.port, self.stats, self.args = f"sim{i}", port, stats, args
        self.lease_conn, self.hb_conn = Conn(port), Conn(port)
        self.wid: str | None = None
        self.held: set[str] = set()

    async def register(self) -> None:
        body = json.dumps(dict(REGISTER, hostname=self.name)).encode()
        status, data = await self.lease_conn.request("POST", "/v1/workers", body)
        if status != 200:
            raise RuntimeError(f"register: HTTP {status} {data[:200]!r}")
        self.wid = json.loads(data)["id"]

    async def heartbeat_loop(self) -> None:
        await asyncio.sleep(random.uniform(0, HEARTBEAT_INTERVAL_S))  # spread the beats out
        while True:
            t0 = time.monotonic()
            try:
                status, data = await self.hb_conn.request(
                    "POST", f"/v1/workers/{self.wid}/heartbeat",
                    json.dumps({"running": sorted(self.held)}).encode())
                if self.stats.recording:
                    self.stats.heartbeat_rtt.append(time.monotonic() - t0)
                if status != 200:
                    self.stats.error(f"heartbeat: HTTP {status} {data[:120]!r}")
                    if status in (404, 410):
                        await self.rejoin()
            except (OSError, asyncio.IncompleteReadError) as e:
                self.stats.error(f"heartbeat: {e!r}")
            await asyncio.sleep(max(0.0, HEARTBEAT_INTERVAL_S - (time.monotonic() - t0)))

    async def rejoin(self) -> None:
        self.stats.lost += 1
        self.held.clear()
        await self.register()

    async def pulse_loop(self) -> None:
        while True:
            try:
                await Conn(self.port).stream(f"/v1/workers/{self.wid}/session")
            except (OSError, asyncio.IncompleteReadError) as e:
                self.stats.error(f"pulse: {e!r}")
            await asyncio.sleep(0.5)

    async def lease_loop(self) -> None:
        lease = json.dumps({"slots": 1, "free": [0], "wait": self.args.lease_wait}).encode()
        while True:
            try:
                status, data = await self.lease_conn.request(
                    "POST", f"/v1/workers/{self.wid}/lease", lease)
            except (OSError, asyncio.IncompleteReadError) as e:
                self.stats.error(f"lease: {e!r}")
                await asyncio.sleep(0.5)
                continue
            if status != 200:
                self.stats.error(f"lease: HTTP {status} {data[:120]!r}")
                if status in (404, 410):
                    await self.rejoin()
                else:
                    await asyncio.sleep(0.5)
                continue
            await self.run_tasks(data)

    async def run_tasks(self, data: bytes) -> None:
        """Answer every task of a lease answer, following each result's ``next`` task."""
        while True:
            frames = wire.unpack_frames(data)
            tasks = json.loads(bytes(frames[0]))["tasks"]
            if not tasks:
                return
            task, arg = tasks[0], frames[1]
            got = time.monotonic()
            (t_submit,), _ = wire.loads(arg)
            tid = task["task_id"]
            self.held.add(tid)
            chunks, _ = wire.pack_frames([RESULT_HEAD, wire.dumps(t_submit)])
            body = b"".join(bytes(c) for c in chunks)
            path = f"/v1/tasks/{tid}/result?lease={task['lease_id']}&next=1&slot={task.get('slot', 0)}"
            t0 = time.monotonic()
            try:
                status, data = await self.lease_conn.request("POST", path, body, FRAMES)
            except (OSError, asyncio.IncompleteReadError) as e:
                self.stats.error(f"result: {e!r}")
                self.held.discard(tid)
                return
            self.held.discard(tid)
            if status != 200:
                self.stats.error(f"result: HTTP {status} {data[:120]!r}")
                return
            if self.stats.recording:
                self.stats.lease_latency.append(got - t_submit)
                self.stats.result_rtt.append(time.monotonic() - t0)
                self.stats.done += 1


def generator_main(first: int, count: int, port: int, args, conn) -> None:
    """One generator process: ``count`` simulated workers on one asyncio loop. Talks to the
    parent over ``conn``: sends ("registered", n), then obeys "record" / "stop", and
    answers "stop" with its stats."""
    asyncio.run(_generator(first, count, port, args, conn))


async def _generator(first: int, count: int, port: int, args, conn) -> None:
    stats = Stats()
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: commands.put_nowait(conn.recv()))
    sims = [SimWorker(first + i, port, stats, args) for i in range(count)]
    for k in range(0, count, 50):  # register in waves: a burst of N connects is not the test
        await asyncio.gather(*(s.register() for s in sims[k:k + 50]))
    background = []
    for s in sims:
        background.append(asyncio.create_task(s.heartbeat_loop()))
        if args.pulse:
            background.append(asyncio.create_task(s.pulse_loop()))
        background.append(asyncio.create_task(s.lease_loop()))
    conn.send(("registered", count))
    me = psutil.Process()
    while True:
        cmd = await commands.get()
        if cmd == "record":
            stats.recording = True
            cpu0 = sum(me.cpu_times()[:2])
        elif cmd == "stop":
            stats.recording = False
            cpu = sum(me.cpu_times()[:2]) - cpu0
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            conn.send({"lease_latency": stats.lease_latency, "result_rtt": stats.result_rtt,
                       "heartbeat_rtt": stats.heartbeat_rtt, "done": stats.done,
                       "lost": stats.lost, "errors": stats.errors[:5],
                       "n_errors": len(stats.errors), "cpu_s": cpu})
            return


# ------------------------------------------------------------------ callers + probe -----
def callers_main(url: str, n_callers: int, batch: int, seconds: float, rate: float, out) -> None:
    """In a child process: ``n_callers`` threads submitting ``.map`` jobs for ``seconds``
    (back to back, or paced to ``rate`` tasks/s in all when ``rate`` > 0), and one probe
    thread timing ``GET /v1/workers``."""
    import httpx

    from gpumesh import GPUMesh, accelerate
    from gpumesh.client import mesh as mesh_mod

    def refuse(fn, calls):
        raise RuntimeError("the load generator's job ran locally: the coordinator saw no worker")
    mesh_mod.pipeline.InlineBackend.run = refuse  # every local fallback
    m = GPUMesh(url, token=TOKEN, output=False)

    @accelerate(m)
    def echo(t):
        return t

    done = [0]
    errors: list[str] = []
    probe: list[float] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def loop(k: int) -> None:
        interval = batch * n_callers / rate if rate > 0 else 0.0
        due = time.monotonic() + k * interval / n_callers  # callers take turns, evenly spread
        while time.monotonic() < end:
            if interval:
                time.sleep(max(0.0, due - time.monotonic()))
                due += interval
            try:
                values = echo.map([time.monotonic()] * batch)
                assert len(values) == batch
                with lock:
                    done[0] += batch
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(repr(e))
                time.sleep(0.2)

    def probe_loop() -> None:
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKEN}"}) as c:
            while time.monotonic() < end:
                t0 = time.monotonic()
                c.get("/v1/workers").raise_for_status()
                probe.append(time.monotonic() - t0)
                time.sleep(0.25)

    me = psutil.Process()
    cpu0 = sum(me.cpu_times()[:2])
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(n_callers)]
    threads.append(threading.Thread(target=probe_loop))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.send({"done": done[0], "elapsed": time.monotonic() - t0, "errors": errors[:5],
              "probe": probe, "cpu_s": sum(me.cpu_times()[:2]) - cpu0})


# ------------------------------------------------------------------ coordinator ----------
class Coordinator:
    """A ``gpumesh serve --no-self-worker`` process on 127.0.0.1 (pinned to ``cpus``)."""

    def __init__(self, root: Path, cpus: set[int] | None = None):
        import httpx
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, GPUMESH_TOKEN=TOKEN, HOME=str(root), GPUMESH_CONFIG=str(root / "config.json"),
                   GPUMESH_DISCOVERY="0")
        env.pop("GPUMESH_URL", None)
        self.log = open(root / "coordinator.log", "wb")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.p = subprocess.Popen([sys.executable, "-m", "gpumesh", "serve", "--port", str(self.port),
                                   "--data-dir", str(root / "data"), "--no-self-worker"],
                                  env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=pin)
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

    def workers(self) -> int:
        import httpx
        r = httpx.get(f"{self.url}/v1/workers", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        return sum(1 for w in r.json() if w.get("alive"))

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(15)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.log.close()


# ------------------------------------------------------------------ one N ---------------
def run_n(n: int, args, root: Path, coord_cpus: set[int] | None) -> dict:
    coord = Coordinator(root / f"n{n}", coord_cpus)
    ctx = mp.get_context("fork")
    row: dict = {"workers": n}
    procs = max(1, min(args.procs, n))
    gens = []
    try:
        for k in range(procs):
            first, count = k * n // procs, (k + 1) * n // procs - k * n // procs
            parent, child = ctx.Pipe()
            p = ctx.Process(target=generator_main, args=(first, count, coord.port, args, child), daemon=True)
            p.start()
            gens.append((p, parent))
        registered = sum(conn.recv()[1] for _, conn in gens)
        row["registered"] = registered
        time.sleep(1.0 + HEARTBEAT_INTERVAL_S)  # every long-poll open, every heartbeat running
        # idle: N workers heartbeating and long-polling, nothing submitted
        c0, t0 = coord.cpu_seconds(), time.monotonic()
        time.sleep(args.idle)
        row["cpu_idle_pct"] = round(100 * (coord.cpu_seconds() - c0) / (time.monotonic() - t0), 1)
        # load: callers in a child process, measured while they run
        batch = args.batch or max(25, n // 2)
        row["batch"], row["callers"] = batch, args.callers
        parent, child = ctx.Pipe()
        callers = ctx.Process(target=callers_main,
                              args=(coord.url, args.callers, batch, args.seconds, args.rate, child))
        for _, conn in gens:
            conn.send("record")
        c0, t0 = coord.cpu_seconds(), time.monotonic()
        callers.start()
        res = parent.recv()
        elapsed = time.monotonic() - t0
        row["cpu_load_pct"] = round(100 * (coord.cpu_seconds() - c0) / elapsed, 1)
        callers.join()
        row["alive_at_end"] = coord.workers()
        for _, conn in gens:
            conn.send("stop")
        parts = [conn.recv() for _, conn in gens]
        for p, _ in gens:
            p.join(10)
        row["rss_mib"] = round(coord.rss_mib(), 1)
        # the load generator's own CPU (simulated workers + callers), in percent of one core
        row["generator_cpu_pct"] = round(100 * (sum(p["cpu_s"] for p in parts) + res["cpu_s"]) / elapsed, 1)
        row["tasks_per_s"] = round(res["done"] / res["elapsed"], 1)
        row["tasks"] = res["done"]
        joined = {k: [v for p in parts for v in p[k]] for k in ("lease_latency", "result_rtt", "heartbeat_rtt")}
        row["lease_p50_ms"] = ms(pct(joined["lease_latency"], 0.5))
        row["lease_p99_ms"] = ms(pct(joined["lease_latency"], 0.99))
        row["result_rtt_p50_ms"] = ms(pct(joined["result_rtt"], 0.5))
        row["result_rtt_p99_ms"] = ms(pct(joined["result_rtt"], 0.99))
        row["heartbeat_p99_ms"] = ms(pct(joined["heartbeat_rtt"], 0.99))
        row["workers_p99_ms"] = ms(pct(res["probe"], 0.99))
        row["workers_max_ms"] = ms(max(res["probe"], default=None))
        row["lost_workers"] = sum(p["lost"] for p in parts)
        row["caller_errors"] = res["errors"]
        row["worker_errors"] = [e for p in parts for e in p["errors"]][:5]
        row["n_worker_errors"] = sum(p["n_errors"] for p in parts)
    finally:
        for p, _ in gens:
            if p.is_alive():
                p.kill()
        coord.stop()
    return row


COLUMNS = [("workers", "N"), ("cpu_idle_pct", "coord CPU idle %"), ("cpu_load_pct", "coord CPU load %"),
           ("rss_mib", "RSS MiB"), ("tasks_per_s", "tasks/s"),
           ("lease_p50_ms", "lease p50 ms"), ("lease_p99_ms", "lease p99 ms"),
           ("result_rtt_p50_ms", "result RTT p50 ms"), ("result_rtt_p99_ms", "result RTT p99 ms"),
           ("heartbeat_p99_ms", "heartbeat p99 ms"), ("workers_p99_ms", "workers() p99 ms"),
           ("lost_workers", "lost workers"), ("generator_cpu_pct", "generator CPU %")]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join("n/a" if r.get(k) is None else str(r[k]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--workers", default="10,50,200,500", help="comma-separated N values")
    ap.add_argument("--seconds", type=float, default=10.0, help="load duration per N")
    ap.add_argument("--idle", type=float, default=4.0, help="idle measurement per N (s)")
    ap.add_argument("--callers", type=int, default=4, help="caller threads submitting .map jobs")
    ap.add_argument("--batch", type=int, default=0, help="tasks per job (default max(25, N/2))")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="offered load in tasks/s (default 0: as fast as the coordinator goes)")
    ap.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="processes the simulated workers are spread over")
    ap.add_argument("--lease-wait", type=float, default=20.0, help="lease long-poll wait (s)")
    ap.add_argument("--no-pulse", dest="pulse", action="store_false", help="workers hold no pulse")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="don't pin the coordinator to CPU 0 and the generator to the others")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    except (ImportError, ValueError, OSError):
        pass
    cpus = sorted(os.sched_getaffinity(0))
    coord_cpus = None
    if args.pin and len(cpus) >= 2:
        coord_cpus = {cpus[0]}
        os.sched_setaffinity(0, set(cpus[1:]))  # inherited by the generator and the callers
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpumesh-scale-") as tmp:
        for n in [int(x) for x in args.workers.split(",") if x.strip()]:
            row = run_n(n, args, Path(tmp), coord_cpus)
            rows.append(row)
            print(f"N={n}: " + json.dumps(row), file=sys.stderr, flush=True)
    pinning = (f"coordinator pinned to CPU {cpus[0]}, generator on CPU(s) {cpus[1:]}"
               if coord_cpus else "no pinning")
    load = f"{args.rate:g} tasks/s offered" if args.rate > 0 else "submitting as fast as it goes"
    print(f"machine: {len(cpus)} CPUs, Python {sys.version.split()[0]}; {pinning}; "
          f"{args.procs} generator process(es), {args.callers} callers {load}, "
          f"{args.seconds:g} s of load per N")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
