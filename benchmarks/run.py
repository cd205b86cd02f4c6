#!/usr/bin/env python3
"""gpumesh benchmarks, with dask.distributed and ray as optional peers.

    python benchmarks/run.py                 # full run: every installed system
    python benchmarks/run.py --quick         # < 2 min per system: fewer repetitions, 3 s idle
    python benchmarks/run.py --systems gpumesh --json out.json
    .venv-bench/bin/python benchmarks/run.py --quick   # with peers (benchmarks/setup_peers.sh)

Prints one table: a row per figure, a column per system ("n/a" where a system is not
installed or a scenario failed), then each gpumesh mode's ratio to its like-for-like
peer (default ``isolation="task"`` against Ray with ``max_calls=1``; ``isolation="job"``
against Ray's default) and to Dask. See benchmarks/README.md for what each figure means.

Each system runs in its own child process (``run.py --child NAME``) so that one
system's imports, threads and memory never touch another's figures; every process a
child starts carries a per-run marker in its environment and is killed by pid at the
end if anything is still alive.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Every system run.py knows, in table order.
ALL_SYSTEMS = ["gpumesh", "gpumesh-job", "dask", "ray", "ray-isolated"]
MARKER_ENV = "GPUMESH_BENCH_RUN"
MiB = 2**20
ARRAY_N = 16 * 2**20            # 16 Mi float32 = 64 MiB
ARRAY_MiB = ARRAY_N * 4 / MiB


# ------------------------------------------------------------------ the tasks ---------
# Defined in __main__ on purpose: every system then ships them by value (cloudpickle),
# and no worker needs this directory on its import path.
def whoami():
    import os
    return os.getpid()


def noop(x=None):
    return x


def nap(seconds):
    import time
    time.sleep(seconds)
    return seconds


def inc(a):
    return a + 1


def ones(n=ARRAY_N):
    import numpy as np
    return np.ones(n, np.float32)


def ones_bytes(nbytes):
    """A float32 array of ``nbytes`` bytes (the per-size result curve)."""
    import numpy as np
    return np.ones(nbytes // 4, np.float32)


#: The module the slow-import scenario's function imports: written into the run's work
#: directory, which is put on every system's worker path (PYTHONPATH). It takes 1 s to
#: import and appends the importing process's pid to a log, so the run can count how
#: many times the import was paid.
SLOW_MODULE = "gm_bench_slow_import"
SLOW_IMPORT_S = 1.0


def slow_import(i):
    import gm_bench_slow_import  # noqa: F401 - SLOW_IMPORT_S to import (written by run_child)
    return i


def fault_task(spec):
    """Append "pid start-time" to a file, sleep, return a value. ``spec`` is one list
    ``[path, seconds, value]``: a single argument for every system's map (gpumesh's
    ``.map`` would spread a tuple into positional arguments, dask's and ray's would not)."""
    import os
    import time
    path, seconds, value = spec
    with open(path, "a") as fh:
        fh.write(f"{os.getpid()} {time.time():.6f}\n")
    time.sleep(seconds)
    return value


#: What the fault scenario's task returns (and the caller must receive).
FAULT_VALUE = 42


def read_runs(path: Path) -> list[tuple[int, float]]:
    """The (pid, start time) lines ``fault_task`` wrote so far; complete lines only."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    runs = []
    for line in text.split("\n")[:-1]:
        pid, t = line.split()
        runs.append((int(pid), float(t)))
    return runs


