"""Starting a coordinator or a worker from Python, as background processes.

Both run the real CLI (``python -m gpumesh serve|join``) so they behave exactly as the
commands do; the token travels in the environment, never on the command line. What
would stop ``serve`` at once (its port taken, its data directory held by another
coordinator) is checked here first, and a :class:`~gpumesh.errors.StartFailed` names the
function's parameters (``port=``, ``data_dir=``), not the flags ``serve`` would; the
text of a ``serve`` that exits anyway has its flags put as those parameters too.

They belong to the program that started them, as a Ray ``ray.init()`` cluster or a Dask
``LocalCluster`` does: ``stop()``, the end of a ``with`` block, or else this program's
exit (an :mod:`atexit` hook) stops them, workers first. ``detach=True`` keeps one running
after the program ends (it is then stopped by its PID, ``handle.process.pid``). Python
runs no atexit hook when the program is killed by a signal it does not handle (SIGKILL,
SIGTERM without a handler) or leaves through ``os._exit``: processes started then are
left running.

Each one's output goes to a log file in the temporary directory
(``tempfile.gettempdir()``: ``$TMPDIR``, else ``/tmp``), ``gpumesh-coordinator-*.log`` or
``gpumesh-worker-*.log``, named by ``handle.log_path``. It is removed once the process
stopped cleanly (exit code 0); it is kept, and named, when the process fails to start
(in the :class:`~gpumesh.errors.StartFailed`), exits with an error or has to be killed,
and while a detached process runs.
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .. import config, protocol
from ..errors import MeshError, StartFailed
from ..transport import Transport

START_TIMEOUT_S = 30.0
#: The first line of ``gpumesh serve``'s banner, printed once it holds its port.
LISTENING = "[OK] Coordinator listening on "
#: The line ``gpumesh join`` prints once registered, with the worker's id.
JOINED = re.compile(r"^\[worker\] joined mesh as (\S+)$", re.M)

#: The token each coordinator this process started was given (by URL): started again
#: without one, it keeps it (the saved config is not written for them).
_tokens: dict[str, str] = {}


#: The processes this program started and has not stopped, but for detached ones: the
#: atexit hook stops them (newest first: workers before their coordinator).
_owned: list[_Process] = []
_owned_lock = threading.Lock()
_hook_registered = False

_P = TypeVar("_P", bound="_Process")


class _Process:
    def __init__(self, proc: subprocess.Popen, log_path: Path, detach: bool = False):
        self.process = proc
        self.log_path = log_path
        self.owner = os.getpid()  # (the process that started it)
        self.detach = False
        _own(self)
        if detach:
            self._detach()

    def stop(self, timeout: float = 10.0) -> None:
        """Ctrl+C the process (it shuts down cleanly), then kill it (and what it started)
        if it lingers. Its log file is removed if it exited with code 0, else kept
        (``log_path``)."""
        self._end(timeout)
        if self.process.returncode == 0:
            _remove(self.log_path)

    def _end(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGINT)
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill(self.process)
        _disown(self)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _failed(self, what: str, words: Callable[[str], str] = str) -> StartFailed:
        """Stop the process if it still runs (keeping its log) and the StartFailed that
        ends with its last output (as ``words`` puts it) and names the log file."""
        self._end()
        return StartFailed(f"{what}: {words(self.log_tail())}\n(its whole log: {self.log_path})")

    def _detach(self) -> None:
        """Leave it running when this program exits (its log too)."""
        self.detach = True
        _disown(self)

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _own(p: _Process) -> None:
    global _hook_registered
    with _owned_lock:
        _owned.append(p)
        if not _hook_registered:
            atexit.register(_stop_owned)
            _hook_registered = True


def _disown(p: _Process) -> None:
    with _owned_lock:
        for i, q in enumerate(_owned):
            if q is p:  # (by identity: a WorkerHandle is a dict, equal to any like it)
                del _owned[i]
                break


def _stop_owned() -> None:
    """The atexit hook: stop what this program started and still runs, newest first.
    (Not in a child this program forked, which inherits the list and the hook: those
    processes are not its children.)"""
    while True:
        with _owned_lock:
            if not _owned or _owned[-1].owner != os.getpid():
                return
            p = _owned[-1]
        try:
            p.stop()
        except Exception:  # noqa: BLE001 - the others are still stopped
            _disown(p)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and its process group (a coordinator's self-worker with it)."""
    try:
        if os.name != "nt":
            os.killpg(proc.pid, signal.SIGKILL)  # (its own group: start_new_session)
        else:
            proc.kill()
    except OSError:
        pass
    proc.wait()


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


