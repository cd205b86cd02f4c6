"""Run the coordinator app under uvicorn on a socket we bind ourselves.

Binding first (instead of letting uvicorn do it) turns "port in use" and "cannot bind"
into one clear error before anything else starts, and lets the caller know the server
is reachable the moment :func:`serve` starts accepting.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
from pathlib import Path
from typing import Any

import uvicorn

from ..limits import MAX_CONNECTIONS, REQUEST_BODY_IDLE_S, REQUEST_HEAD_TIMEOUT_S
from .app import create_app
from .auth import Authenticator, is_loopback
from .bodies import SMALL_BODY_BYTES
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


def max_connections() -> int:
    """Open connections the coordinator keeps at most (``GPUMESH_MAX_CONNECTIONS``; 0:
    half the open-file limit, so that sockets never take the descriptors its store,
    payload files and logs need)."""
    if MAX_CONNECTIONS:
        return MAX_CONNECTIONS
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 4096
    return 65536 if soft == resource.RLIM_INFINITY or soft <= 0 else max(16, soft // 2)


#: When a connection over the cap was last logged (one line a minute at most).
_over_cap_logged = [-1e9]


def _head_timeout_protocol():
    """uvicorn's httptools protocol with deadlines on requests: a connection that has not
    sent a complete request line and headers within REQUEST_HEAD_TIMEOUT_S of opening
    (or of beginning its next request), or whose request body then sends nothing for
    REQUEST_BODY_IDLE_S, is closed. A connection opened while :func:`max_connections`
    are open takes the place of the one that has waited longest for a request head (a
    silent or half-sent one): a request under way, or a client's idle keep-alive
    connection, is never cut; with none waiting, the new
    connection is closed at once. A real client sends its head as it connects, so a
    flood of silent sockets does not keep it out. Slow clients
    never block others (everything is asynchronous); this only stops them holding
    sockets, and with them the process's file descriptors, for long. None when
    httptools is missing (uvicorn's h11 protocol is used as it is)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None
    cap = max_connections()
    #: Connections waiting for a request head, the longest-waiting first.
    waiting: dict[Any, None] = {}

    class HeadTimeoutProtocol(HttpToolsProtocol):
        _head_timer = None
        #: When the request's body last sent bytes (its head, at first); None while a
        #: head is awaited. One timer watches both: the body's deadline moves with each
        #: piece, and is checked only when the timer fires (nothing per piece but this).
        _body_at: float | None = None

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._body_at = None
            waiting.pop(self, None)
            waiting[self] = None
            self._head_timer = self.loop.call_later(REQUEST_HEAD_TIMEOUT_S, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self._body_at is not None:
                idle = self.loop.time() - self._body_at
                # (reading paused: the app is behind, not the client)
                if idle < REQUEST_BODY_IDLE_S or self.flow.read_paused:
                    self._head_timer = self.loop.call_later(
                        max(REQUEST_BODY_IDLE_S - idle, 1.0), self._head_timed_out)
                    return
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.transport = _HeadWithBody(self.transport)  # type: ignore[assignment]  # wraps it
            if len(self.connections) > cap:
                now = self.loop.time()
                if now - _over_cap_logged[0] > 60:
                    _over_cap_logged[0] = now
                    log.warning("%d connections are open (GPUMESH_MAX_CONNECTIONS=%d): each new one "
                                "replaces the one longest without a request", len(self.connections) - 1, cap)
                if not waiting:
                    self.transport.close()
                    return
                oldest = next(iter(waiting))
                del waiting[oldest]
                oldest._cancel_head_timer()
                oldest.transport.close()
            self._arm_head_timer()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_head_timer()

        def on_headers_complete(self) -> None:
            waiting.pop(self, None)
            self._body_at = self.loop.time()  # (the head's timer watches the body from here)
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._body_at = self.loop.time()
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._cancel_head_timer()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self.transport.flush()  # type: ignore[attr-defined]  # (_HeadWithBody's) a response without body writes (HEAD) sends its head now
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            waiting.pop(self, None)
            self._cancel_head_timer()
            super().connection_lost(exc)

    return HeadTimeoutProtocol


class _HeadWithBody:
    """A transport that sends a response's head together with the start of its body.

    uvicorn writes the status line and headers, then the body, as two writes: two
    segments on the wire and two wake-ups of the client for every answer, most of which
    are a few hundred bytes. Held back until the body's first write (and sent with it
    when that piece is small), the head costs nothing extra; on loopback the separate
    write was the largest single item of the coordinator's CPU per task. Everything else
    is the real transport's."""

    __slots__ = ("_transport", "_head")
    #: A first body piece up to this size is joined to the head (one copy of it);
    #: bigger ones follow the head as a second write instead. Every answer built in one
    #: piece (``bodies.SMALL_BODY_BYTES``: a lease, a page of results each up to the
    #: store's inline limit) fits: under a limit of 64 KiB, a 64 KiB result's answer sent
    #: its head as a write and a segment of its own (docs/performance.md, "Ninth session: where a small
    #: result's extra cost is").
    JOIN_BYTES = SMALL_BODY_BYTES

    def __init__(self, transport):
        self._transport = transport
        self._head: bytes | None = None

    def write(self, data) -> None:
        head, self._head = self._head, None
        if head is not None:
            if len(data) <= self.JOIN_BYTES:
                self._transport.write(head + bytes(data))
                return
            self._transport.write(head)
        elif data[:9] == b"HTTP/1.1 " and data[9:12] != b"100" and data[-4:] == b"\r\n\r\n":
            self._head = bytes(data)  # a response head (not "100 Continue"): wait for its body
            return
        self._transport.write(data)

    def flush(self) -> None:
        """Send a held head now (its response ended without a body write, e.g. HEAD)."""
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()  # a head whose body never came is sent all the same
        self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class _Uvicorn(uvicorn.Server):
    """uvicorn, told to answer our long-polls before it starts closing connections.

    Long-polls and worker pulses never finish on their own; left alone, uvicorn's graceful
    shutdown would cancel them mid-request (500s and tracebacks at every caller). Answered
    first, each client gets a normal (empty) answer and then finds the coordinator gone,
    which it already handles by waiting for it to come back.
    """

    def __init__(self, coord, config: uvicorn.Config):
        super().__init__(config)
        self._coord = coord

    #: Called (in a thread) before anything else at shutdown, e.g. to stop the self-worker
    #: while the API still answers its goodbye.
    before_shutdown = None

    async def shutdown(self, sockets=None) -> None:
        if self.before_shutdown is not None:
            await asyncio.to_thread(self.before_shutdown)
        self._coord.begin_shutdown()
        await asyncio.sleep(SHUTDOWN_ANSWER_S)  # let those answers leave
        await super().shutdown(sockets=sockets)


#: Seconds between answering every long-poll and closing connections at shutdown.
SHUTDOWN_ANSWER_S = 0.2


class Server:
    """The coordinator: store + state + HTTP, served on an already bound socket.

    ``token``/``worker_token``: see :func:`~.app.create_app` (only hashes are kept).
    ``safe_mode``: refuse function jobs. ``tls_cert``/``tls_key``: serve HTTPS with this
    PEM pair (see :mod:`gpumesh.tls`). ``trusted_proxies`` (CIDR strings) and ``fronted``
    (a tunnel or proxy is in front): see :mod:`.auth`.
    """

    def __init__(self, sock: socket.socket, data_dir: Path, token: str, *,
                 worker_token: str | None = None, safe_mode: bool = False,
                 tls_cert: Path | None = None, tls_key: Path | None = None,
                 trusted_proxies=(), fronted: bool = False,
                 metrics_token: str | None = None):
        self.sock = sock
        self.store = Store(data_dir)
        self.coord = Coordinator(self.store)
        bound = sock.getsockname()[0]
        auth = Authenticator(token, worker_token, loopback_bound=is_loopback(bound),
                             trusted_proxies=trusted_proxies, fronted=fronted)
        app = create_app(self.coord, token, worker_token=worker_token, safe_mode=safe_mode,
                         authenticator=auth, metrics_token=metrics_token)
        try:
            import uvloop  # noqa: F401
            loop = "uvloop"
        except ImportError:
            loop = "asyncio"
        http = _head_timeout_protocol() or "h11"
        tls: dict[str, Any] = {}
        if tls_cert is not None:
            tls = {"ssl_certfile": str(tls_cert), "ssl_keyfile": str(tls_key) if tls_key else None}
        self.uvicorn = _Uvicorn(self.coord, uvicorn.Config(
            app, loop=loop, http=http, log_level="warning", access_log=False,
            timeout_keep_alive=120, lifespan="on",
            # uvicorn must not rewrite the client address from headers: X-Forwarded-For
            # could then name a new address per guess and dodge the failed-auth lockout.
            # auth.py alone reads it, and only from trusted proxies.
            proxy_headers=False,
            # long-polls and worker pulses never "finish": don't wait for them on Ctrl+C
            timeout_graceful_shutdown=2, **tls))
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