# ------------------------------------------------------------------ figures -----------
#: (key, label, unit, which way is better)
ROWS = [
    ("cold_start_s", "cold start: launch -> first remote result (1 slot)", "s", "lower"),
    ("lat_p50_ms", "no-op call latency p50", "ms", "lower"),
    ("lat_p99_ms", "no-op call latency p99", "ms", "lower"),
    ("idle_first_ms", "no-op call after {idle:g} s idle: first", "ms", "lower"),
    ("idle_median_ms", "no-op call after {idle:g} s idle: median of {idle_calls}", "ms", "lower"),
    ("map_tasks_per_s", "{map_tasks} no-op tasks via map, 2 slots", "tasks/s", "higher"),
    ("sleep_makespan_s", "8 x sleep(1 s) via map, 2 slots (ideal 4)", "s", "lower"),
    ("array_inout_MiBps", "64 MiB float32 in and out (a + 1)", "MiB/s", "higher"),
    ("array_out_MiBps", "64 MiB float32 result only", "MiB/s", "higher"),
    ("slow_import_s", "{slow_tasks}-task map, function imports a {slow_import_s:g} s module", "s", "lower"),
    ("slow_import_count", "... times that module was imported", "imports", "lower"),
    ("rss_before_MiB", "idle RSS of started processes, before calls", "MiB", "lower"),
    ("rss_after_MiB", "idle RSS of started processes, after runs", "MiB", "lower"),
    ("pss_after_MiB", "idle PSS of started processes, after runs", "MiB", "lower"),
    ("rss_released_MiB", "idle RSS {release_s:g} s after the last call", "MiB", "lower"),
    ("fault_recovery_s", "worker kill -9 mid-task: kill -> right result ({fault_task_s:g} s task)",
     "s", "lower"),
    ("fault_overhead_s", "worker kill -9 mid-task: recovery overhead (that - {fault_task_s:g} s)",
     "s", "lower"),
]


