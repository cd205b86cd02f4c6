"""The systems ``run.py`` measures, behind one small interface.

Each system class offers::

    cold_start(whoami) -> dict       launch a fresh 1-slot instance, time it to the first
                                     remote result of whoami(), tear it down
    start()                          the 2-slot instance every other scenario uses
    call(fn, *args)                  one remote call, its value
    map(fn, items)                   one remote task per item, values in order
    memory() -> dict                 RSS/PSS of every process the instance started
    find_worker(task_pid)            the worker process that runs the task in process
        -> (psutil.Process, dict)    task_pid (one this instance started), for the
                                     kill -9 fault scenario; raises if it is not ours
    stop()                           stop everything it started (idempotent)

Functions are passed in by the caller (they live in ``run.py``, i.e. ``__main__``, so
every system ships them by value with cloudpickle and no worker needs ``benchmarks/``
importable).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

try:
    import httpx
    import psutil
except ImportError as e:  # the package alone does not bring these
    raise SystemExit(f"{e.name} is missing: the benchmarks need gpumesh's bench extra "
                     "(.venv/bin/pip install -e '.[bench]'; `make bench` installs it)") from None

MiB = 2**20
TOKEN = "bench-token-0123456789abcdefghijklmnopqrstuvwxyz"
START_TIMEOUT_S = 60


# ------------------------------------------------------------------ processes ---------
def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its descendants (those alive now)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def memory_of(procs: list[psutil.Process]) -> dict:
    """Summed RSS and PSS (MiB) of ``procs``; PSS splits pages shared between processes
    (forked children, shared libraries) so it does not count them twice."""
    rss = pss = 0
    n = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
            try:
                pss += p.memory_full_info().pss
            except (psutil.AccessDenied, AttributeError):
                pss = float("nan")
            n += 1
        except psutil.NoSuchProcess:
            pass
    return {"rss_MiB": rss / MiB, "pss_MiB": pss / MiB, "n_procs": n}


def descendants_memory() -> dict:
    """Memory of every process this (benchmark) process started, itself excluded."""
    return memory_of(psutil.Process().children(recursive=True))


def _gone(p: psutil.Process) -> bool:
    # A zombie has exited; only its parent can reap it (psutil.wait_procs would wait
    # for that, which for a grandchild may be the full timeout).
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process in ``procs`` has exited; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive:
        alive = [p for p in alive if not _gone(p)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return alive


def kill_tree(procs: list[psutil.Process], grace: float = 10.0) -> None:
    """SIGKILL whatever of ``procs`` is still alive after ``grace`` seconds."""
    alive = wait_gone(procs, grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    wait_gone(alive, 5)


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``, read from ``/proc/<pid>/stat`` (psutil elsewhere);
    None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


def ancestors(pid: int) -> list[int]:
    """``pid``, its parent, its parent's parent, ... up to (not including) pid 0."""
    chain = [pid]
    while len(chain) < 64:
        ppid = parent_pid(chain[-1])
        if not ppid or ppid in chain:
            break
        chain.append(ppid)
    return chain


def describe(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()).strip()[:200] or p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"


def own_process(pid: int) -> psutil.Process:
    """``pid`` as a psutil.Process, if this process started it (directly or not);
    raises otherwise, so the fault scenario never signals a process that is not ours."""
    proc = psutil.Process(pid)  # pinned (pid + start time) before the check
    if os.getpid() in ancestors(pid)[1:]:
        return proc
    raise RuntimeError(f"pid {pid} is not a descendant of this benchmark process "
                       f"(ancestors {ancestors(pid)})")


def _ppid(p: psutil.Process) -> int | None:
    try:
        return p.ppid()
    except psutil.NoSuchProcess:
        return None


class CliProc:
    """A ``gpumesh`` CLI process (own session) with its output in a log file."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.args, self.log = args, log
        with open(log, "ab") as fh:
            self.p = subprocess.Popen([sys.executable, "-m", "gpumesh", *args], env=env,
                                      stdout=fh, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Ctrl+C (the CLI's clean stop), then SIGKILL the whole tree, task children
        in their own sessions included, if anything is left after 10 s."""
        procs = tree(self.p.pid)
        # A coordinator's self-worker first: while its lease long-poll is open,
        # ``serve`` on Ctrl+C waits ~30 s for it (uvicorn's graceful shutdown).
        kids = [c for c in procs[1:] if _ppid(c) == self.p.pid]
        for c in kids:
            try:
                c.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        if kids:
            wait_gone(kids, 10)
        if self.p.poll() is None:
            try:
                self.p.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass
        kill_tree(procs)
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except OSError:
            pass
        self.p.wait()


