"""Run the coordinator app under uvicorn on a socket we bind ourselves.

Binding first (instead of letting uvicorn do it) turns "port in use" and "cannot bind"
into one clear error before anything else starts, and lets the caller know the server
is reachable the moment :func:`serve` starts accepting.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from pathlib import Path

import uvicorn

from .app import create_app
from .core import Coordinator
from .store import Store

log = logging.getLogger("gpumesh.coordinator")


class BindError(Exception):
    """The address could not be bound; the message says what to do."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``. Raises :class:`BindError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise BindError(f"port {port} is already in use on {host}: stop the other process "
                            f"or pass --port with a free port") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise BindError(f"{host} is not an address of this machine (--host)") from None
        if e.errno == errno.EACCES:
            raise BindError(f"not allowed to bind port {port} (ports below 1024 need root); "
                            f"pass --port 8000 or higher") from None
        raise BindError(f"cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class Server:
    """The coordinator: store + state + HTTP, served on an already bound socket."""

    def __init__(self, sock: socket.socket, data_dir: Path, token: str):
        self.sock = sock
        self.store = Store(data_dir)
        self.coord = Coordinator(self.store)
        app = create_app(self.coord, token)
        try:
            import uvloop  # noqa: F401
            loop = "uvloop"
        except ImportError:
            loop = "asyncio"
        try:
            import httptools  # noqa: F401
            http = "httptools"
        except ImportError:
            http = "h11"
        self.uvicorn = uvicorn.Server(uvicorn.Config(
            app, loop=loop, http=http, log_level="warning", access_log=False,
            timeout_keep_alive=120, lifespan="on",
            # long-polls and worker pulses never "finish": don't wait for them on Ctrl+C
            timeout_graceful_shutdown=2))
        self.ready = threading.Event()

    def run(self) -> None:
        """Serve until SIGINT/SIGTERM (uvicorn installs the handlers)."""
        watcher = threading.Thread(target=self._watch_started, daemon=True)
        watcher.start()
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self.store.close()

    def _watch_started(self) -> None:
        while not self.uvicorn.started and not self.uvicorn.should_exit:
            threading.Event().wait(0.01)
        if self.uvicorn.started:
            self.ready.set()

    def stop(self) -> None:
        self.uvicorn.should_exit = True
