"""Fixtures that start real coordinators and workers as processes on 127.0.0.1.

Every process gets its own HOME, data directory and config path under pytest's tmp dir,
so the user's ~/.gpumesh is never touched, and is stopped (Ctrl+C, then kill) at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

TOKEN = "test-token-0123456789abcdefghijklmnopqrstuvwxyz"
START_TIMEOUT_S = 30
T = TypeVar("T")


@pytest.fixture(scope="session", autouse=True)
def no_lan_discovery():
    """Nothing the suite starts in this (the root) network namespace may announce itself or
    browse over mDNS: multicast would leave on the real network. Tests that need
    discovery unset GPUMESH_DISCOVERY for processes inside namespaces they created."""
    old = os.environ.get("GPUMESH_DISCOVERY")
    os.environ["GPUMESH_DISCOVERY"] = "0"
    yield
    if old is None:
        os.environ.pop("GPUMESH_DISCOVERY", None)
    else:
        os.environ["GPUMESH_DISCOVERY"] = old


@pytest.fixture(scope="session", autouse=True)
def no_worker_directories_left():
    """Workers the suite kills (-9) cannot remove their temporary directories; a worker
    that starts later removes them, and so does the end of the session (never those of
    workers still alive: see gpumesh.worker.tempdirs); the same for the control sockets
    they leave in the temp dir (gpumesh.worker.control.sweep_stale)."""
    yield
    from gpumesh.worker import control, tempdirs
    tempdirs.sweep()
    control.sweep_stale()


#: The modules that take longest (their own durations, from ``--durations=0`` on the
#: 2-core CI machine): ``make test`` runs modules on two pytest-xdist workers
#: (``--dist loadfile --no-loadscope-reorder``: a module's tests stay together, handed
#: out in collection order), and one of these started last would run on alone after
#: the other worker has finished. Only the order changes; a name missing here (renamed,
#: new) just runs in its usual place.
SLOW_MODULES_FIRST = (
    "tests/security/test_fuzz.py",
    "tests/integration/test_owner.py",
    "tests/integration/test_install_from_coordinator.py",
    "tests/integration/test_python_skew.py",
    "tests/integration/test_scripts.py",
    "tests/security/test_tls.py",
    "tests/integration/test_proxies.py",
    "tests/security/test_load.py",
    "tests/integration/test_dashboard_browser.py",
    "tests/integration/test_sweeps.py",
    "tests/integration/test_winsurface.py",
    "tests/integration/test_cli.py",
    "tests/integration/test_examples.py",
    "tests/integration/test_cases.py",  # the slowest under make test-spawn
    "tests/integration/test_handoff.py",
)


def pytest_collection_modifyitems(config, items):
    """Under xdist (``-n``), the slow modules first (see ``SLOW_MODULES_FIRST``); a plain
    run keeps pytest's order."""
    if not hasattr(config, "workerinput"):
        return
    rank = {path: i for i, path in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


class FakeClock:
    """A clock that stands still until told: ``clock()`` is ``t`` (seconds),
    ``advance(dt)`` moves it on. Handed to a ``Coordinator`` as its ``clock``."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


#: Where :func:`free_port` looks: below Linux's ephemeral range (where the kernel picks
#: every outgoing connection's local port), so no process's connection can take the port
#: between the check and the server's bind; each pytest-xdist worker has a slice of its own.
PORTS_FROM, PORTS_SPAN = 20000, 12000
_next_port: list[int] = []


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown (not Linux): let the kernel choose


def free_port() -> int:
    """A loopback TCP port that nothing listens on now, for a server a test starts. Ports
    are handed out in turn from this xdist worker's slice (a port is not handed out again
    until the slice wraps), skipping any in use; where the ephemeral range would overlap
    the slices, the kernel picks one (port 0)."""
    if _ephemeral_low() < PORTS_FROM + PORTS_SPAN:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    width = PORTS_SPAN // count
    start = PORTS_FROM + (int(worker) % count if worker.isdigit() else 0) * width
    if not _next_port:
        _next_port.append(os.getpid() % width)  # (another run at once starts elsewhere)
    for _ in range(width):
        port = start + _next_port[0] % width
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {start}-{start + width - 1}")



def function_blob(directory, fn) -> tuple[str, str]:
    """Write ``fn``'s code blob (as a caller ships it) into ``directory``; returns its
    sha256 and path, what an executor's ``run`` is given."""
    from gpumesh import wire
    payload = wire.dumps(fn, code=True)
    h = payload.sha256()
    path = Path(directory) / h
    if not path.exists():
        path.write_bytes(b"".join(bytes(c) for c in payload.chunks))
    return h, str(path)