# ------------------------------------------------------------------ gpumesh -----------
class GPUMeshSystem:
    """gpumesh in its default mode: every task in a process of its own
    (``isolation="task"``), the like-for-like peer of Ray with ``max_calls=1``."""

    name = "gpumesh"
    isolation = "task"

    def __init__(self, workdir: Path):
        self.workdir = workdir
        (workdir / "home").mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, HOME=str(workdir / "home"), GPUMESH_TOKEN=TOKEN,
                        GPUMESH_CONFIG=str(workdir / "config.json"))
        for k in ("GPUMESH_URL", "GPUMESH_LOCAL"):
            self.env.pop(k, None)
        # The caller (this process) must not read or write the user's config either.
        os.environ.update(HOME=self.env["HOME"], GPUMESH_CONFIG=self.env["GPUMESH_CONFIG"])
        for k in ("GPUMESH_URL", "GPUMESH_LOCAL", "GPUMESH_TOKEN"):
            os.environ.pop(k, None)
        self.procs: list[CliProc] = []
        self.url = ""
        self.mesh = None
        self._wrapped: dict = {}

    # -- helpers ---------------------------------------------------------------------
    def _serve(self, tag: str, extra: list[str]) -> tuple[CliProc, str]:
        port = free_port()
        args = ["serve", "--port", str(port), "--token", TOKEN,
                "--data-dir", str(self.workdir / f"data-{tag}"), *extra]
        proc = CliProc(args, self.env, self.workdir / f"coordinator-{tag}.log")
        self.procs.append(proc)
        return proc, f"http://127.0.0.1:{port}"

    @staticmethod
    def _wait_health(proc: CliProc, url: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if proc.p.poll() is not None:
                raise RuntimeError("coordinator exited:\n" + proc.output())
            try:
                if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise RuntimeError("coordinator did not answer /v1/health:\n" + proc.output())

    def _scored(self) -> bool:
        r = httpx.get(f"{self.url}/v1/workers", headers={"authorization": f"Bearer {TOKEN}"},
                      timeout=5)
        r.raise_for_status()
        return all(w.get("scores") for w in r.json() if w["alive"])

    def _alive(self) -> int:
        r = httpx.get(f"{self.url}/v1/workers", headers={"authorization": f"Bearer {TOKEN}"},
                      timeout=5)
        r.raise_for_status()
        return sum(1 for w in r.json() if w["alive"])

    def _wrap(self, fn):
        from gpumesh import accelerate
        w = self._wrapped.get(fn)
        if w is None:
            w = self._wrapped[fn] = accelerate(self.mesh, isolation=self.isolation)(fn)
        return w

    # -- interface -------------------------------------------------------------------
    def cold_start(self, whoami) -> dict:
        from gpumesh import GPUMesh, accelerate  # the caller's import is not part of the start
        me = os.getpid()
        t0 = time.perf_counter()
        proc, url = self._serve("cold", ["--slots", "1"])  # with its self-worker
        try:
            self._wait_health(proc, url, time.monotonic() + START_TIMEOUT_S)
            t_health = time.perf_counter() - t0
            mesh = GPUMesh(url, token=TOKEN)
            f = accelerate(mesh)(whoami)
            deadline = time.monotonic() + START_TIMEOUT_S
            local_calls = 0
            while True:
                # Until the self-worker has registered, the call runs here (fallback).
                if f() != me:
                    break
                local_calls += 1
                if time.monotonic() > deadline:
                    raise RuntimeError("no remote result within the start timeout:\n" + proc.output())
                time.sleep(0.02)
            t_first = time.perf_counter() - t0
            mesh.close()
        finally:
            proc.stop()
            self.procs.remove(proc)
        return {"cold_start_s": t_first, "cold_health_s": t_health,
                "cold_local_fallback_calls": local_calls}

    def start(self) -> None:
        from gpumesh import GPUMesh
        coord, self.url = self._serve("main", ["--no-self-worker"])
        self._wait_health(coord, self.url, time.monotonic() + START_TIMEOUT_S)
        joins = []
        for i in range(2):
            p = CliProc(["join", self.url, "--token", TOKEN, "--slots", "1"], self.env,
                        self.workdir / f"worker{i}.log")
            self.procs.append(p)
            joins.append(p)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self._alive() < 2:
            for p in joins:
                if p.p.poll() is not None:
                    raise RuntimeError("worker exited:\n" + p.output())
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not register")
            time.sleep(0.05)
        # Each worker measures its devices once, in a process of its own, while it has
        # been idle for 0.3 s (worker/scoring.py); a task kills a measurement under way,
        # which starts again at the next quiet moment. Measuring before both are done
        # would time the mesh with a benchmark burning the same two cores (about 1 s
        # after joining on a quiet machine).
        while not self._scored():
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not finish measuring their devices")
            time.sleep(0.05)
        self.mesh = GPUMesh(self.url, token=TOKEN)
        self.refuse_local_fallback()

    def refuse_local_fallback(self) -> None:
        """From now on, make gpumesh's run-here fallback (coordinator unreachable, no
        live worker) raise instead of silently timing this process."""
        from gpumesh.client import mesh as mesh_mod

        def refuse(fn, calls):
            raise RuntimeError("gpumesh fell back to running the call locally "
                               "(coordinator unreachable or no live worker)")
        if hasattr(mesh_mod, "pipeline"):
            mesh_mod.pipeline.InlineBackend.run = refuse  # every local fallback

    def check(self) -> None:
        """Raise if a process of the mesh has exited or a worker is no longer alive."""
        for p in self.procs:
            if p.p.poll() is not None:
                raise RuntimeError(f"gpumesh {p.args[0]} exited with {p.p.returncode}:\n"
                                   + p.output())
        if self._alive() != 2:
            raise RuntimeError(f"only {self._alive()} of 2 workers alive")

    def call(self, fn, *args):
        return self._wrap(fn)(*args)

    def map(self, fn, items):
        return self._wrap(fn).map(items)

    def memory(self) -> dict:
        procs = [q for p in self.procs for q in tree(p.p.pid)]
        return memory_of(procs)

    def find_worker(self, task_pid: int) -> tuple[psutil.Process, dict]:
        """The ``gpumesh join`` agent whose tree runs the task: walk the parent links
        (task child -> function host -> zygote -> agent) up to one of the started joins."""
        joins = {p.p.pid for p in self.procs if p.args[0] == "join" and p.p.poll() is None}
        chain = ancestors(task_pid)
        agent = next((pid for pid in chain if pid in joins), None)
        if agent is None:
            raise RuntimeError(f"task pid {task_pid} runs under none of the started "
                               f"gpumesh join processes {sorted(joins)} (ancestors {chain})")
        proc = own_process(agent)
        return proc, {"killed": "gpumesh join agent (the worker process that leased the task)",
                      "killed_cmd": describe(proc),
                      "chain": chain[:chain.index(agent) + 1]}

    def stop(self) -> None:
        if self.mesh is not None:
            self.mesh.close()
            self.mesh = None
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


class GPUMeshJobSystem(GPUMeshSystem):
    """gpumesh with ``isolation="job"``: a slot keeps one process for the tasks of a job
    (the process-reuse mode), the like-for-like peer of Ray's default tasks."""

    name = "gpumesh-job"
    isolation = "job"


# ------------------------------------------------------------------ dask --------------
class DaskSystem:
    """``distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True)``;
    the scheduler lives inside the caller process (LocalCluster's design), so memory
    counts only the nanny and worker processes."""

    name = "dask"

    def __init__(self, workdir: Path):
        import logging
        import warnings
        warnings.filterwarnings("ignore", message=".*[Ll]arge object.*")
        warnings.filterwarnings("ignore", message=".*[Ss]ending large graph.*")
        warnings.filterwarnings("ignore", category=UserWarning, module="distributed")
        logging.getLogger("distributed").setLevel(logging.ERROR)
        self.workdir = workdir
        self.cluster = self.client = None

    def _make(self, n_workers: int):
        from distributed import Client, LocalCluster
        import logging
        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=logging.ERROR,
                               local_directory=str(self.workdir))
        return cluster, Client(cluster)

    def cold_start(self, whoami) -> dict:
        import distributed  # noqa: F401 - the caller's import is not part of the start
        me = os.getpid()
        t0 = time.perf_counter()
        cluster, client = self._make(1)
        try:
            pid = client.submit(whoami, pure=False).result()
            t_first = time.perf_counter() - t0
            assert pid != me
        finally:
            client.close()
            cluster.close()
        return {"cold_start_s": t_first}

    def start(self) -> None:
        self.cluster, self.client = self._make(2)
        self.client.wait_for_workers(2, timeout=START_TIMEOUT_S)

    def call(self, fn, *args):
        return self.client.submit(fn, *args, pure=False).result()

    def map(self, fn, items):
        futs = self.client.map(fn, list(items), pure=False)
        return self.client.gather(futs)

    def check(self) -> None:
        n = len(self.client.scheduler_info(n_workers=-1)["workers"]) if self.client else 0
        if n != 2:
            raise RuntimeError(f"only {n} of 2 dask workers alive")

    def memory(self) -> dict:
        return descendants_memory()

    def find_worker(self, task_pid: int) -> tuple[psutil.Process, dict]:
        """A task runs in a thread of its worker process: that process itself (its
        parent is the nanny, which restarts it)."""
        proc = own_process(task_pid)
        return proc, {"killed": "dask worker process running the task (its nanny survives)",
                      "killed_cmd": describe(proc), "chain": ancestors(task_pid)}

    def stop(self) -> None:
        procs = psutil.Process().children(recursive=True)
        try:
            if self.client is not None:
                self.client.close()
            if self.cluster is not None:
                self.cluster.close()
        finally:
            self.client = self.cluster = None
            kill_tree(procs, grace=5)