class CoordinatorHandle(_Process):
    """A running coordinator: ``url``, ``token``, ``stop()``, ``process``, ``log_path``;
    usable with ``with`` (stopped at its end)."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, url: str, token: str,
                 detach: bool = False):
        super().__init__(proc, log_path, detach)
        self.url, self.token = url, token


class WorkerHandle(dict, _Process):
    """A worker's description (as in ``GPUMesh.workers()``) that can also ``stop()``;
    ``process``, ``log_path``; usable with ``with`` (stopped at its end)."""

    def __init__(self, info: dict, proc: subprocess.Popen, log_path: Path, detach: bool = False):
        dict.__init__(self, info)
        _Process.__init__(self, proc, log_path, detach)


def _spawn(args: list[str], env: dict, name: str) -> tuple[subprocess.Popen, Path]:
    fd, path = tempfile.mkstemp(prefix=f"gpumesh-{name}-", suffix=".log")
    with open(fd, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpumesh", *args], env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc, Path(path)


def start_coordinator(port: int = 8000, token: str | None = None, host: str = "127.0.0.1",
                      data_dir: str | None = None, self_worker: bool = True,
                      detach: bool = False) -> CoordinatorHandle:
    _check_int("port", port, 1, 65535)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    # A restart keeps the token its workers joined with: the one this process gave it
    # before, else the one the saved config holds for this URL (as ``gpumesh serve``).
    token = token or _tokens.get(url) or config.saved_token(url) or config.generate_token()
    env = dict(os.environ, GPUMESH_TOKEN=token)
    # Never the user's saved config: a coordinator started from a script, a notebook or
    # a test is that program's; the one `gpumesh serve` saved stays the default.
    args = ["serve", "--host", host, "--port", str(port), "--no-save-config"]
    if data_dir:
        args += ["--data-dir", str(data_dir)]
    if not self_worker:
        args.append("--no-self-worker")
    # A port someone already listens on: say so now, starting nothing. (Else the health
    # probe below could be answered by that other coordinator while ours fails to bind.)
    busy = _port_in_use(host, port) or _data_dir_in_use(data_dir)
    if busy:
        raise StartFailed(busy)
    proc, log_path = _spawn(args, dict(env, PYTHONUNBUFFERED="1"), "coordinator")
    handle = CoordinatorHandle(proc, log_path, url, token)  # (owned until it is up)
    probe = Transport(url, None)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise handle._failed(f"the coordinator exited with code {proc.returncode}",
                                      as_parameters)
            # Ours answers only once it printed its banner (after it bound the port): a
            # health answer before that comes from whoever took the port meanwhile.
            if LISTENING in handle.log_tail(1 << 20):
                try:
                    probe.request("GET", protocol.HEALTH, timeout=1)
                    _tokens[url] = token
                    if detach:
                        handle._detach()
                    return handle
                except MeshError:
                    pass
            time.sleep(0.05)
    except BaseException:  # (Ctrl+C while waiting, say): nothing is left running
        if proc.poll() is None:
            _kill(proc)
        _disown(handle)
        raise
    raise handle._failed(f"the coordinator did not answer within {START_TIMEOUT_S:.0f}s")


#: ``serve``'s flags that ``start_coordinator`` sets, as its caller names them.
_PARAMETERS = {"--data-dir": "data_dir=", "--port": "port=", "--host": "host=",
               "--no-self-worker": "self_worker=False"}
#: ``join``'s flags that ``add_worker`` sets, and the token's, as its caller names them.
_JOIN_PARAMETERS = {"--cpu-slots": "slots=", "--slots": "slots=", "--token": "token="}
#: The lines of a command's usage error that speak of its command line (``Usage: gpumesh
#: serve [OPTIONS]``, ``Try 'gpumesh serve --help' for help.``): not a Python caller's.
_USAGE_LINE = re.compile(r"^(Usage: gpumesh |Try 'gpumesh ).*$\n?", re.M)


def as_parameters(text: str, flags: dict[str, str] = _PARAMETERS) -> str:
    """A command's words for its caller in Python: each of ``flags`` (``serve``'s, by
    default) becomes the function's parameter (``pass --data-dir with ...`` -> ``pass
    data_dir= with ...``), and its usage lines go."""
    text = _USAGE_LINE.sub("", text)
    return re.sub("|".join(re.escape(f) + r"\b" for f in flags), lambda m: flags[m.group(0)], text)


def _check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as the whole number ``name=`` must be, from ``low`` to ``high``; raises
    ValueError (TypeError for another type) naming the parameter, before anything starts."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}= must be a whole number from {low} to {high}, "
                        f"got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name}= must be a whole number from {low} to {high}, got {value}")
    return value


def _data_dir_in_use(data_dir: str | None) -> str | None:
    """The StartFailed text when a coordinator holds ``data_dir`` (None: serve's default,
    ``~/.gpumesh``), else None."""
    from ..coordinator.datalock import held_by_another
    held = held_by_another(Path(data_dir or config.home_dir()).expanduser(), "data_dir=")
    return None if held is None else f"{held}; nothing was started"


def _port_in_use(host: str, port: int) -> str | None:
    """The StartFailed text when ``host:port`` is taken by a listening socket, else None
    (other bind errors are left to ``serve``, which words them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if os.name != "nt":  # (as serve binds: a socket in TIME_WAIT does not count)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return (f"port {port} on {host} is already in use (another coordinator or program "
                    f"listens there); nothing was started: stop it, or pass another port=")
    finally:
        sock.close()
    return None