def wait_for(cond: Callable[[], T], timeout: float = 10.0,
             what: str | Callable[[], object] = "the condition", interval: float = 0.05) -> T:
    """Poll ``cond`` every ``interval`` seconds until it returns something truthy, and
    return that. After ``timeout`` seconds (and one last look) raise AssertionError naming
    ``what``: a string, or a callable whose value at that moment says what was seen (a
    log, a status), so the message costs nothing while the test passes."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for "
                         f"{what if isinstance(what, str) else what()}")


# ---------------------------------------------------------------- Linux /proc ---------
# The suite's one reader of process state: which processes a test started are still
# running, and whose children they are. Linux only (callers skip elsewhere).

def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None
    when there is no such process. The name is in parentheses and may itself hold spaces
    or parentheses, hence the split at the last one."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 1:].decode().split()


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` (``R``, ``S``, ``Z`` for a zombie, ...), or ``"gone"``."""
    fields = _stat(pid)
    return fields[0] if fields else "gone"


def files_under(root: Path) -> list[Path]:
    """Every file under ``root``, sorted (none when it does not exist). The process under
    test may remove a folder during the walk (the coordinator's reaper does): the walk
    then starts again, so it never fails on, nor counts, what vanished meanwhile."""
    while True:
        try:
            return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
        except FileNotFoundError:
            continue


def alive(pid: int) -> bool:
    """``pid`` exists and has not ended: a zombie (exited, not yet reaped) is not alive."""
    return proc_state(pid) not in ("gone", "Z")