#: The per-size result curve: ``ones_bytes(n)`` for each size (bytes).
CURVE_SIZES = [64 * 2**10, 256 * 2**10, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
#: Systems the curve and the 64 MiB rows are not run on: a Ray worker that exits after
#: each task moves results through the same object store as Ray's default; only the
#: process start differs, and the rows above show that.
NO_ARRAYS = {"ray-isolated"}


def size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // 2**10} KiB"


#: Sizes up to this many bytes take a few ms a call, so their medians take more calls: a
#: median of 5 calls at 64 KiB moved by +-30 % between runs, more than the systems differ.
SMALL_CURVE_BYTES = MiB


def curve_reps_key(n: int) -> str:
    return "curve_reps_small" if n <= SMALL_CURVE_BYTES else "curve_reps"


def curve_rows() -> list:
    return [(f"curve_{n}_MiBps", f"result only, {size_label(n)} (median of {{{curve_reps_key(n)}}})",
             "MiB/s", "higher") for n in CURVE_SIZES]


def all_rows() -> list:
    return ROWS[:9] + curve_rows() + ROWS[9:]


def settings(args) -> dict:
    quick = args.quick
    return {
        "latency_calls": args.calls or (50 if quick else 200),
        "warmup_calls": 5 if quick else 10,
        "idle": args.idle if args.idle is not None else (3.0 if quick else 15.0),
        "idle_calls": 5,
        "map_tasks": args.map_tasks or 1000,
        "sleep_tasks": 8,
        "sleep_s": 1.0,
        "array_reps": 5 if quick else 9,  # the median of few calls moves with the VM's memory
        "curve_reps": 5 if quick else 7,
        "curve_reps_small": 21 if quick else 31,  # sizes up to SMALL_CURVE_BYTES
        "slow_tasks": 20,
        "slow_import_s": SLOW_IMPORT_S,
        # Ray with max_calls=1 starts a process per task (~0.25 s here): a 1,000-task map
        # would take minutes, and its workers abort under it ("Mutex corrupt").
        "map_tasks_isolated": min(args.map_tasks or 1000, 50 if quick else 100),
        "latency_calls_isolated": min(args.calls or 200, 20 if quick else 50),
        # Wait after the last call before the last RSS: gpumesh releases the task
        # processes of functions not used for GPUMESH_SPARE_IDLE (60 s) s.
        "release_s": args.release if args.release is not None else (0.0 if quick else 70.0),
        "settle_s": 1.0 if quick else 3.0,
        "fault_task_s": 2.0,          # the task the worker dies under, and its re-run
        "fault_kill_after_s": 0.5,    # SIGKILL its worker this long after it started
        "fault_wait_s": 60.0,         # longest wait for the right value after the kill
    }


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


# ------------------------------------------------------------------ one system --------
def run_child(name: str, cfg: dict, out: Path) -> int:
    """Run every scenario on one system; write figures to ``out`` after each one."""
    sys.path.insert(0, str(HERE))
    from systems import SYSTEMS

    results: dict = {"figures": {}, "details": {}, "errors": {}}
    fig, det = results["figures"], results["details"]

    def save() -> None:
        out.write_text(json.dumps(results, indent=1))

    def scenario(key: str, body, check: bool = True) -> None:
        t0 = time.perf_counter()
        log(f"{name}: {key} ...")
        before = set(fig)
        try:
            body()
            if check:
                # The instance must still be whole after the scenario, or its figures
                # may describe something else (e.g. a crashed worker, a local fallback).
                system.check()
        except Exception as e:  # noqa: BLE001 - one failed scenario must not hide the rest
            err = f"{type(e).__name__}: {e}"
            if check and not str(e).startswith("gpumesh ") and "alive" not in str(e):
                try:
                    system.check()
                except Exception as why:  # noqa: BLE001 - a diagnosis, e.g. which process died
                    err += f" [then: {why}]"
            results["errors"][key] = err[:2000]
            traceback.print_exc()
            for k in set(fig) - before:
                del fig[k]
        log(f"{name}: {key} {'FAILED' if key in results['errors'] else 'done'} "
            f"in {time.perf_counter() - t0:.1f} s")
        save()

    workdir = Path(tempfile.mkdtemp(prefix=f"gpumesh-bench-{name}-"))
    # The slow-import module, on the path of every process the system starts (each
    # system starts its workers from this process's environment).
    moddir = workdir / "modules"
    moddir.mkdir()
    import_log = workdir / "slow-imports.log"
    (moddir / f"{SLOW_MODULE}.py").write_text(
        "import os\nimport time\n"
        f"time.sleep({SLOW_IMPORT_S!r})\n"
        f"with open({str(import_log)!r}, 'a') as _fh:\n"
        "    _fh.write(f'{os.getpid()}\\n')\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(moddir), *filter(None, [os.environ.get("PYTHONPATH")])])
    # multiprocessing's spawn (Dask's worker processes) gives a child its parent's
    # sys.path rather than PYTHONPATH's.
    sys.path.insert(0, str(moddir))
    system = SYSTEMS[name](workdir)
    started = []

    def cold() -> None:
        r = system.cold_start(whoami)
        fig["cold_start_s"] = r.pop("cold_start_s")
        det.update(r)

    def start() -> None:
        t0 = time.perf_counter()
        system.start()
        started.append(True)
        det["start_s"] = time.perf_counter() - t0
        time.sleep(cfg["settle_s"])
        m = system.memory()
        fig["rss_before_MiB"] = m["rss_MiB"]
        det["pss_before_MiB"] = m["pss_MiB"]
        det["procs_before"] = m["n_procs"]

    def latency() -> None:
        for _ in range(cfg["warmup_calls"]):
            system.call(noop, 0)
        ts = []
        calls = cfg["latency_calls_isolated"] if name == "ray-isolated" else cfg["latency_calls"]
        det["latency_calls"] = calls
        for i in range(calls):
            t0 = time.perf_counter()
            v = system.call(noop, i)
            ts.append((time.perf_counter() - t0) * 1e3)
            assert v == i, (v, i)
        fig["lat_p50_ms"] = statistics.median(ts)
        fig["lat_p99_ms"] = percentile(ts, 99)
        det["lat_mean_ms"] = statistics.fmean(ts)
        det["lat_max_ms"] = max(ts)

    def idle() -> None:
        time.sleep(cfg["idle"])
        ts = []
        for i in range(cfg["idle_calls"]):
            t0 = time.perf_counter()
            assert system.call(noop, i) == i
            ts.append((time.perf_counter() - t0) * 1e3)
        fig["idle_first_ms"] = ts[0]
        fig["idle_median_ms"] = statistics.median(ts)
        det["idle_ms"] = ts

    def map_noop() -> None:
        n = cfg["map_tasks_isolated"] if name == "ray-isolated" else cfg["map_tasks"]
        det["map_tasks"] = n
        system.map(noop, list(range(10)))  # warm
        t0 = time.perf_counter()
        vals = system.map(noop, list(range(n)))
        dt = time.perf_counter() - t0
        assert list(vals) == list(range(n))
        fig["map_tasks_per_s"] = n / dt
        det["map_s"] = dt

    def sleeps() -> None:
        system.call(nap, 0.0)  # warm: the function is loaded, not timed
        t0 = time.perf_counter()
        vals = system.map(nap, [cfg["sleep_s"]] * cfg["sleep_tasks"])
        fig["sleep_makespan_s"] = time.perf_counter() - t0
        assert list(vals) == [cfg["sleep_s"]] * cfg["sleep_tasks"]

    def arrays() -> None:
        import numpy as np
        a = np.zeros(ARRAY_N, np.float32)
        r = system.call(inc, np.zeros(4, np.float32))  # warm: numpy imported remotely
        assert float(r[0]) == 1.0
        ts = []
        for _ in range(cfg["array_reps"]):
            t0 = time.perf_counter()
            r = system.call(inc, a)
            ts.append(time.perf_counter() - t0)
            assert r.shape == a.shape and r.dtype == np.float32 and float(r[0]) == 1.0 and float(r[-1]) == 1.0
            del r
        fig["array_inout_MiBps"] = 2 * ARRAY_MiB / statistics.median(ts)
        det["array_inout_s"] = ts
        r = system.call(ones, 4)
        ts = []
        for _ in range(cfg["array_reps"]):
            t0 = time.perf_counter()
            r = system.call(ones)
            ts.append(time.perf_counter() - t0)
            assert r.shape == (ARRAY_N,) and float(r[0]) == 1.0 and float(r[-1]) == 1.0
            del r
        fig["array_out_MiBps"] = ARRAY_MiB / statistics.median(ts)
        det["array_out_s"] = ts

    def curve() -> None:
        # Warm every worker, not just the one the first call lands on: a map of several
        # tasks reaches both slots, so each has numpy imported and the function loaded
        # (one cold worker in a median of 3 made the small sizes look 5-20x slower).
        rs = system.map(ones_bytes, [16] * 4)
        assert [r.shape for r in rs] == [(4,)] * 4
        for n in CURVE_SIZES:
            system.map(ones_bytes, [n, n])  # the first calls of a size are not timed
            ts = []
            for _ in range(cfg[curve_reps_key(n)]):
                t0 = time.perf_counter()
                r = system.call(ones_bytes, n)
                ts.append(time.perf_counter() - t0)
                assert r.nbytes == n and float(r[0]) == 1.0 and float(r[-1]) == 1.0
                del r
            fig[f"curve_{n}_MiBps"] = n / MiB / statistics.median(ts)
            det[f"curve_{n}_s"] = ts

    def slow() -> None:
        k = cfg["slow_tasks"]
        t0 = time.perf_counter()
        vals = system.map(slow_import, list(range(k)))
        fig["slow_import_s"] = time.perf_counter() - t0
        assert list(vals) == list(range(k)), vals
        try:
            pids = import_log.read_text().split()
        except FileNotFoundError:
            pids = []
        fig["slow_import_count"] = len(pids)
        det["slow_import_pids"] = sorted(set(pids))

    def released() -> None:
        time.sleep(cfg["release_s"])
        m = system.memory()
        fig["rss_released_MiB"] = m["rss_MiB"]
        det["pss_released_MiB"] = m["pss_MiB"]
        det["procs_released"] = m["n_procs"]

    def after() -> None:
        import gc
        gc.collect()
        time.sleep(cfg["settle_s"])
        m = system.memory()
        fig["rss_after_MiB"] = m["rss_MiB"]
        fig["pss_after_MiB"] = m["pss_MiB"]
        det["procs_after"] = m["n_procs"]

    def fault() -> None:
        """SIGKILL the worker process running a task, 0.5 s into its 2 s; time the kill
        to the caller receiving the right value (the system must re-run the task)."""
        import psutil
        import threading
        from systems import START_TIMEOUT_S, wait_gone
        task_s, kill_after, wait_s = cfg["fault_task_s"], cfg["fault_kill_after_s"], cfg["fault_wait_s"]
        d = Path(tempfile.mkdtemp(prefix="fault-", dir=workdir))
        # Warm: two overlapping tasks on the 2 slots, so each worker has most likely
        # loaded the function already; the re-run then measures recovery, not a load.
        warm = system.map(fault_task, [[str(d / "warm.log"), 0.3, i] for i in range(2)])
        assert list(warm) == [0, 1], warm
        det["fault_warm_pids"] = sorted({pid for pid, _ in read_runs(d / "warm.log")})
        path = d / "runs.log"
        box: dict = {}

        def caller() -> None:
            try:
                box["value"] = system.call(fault_task, [str(path), task_s, FAULT_VALUE])
            except BaseException as e:  # noqa: BLE001 - reported below
                box["error"] = e
            box["t_done"] = time.perf_counter()

        th = threading.Thread(target=caller, name="fault-caller", daemon=True)
        th.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (runs := read_runs(path)):
            if not th.is_alive():
                raise RuntimeError(f"the call ended before the task started: {box.get('error', box)!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the task did not start within {START_TIMEOUT_S} s")
            time.sleep(0.005)
        task_pid, t_started = runs[0]
        task_proc = psutil.Process(task_pid)
        worker, info = system.find_worker(task_pid)
        det["fault_task_pid"] = task_pid
        det["fault_killed_pid"] = worker.pid
        det.update({f"fault_{k}": v for k, v in info.items()})
        time.sleep(max(0.0, t_started + kill_after - time.time()))
        if not th.is_alive():
            raise RuntimeError(f"the call ended before the kill: {box!r}")
        det["fault_killed_after_start_s"] = time.time() - t_started
        t_kill_wall = time.time()
        t_kill = time.perf_counter()
        worker.send_signal(signal.SIGKILL)
        try:
            th.join(wait_s)
            if th.is_alive():
                raise RuntimeError(f"no result within {wait_s:g} s of the kill (the task "
                                   "was not re-run, or its re-run never reached the caller)")
            if "error" in box:
                e = box["error"]
                raise RuntimeError(f"not re-run: the call raised {type(e).__name__}: {e}")
            elapsed = box["t_done"] - t_kill
            v = box.get("value")
            if v != FAULT_VALUE or type(v) is not int:
                raise RuntimeError(f"wrong value after the kill: {v!r} (expected {FAULT_VALUE})")
            runs = read_runs(path)
            det["fault_runs"] = [[pid, round(t - t_kill_wall, 3)] for pid, t in runs]
            reruns = [(pid, t) for pid, t in runs[1:] if pid != task_pid and t >= t_kill_wall - 0.01]
            if not reruns:
                raise RuntimeError(f"right value, but no re-run started after the kill (runs: {runs}); "
                                   "the killed process did not run the task")
            det["fault_rerun_pid"] = reruns[0][0]
            det["fault_rerun_started_after_kill_s"] = reruns[0][1] - t_kill_wall
            fig["fault_recovery_s"] = elapsed
            fig["fault_overhead_s"] = elapsed - task_s
        finally:
            # The killed task's own process must go too (gpumesh: its host kills it when
            # the agent's socket closes; dask, ray: it is the killed process).
            left = wait_gone([task_proc, worker], 5)
            det["fault_killed_processes_left"] = [p.pid for p in left]
            for p in left:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass

    try:
        scenario("cold_start", cold, check=False)
        scenario("start", start)
        if started:
            todo = [("latency", latency), ("idle", idle), ("map_noop", map_noop),
                    ("sleep_makespan", sleeps), ("slow_import", slow)]
            if name not in NO_ARRAYS:
                todo += [("arrays", arrays), ("curve", curve)]
            todo.append(("memory_after", after))
            if cfg["release_s"] > 0:
                todo.append(("memory_released", released))
            for key, body in todo:
                scenario(key, body)
            # Last: it kills a worker, so the instance is not whole afterwards (no check).
            scenario("fault_recovery", fault, check=False)
    finally:
        try:
            system.stop()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        save()
        if results["errors"] or cfg.get("keep_logs"):
            log(f"{name}: logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


# ------------------------------------------------------------------ orchestrator ------
def installed(name: str) -> bool:
    sys.path.insert(0, str(HERE))
    from systems import REQUIRES
    try:
        return importlib.util.find_spec(REQUIRES[name]) is not None
    except (ImportError, ValueError):
        return False


def sweep(marker: str) -> int:
    """Kill (by pid) every process still carrying this run's marker; return how many."""
    import psutil
    me = os.getpid()
    left = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get(MARKER_ENV) == marker:
                left.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=5)
    return len(left)


def run_system(name: str, args, cfg: dict, marker: str, tmp: Path) -> dict:
    out = tmp / f"{name}.json"
    env = dict(os.environ, **{MARKER_ENV: marker})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name,
           "--child-out", str(out), "--child-cfg", json.dumps(cfg)]
    t0 = time.perf_counter()
    # The child's stdout goes to stderr: what a system prints (e.g. ray's raylet
    # reporting the killed worker) stays out of the table on stdout.
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr,
                            start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=args.system_timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        log(f"{name}: still running after {args.system_timeout} s; stopping it")
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
    except BaseException:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        raise
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
        n = sweep(marker)
        if n:
            log(f"{name}: killed {n} leftover process(es)")
    try:
        res = json.loads(out.read_text())
    except (OSError, ValueError):
        res = {"figures": {}, "details": {}, "errors": {"run": f"child exited {proc.returncode}"}}
    if timed_out:
        res["errors"]["run"] = f"timed out after {args.system_timeout} s"
    res["wall_s"] = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------ table -------------
def fmt(v) -> str:
    if v is None:
        return "n/a"
    if v != v:  # nan
        return "n/a"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


#: The ratio columns: (system, peer). Each gpumesh mode against its like-for-like peer
#: (the Ray mode that isolates tasks the same way, systems.LIKE_FOR_LIKE) and Dask.
RATIOS = [("gpumesh", "ray-isolated"), ("gpumesh", "dask"), ("gpumesh-job", "ray"),
          ("gpumesh-job", "dask")]
GPUMESH_MODES = ("gpumesh", "gpumesh-job")


def _num(v):
    return v if v is not None and v == v else None


def build_rows(systems: list[str], results: dict, cfg: dict) -> list[dict]:
    """One dict per figure: its values per system, ``ratios`` ("a/b": a's figure / b's)
    for each pair of RATIOS present, and ``winner`` (the best system on the row)."""
    rows = []
    for key, label, unit, better in all_rows():
        if key == "rss_released_MiB" and not cfg.get("release_s"):
            continue  # not measured in this run
        vals = {s: (results.get(s) or {}).get("figures", {}).get(key) for s in systems}
        row = {"key": key, "figure": label.format(**cfg), "unit": unit, "better": better,
               "values": vals, "ratios": {}, "winner": None}
        for a, b in RATIOS:
            va, vb = _num(vals.get(a)), _num(vals.get(b))
            if a in systems and b in systems:
                row["ratios"][f"{a}/{b}"] = va / vb if va is not None and vb else None
        have = {s: v for s in systems if (v := _num(vals.get(s))) is not None}
        if have:
            row["winner"] = (min if better == "lower" else max)(have, key=have.get)
        rows.append(row)
    return rows


def render(systems: list[str], rows: list[dict]) -> str:
    pairs = [f"{a}/{b}" for a, b in RATIOS if a in systems and b in systems]
    head = ["figure", "unit", "better", *systems, *pairs, "winner"]
    body = []
    for r in rows:
        ratios = [("n/a" if (x := r["ratios"].get(k)) is None else f"{x:.2f}x") for k in pairs]
        body.append([r["figure"], r["unit"], r["better"], *[fmt(r["values"][s]) for s in systems],
                     *ratios, r["winner"] or "n/a"])
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    right = set(range(3, 3 + len(systems) + len(pairs)))

    def line(cells):
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(head), sep, *(line(b) for b in body)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer repetitions (50 latency calls) and a 3 s idle, for < 2 min per system")
    ap.add_argument("--idle", type=float, default=None, metavar="S",
                    help="seconds of idle before the after-idle calls [default: 15, --quick: 3]")
    ap.add_argument("--calls", type=int, default=None, metavar="N",
                    help="timed no-op calls for p50/p99 [default: 200, --quick: 50]")
    ap.add_argument("--map-tasks", type=int, default=None, metavar="N",
                    help="tasks in the no-op map [default: 1000]")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                    help=f"comma-separated, of {', '.join(ALL_SYSTEMS)} [default: all; missing ones show n/a]")
    ap.add_argument("--release", type=float, default=None, metavar="S",
                    help="seconds to wait after the last call before the last RSS "
                         "[default: 70, --quick: 0 (row skipped)]")
    ap.add_argument("--no-peers", action="store_true", help="gpumesh only")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures here")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep each system's work directory (gpumesh logs, data dirs) [default: only on errors]")
    ap.add_argument("--system-timeout", type=float, default=None, metavar="S",
                    help="stop a system's run after this long [default: 300, or 600 in full mode]")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-cfg", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        return run_child(args.child, json.loads(args.child_cfg), args.child_out)

    cfg = settings(args)
    cfg["keep_logs"] = args.keep_logs
    if args.system_timeout is None:
        args.system_timeout = 300 if args.quick else 600
    systems = list(GPUMESH_MODES) if args.no_peers else [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        ap.error(f"unknown system(s): {sorted(unknown)}")
    if "gpumesh" not in systems:
        systems.insert(0, "gpumesh")
    results: dict = {}
    marker = secrets.token_hex(8)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as tmp:
        for name in systems:
            if not installed(name):
                log(f"{name}: not installed here; its column shows n/a")
                results[name] = None
                continue
            log(f"{name}: running ({'quick' if args.quick else 'full'} mode)")
            results[name] = run_system(name, args, cfg, marker, Path(tmp))
            for k, e in results[name]["errors"].items():
                log(f"{name}: {k} failed: {e.splitlines()[0] if e else e}")

    rows = build_rows(systems, results, cfg)
    versions = {}
    for name, mod in (("gpumesh", "gpumesh"), ("dask", "distributed"), ("ray", "ray")):
        try:
            if importlib.util.find_spec(mod) is not None:
                from importlib.metadata import version
                versions[name] = version("gpumesh" if mod == "gpumesh" else mod)
        except Exception:  # noqa: BLE001
            pass
    print()
    print(f"gpumesh benchmarks ({'quick' if args.quick else 'full'} mode) on {platform.node()}: "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
          + ", ".join(f"{k} {v}" for k, v in versions.items()) + "; all on 127.0.0.1")
    print(render(systems, rows))
    print(f"(a/b = a's figure / b's: each gpumesh mode against its like-for-like peer and Dask; "
          f"'better' says which direction wins; "
          f"total {time.perf_counter() - t_all:.0f} s)")
    notes = [(s, "run", "not installed in this environment") for s in systems if results.get(s) is None]
    notes += [(s, k, e) for s in systems for k, e in ((results.get(s) or {}).get("errors") or {}).items()]
    if notes:
        print("n/a because:")
        for s, k, e in notes:
            first = (e or "").strip().splitlines()[0] if (e or "").strip() else "?"
            print(f"  {s} {k}: {first[:300]}")
    if args.json:
        doc = {"mode": "quick" if args.quick else "full", "settings": cfg, "systems": systems,
               "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                           "python": platform.python_version(), "platform": platform.platform()},
               "versions": versions, "results": results, "rows": rows,
               "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        args.json.write_text(json.dumps(doc, indent=1))
        log(f"figures written to {args.json}")
    failed = any((results.get(m) or {}).get("errors") for m in GPUMESH_MODES)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
