"""Starting a coordinator or a worker from Python, as background processes.

Both run the real CLI (``python -m gpumesh serve|join``) so they behave exactly as the
commands do; the token travels in the environment, never on the command line. What
would stop ``serve`` at once (its port taken, its data directory held by another
coordinator) is checked here first, and a :class:`~gpumesh.errors.StartFailed` names the
function's parameters (``port=``, ``data_dir=``), not the flags ``serve`` would; the
text of a ``serve`` that exits anyway has its flags put as those parameters too.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import config, protocol
from ..errors import MeshError, StartFailed
from ..transport import Transport

START_TIMEOUT_S = 30.0
#: The first line of ``gpumesh serve``'s banner, printed once it holds its port.
LISTENING = "[OK] Coordinator listening on "

#: The token each coordinator this process started was given (by URL): started again
#: without one, it keeps it (the saved config is not written for them).
_tokens: dict[str, str] = {}


class _Process:
    def __init__(self, proc: subprocess.Popen, log_path: Path):
        self.process = proc
        self.log_path = log_path

    def stop(self, timeout: float = 10.0) -> None:
        """Ctrl+C the process (it shuts down cleanly), then kill it if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class CoordinatorHandle(_Process):
    """A running coordinator: ``url``, ``token``, ``stop()``; usable with ``with``."""

    def __init__(self, proc, log_path, url: str, token: str):
        super().__init__(proc, log_path)
        self.url, self.token = url, token

    def __enter__(self) -> CoordinatorHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class WorkerHandle(dict, _Process):
    """A worker's description (as in ``GPUMesh.workers()``) that can also ``stop()``."""

    def __init__(self, info: dict, proc, log_path):
        dict.__init__(self, info)
        _Process.__init__(self, proc, log_path)


def _spawn(args: list[str], env: dict, name: str) -> tuple[subprocess.Popen, Path]:
    log_path = Path(tempfile.mkstemp(prefix=f"gpumesh-{name}-", suffix=".log")[1])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpumesh", *args], env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc, log_path


def start_coordinator(port: int = 8000, token: str | None = None, host: str = "127.0.0.1",
                      data_dir: str | None = None, self_worker: bool = True) -> CoordinatorHandle:
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
    handle = CoordinatorHandle(proc, log_path, url, token)
    probe = Transport(url, None)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StartFailed(f"the coordinator exited with code {proc.returncode}: "
                              f"{as_parameters(handle.log_tail())}")
        # Ours answers only once it printed its banner (after it bound the port): a health
        # answer before that comes from whoever took the port meanwhile.
        if LISTENING in handle.log_tail(1 << 20):
            try:
                probe.request("GET", protocol.HEALTH, timeout=1)
                _tokens[url] = token
                return handle
            except MeshError:
                pass
        time.sleep(0.05)
    handle.stop()
    raise StartFailed(f"the coordinator did not answer within {START_TIMEOUT_S:.0f}s: {handle.log_tail()}")


#: ``serve``'s flags that ``start_coordinator`` sets, as its caller names them.
_PARAMETERS = {"--data-dir": "data_dir=", "--port": "port=", "--host": "host=",
               "--no-self-worker": "self_worker=False"}


def as_parameters(text: str) -> str:
    """``serve``'s words for its caller in Python: each flag ``start_coordinator`` sets
    becomes its parameter (``pass --data-dir with ...`` -> ``pass data_dir= with ...``)."""
    import re
    return re.sub("|".join(re.escape(f) + r"\b" for f in _PARAMETERS),
                  lambda m: _PARAMETERS[m.group(0)], text)


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


def add_worker(url: str, token: str | None = None, slots: int = 1) -> WorkerHandle:
    ep = config.resolve(url, token)
    env = dict(os.environ)
    if ep.token:
        env["GPUMESH_TOKEN"] = ep.token
    http = Transport(ep.url, ep.token, fingerprint=ep.fingerprint)
    before = {w["id"] for w in http.request("GET", protocol.WORKERS, timeout=10).json()}
    proc, log_path = _spawn(["join", ep.url, "--slots", str(slots)], env, "worker")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StartFailed(f"the worker exited with code {proc.returncode}: "
                               f"{Path(log_path).read_text(errors='replace')[-4000:]}")
        for w in http.request("GET", protocol.WORKERS, timeout=10).json():
            if w["id"] not in before and w.get("alive"):
                return WorkerHandle(w, proc, log_path)
        time.sleep(0.05)
    proc.kill()
    raise StartFailed(f"the worker did not register within {START_TIMEOUT_S:.0f}s")