def parent(pid: int) -> int | None:
    """The parent of ``pid``, or None when it is gone."""
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _parents() -> dict[int, list[int]]:
    """Every process's children, from one pass over /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = parent(int(entry))
            if ppid is not None:
                out.setdefault(ppid, []).append(int(entry))
    return out


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (zombies included: they are still its children)."""
    return sorted(_parents().get(pid, []))


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid``: children, their children, ..."""
    tree, out, todo = _parents(), [], [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def default_signals() -> None:
    """``preexec_fn`` for a child whose signal handling a test checks: SIGINT, SIGHUP and
    SIGTERM at their defaults, as an interactive shell starts a program, whatever this
    run inherited (an ignored disposition survives exec: ``nohup`` ignores SIGHUP, and a
    non-interactive shell's background job ignores SIGINT)."""
    for sig in ("SIGINT", "SIGHUP", "SIGTERM"):
        if hasattr(signal, sig):
            signal.signal(getattr(signal, sig), signal.SIG_DFL)


class Proc:
    """A gpumesh CLI process with its output in a log file."""

    def __init__(self, args: list[str], env: dict, log: Path, cwd: Path | None = None):
        self.args, self.log = args, log
        with open(log, "ab") as fh:
            self.p = subprocess.Popen([sys.executable, "-m", "gpumesh", *args], env=env, cwd=cwd,
                                      stdout=fh, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      preexec_fn=default_signals)  # (stop() sends SIGINT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig=signal.SIGINT, timeout: float = 10) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        return self.p.returncode


class Mesh:
    """A coordinator (optionally with workers) started for one test or module."""

    #: Whether the health check verifies the coordinator's TLS certificate (SecureMesh's
    #: is self-signed).
    verify = True

    def __init__(self, root: Path, token: str = TOKEN):
        self.root, self.token = root, token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        (root / "home").mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, HOME=str(root / "home"), GPUMESH_TOKEN=token,
                        GPUMESH_CONFIG=str(root / "config.json"))
        self.env.pop("GPUMESH_URL", None)
        self.env.pop("GPUMESH_LOCAL", None)
        # The name of the test that happened to start the mesh (a session's mesh outlives
        # it); a parametrized test's id may even hold a token-like string.
        self.env.pop("PYTEST_CURRENT_TEST", None)
        self.coordinator: Proc | None = None
        self.serve_args: list[str] = []

    def start(self, self_worker: bool = False, extra: list[str] = ()) -> "Mesh":
        args = ["serve", "--port", str(self.port), "--data-dir", str(self.root / "data"), *extra]
        if not self_worker:
            args.append("--no-self-worker")
        self.serve_args = args
        self.coordinator = Proc(args, self.env, self.root / "coordinator.log")
        self.procs.append(self.coordinator)
        self.wait_health()
        return self

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (no clean shutdown), and wait until it is gone."""
        p = self.coordinator.p
        if p.poll() is None:
            p.kill()
            p.wait(10)

    def restart(self) -> Proc:
        """Start ``gpumesh serve`` again with the same port, data dir and token."""
        if self.coordinator is not None and self.coordinator.p.poll() is None:
            self.coordinator.stop()
        old = self.coordinator
        self.coordinator = Proc(self.serve_args, self.env, self.root / "coordinator.log")
        # keep the coordinator where the old one was, so stop() still stops workers first
        if old in self.procs:
            self.procs[self.procs.index(old)] = self.coordinator
        else:
            self.procs.insert(0, self.coordinator)
        self.wait_health()
        return self.coordinator

    def wait_health(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.coordinator.p.poll() is not None:
                raise RuntimeError("coordinator exited:\n" + self.coordinator.output())
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=1, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("coordinator did not start:\n" + self.coordinator.output())

    def workers(self) -> list[dict]:
        r = httpx.get(f"{self.url}/v1/workers", headers={"authorization": f"Bearer {self.token}"},
                      timeout=5)
        r.raise_for_status()
        return r.json()

    def alive(self) -> int:
        return sum(1 for w in self.workers() if w["alive"])

    def add_worker(self, slots: int = 1, wait: bool = True) -> Proc:
        n = len(self.procs)
        before = self.alive() if wait else 0
        proc = Proc(["join", self.url, "--slots", str(slots)], self.env, self.root / f"worker{n}.log")
        self.procs.append(proc)
        if wait:
            self.wait_alive(before + 1, proc)
        return proc

    def wait_alive(self, n: int, proc: Proc | None = None, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.p.poll() is not None:
                raise RuntimeError("worker exited:\n" + proc.output())
            if self.alive() == n:
                return
            time.sleep(0.05)
        raise RuntimeError(f"expected {n} alive workers, have {self.alive()}")

    def client(self, **kw):
        from gpumesh import GPUMesh
        return GPUMesh(self.url, token=self.token, **kw)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture
def make_mesh(tmp_path):
    """Factory: ``make_mesh(workers=N, self_worker=False)`` -> a started :class:`Mesh`."""
    made: list[Mesh] = []

    def make(workers: int = 0, self_worker: bool = False, slots: int = 1, token: str = TOKEN) -> Mesh:
        m = Mesh(tmp_path / f"mesh{len(made)}", token)
        made.append(m)
        m.start(self_worker=self_worker)
        for _ in range(workers):
            m.add_worker(slots=slots)
        return m

    yield make
    for m in made:
        m.stop()


@pytest.fixture(scope="session")
def shared_mesh(tmp_path_factory):
    """One coordinator with two one-slot workers, shared by the read-only API tests."""
    m = Mesh(tmp_path_factory.mktemp("shared"))
    m.start()
    m.add_worker()
    m.add_worker()
    yield m
    m.stop()


@pytest.fixture
def cheap_kdf(monkeypatch):
    """In-process coordinators (``create_app`` here) hash their tokens with a small scrypt
    cost: the same checks, without ~0.3 s of hashing per token per test on a shared
    machine. Processes the suite starts keep the real cost, and tests/security/test_auth.py
    checks the real parameters."""
    from gpumesh.coordinator import auth
    monkeypatch.setattr(auth, "KDF_N", 2**8)


@pytest.fixture
def start_empty_coordinator(make_mesh):
    """For shared/cases c24: a coordinator with no workers at all -> (url, token)."""
    def start():
        m = make_mesh(workers=0)
        return m.url, m.token
    return start