def add_worker(url: str, token: str | None = None, slots: int = 1,
               detach: bool = False) -> WorkerHandle:
    from ..limits import MAX_SLOTS
    _check_int("slots", slots, 1, MAX_SLOTS)
    ep = config.resolve(url, token)
    env = dict(os.environ)
    if ep.token:
        env["GPUMESH_TOKEN"] = ep.token
    http = Transport(ep.url, ep.token, fingerprint=ep.fingerprint)
    try:
        http.request("GET", protocol.WORKERS, timeout=10)  # (a wrong URL or token: said now)
    except MeshError as e:
        raise StartFailed(f"no worker was started: {as_parameters(str(e), _JOIN_PARAMETERS)}") from e
    proc, log_path = _spawn(["join", ep.url, "--slots", str(slots)],
                            dict(env, PYTHONUNBUFFERED="1"), "worker")
    starting = _Process(proc, log_path)  # (owned until it registered)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise starting._failed(f"the worker exited with code {proc.returncode}",
                                       lambda text: as_parameters(text, _JOIN_PARAMETERS))
            # Ours by the id it printed: not another worker that joined meanwhile (the
            # self-worker of a coordinator started just before, say).
            joined = JOINED.search(starting.log_tail(1 << 20))
            if joined:
                for w in http.request("GET", protocol.WORKERS, timeout=10).json():
                    if w["id"] == joined.group(1) and w.get("alive"):
                        _disown(starting)
                        return WorkerHandle(w, proc, log_path, detach)
            time.sleep(0.05)
    except BaseException:  # (the coordinator stopped answering, Ctrl+C): nothing left running
        if proc.poll() is None:
            _kill(proc)
        _disown(starting)
        raise
    raise starting._failed(f"the worker did not register within {START_TIMEOUT_S:.0f}s")