# ------------------------------------------------------------------ ray ---------------
class RaySystem:
    """``ray.init(num_cpus=2)`` (a local head: GCS, raylet, workers) with ``@ray.remote``
    tasks. The object store hands NumPy results back zero-copy (read-only views)."""

    name = "ray"
    #: ``@ray.remote(max_calls=...)``: 0 is Ray's default for tasks (a worker process
    #: runs task after task); see RayIsolatedSystem.
    max_calls = 0

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self._remote: dict = {}
        self.started = False

    @staticmethod
    def _init(num_cpus: int) -> None:
        import ray
        # address="local": always a fresh instance of our own, even when a `ray start`
        # cluster of this machine (or a stale /tmp/ray/ray_current_cluster) exists.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR", configure_logging=True)

    def _wrap(self, fn):
        import ray
        r = self._remote.get(fn)
        if r is None:
            r = self._remote[fn] = (ray.remote(max_calls=self.max_calls)(fn) if self.max_calls
                                    else ray.remote(fn))
        return r

    def cold_start(self, whoami) -> dict:
        import ray  # the caller's import is not part of the start
        me = os.getpid()
        t0 = time.perf_counter()
        self._init(1)
        try:
            pid = ray.get(ray.remote(whoami).remote())
            t_first = time.perf_counter() - t0
            assert pid != me
        finally:
            self._shutdown()
        return {"cold_start_s": t_first}

    def start(self) -> None:
        self._init(2)
        self.started = True

    def call(self, fn, *args):
        import ray
        return ray.get(self._wrap(fn).remote(*args))

    def map(self, fn, items):
        import ray
        r = self._wrap(fn)
        return ray.get([r.remote(x) for x in items])

    def memory(self) -> dict:
        return descendants_memory()

    def find_worker(self, task_pid: int) -> tuple[psutil.Process, dict]:
        """A task runs in a ray worker process (a child of the raylet): that process."""
        proc = own_process(task_pid)
        return proc, {"killed": "ray worker process running the task (a child of the raylet)",
                      "killed_cmd": describe(proc), "chain": ancestors(task_pid)}

    def check(self) -> None:
        import ray
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus != 2:
            raise RuntimeError(f"ray reports {cpus} CPUs, expected 2")

    def _shutdown(self) -> None:
        import ray
        procs = psutil.Process().children(recursive=True)
        try:
            ray.shutdown()
        finally:
            self._remote.clear()
            kill_tree(procs, grace=5)

    def stop(self) -> None:
        if self.started:
            self.started = False
            self._shutdown()


class RayIsolatedSystem(RaySystem):
    """Ray with ``@ray.remote(max_calls=1)``: a worker process exits after one task, so
    every task gets a fresh process (what Ray does by default for GPU tasks, because
    CUDA libraries leak). The like-for-like peer of gpumesh's default."""

    name = "ray-isolated"
    max_calls = 1


SYSTEMS = {"gpumesh": GPUMeshSystem, "gpumesh-job": GPUMeshJobSystem, "dask": DaskSystem,
           "ray": RaySystem, "ray-isolated": RayIsolatedSystem}
#: The module a system needs, to tell whether it is installed.
REQUIRES = {"gpumesh": "gpumesh", "gpumesh-job": "gpumesh", "dask": "distributed",
            "ray": "ray", "ray-isolated": "ray"}
#: Each system's like-for-like peer: the one that isolates tasks the same way.
LIKE_FOR_LIKE = {"gpumesh": "ray-isolated", "gpumesh-job": "ray"}
